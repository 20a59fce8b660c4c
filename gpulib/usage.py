"""Which VM uses which device, without asking libvirt (hooks must never call it).

Sources, in order (DESIGN section 4): gpulib's own allocations, the status XML
of running domains (`run/libvirt/qemu/<name>.xml`, `<domstatus><domain>`),
and the definitions of defined domains (`etc/libvirt/qemu/*.xml`). The first
source that names a device wins.

Files without a `<hostdev` are not parsed at all; that keeps a host with many
VMs cheap to scan.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

from gpulib.context import DEFINED_DOMAINS, RUNNING_DOMAINS
from gpulib.lazyre import lazy
from gpulib.pci import PciAddress
from gpulib.sysfs import Sysfs

log = logging.getLogger(__name__)

# Hostdev sources as libvirt writes them: attributes in any order and quote.
_HOSTDEV = lazy(r"<hostdev\b([^>]*)>(.*?)</hostdev>", re.S)
_ATTR = lazy(r"""([A-Za-z_:][-.\w:]*)\s*=\s*(?:'([^']*)'|"([^"]*)")""")
_SOURCE = lazy(r"<source\b[^>]*>(.*?)</source>", re.S)
_ADDRESS = lazy(r"<address\b([^>]*?)/?>", re.S)
_NAME = lazy(r"<name>\s*([^<]+?)\s*</name>")


def _attrs(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) if m.group(2) is not None else m.group(3)
            for m in _ATTR.finditer(text)}


class DomainDevices:
    """The host devices one domain file names."""

    __slots__ = ("mdevs", "name", "pci")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pci: list[PciAddress] = []
        self.mdevs: list[str] = []


def scan_domain_xml(text: str) -> Optional[DomainDevices]:
    """Devices of one domain (status or definition) XML, None if unreadable.

    libvirt writes these files itself, so a tolerant scan is enough and avoids
    paying for an XML parser on every VM of a large host. Comments are removed
    first so a commented-out hostdev is not counted.
    """
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    # In a status file the first <name> inside <domain> is the VM's name.
    dom_start = text.find("<domain")
    m = _NAME.search(text, dom_start if dom_start >= 0 else 0)
    if not m:
        return None
    devices = DomainDevices(m.group(1))
    if "<hostdev" not in text:
        return devices
    for hd in _HOSTDEV.finditer(text):
        attrs = _attrs(hd.group(1))
        if attrs.get("mode", "subsystem") != "subsystem":
            continue
        src = _SOURCE.search(hd.group(2))
        if not src:
            continue
        addr = _ADDRESS.search(src.group(1))
        if not addr:
            continue
        a = _attrs(addr.group(1))
        kind = attrs.get("type")
        if kind == "pci":
            try:
                devices.pci.append(PciAddress.from_libvirt(
                    a.get("domain", "0"), a.get("bus", ""), a.get("slot", ""),
                    a.get("function", "")))
            except Exception:
                log.debug("skipping unreadable PCI hostdev in domain %s", devices.name)
        elif kind == "mdev" and a.get("uuid"):
            devices.mdevs.append(a["uuid"].lower())
    return devices


def _scan_dir(sysfs: Sysfs, rel: str) -> list[DomainDevices]:
    out = []
    for name in sorted(sysfs.listdir(rel)):
        if not name.endswith(".xml"):
            continue
        try:
            data = sysfs.read_bytes(f"{rel}/{name}")
        except OSError as exc:
            log.warning("cannot read %s/%s: %s", rel, name, exc.strerror)
            continue
        if data is None:
            continue
        found = scan_domain_xml(data.decode("utf-8", "replace"))
        if found is not None:
            out.append(found)
    return out


class Usage:
    """Device -> VM maps, with the source each answer came from."""

    def __init__(self) -> None:
        self.pci: dict[PciAddress, str] = {}
        self.mdev: dict[str, str] = {}
        self.running: set[str] = set()
        self.defined: set[str] = set()

    def add(self, devices: DomainDevices) -> None:
        for addr in devices.pci:
            self.pci.setdefault(addr, devices.name)
        for uuid in devices.mdevs:
            self.mdev.setdefault(uuid, devices.name)

    def vm_for_pci(self, address: PciAddress) -> Optional[str]:
        return self.pci.get(address)

    def vm_for_mdev(self, uuid: str) -> Optional[str]:
        return self.mdev.get(uuid.lower())


def running_domains(sysfs: Sysfs) -> list[DomainDevices]:
    return _scan_dir(sysfs, RUNNING_DOMAINS)


def read_usage(sysfs: Sysfs, allocations: Optional[dict[str, list[tuple[str, str]]]] = None,
               include_defined: bool = True) -> Usage:
    """Build the maps. `allocations` is gpulib's own: vm -> [(kind, id)]."""
    usage = Usage()
    for vm, devices in (allocations or {}).items():
        for kind, ident in devices:
            if kind == "mdev":
                usage.mdev.setdefault(ident.lower(), vm)
            else:
                try:
                    usage.pci.setdefault(PciAddress.parse(ident), vm)
                except Exception:
                    continue
    for dom in running_domains(sysfs):
        usage.running.add(dom.name)
        usage.add(dom)
    if include_defined:
        for dom in _scan_dir(sysfs, DEFINED_DOMAINS):
            usage.defined.add(dom.name)
            usage.add(dom)
    return usage
