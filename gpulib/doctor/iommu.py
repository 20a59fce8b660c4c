"""`iommu`: the IOMMU is enabled and active now, and the next boot enables it too.

Two readings, each said by name: the running kernel's command line
(`/proc/cmdline`) and the IOMMU units it made, and the next boot's command line
as its configuration gives it (`gpulib.bootstate.NextBoot`, the one `gpulib
setup` edits). A one-off boot-menu edit that enabled the IOMMU is not a host that
will have it after the next reboot, and an `intel_iommu=off` the configuration
holds is one even when this boot went without it.
"""

from __future__ import annotations

from gpulib.bootconfig import superseded
from gpulib.context import PROC_CMDLINE
from gpulib.doctor.actions import KernelArgs, Manual, Reboot, RunCommand
from gpulib.doctor.core import FAIL, OK, WARN, Result, host_path
from gpulib.pci import group_number

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Facts

OFF_ARGS = ("intel_iommu=off", "amd_iommu=off", "iommu=off")


def _where(d: Facts) -> str:
    return d.args_where()


def _values(args: list[str], name: str) -> list[str]:
    prefix = name + "="
    return [v for a in args if a.startswith(prefix) for v in a[len(prefix):].split(",")]


def check(d: Facts) -> list[Result]:
    cid, subject = "iommu", host_path(PROC_CMDLINE)
    vendor = d.cpu_vendor()
    units = sorted(d.sysfs.listdir("sys/class/iommu"))
    groups = [g for g in d.sysfs.listdir("sys/kernel/iommu_groups") if group_number(g) is not None]
    running = d.cmdline
    intel, amd = _values(running, "intel_iommu"), _values(running, "amd_iommu")
    generic = _values(running, "iommu")
    shown = " ".join(t for t in running
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
    nb = d.next_boot
    known = nb.known
    configured = d.configured_args
    config = nb.where() if known else ""
    # The next boot: its configuration switches it off (where no later argument
    # switches it on again), or lacks what enables it.
    next_off = list(dict.fromkeys(
        o for _, args in (nb.sources() if known else []) for o in OFF_ARGS
        if o in args and not superseded(o, args, wanted)))
    next_lacks = [a for a in wanted if known and a not in configured]
    if next_off:
        places = nb.where()
        now = ("the running kernel has it too" if off else
               f"the running kernel was booted without it ({what})")
        return [d.result(cid, FAIL, subject,
                         f"the next boot switches the IOMMU off: {' '.join(next_off)} is in "
                         f"{places}; {now}",
                         [KernelArgs(add=wanted, remove=tuple(next_off), where=_where(d))])]
    # /etc/default/grub already says what the running kernel lacks: the next boot has it
    # (after the boot entries are regenerated, which gpulib setup does with its edit).
    in_config = known and not next_lacks
    if in_config and (off or not active or not on_cmdline):
        applied = d.setup_pending(cid)
        if applied:
            return [d.result(cid, WARN, subject,
                             f"the IOMMU arguments ({' '.join(wanted)}) are in "
                             f"{config} since gpulib setup at {applied}, but the running "
                             f"kernel was booted without them; {what}: a reboot is pending",
                             [Reboot()], pending="reboot")]
        commands = d.distro.boot_config_commands(add=wanted, remove=tuple(off))
        regenerate: list[Action] = [RunCommand(c) for c in commands] or \
            [Manual(d.distro.grub_update())]
        unfinished = d.setup_unfinished()
        note = (f"; gpulib setup's last apply did not complete (`{unfinished}`): run gpulib "
                "setup --apply again before rebooting" if unfinished else "")
        return [d.result(cid, FAIL, subject,
                         f"the IOMMU is configured in {config} but the running kernel was "
                         f"booted without it; {what}{note}", [*regenerate, Reboot()])]
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
    if next_lacks:
        # enabled for this boot only (a boot-menu edit, or the configuration changed since)
        return [d.result(cid, FAIL, subject,
                         f"the running kernel has {shown} and the IOMMU is active ({what}), "
                         f"but the next boot's configuration ({config}) lacks "
                         f"{' '.join(next_lacks)}: the host loses the IOMMU at its next "
                         "reboot", [KernelArgs(add=wanted, where=_where(d))])]
    how = shown or "AMD: on by default"
    nxt = f"; the next boot gets it from {config}" if known else \
        "; no boot configuration gpulib reads (/etc/default/grub) to judge the next boot by"
    return [Result(cid, OK, subject, f"the IOMMU is enabled ({how}) and active: {what}{nxt}")]

