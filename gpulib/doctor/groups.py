"""`iommu-group`: every other endpoint in a passthrough GPU's group can go with it."""

from __future__ import annotations

from gpulib.doctor import passthrough as pt
from gpulib.doctor.actions import Reboot
from gpulib.doctor.core import FAIL, OK, WARN, Result, is_free_for_vfio
from gpulib.pci import PCI_DEVICES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.doctor.facts import Facts


def check(d: Facts) -> list[Result]:
    cid = "iommu-group"
    problems: list[Result] = []
    gpus = d.passthrough_gpus()
    for gpu in gpus:
        group = gpu.fn.iommu_group
        if group is None:
            applied = d.setup_pending("iommu")
            if applied:
                problems.append(d.result(
                    cid, WARN, str(gpu.address),
                    f"passthrough GPU {d.label(gpu)} has no IOMMU group yet: gpulib setup "
                    f"enabled the IOMMU at {applied}, a reboot is pending", [Reboot()],
                    pending="reboot"))
                continue
            problems.append(Result(
                cid, FAIL, str(gpu.address),
                f"passthrough GPU {d.label(gpu)} has no IOMMU group: it cannot be "
                "given to a VM", "enable the IOMMU: see the iommu check"))
            continue
        if gpu.host_endpoint is not None:
            # The host's (`ownership.host_endpoints`): no fix takes the endpoint
            # from its driver; the GPU is not offered whole.
            problems.append(Result(
                cid, WARN, str(gpu.address),
                f"passthrough GPU {d.label(gpu)} is not offered whole: {gpu.host_endpoint}",
                "leave that endpoint to the host: move the GPU to a slot of its own "
                "(a root port or switch with ACS), or give it as vGPUs"))
            continue
        for fn in d.group_peers(gpu):
            member = fn.address
            drv = d.sysfs.link_name(f"{PCI_DEVICES}{member}/driver")
            if is_free_for_vfio(drv):
                continue
            applied = d.vfio_pending({(fn.vendor_id, fn.device_id)})
            if applied is None and pt.overridden(d, member):
                # driverctl's record: vfio-pci gets it when it appears at the next boot
                problems.append(d.result(
                    cid, WARN, str(member),
                    f"{member} ({fn.class_name}) shares IOMMU group {group} with passthrough "
                    f"GPU {gpu.address} and is still on {drv}; driverctl overrides it to "
                    "vfio-pci (/" + pt.override_file(member) + "): it moves at the next boot",
                    [Reboot()], pending="reboot"))
                continue
            if applied:
                problems.append(d.result(
                    cid, WARN, str(member),
                    f"{member} ({fn.class_name}) shares IOMMU group {group} with passthrough "
                    f"GPU {gpu.address} and is still on {drv}; gpulib setup configured "
                    f"vfio-pci for it at {applied}: a reboot is pending", [Reboot()],
                    pending="reboot"))
                continue
            other = "" if member.slot_key == gpu.address.slot_key else (
                "; it is another device, so it goes to the same VM (or the slot lacks "
                "ACS isolation)")
            problems.append(Result(
                cid, FAIL, str(member),
                f"{member} ({fn.class_name}) shares IOMMU group {group} with passthrough "
                f"GPU {gpu.address} and is bound to {drv}: every endpoint of the group "
                f"must be on vfio-pci or free before the GPU can go to a VM{other}",
                d.rebind_fix(member)))
    if problems:
        return problems
    if not gpus:
        return [Result(cid, OK, "IOMMU groups", "no GPU is offered for passthrough")]
    return [Result(cid, OK, "IOMMU groups",
                   f"{len(gpus)} passthrough GPU group(s): every other endpoint is on "
                   "vfio-pci or free")]
