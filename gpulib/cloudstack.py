"""The CloudStack KVM agent's conventions: its discovery JSON (ARCHITECTURE.md).

`render(inventory)` gives exactly the document the agent parses from its stock
`gpudiscovery.sh`: the same keys and JSON types (`enabled` is the number 0 or
1, the agent reads it with getAsInt; `iommu_group` and `pci_root` are
strings; counts are numbers; unknown numbers are null; `vf_profile` is never
null). NVIDIA vendor-specific VFs carry the profile numbers the agent added
for them (max_instances, video_ram, max_heads, max_resolution_x/y): NVIDIA's
tool's where `hostview.attach_type_numbers` found them, else null but for the frame
buffer a profile's name tells.

No device is dropped for a passing reason: the management server marks a
device missing from a report Error and Unmanaged, and one listed again Free
but still Unmanaged, out of allocation until an administrator runs
`manageGpuDevice` (GpuServiceImpl.addGpuDevicesToHost). An instance that
cannot be given now and that no VM holds is reported used by `UNAVAILABLE`,
which the management server marks Error and keeps managed: Free again at the
first report that names no VM.
"""

from __future__ import annotations

import posixpath

from gpulib import jsontext
from gpulib.context import AGENT_PROPERTIES
from gpulib.discovery import Gpu, Inventory, VirtualFunction
from gpulib.mdev import Description, MdevType
from gpulib.nvidia import framebuffer_mb_from_name
from gpulib.pci import CLASS_NAMES, PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

    from gpulib.context import Context
    from gpulib.nvidiasmi import TypeNumbers

# The agent's default hook names (agent.hooks.basedir).
AGENT_HOOKS_DIR = "etc/cloudstack/agent/hooks"
TRANSFORMER_HOOK = "libvirt-vm-xml-transformer.sh"
STATE_CHANGE_HOOK = "libvirt-vm-state-change.sh"
# `used_by_vm` of an instance that no VM holds and that cannot be given now
# (its GPU cannot make it, its state cannot be read): a name no CloudStack
# instance can have (":" is in no host name), so the management server finds
# no such VM and marks the device Error, keeping it managed.
UNAVAILABLE = "gpulib:unavailable"


def agent_hooks_dir(ctx: Context) -> str:
    """The agent's hook directory, root-relative: `agent.hooks.basedir` of its
    agent.properties when set (and inside the root), else the default."""
    text = ctx.sysfs.read(AGENT_PROPERTIES) or ""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "agent.hooks.basedir" and value.strip():
            rel = posixpath.normpath(value.strip().lstrip("/"))
            if rel != ".." and not rel.startswith("../"):
                return rel
    return AGENT_HOOKS_DIR


def pci_class(code: int) -> str:
    """A class code as the stock script writes it: the class field of `lspci
    -nnm`, its name and its 4 hex digits (`3D controller [0302]`), `Class
    [xxxx]` for a class lspci has no name for."""
    name = CLASS_NAMES.get(code, "Class")
    return f"{name} [{code:04x}]"


def _type_numbers(t: Optional[MdevType]) -> dict[str, Optional[int]]:
    return _numbers(t.description if t is not None else None)


def _numbers(d: Optional[Description]) -> dict[str, Optional[int]]:
    res = d.max_resolution if d is not None else None
    return {
        "max_instances": d.max_instance if d else None,
        "video_ram": d.framebuffer_mb if d else None,
        "max_heads": d.num_heads if d else None,
        "max_resolution_x": res[0] if res else None,
        "max_resolution_y": res[1] if res else None,
    }


def _user(used_by: Optional[str], available: bool) -> Optional[str]:
    """`used_by_vm` of an instance: the VM holding it; for one no VM holds
    that cannot be given now, `UNAVAILABLE` (the management server then
    marks it Error, not free, and Free again when a later report names no
    VM: dropping it instead would take it out of allocation for good)."""
    if used_by is None and not available:
        return UNAVAILABLE
    return used_by


def _vf_entry(vf: VirtualFunction, numbers: dict[int, TypeNumbers]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "vf_pci_address": vf.address.lspci,
        "vf_profile": vf.device_name or f"Device {vf.fn.device_id:04x}",
        "libvirt_address": vf.address.libvirt(),
        "used_by_vm": _user(vf.used_by, vf.available),
    }
    nv = vf.nvidia
    if nv is not None:
        # An idle VF that gpulib's registry types at VM start reports that
        # profile: the agent's database knows the device by it. Its numbers
        # are NVIDIA's tool's (`nvidiasmi`), as the stock script's; without
        # them only the frame buffer can be told, from the profile's name.
        known = numbers.get(nv.profile_type) if nv.profile_type else None
        name = nv.profile_name or (known.name if known else None)
        if nv.profile_type:
            entry["vf_profile"] = name or f"NVIDIA vGPU type {nv.profile_type}"
        res = known.max_resolution if known else None
        entry.update({
            "max_instances": known.max_instances if known else None,
            "video_ram": (known.framebuffer_mb if known and known.framebuffer_mb
                          else framebuffer_mb_from_name(name)),
            "max_heads": known.num_heads if known else None,
            "max_resolution_x": res[0] if res else None,
            "max_resolution_y": res[1] if res else None})
    return entry


def gpu_entry(gpu: Gpu) -> dict[str, Any]:
    fn = gpu.fn
    # The stock script reads these from a `description` file of the GPU itself
    # (drivers rarely provide one): the same here, so both agree where one exists.
    pf_numbers = _numbers(Description(gpu.description) if gpu.description else None)
    root: PciAddress = fn.pci_root or fn.address
    return {
        "pci_address": fn.address.lspci,
        "vendor_id": f"{fn.vendor_id:04x}",
        "device_id": f"{fn.device_id:04x}",
        "vendor": gpu.vendor_name,
        "device": gpu.device_name,
        "driver": fn.driver or "unknown",
        "pci_class": pci_class(fn.class_code),
        "iommu_group": str(fn.iommu_group) if fn.iommu_group is not None else "null",
        "pci_root": str(root),
        "numa_node": fn.numa_node,
        "sriov_totalvfs": gpu.sriov_totalvfs,
        "sriov_numvfs": gpu.sriov_numvfs,
        **pf_numbers,
        "full_passthrough": {
            "enabled": 1 if gpu.passthrough_enabled else 0,
            "libvirt_address": fn.address.libvirt(),
            "used_by_vm": gpu.used_by,
        },
        "vgpu_instances": [
            {
                "mdev_uuid": v.uuid,
                "profile_name": v.mdev_type.profile_name,
                **_type_numbers(v.mdev_type),
                "libvirt_address": v.parent.libvirt(),
                "used_by_vm": _user(v.used_by, v.available),
            }
            for v in gpu.reported_vgpus
        ],
        "vf_instances": [_vf_entry(vf, gpu.nvidia_numbers)
                         for vf in sorted([*gpu.reported_vfs, *gpu.unread_vfs],
                                          key=lambda vf: vf.index)],
    }


def unavailable_instances(gpu: Gpu) -> tuple[int, int]:
    """(vGPUs, VFs) of the GPU the report lists used by `UNAVAILABLE`: the
    report's own choice of instances (`reported_vgpus`, `reported_vfs` and
    `unread_vfs`) and rule (`_user`), so metrics count exactly what the
    management server marks Error."""
    vgpus = sum(1 for v in gpu.reported_vgpus if _user(v.used_by, v.available) == UNAVAILABLE)
    vfs = sum(1 for vf in (*gpu.reported_vfs, *gpu.unread_vfs)
              if _user(vf.used_by, vf.available) == UNAVAILABLE)
    return vgpus, vfs


def render(inventory: Inventory) -> dict[str, Any]:
    return {"gpus": [gpu_entry(g) for g in inventory.gpus]}


def dumps(inventory: Inventory) -> str:
    return jsontext.dumps(render(inventory)) + "\n"
