"""PCI addresses and the sysfs facts of one PCI function.

Addresses are kept in canonical sysfs form (`dddd:bb:ss.f`, lowercase). The
forms other tools want (lspci's short `bb:ss.f`, libvirt's `0x..` fields) are
renderings of the same value.
"""

from __future__ import annotations

import os
from collections import namedtuple

from gpulib.errors import DeviceError, InputError
from gpulib.sysfs import ReadFailure, Sysfs
from gpulib.validate import decimal, pci_address_parts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NamedTuple, Optional

PCI_DEVICES = "sys/bus/pci/devices/"



MAX_DOMAIN = 0xFFFFFFFF
_C_SPACE = " \t\n\v\f\r"
_OCT_DIGITS = frozenset("01234567")
_DEC_DIGITS = frozenset("0123456789")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def libvirt_uint(text: str) -> Optional[int]:
    """A number attribute as libvirt reads it, or None where libvirt refuses it.

    libvirt reads `domain`, `bus`, `slot` and `function` with C's strtoul in
    base 0 and then refuses a minus sign, trailing characters and values
    above UINT_MAX. So: leading C whitespace is skipped, `+` is allowed,
    `0x`/`0X` means hex, a leading `0` octal (`0301` is 0xc1), only ASCII
    digits count; Python's int(x, 0) differs both ways (`0b1`, `0o7`, `1_0`,
    non-ASCII digits, trailing spaces accepted; `0301` refused).
    """
    rest = text.lstrip(_C_SPACE)
    if rest[:1] == "+":
        rest = rest[1:]
    if rest[:2] in ("0x", "0X") and rest[2:3] in _HEX_DIGITS and rest[2:3]:
        digits, base, allowed = rest[2:], 16, _HEX_DIGITS
    elif rest[:1] == "0":
        digits, base, allowed = rest, 8, _OCT_DIGITS
    else:
        digits, base, allowed = rest, 10, _DEC_DIGITS
    if not digits or not allowed.issuperset(digits):
        return None
    digits = digits.lstrip("0") or "0"
    if len(digits) > 11:  # above UINT_MAX in any base (and int()'s digit limit)
        return None
    value = int(digits, base)
    return value if value <= 0xFFFFFFFF else None


if TYPE_CHECKING:
    class _PciAddressFields(NamedTuple):
        domain: int
        bus: int
        slot: int
        function: int
else:
    # The same tuple without typing, whose import costs every run milliseconds
    # (and whose class form compiles each postponed annotation when it makes
    # the class, about half a millisecond per field on every hook run).
    _PciAddressFields = namedtuple("_PciAddressFields", ("domain", "bus", "slot", "function"))


# str() of the addresses met so far, bounded (a host has at most a few
# thousand functions; a long test run may make many more).
_TEXT: dict[tuple[int, int, int, int], str] = {}
_TEXT_MAX = 1 << 14
# The addresses parsed so far, by their text (same bound).
_PARSED: dict[str, PciAddress] = {}


class PciAddress(_PciAddressFields):
    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """Accept `dddd:bb:ss.f` or lspci's `bb:ss.f` (domain 0)."""
        # Remembered too: discovery parses every VF's address from its links
        # several times (virtfnN, physfn, the mdev parents' links).
        cached = cls is PciAddress and type(text) is str
        found = _PARSED.get(text) if cached else None
        if found is None:
            found = cls(*pci_address_parts(text))
            if cached and len(_PARSED) < _TEXT_MAX:
                _PARSED[text] = found
        return found

    @classmethod
    def from_libvirt(cls, domain: Optional[str], bus: Optional[str], slot: Optional[str],
                     function: Optional[str]) -> PciAddress:
        """From the attributes of libvirt's `<address type='pci'>`, read as libvirt
        reads them (`libvirt_uint`); an absent attribute (None) is 0, as in libvirt."""
        values = []
        for name, text in (("domain", domain), ("bus", bus), ("slot", slot),
                           ("function", function)):
            value = 0 if text is None else libvirt_uint(text)
            if value is None:
                raise InputError(f"bad PCI address in XML: {name}={text!r} is not a "
                                 "non-negative integer as libvirt reads it")
            values.append(value)
        d, b, s, f = values
        if not (b <= 0xFF and s <= 0x1F and f <= 7):
            raise InputError(f"PCI address out of range: {d:04x}:{b:02x}:{s:02x}.{f} "
                             "(bus <= 0xff, slot <= 0x1f, function <= 7)")
        return cls(d, b, s, f)

    def __str__(self) -> str:
        # Remembered: a report turns the same few hundred addresses into text
        # thousands of times (every vGPU type of every VF names its parent),
        # and formatting costs twenty times a dictionary look-up.
        text = _TEXT.get(self)
        if text is None:
            text = f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"
            if len(_TEXT) < _TEXT_MAX:
                _TEXT[self] = text
        return text

    @property
    def lspci(self) -> str:
        """As `lspci` prints it: the domain only when it is not 0000."""
        short = f"{self.bus:02x}:{self.slot:02x}.{self.function:x}"
        return short if self.domain == 0 else f"{self.domain:04x}:{short}"

    @property
    def bus_id(self) -> str:
        """As NVIDIA's tools write it (nvidia-smi takes it for `-i`, NVML's and
        dcgm-exporter's `pci_bus_id`): an 8-digit domain, upper-case hex,
        `00000000:3B:00.0`."""
        return f"{self.domain:08X}:{self.bus:02X}:{self.slot:02X}.{self.function:X}"

    def libvirt(self) -> dict[str, str]:
        return {"domain": f"0x{self.domain:04x}", "bus": f"0x{self.bus:02x}",
                "slot": f"0x{self.slot:02x}", "function": f"0x{self.function:x}"}

    @property
    def slot_key(self) -> tuple[int, int, int]:
        return (self.domain, self.bus, self.slot)


# PCI class codes (base class, subclass) that can be GPUs.
CLASS_VGA = 0x0300
CLASS_PROCESSING_ACCEL = 0x1200
DISPLAY_BASE_CLASS = 0x03
PROCESSING_BASE_CLASS = 0x12
# Bridges stay with the host: never a guest's, never a GPU's group companion.
BRIDGE_BASE_CLASS = 0x06


def has_gpu_class(class_code: int) -> bool:
    """Whether a 16-bit class code (base, sub) is one a GPU may have: a display
    controller or a processing accelerator. Whether a function with it is a
    GPU is `discovery.is_gpu_function`'s answer (vendor, configuration)."""
    return class_code >> 8 in (DISPLAY_BASE_CLASS, PROCESSING_BASE_CLASS)


# lspci's names for the classes a GPU report may show.
CLASS_NAMES = {
    0x0300: "VGA compatible controller",
    0x0301: "XGA compatible controller",
    0x0302: "3D controller",
    0x0380: "Display controller",
    0x0400: "Multimedia video controller",
    0x0401: "Multimedia audio controller",
    0x0403: "Audio device",
    0x0480: "Multimedia controller",
    0x0200: "Ethernet controller",
    0x0207: "Infiniband controller",
    0x0600: "Host bridge",
    0x0604: "PCI bridge",
    0x0880: "System peripheral",
    0x1200: "Processing accelerators",
    0x1201: "AI inference accelerator",
}

# Vendors whose 0x1200 devices are GPUs (compute GPUs like AMD Instinct
# MI300X report "Processing accelerators"), and vendors that make GPUs.
GPU_VENDORS = frozenset({0x10DE, 0x1002, 0x8086})
# Linux's MAX_NUMNODES is at most 1 << 10; anything larger in `numa_node` is garbage.
MAX_NUMA_NODE = 1 << 10


def class_name(code: int) -> str:
    """lspci's class name for a 16-bit class code (base, sub)."""
    name = CLASS_NAMES.get(code)
    if name is None:
        name = f"Class {code:04x}"
    return name


class PciFunction:
    """The sysfs facts of one PCI function, read eagerly (they are cheap)."""

    __slots__ = ("address", "class_code", "device_id", "driver", "iommu_group", "numa_node",
                 "pci_root", "physfn", "prog_if", "rel", "revision", "subsystem_device",
                 "subsystem_vendor", "vendor_id", "vf_unresolved")

    def __init__(self, address: PciAddress) -> None:
        self.address = address
        self.rel = PCI_DEVICES + str(address)
        self.vendor_id = 0
        self.device_id = 0
        self.class_code = 0  # 16-bit base<<8 | subclass
        self.prog_if = 0
        self.subsystem_vendor: Optional[int] = None
        self.subsystem_device: Optional[int] = None
        self.revision: Optional[int] = None
        self.driver: Optional[str] = None
        self.iommu_group: Optional[int] = None
        self.numa_node = -1
        self.pci_root: Optional[PciAddress] = None
        self.physfn: Optional[PciAddress] = None
        # A `physfn` entry that names no PF (a loop, a bad target): still a VF.
        self.vf_unresolved = False

    @classmethod
    def read(cls, sysfs: Sysfs, address: PciAddress, vf_of: Optional[PciFunction] = None
             ) -> PciFunction:
        """Read a function; raises OSError only if the device is unreadable.

        `vf_of`: the PF of a VF being read; the VF shares its PCI root and
        NUMA node, which saves a link and a file per VF on hosts with hundreds.
        """
        fn = cls(address)
        rel = fn.rel
        klass = sysfs.read_id(rel + "/class", 24)
        if klass is None and not sysfs.exists(rel):
            raise FileNotFoundError(f"no PCI device {address}")
        fn.class_code = (klass or 0) >> 8
        fn.prog_if = (klass or 0) & 0xFF
        fn.vendor_id = sysfs.read_id(rel + "/vendor") or 0
        fn.device_id = sysfs.read_id(rel + "/device") or 0
        fn.read_details(sysfs, vf_of)
        return fn

    @classmethod
    def read_ids(cls, sysfs: Sysfs, address: PciAddress) -> PciFunction:
        """Only class, vendor, device and physfn: enough to decide if it is a GPU."""
        fn = cls(address)
        rel = fn.rel
        klass = sysfs.read_id(rel + "/class", 24) or 0
        fn.class_code = klass >> 8
        fn.prog_if = klass & 0xFF
        fn.vendor_id = sysfs.read_id(rel + "/vendor") or 0
        fn.device_id = sysfs.read_id(rel + "/device") or 0
        fn._read_physfn(sysfs)
        return fn

    def read_details(self, sysfs: Sysfs, vf_of: Optional[PciFunction] = None) -> None:
        rel = self.rel
        self.driver = sysfs.link_name(rel + "/driver")
        self.iommu_group = group_number(sysfs.link_name(rel + "/iommu_group"))
        if vf_of is not None:
            # A VF is on its PF's NUMA node (the kernel gives it the node of
            # the PF's bus): one file less per VF on hosts with hundreds.
            self.numa_node = vf_of.numa_node
            self.physfn = vf_of.address
            self.pci_root = vf_of.pci_root
            return
        numa = sysfs.read_int(rel + "/numa_node", low=-1, high=MAX_NUMA_NODE)
        self.numa_node = -1 if numa is None else numa
        self._read_physfn(sysfs)
        self.pci_root = pci_root(sysfs, self.address)

    def _read_physfn(self, sysfs: Sysfs) -> None:
        self.physfn = _physfn(sysfs, self.rel)
        self.vf_unresolved = self.physfn is None and sysfs.exists(self.rel + "/physfn")
        if self.vf_unresolved:
            sysfs.failed(self.rel + "/physfn", "names no physical function")

    @property
    def is_vf(self) -> bool:
        return self.physfn is not None or self.vf_unresolved

    @property
    def class_name(self) -> str:
        return class_name(self.class_code)


def is_boot_vga(sysfs: Sysfs, address: PciAddress, class_code: int) -> bool:
    """The device the firmware drew the host's console on: its `boot_vga` is 1.

    The kernel shows `boot_vga` only on VGA-class functions, so no other
    function is asked (a file less per GPU on hosts of 3D controllers)."""
    if class_code != CLASS_VGA:
        return False
    return sysfs.read_int(f"{PCI_DEVICES}{address}/boot_vga", low=0, high=1) == 1


def group_number(name: Optional[str]) -> Optional[int]:
    """The IOMMU group an `iommu_group` link's name gives, None when it names
    none. Group numbers are small decimals; a link named otherwise is not a
    group."""
    return decimal(name, 9)


def _physfn(sysfs: Sysfs, rel: str) -> Optional[PciAddress]:
    """The PF of a VF (its `physfn` link), None for anything else."""
    name = sysfs.link_name(rel + "/physfn")
    if not name:
        return None
    try:
        return PciAddress.parse(name)
    except InputError:
        return None


def pci_root(sysfs: Sysfs, address: PciAddress) -> Optional[PciAddress]:
    """The root port above `address` (the function on its root bus), or itself.

    The canonical path looks like sys/devices/pci0000:80/0000:80:01.2/0000:82:00.0;
    the first component below the host bridge is the root. Behind an Intel
    VMD controller the path holds a second root bus, the VMD domain's
    (sys/devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e0:06.0/10000:e1:00.0):
    the kernel makes it a root bus of its own and finds a device's root port
    there (10000:e0:06.0, pcie_find_root_port), while the VMD controller is an
    endpoint of the host's bus that every device of its domain sits behind.
    So the root is the component below the last root bus: two GPUs on two VMD
    root ports are not reported as sharing one, and their locality (NUMA node:
    the kernel gives the domain the controller's node) is read from their own
    `numa_node` as elsewhere.
    """
    # The bus link's own target names the chain ("../../../devices/pci0000:80/
    # 0000:80:01.2/0000:82:00.0"): one readlink instead of a realpath walk.
    try:
        target = os.readlink(sysfs.path(PCI_DEVICES + str(address)))
    except OSError:
        return None
    if "/devices/pci" not in target:
        try:
            target = sysfs.resolve(PCI_DEVICES + str(address))
        except ValueError:
            return None
    parts = target.split("/")
    below = [i + 1 for i, part in enumerate(parts[:-1])
             if part.startswith("pci") and ":" in part]
    if not below:
        return address
    try:
        return PciAddress.parse(parts[below[-1]])
    except InputError:
        return None


def _addresses_in(sysfs: Sysfs, rel: str) -> list[PciAddress]:
    """The entries of a directory that are PCI addresses, in address order."""
    out = []
    for name in sysfs.listdir(rel):
        try:
            out.append(PciAddress.parse(name))
        except InputError:
            continue  # mdev UUIDs in an IOMMU group, stray files
    out.sort()
    return out


def list_addresses(sysfs: Sysfs) -> list[PciAddress]:
    """Every PCI function on the host, in address order.

    A host without `sys/bus/pci/devices` has none; one whose directory cannot
    be listed (a symlink loop, EIO) raises DeviceError: an empty list would
    tell the CloudStack agent that every GPU is gone.
    """
    rel = PCI_DEVICES.rstrip("/")
    names = sysfs.listdir_result(rel)
    if isinstance(names, ReadFailure):
        if names.missing:
            return []
        raise DeviceError(f"cannot list the PCI devices in {names.path}: {names.reason}")
    out = []
    for name in names:
        try:
            out.append(PciAddress.parse(name))
        except InputError:
            continue
    out.sort()
    return out


def virtfn_links(sysfs: Sysfs, pf: PciAddress) -> list[tuple[int, PciAddress]]:
    """A PF's VFs as (index, address), in `virtfnN` order (0, 1, 2, ... 10)."""
    rel = PCI_DEVICES + str(pf)
    out = []
    for name in sysfs.listdir(rel):
        index = decimal(name[6:], 9) if name.startswith("virtfn") else None
        if index is None:
            continue
        target = sysfs.link_name(rel + "/" + name)
        if not target:
            continue
        try:
            out.append((index, PciAddress.parse(target)))
        except InputError:
            continue
    out.sort()
    return out


def physical_function(sysfs: Sysfs, vf: PciAddress) -> Optional[PciAddress]:
    """The PF of a VF, None for anything else.

    From the VF's `physfn` link; when that link names no PF (a loop, a bad
    target), from the PF whose `virtfnN` links name the VF, the way discovery
    finds a PF's VFs: a VF whose own link is broken still has its PF.
    """
    rel = PCI_DEVICES + str(vf)
    found = _physfn(sysfs, rel)
    if found is not None or not sysfs.exists(rel + "/physfn"):
        return found
    try:
        candidates = list_addresses(sysfs)
    except DeviceError:
        return None
    for pf in candidates:
        if pf != vf and any(a == vf for _, a in virtfn_links(sysfs, pf)):
            return pf
    return None


def iommu_group_members(sysfs: Sysfs, group: int) -> list[PciAddress]:
    """The PCI functions of an IOMMU group."""
    return _addresses_in(sysfs, f"sys/kernel/iommu_groups/{group}/devices")
