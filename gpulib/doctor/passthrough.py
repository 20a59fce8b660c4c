"""Which GPUs may be kept from the host for passthrough, and the actions that do it.

One place decides: `gpulib setup --passthrough` applies these actions and the
`driver-binding` check prints them as its fix, so both say the same thing.

Nothing is rebound while the host runs: vfio-pci gets the devices at the next
boot (its ids in modprobe.d and on the kernel command line, loaded early from
the initramfs and by systemd-modules-load, so a blacklisted display driver
leaves the GPU on vfio-pci rather than driverless), or per device with
`driverctl --noprobe`, which records the override for the next boot and
leaves the device where it is now.
"""

from __future__ import annotations

import re

from gpulib.context import MODPROBE_DIR
from gpulib.discovery import Gpu
from gpulib.doctor.actions import KernelArgs, Manual, Reboot, RunCommand, WriteFile
from gpulib.doctor.core import is_free_for_vfio, is_vfio_driver
from gpulib.pci import BRIDGE_BASE_CLASS, PCI_DEVICES, PciAddress, PciFunction
from gpulib.slotted import Slotted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Doctor

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


def file_text(d: Doctor, rel: str) -> str:
    """A configuration file's whole text ("" when absent): not an attribute's stripped one."""
    data = d.sysfs.read_bytes(rel)
    return "" if data is None else data.decode("utf-8", "replace")


def ids_of(fn: PciFunction) -> str:
    return f"{fn.vendor_id:04x}:{fn.device_id:04x}"


def all_functions(d: Doctor) -> list[PciFunction]:
    out = []
    for name in sorted(d.sysfs.listdir(PCI_DEVICES.rstrip("/"))):
        try:
            fn = PciFunction.read_ids(d.sysfs, PciAddress.parse(name))
        except Exception:
            continue
        fn.driver = d.sysfs.link_name(f"{PCI_DEVICES}{name}/driver")
        out.append(fn)
    return out


def vgpu_use(d: Doctor, gpu: Gpu) -> list[str]:
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


def driverctl(d: Doctor) -> Optional[str]:
    return next((p for p in DRIVERCTL if d.sysfs.exists(p)), None)


def overridden(d: Doctor, address: PciAddress) -> bool:
    """driverctl keeps an override to vfio-pci for the device (from the next boot on)."""
    text = d.sysfs.read(f"{DRIVERCTL_DIR}/pci-{address}") or ""
    return text.strip() == "vfio-pci"


def configured_ids(d: Doctor) -> list[str]:
    """vendor:device ids the next boot gives vfio-pci (command line and modprobe.d)."""
    out: list[str] = []
    for arg in d.configured_args:
        name, _, value = arg.partition("=")
        if name in ("vfio-pci.ids", "vfio_pci.ids"):
            out += [i for i in value.split(",") if i]
    conf = file_text(d, VFIO_CONF)
    for m in re.finditer(r"^options\s+vfio[-_]pci\s+ids=(\S+)", conf, re.M):
        out += [i for i in m.group(1).split(",") if i]
    return list(dict.fromkeys(i.lower() for i in out))


def kept_for_passthrough(d: Doctor, gpu: Gpu) -> bool:
    """The next boot gives the GPU to vfio-pci (gpulib setup, or by hand)."""
    return ids_of(gpu.fn) in configured_ids(d) or overridden(d, gpu.address)


class PassthroughPlan(Slotted):
    __slots__ = ("actions", "refusals", "taken")
    _fields = ("actions", "refusals", "taken")

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.refusals: list[tuple[str, str]] = []  # (address, why)
        self.taken: list[PciAddress] = []  # every function kept from the host


def _group(d: Doctor, gpu: Gpu) -> list[PciFunction]:
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


def plan(d: Doctor, gpus: list[Gpu], by_address: set[PciAddress],
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
    for gpu, group in accepted:
        ids = {ids_of(fn) for fn in group}
        # a device with the same id that nobody named would go to vfio-pci too
        others = [fn for fn in functions if ids_of(fn) in ids and fn.address not in named
                  and (not is_free_for_vfio(fn.driver) or str(fn.address) in refused)]
        if others:
            shown = ", ".join(f"{fn.address} ({ids_of(fn)})" for fn in others)
            if tool is None:
                out.refusals.append((str(gpu.address),
                                     f"vfio-pci.ids= binds by vendor:device and would also "
                                     f"take {shown} from the host; install driverctl to bind "
                                     "per device"))
                continue
            per_device.extend(group)
        else:
            by_ids.extend(group)
        out.taken.extend(fn.address for fn in group)
    for fn in per_device:
        if not is_vfio_driver(fn.driver) and not overridden(d, fn.address):
            # --noprobe: recorded for the next boot, the device stays bound now
            out.actions.append(RunCommand(("driverctl", "--noprobe", "set-override",
                                           str(fn.address), "vfio-pci")))
    if by_ids:
        out.actions.extend(vfio_ids_actions(d, by_ids))
    if out.actions and not any(isinstance(a, Reboot) for a in out.actions):
        out.actions.append(Reboot())
    return out


def _refusal(d: Doctor, gpu: Gpu, by_address: set[PciAddress], include_boot_vga: bool,
             include_vgpu: bool) -> str:
    rel = f"{PCI_DEVICES}{gpu.address}"
    if d.sysfs.read(f"{rel}/boot_vga") == "1" and not include_boot_vga:
        return ("it is the boot VGA device (the host's console); name it with "
                "--include-boot-vga as well to take it")
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
    if needed:
        return (f"its IOMMU group {gpu.fn.iommu_group} also holds {', '.join(needed)}, which "
                "the host needs: the whole group would go to the VM")
    return ""


def _lines_file(d: Doctor, rel: str, header: str, lines: list[str]) -> Optional[WriteFile]:
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


def early_load_actions(d: Doctor) -> list[Action]:
    """vfio-pci loaded at boot before any display driver (none if it already is)."""
    out: list[Action] = []
    header = "# gpulib setup: vfio-pci claims the passthrough devices before any other driver"
    for rel, lines in ((MODULES_LOAD, ["vfio-pci"]),):
        found = _lines_file(d, rel, header, lines)
        if found:
            out.append(found)
    family = d.distro.family
    if family == "debian":
        found = _lines_file(d, INITRAMFS_MODULES, header, list(VFIO_MODULES))
        if found:
            out.append(found)
    elif family in ("rhel", "suse"):
        content = f'{header}\nforce_drivers+=" {" ".join(VFIO_MODULES)} "\n'
        if file_text(d, DRACUT_CONF) != content:
            out.append(WriteFile(DRACUT_CONF, content))
    return out


def vfio_ids_actions(d: Doctor, take: list[PciFunction]) -> list[Action]:
    """vfio-pci takes these ids at the next boot; what earlier runs configured stays."""
    ids = configured_ids(d)
    for fn in take:
        if ids_of(fn) not in ids:
            ids.append(ids_of(fn))
    conf = file_text(d, VFIO_CONF)
    drivers = re.findall(r"^softdep\s+(\S+)\s+pre:\s+vfio-pci", conf, re.M)
    for fn in take:
        if fn.driver and not is_vfio_driver(fn.driver) and fn.driver not in drivers:
            drivers.append(fn.driver)
    existing = tuple(a for a in d.configured_args
                     if a.split("=", 1)[0] in ("vfio-pci.ids", "vfio_pci.ids"))
    arg = "vfio-pci.ids=" + ",".join(ids)
    out: list[Action] = []
    content = ("# gpulib setup: these devices go to virtual machines, not to the host\n"
               f"options vfio-pci ids={','.join(ids)}\n" +
               "".join(f"softdep {drv} pre: vfio-pci\n" for drv in drivers))
    files_changed = conf != content
    if files_changed:
        out.append(WriteFile(VFIO_CONF, content))
    early = early_load_actions(d)
    out.extend(early)
    if files_changed or early:
        argv = d.distro.initramfs_argv()
        out.append(RunCommand(argv) if argv else Manual(d.distro.initramfs_update()))
    if existing != (arg,):  # last: its fix text ends with the reboot
        out.append(KernelArgs(add=(arg,), remove=tuple(a for a in existing if a != arg)))
    if out:
        out.append(Reboot())
    return out
