"""Which GPUs may be kept from the host for passthrough, and the actions that do it.

One place decides: `gpulib setup --passthrough` applies these actions and the
`driver-binding` check prints them as its fix, so both say the same thing.

Nothing is rebound while the host runs: vfio-pci gets the devices at the next
boot (its ids in modprobe.d and on the kernel command line, loaded early from
the initramfs and by systemd-modules-load, so a blacklisted display driver
leaves the GPU on vfio-pci rather than driverless), or per device through
driverctl's override files (`/etc/driverctl.d/pci-<address>`, what
`driverctl set-override` saves), which its udev rule applies when the device
appears at boot. gpulib writes the file itself: `driverctl set-override`, even
with `--noprobe`, unbinds the device at once.

What the administrator configured stays: the `ids` vfio-pci is given now (from
any modprobe.d file or the command line: the last one wins) are kept in the
value gpulib writes, lines they added to gpulib's own file stay, an unnamed
device with the same id (a twin, driverless or not) is never swept along by
`vfio-pci.ids=`, and a device driverctl keeps on another driver is not taken.
"""

from __future__ import annotations

import re

from gpulib.bootstate import DRACUT, INITRAMFS_TOOLS, VFIO_IDS_ARGS, id_key
from gpulib.context import MODPROBE_DIR
from gpulib.discovery import Gpu
from gpulib.doctor.actions import KernelArgs, Manual, Reboot, RunCommand, WriteFile
from gpulib.doctor.core import is_vfio_driver
from gpulib.lazyre import lazy
from gpulib.ownership import host_endpoints
from gpulib.pci import BRIDGE_BASE_CLASS, PCI_DEVICES, PciAddress, PciFunction
from gpulib.slotted import Slotted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Facts

VFIO_CONF = MODPROBE_DIR + "/gpulib-vfio.conf"
# vfio-pci loaded at boot whatever else loads: systemd-modules-load on every family,
# and in the initramfs (initramfs-tools' module list, dracut's force_drivers).
MODULES_LOAD = "etc/modules-load.d/gpulib-vfio.conf"
INITRAMFS_MODULES = "etc/initramfs-tools/modules"
DRACUT_CONF = "etc/dracut.conf.d/gpulib-vfio.conf"
DRIVERCTL = ("usr/sbin/driverctl", "usr/bin/driverctl", "sbin/driverctl")
DRIVERCTL_DIR = "etc/driverctl.d"
# PCI base classes the host cannot lose with a GPU's IOMMU group.
HOST_NEEDED = {0x01: "storage", 0x02: "network"}
VFIO_MODULES = ("vfio", "vfio_iommu_type1", "vfio_pci")


def file_text(d: Facts, rel: str) -> str:
    """A configuration file's whole text ("" when absent): not an attribute's stripped one."""
    data = d.sysfs.read_bytes(rel)
    return "" if data is None else data.decode("utf-8", "replace")


def ids_of(fn: PciFunction) -> str:
    return f"{fn.vendor_id:04x}:{fn.device_id:04x}"


def all_functions(d: Facts) -> list[PciFunction]:
    out = []
    for name in sorted(d.sysfs.listdir(PCI_DEVICES.rstrip("/"))):
        try:
            fn = PciFunction.read_ids(d.sysfs, PciAddress.parse(name))
        except Exception:
            continue
        fn.driver = d.sysfs.link_name(f"{PCI_DEVICES}{name}/driver")
        out.append(fn)
    return out


def vgpu_use(d: Facts, gpu: Gpu) -> list[str]:
    """What the GPU is used for as vGPU (empty: nothing), each as a few words."""
    out: list[str] = []
    if gpu.mode != "passthrough":
        out.append(f"it offers vGPU ({gpu.mode})")
    elif d.needs_vfs(gpu):
        out.append("it is on its vendor's vGPU driver")
    if gpu.sriov_numvfs > 0:
        out.append(f"{gpu.sriov_numvfs} VF(s) enabled")
    if gpu.vgpus:
        live = sum(1 for v in gpu.vgpus if v.live)
        used = sum(1 for v in gpu.vgpus if v.used_by)
        out.append(f"{len(gpu.vgpus)} vGPU(s), {live} live" + (f", {used} in use" if used else ""))
    if gpu.pools:
        out.append(f"parent of pool {', '.join(gpu.pools)}")
    parents = {str(gpu.address), *(str(vf.address) for vf in gpu.vfs)}
    kept = sorted(p for p in d.sysfs.listdir("etc/mdevctl.d") if p in parents
                  and d.sysfs.listdir(f"etc/mdevctl.d/{p}"))
    if kept:
        out.append("vGPU definitions kept in /etc/mdevctl.d")
    return out


def driverctl(d: Facts) -> Optional[str]:
    return next((p for p in DRIVERCTL if d.sysfs.exists(p)), None)


def override_file(address: PciAddress) -> str:
    """driverctl's record of a device's override (root-relative)."""
    return f"{DRIVERCTL_DIR}/pci-{address}"


def override_of(d: Facts, address: PciAddress) -> Optional[str]:
    """The driver driverctl keeps the device on from the next boot on (None: none).

    Its udev rule writes the device's `driver_override` when the device appears,
    which beats every id match: such a device goes to that driver, whatever
    `vfio-pci.ids` says."""
    text = (d.sysfs.read(override_file(address)) or "").strip()
    return text or None


def overridden(d: Facts, address: PciAddress) -> bool:
    """driverctl keeps an override to vfio-pci for the device (from the next boot on)."""
    return override_of(d, address) == "vfio-pci"


def configured_ids(d: Facts) -> list[str]:
    """vendor:device ids the next boot gives vfio-pci (the last `ids` modprobe reads)."""
    return d.next_boot.vfio_ids()


def kept_for_passthrough(d: Facts, gpu: Gpu) -> bool:
    """The next boot gives the GPU to vfio-pci (gpulib setup, or by hand)."""
    return ids_of(gpu.fn) in configured_ids(d) or overridden(d, gpu.address)


class PassthroughPlan(Slotted):
    __slots__ = ("actions", "how", "refusals", "taken")
    _fields = ("actions", "refusals", "taken", "how")

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.refusals: list[tuple[str, str]] = []  # (address, why)
        self.taken: list[PciAddress] = []  # every function kept from the host
        # per function taken: how vfio-pci gets it at the next boot, and how to see it
        self.how: dict[PciAddress, str] = {}


BY_IDS = "vfio-pci.ids (the kernel command line and /" + VFIO_CONF + ")"
BY_OVERRIDE = "its driverctl override (/" + DRIVERCTL_DIR + "/pci-{address}: `driverctl " \
    "list-persisted` lists it now)"


def swept_along(d: Facts, fn: PciFunction) -> bool:
    """An unnamed device `vfio-pci.ids=` for its id would take at the next boot: it is
    not on vfio-pci now (on a driver, or on none: a driverless twin is taken as
    well), and no driverctl override keeps it on a driver of its own."""
    return not is_vfio_driver(fn.driver) and override_of(d, fn.address) is None


def _group(d: Facts, gpu: Gpu) -> list[PciFunction]:
    gpu_fn = PciFunction.read_ids(d.sysfs, gpu.address)
    gpu_fn.driver = gpu.fn.driver
    out = [gpu_fn]
    for member in gpu.group_members:
        if member == gpu.address:
            continue
        fn = PciFunction.read_ids(d.sysfs, member)
        fn.driver = d.sysfs.link_name(f"{PCI_DEVICES}{member}/driver")
        if fn.class_code >> 8 != BRIDGE_BASE_CLASS:
            out.append(fn)
    return out


def plan(d: Facts, gpus: list[Gpu], by_address: set[PciAddress],
         include_boot_vga: bool = False, include_vgpu: bool = False) -> PassthroughPlan:
    """Keep `gpus` (with their IOMMU groups) from the host from the next boot on.

    `by_address`: the GPUs named by PCI address (a vendor:device id alone never
    takes a GPU with vGPU use). All named GPUs' groups count as named together:
    two identical GPUs, each with its audio function, go together.
    """
    out = PassthroughPlan()
    accepted: list[tuple[Gpu, list[PciFunction]]] = []
    for gpu in gpus:
        why = _refusal(d, gpu, by_address, include_boot_vga, include_vgpu)
        if why:
            out.refusals.append((str(gpu.address), why))
            continue
        accepted.append((gpu, _group(d, gpu)))
    named = {fn.address for _, group in accepted for fn in group}
    refused = {addr for addr, _ in out.refusals}
    functions = all_functions(d)
    by_ids: list[PciFunction] = []
    per_device: list[PciFunction] = []
    tool = driverctl(d)
    kept = set(configured_ids(d))
    for gpu, group in accepted:
        ids = {ids_of(fn) for fn in group}
        if all(overridden(d, fn.address) for fn in group):
            # kept per device already (driverctl's records): nothing more to do
            for fn in group:
                out.how[fn.address] = BY_OVERRIDE.format(address=fn.address)
            out.taken.extend(fn.address for fn in group)
            continue
        # a device with the same id that nobody named would go to vfio-pci too (unless
        # the ids already give vfio-pci that id: then it goes whatever gpulib does)
        others = [fn for fn in functions if ids_of(fn) in ids - kept and
                  fn.address not in named and
                  (swept_along(d, fn) or str(fn.address) in refused)]
        if others:
            shown = ", ".join(f"{fn.address} ({ids_of(fn)}, "
                              f"{'on ' + fn.driver if fn.driver else 'no driver'})"
                              for fn in others)
            if tool is None:
                out.refusals.append((str(gpu.address),
                                     f"vfio-pci.ids= binds by vendor:device and would also "
                                     f"take {shown} from the host; install driverctl to bind "
                                     "per device"))
                continue
            per_device.extend(group)
            for fn in group:
                out.how[fn.address] = BY_OVERRIDE.format(address=fn.address)
        else:
            by_ids.extend(group)
            for fn in group:
                out.how[fn.address] = BY_IDS
        out.taken.extend(fn.address for fn in group)
    for fn in per_device:
        if not is_vfio_driver(fn.driver) and not overridden(d, fn.address):
            # driverctl's own record, applied by its udev rule when the device appears
            # at boot: nothing is unbound now (`driverctl set-override` would)
            out.actions.append(WriteFile(override_file(fn.address), "vfio-pci\n"))
    if by_ids:
        out.actions.extend(vfio_ids_actions(d, by_ids))
    if out.actions and not any(isinstance(a, Reboot) for a in out.actions):
        out.actions.append(Reboot())
    return out


def _refusal(d: Facts, gpu: Gpu, by_address: set[PciAddress], include_boot_vga: bool,
             include_vgpu: bool) -> str:
    if gpu.boot_vga and not include_boot_vga:
        return ("it is the boot VGA device (the host's console); name it with "
                "--include-boot-vga as well to take it")
    override = override_of(d, gpu.address)
    if override is not None and override != "vfio-pci":
        return (f"driverctl keeps it on {override} (/{override_file(gpu.address)}), which "
                "beats any vfio-pci id: remove that file by hand (driverctl unset-override "
                "would rebind it now) to take it")
    use = vgpu_use(d, gpu)
    if use and not (gpu.address in by_address and include_vgpu):
        how = ("name it by its PCI address" if gpu.address not in by_address else "") + \
            (" and " if gpu.address not in by_address and not include_vgpu else "") + \
            ("add --include-vgpu-gpu" if not include_vgpu else "")
        return (f"it is used for vGPU ({'; '.join(use)}): passthrough would take that from "
                f"the host and its VMs; {how} to take it anyway")
    if gpu.fn.iommu_group is None:
        return ("it has no IOMMU group (enable the IOMMU first, then run gpulib setup again "
                "after the reboot)")
    needed = [f"{fn.address} ({HOST_NEEDED[fn.class_code >> 8]})" for fn in _group(d, gpu)[1:]
              if fn.class_code >> 8 in HOST_NEEDED]
    # An endpoint a host driver uses that is not the GPU's own function is
    # the host's (`ownership.host_endpoints`): never bound to vfio-pci.
    listed = {n.split(" ", 1)[0] for n in needed}
    needed += [f"{addr} (on {driver})" for addr, driver in
               host_endpoints(d.sysfs, gpu.address, gpu.fn.iommu_group, gpu.group_members or None)
               if addr not in listed]
    if needed:
        return (f"its IOMMU group {gpu.fn.iommu_group} also holds {', '.join(needed)}, which "
                "the host needs: the whole group would go to the VM")
    return ""


def _lines_file(d: Facts, rel: str, header: str, lines: list[str]) -> Optional[WriteFile]:
    """`rel` with `lines` appended where missing (None: nothing to add)."""
    text = file_text(d, rel)
    have = {" ".join(line.split()).replace("-", "_") for line in text.splitlines()}
    missing = [line for line in lines if line.replace("-", "_") not in have]
    if not missing:
        return None
    if text and not text.endswith("\n"):
        text += "\n"
    if header not in text:
        text += header + "\n"
    return WriteFile(rel, text + "".join(f"{line}\n" for line in missing))


def early_load_actions(d: Facts) -> list[Action]:
    """vfio-pci loaded at boot before any display driver (none if it already is), by
    systemd-modules-load and from the initramfs of the tool that is installed."""
    out: list[Action] = []
    header = "# gpulib setup: vfio-pci claims the passthrough devices before any other driver"
    for rel, lines in ((MODULES_LOAD, ["vfio-pci"]),):
        found = _lines_file(d, rel, header, lines)
        if found:
            out.append(found)
    tool = d.next_boot.initramfs_tool()
    if tool == INITRAMFS_TOOLS:
        found = _lines_file(d, INITRAMFS_MODULES, header, list(VFIO_MODULES))
        if found:
            out.append(found)
    elif tool == DRACUT:
        # dracut's images hold /etc/modprobe.d only where they are host-only (EL's
        # default, not Debian's): gpulib's file goes in by name
        content = (f'{header}\nforce_drivers+=" {" ".join(VFIO_MODULES)} "\n'
                   f'install_items+=" /{VFIO_CONF} "\n')
        if file_text(d, DRACUT_CONF) != content:
            out.append(WriteFile(DRACUT_CONF, content))
    return out


VFIO_CONF_HEADER = "# gpulib setup: these devices go to virtual machines, not to the host"
# The lines of gpulib's modprobe file that are gpulib's: any other line is the
# administrator's and stays where it is.
_OWN_LINE = lazy(r"^\s*(?:options\s+vfio[-_]pci\s+ids=\S+|softdep\s+\S+\s+pre:\s+vfio-pci)"
                 r"\s*$")


def vfio_conf_text(old: str, ids: list[str], drivers: list[str]) -> str:
    """gpulib's modprobe file: its header, its `options` and `softdep` lines, then
    every other line the file holds (an administrator's) as it was."""
    theirs = [line for line in old.splitlines()
              if line.strip() != VFIO_CONF_HEADER and not _OWN_LINE.match(line)]
    return (f"{VFIO_CONF_HEADER}\noptions vfio-pci ids={','.join(ids)}\n" +
            "".join(f"softdep {drv} pre: vfio-pci\n" for drv in drivers) +
            "".join(f"{line}\n" for line in theirs))


def vfio_ids_actions(d: Facts, take: list[PciFunction]) -> list[Action]:
    """vfio-pci takes these ids at the next boot; the ids it is given now (by gpulib's
    earlier runs or by the administrator, in any file or on the command line) stay."""
    sources = d.next_boot.vfio_ids_sources()
    ids = list(dict.fromkeys(sources[-1].ids)) if sources else []
    for fn in take:
        if ids_of(fn) not in [id_key(i) for i in ids]:
            ids.append(ids_of(fn))
    conf = file_text(d, VFIO_CONF)
    drivers = re.findall(r"^softdep\s+(\S+)\s+pre:\s+vfio-pci", conf, re.M)
    for fn in take:
        if fn.driver and not is_vfio_driver(fn.driver) and fn.driver not in drivers:
            drivers.append(fn.driver)
    existing = tuple(a for a in d.configured_args if a.split("=", 1)[0] in VFIO_IDS_ARGS)
    # The command line's value is the one modprobe and the kernel take last: it holds
    # every id, the administrator's too.
    arg = "vfio-pci.ids=" + ",".join(ids)
    out: list[Action] = []
    content = vfio_conf_text(conf, ids, drivers)
    files_changed = conf != content
    if files_changed:
        out.append(WriteFile(VFIO_CONF, content))
    early = early_load_actions(d)
    out.extend(early)
    if files_changed or early:
        argv = d.initramfs_argv()
        out.append(RunCommand(argv) if argv else Manual(d.initramfs_update()))
    if existing != (arg,):  # last: its fix text ends with the reboot
        out.append(KernelArgs(add=(arg,), remove=tuple(a for a in existing if a != arg),
                              where=d.args_where()))
    if out:
        out.append(Reboot())
    return out
