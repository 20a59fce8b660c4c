"""`iommu`: the IOMMU is enabled on the kernel command line and active."""

from __future__ import annotations

from gpulib import bootconfig
from gpulib.context import PROC_CMDLINE
from gpulib.doctor.actions import KernelArgs, Manual, Reboot, RunCommand
from gpulib.doctor.core import DEFAULT_GRUB, FAIL, OK, WARN, Result, host_path
from gpulib.errors import GpulibError
from gpulib.pci import group_number

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Doctor


def _where(d: Doctor) -> str:
    """The file the kernel command line's effective value comes from (as shown)."""
    try:
        config = bootconfig.read_config(bootconfig.text_reader(d.sysfs.read_bytes),
                                        d.sysfs.listdir, d.distro.family)
    except GpulibError:
        return host_path(DEFAULT_GRUB)
    return host_path(config.where(d.distro.grub_key))


def check(d: Doctor) -> list[Result]:
    cid, subject = "iommu", host_path(PROC_CMDLINE)
    vendor = d.cpu_vendor()
    units = sorted(d.sysfs.listdir("sys/class/iommu"))
    groups = [g for g in d.sysfs.listdir("sys/kernel/iommu_groups") if group_number(g) is not None]
    intel = [v for value in d.params("intel_iommu") for v in value.split(",")]
    amd = [v for value in d.params("amd_iommu") for v in value.split(",")]
    generic = [v for value in d.params("iommu") for v in value.split(",")]
    shown = " ".join(t for t in d.cmdline
                     if t.split("=", 1)[0] in ("intel_iommu", "amd_iommu", "iommu"))
    if vendor == "intel":
        on_args, on_cmdline = "intel_iommu=on iommu=pt", "on" in intel
    elif vendor == "amd":
        on_args, on_cmdline = "iommu=pt", "off" not in amd
    else:
        on_args = "intel_iommu=on iommu=pt"
        on_cmdline = "on" in intel or "on" in amd or "pt" in generic
    off = [f"{name}=off" for name, values in (("intel_iommu", intel), ("amd_iommu", amd),
                                             ("iommu", generic)) if "off" in values]
    active = bool(units) and bool(groups)
    what = (f"{len(units)} IOMMU unit(s) in /sys/class/iommu" if units else
            "no IOMMU unit in /sys/class/iommu") + ", " + \
        (f"{len(groups)} IOMMU groups" if groups else "/sys/kernel/iommu_groups is empty")
    wanted = tuple(on_args.split())
    configured = d.configured_args
    # /etc/default/grub already says what the running kernel lacks: the next boot has it
    # (after the boot entries are regenerated, which gpulib setup does with its edit).
    in_config = all(a in configured for a in wanted) and not any(o in configured for o in off)
    if in_config and (off or not active or not on_cmdline):
        applied = d.setup_pending(cid)
        if applied:
            return [d.result(cid, WARN, subject,
                             f"the IOMMU arguments ({' '.join(wanted)}) are in "
                             f"{host_path(DEFAULT_GRUB)} since gpulib setup at {applied}, but "
                             f"the running kernel was booted without them; {what}: a reboot "
                             "is pending", [Reboot()], pending="reboot")]
        commands = d.distro.boot_config_commands(add=wanted, remove=tuple(off))
        regenerate: list[Action] = [RunCommand(c) for c in commands] or \
            [Manual(d.distro.grub_update())]
        return [d.result(cid, FAIL, subject,
                         f"the IOMMU is configured in {host_path(DEFAULT_GRUB)} but the running "
                         f"kernel was booted without it; {what}", [*regenerate, Reboot()])]
    if off:
        return [d.result(cid, FAIL, subject,
                         f"the IOMMU is switched off on the kernel command line "
                         f"({' '.join(off)}); {what}",
                         [KernelArgs(add=wanted, remove=tuple(off), where=_where(d))])]
    if not active:
        if on_cmdline and shown:
            firmware = {"intel": "VT-d", "amd": "AMD-Vi/IOMMU"}.get(vendor or "",
                                                                    "VT-d or AMD-Vi/IOMMU")
            return [d.result(cid, FAIL, subject,
                             f"the IOMMU is not active although the command line allows it "
                             f"({shown or 'AMD: on by default'}); {what}",
                             [Manual(f"enable {firmware} (and SR-IOV) in the firmware setup, "
                                     "then reboot")])]
        actions: list[Action] = [KernelArgs(add=wanted, where=_where(d))]
        if vendor == "amd":
            actions.append(Manual("(the AMD IOMMU is on by default: if it stays off after the "
                                  "reboot, enable AMD-Vi/IOMMU in the firmware setup)"))
        if vendor is None:
            actions.append(Manual("(on AMD CPUs: only iommu=pt, the AMD IOMMU is on by "
                                  "default; also enable VT-d or AMD-Vi in the firmware setup)"))
        return [d.result(cid, FAIL, subject,
                         f"the IOMMU is not enabled: no {wanted[0]} on the kernel "
                         f"command line; {what}", actions)]
    if not on_cmdline:
        return [d.result(cid, WARN, subject,
                         f"the IOMMU is active by the kernel's default but not enabled on "
                         f"the command line ({what}): another kernel may boot without it",
                         [KernelArgs(add=wanted, where=_where(d))])]
    how = shown or "AMD: on by default"
    return [Result(cid, OK, subject, f"the IOMMU is enabled ({how}) and active: {what}")]
