"""`sriov`: VFs are enabled where the card's vGPU needs them."""

from __future__ import annotations

from gpulib.doctor.actions import Manual, Reboot, RunCommand
from gpulib.doctor.core import FAIL, OK, Result
from gpulib.nvidia import NVIDIA_VENDOR

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Facts

SRIOV_MANAGE = "usr/lib/nvidia/sriov-manage"
UNIT_DIRS = ("etc/systemd/system", "usr/lib/systemd/system", "lib/systemd/system")


def boot_unit(d: Facts) -> Optional[str]:
    """The installed systemd unit that runs sriov-manage at boot (as found, not guessed)."""
    for directory in UNIT_DIRS:
        for name in sorted(d.sysfs.listdir(directory)):
            if "sriov" in name and name.endswith(".service"):
                text = d.sysfs.read(f"{directory}/{name}") or ""
                if "sriov-manage" in text:
                    return name
    return None


def unit_enabled(d: Facts, unit: str) -> bool:
    instance = unit.replace("@.", "@ALL.")
    return any(d.sysfs.exists(f"etc/systemd/system/{wants}/{instance}")
               for wants in d.sysfs.listdir("etc/systemd/system") if wants.endswith(".wants"))


def _facts(d: Facts) -> str:
    if not d.sysfs.exists(SRIOV_MANAGE):
        return f"; /{SRIOV_MANAGE} is not installed"
    unit = boot_unit(d)
    if unit is None:
        return "; no systemd unit runs sriov-manage at boot"
    return f"; {unit} runs sriov-manage at boot" + ("" if unit_enabled(d, unit) else
                                                    " but is not enabled")


def nvidia_vf_actions(d: Facts, addr: str) -> list[Action]:
    """The vendor's unit enabled, so the VFs are there from the next boot on (gpulib
    setup changes nothing now); running sriov-manage now is the operator's to do.
    Only what is installed, nothing fetched."""
    tool = "/" + SRIOV_MANAGE
    if not d.sysfs.exists(SRIOV_MANAGE):
        return [Manual(f"{tool} -e {addr}\n({tool} comes with the NVIDIA vGPU host driver, "
                       "which is not installed; gpulib downloads no driver)")]
    now = Manual(f"(for VFs before the reboot, by hand: {tool} -e {addr})")
    unit = boot_unit(d)
    if unit is None:
        return [Manual(f"{tool} -e {addr}\n(VFs do not survive a reboot: run it at every "
                       "boot, e.g. `sriov-manage -e ALL` from a systemd unit)")]
    if not unit_enabled(d, unit):
        return [RunCommand(("systemctl", "enable", unit.replace("@.", "@ALL."))), Reboot(),
                now]
    return [Manual(f"{tool} -e {addr}\n({unit} runs it at every boot: see why it did not, "
                   f"systemctl status {unit.replace('@.', '@ALL.')})")]


def check(d: Facts) -> list[Result]:
    cid = "sriov"
    problems: list[Result] = []
    enabled = 0
    for gpu in d.inventory.gpus:
        if gpu.sriov_totalvfs > 0 and gpu.sriov_numvfs > 0:
            enabled += 1
        if not d.needs_vfs(gpu):
            continue
        addr = gpu.address
        if gpu.fn.vendor_id == NVIDIA_VENDOR:
            msg = (f"{d.label(gpu)} is on the NVIDIA vGPU host driver and supports "
                   f"{gpu.sriov_totalvfs} VFs, but none is enabled (sriov_numvfs 0) and it "
                   "has no mdev types: it offers no vGPU")
            if not d.sysfs.isdir("sys/module/nvidia_vgpu_vfio"):
                msg += ("; nvidia_vgpu_vfio is not loaded (is the vGPU host driver "
                        "installed? for passthrough, bind the GPU to vfio-pci instead)")
            actions = nvidia_vf_actions(d, str(addr))
            problems.append(d.result(cid, FAIL, str(addr), msg + _facts(d), actions))
            continue
        msg = (f"{d.label(gpu)} is on {gpu.fn.driver} and supports "
               f"{gpu.sriov_totalvfs} VFs, but none is enabled (sriov_numvfs 0): it "
               "offers no VF")
        fix = (f"echo {gpu.sriov_totalvfs} > /sys/bus/pci/devices/{addr}/sriov_numvfs\n"
               "(at every boot, e.g. from a systemd unit or udev rule)")
        problems.append(Result(cid, FAIL, str(addr), msg, fix))
    if problems:
        return problems
    if enabled:
        return [Result(cid, OK, "GPUs", f"{enabled} GPU(s) have their SR-IOV VFs enabled; "
                                        "no vGPU GPU is missing its VFs")]
    return [Result(cid, OK, "GPUs", "no GPU needs SR-IOV VFs")]
