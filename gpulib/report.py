"""gpulib's own renderings of an Inventory: the native JSON and the human table.

The native document (`gpulib discover --format json`, schema version 1) holds
everything discovery knows, where the CloudStack one keeps the agent's shape:

    {"schema": 1, "gpus": [{
        "address", "vendor_id", "device_id", "vendor", "device", "class",
        "class_name", "driver", "iommu_group", "iommu_group_members", "numa_node",
        "pci_root", "mode" (mdev | sriov-mdev | nvidia-vf | sriov | passthrough),
        "used_by" (the VM holding the GPU whole; its vGPUs' and VFs' users are
        theirs), "boot_vga" (the host's console), "whole_refusal" (why it is
        not offered whole, null when it is), "sriov": {"totalvfs", "numvfs"},
        "mdev_types": [{"parent", "type_id", "name", "description", "device_api",
                        "available_instances", "max_instances", "framebuffer_mb",
                        "num_heads", "max_resolution"}],
        "vgpus": [{"uuid", "parent", "type_id", "profile", "used_by",
                   "live" (false: in gpulib's registry, recreated at VM start),
                   "available" (false: its GPU cannot make it ready now and no
                   VM's devices are what keep it; reported to CloudStack used
                   by "gpulib:unavailable", refused at VM start)}],
        "vfs": [{"index", "address", "device", "driver", "iommu_group", "used_by",
                 "available" (as for vGPUs: a recorded type its GPU cannot give now),
                 "mdev_parent", "nvidia": {"current_type", "current_name",
                                           "creatable": {id: name},
                                           "gpu_instance" (the MIG GPU instance
                                           its vGPU runs on, or null)} | null}],
        "nvidia_types": [{"type_id", "name", "max_instances", "framebuffer_mb",
                          "num_heads", "max_resolution",
                          "gpu_instance_profile" (a MIG-backed type's, else
                          null)}] (the types of its NVIDIA vendor-specific VFs:
                         supported, creatable or given; the numbers NVIDIA's
                         tool's, null without it),
        "mig": {"mode": {"current", "pending"},
                "profiles": [{"id", "name", "free", "total", "memory_mb",
                              "slices", "placements", "size"}],
                "gpu_instances": [{"id", "profile_id", "profile",
                                   "placement": {"start", "size"},
                                   "compute_instances": [ids],
                                   "vf" (the VF whose vGPU runs on it, or null),
                                   "used_by" (that VF's VM, or null)}]}
               | null (no MIG, or NVIDIA's tool did not say; from
               `gpulib.migtool`, cached),
        "errors": [...]}]}
"""

from __future__ import annotations

from collections.abc import Sequence

from gpulib.discovery import Gpu, Inventory
from gpulib.mdev import MdevType

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

SCHEMA = 1


def _resolution(res: Optional[tuple[int, int]]) -> Optional[str]:
    return f"{res[0]}x{res[1]}" if res else None


def _type(t: MdevType, parent: str, available: Optional[int]) -> dict[str, Any]:
    d = t.description
    return {
        "parent": parent, "type_id": t.type_id, "name": t.name,
        "description": t.description_text, "device_api": t.device_api,
        "available_instances": available, "max_instances": d.max_instance,
        "framebuffer_mb": d.framebuffer_mb, "num_heads": d.num_heads,
        "max_resolution": _resolution(d.max_resolution),
    }


def _types(gpu: Gpu) -> list[dict[str, Any]]:
    """The GPU's mdev types, its own then its VFs', with the instances left
    of each (`Gpu.mdev_offers`: read a parent's directory at a time; one that
    cannot be read is null and its file is in the GPU's `errors`). A type
    that shares its files with the same type on a sibling VF
    (`MdevType.same_as`) differs from it only in parent and available
    instances: its entry is a copy of the sibling's with those two set (a
    large host has 16 VFs x 24 types a GPU)."""
    out: list[dict[str, Any]] = []
    first: dict[int, dict[str, Any]] = {}
    for address, pairs, available in gpu.mdev_offers():
        parent = str(address)
        for (_, t), n in zip(pairs, available):
            key = id(t.same_as or t)
            template = first.get(key)
            if template is None:
                entry = first[key] = _type(t, parent, n)
            else:
                entry = template.copy()
                entry["available_instances"] = n
            entry["parent"] = parent
            out.append(entry)
    return out


def nvidia_types(gpu: Gpu) -> list[dict[str, Any]]:
    """The types of the GPU's vendor-specific VFs with their numbers: those
    NVIDIA's tool lists for it and those its VFs can create or carry."""
    names: dict[int, Optional[str]] = {}
    for vf in gpu.vfs:
        nv = vf.nvidia
        if nv is None:
            continue
        for tid, name in nv.creatable.items():
            names.setdefault(tid, name)
        for tid, given in ((nv.current_type, nv.current_name),
                           (nv.recorded_type, nv.recorded_name)):
            if tid and (given or tid not in names):
                names[tid] = given
    out = []
    for tid in sorted(set(names) | set(gpu.nvidia_numbers)):
        n = gpu.nvidia_numbers.get(tid)
        out.append({"type_id": tid, "name": names.get(tid) or (n.name if n else None),
                    "max_instances": n.max_instances if n else None,
                    "framebuffer_mb": n.framebuffer_mb if n else None,
                    "num_heads": n.num_heads if n else None,
                    "max_resolution": _resolution(n.max_resolution) if n else None,
                    "gpu_instance_profile": n.gi_profile if n else None})
    return out


def mig_document(gpu: Gpu) -> Optional[dict[str, Any]]:
    """The GPU's MIG layout, each GPU instance with the VF whose vGPU runs on
    it and that VF's VM (None without a layout)."""
    if gpu.mig is None:
        return None
    doc = gpu.mig.as_json()
    bound = {vf.nvidia.gpu_instance: vf for vf in gpu.vfs
             if vf.nvidia is not None and vf.nvidia.gpu_instance is not None}
    for gi in doc["gpu_instances"]:
        vf = bound.get(gi["id"])
        gi["vf"] = str(vf.address) if vf is not None else None
        gi["used_by"] = vf.used_by if vf is not None else None
    return doc


def gpu_document(gpu: Gpu) -> dict[str, Any]:
    fn = gpu.fn
    # Read first: a count that cannot be read goes into the GPU's errors.
    types = _types(gpu)
    return {
        "address": str(fn.address),
        "vendor_id": f"{fn.vendor_id:04x}", "device_id": f"{fn.device_id:04x}",
        "vendor": gpu.vendor_name, "device": gpu.device_name,
        "class": f"0x{fn.class_code:04x}", "class_name": fn.class_name,
        "driver": fn.driver, "iommu_group": fn.iommu_group,
        "iommu_group_members": [str(a) for a in gpu.group_members],
        "numa_node": fn.numa_node,
        "pci_root": str(fn.pci_root) if fn.pci_root else None,
        "mode": gpu.mode, "used_by": gpu.used_by,
        "boot_vga": gpu.boot_vga, "whole_refusal": gpu.whole_refusal,
        "sriov": {"totalvfs": gpu.sriov_totalvfs, "numvfs": gpu.sriov_numvfs},
        "mdev_types": types,
        "vgpus": [{"uuid": v.uuid, "parent": str(v.parent), "type_id": v.mdev_type.type_id,
                   "profile": v.mdev_type.profile_name, "used_by": v.used_by,
                   "live": v.live, "available": v.available}
                  for v in gpu.vgpus],
        "vfs": [{
            "index": vf.index, "address": str(vf.address), "device": vf.device_name,
            "driver": vf.fn.driver, "iommu_group": vf.fn.iommu_group, "used_by": vf.used_by,
            "available": vf.available, "mdev_parent": vf.mdev_parent,
            "nvidia": None if vf.nvidia is None else {
                "current_type": vf.nvidia.current_type,
                "current_name": vf.nvidia.current_name,
                "creatable": {str(k): v for k, v in vf.nvidia.creatable.items()},
                "gpu_instance": vf.nvidia.gpu_instance},
        } for vf in gpu.vfs],
        "nvidia_types": nvidia_types(gpu),
        "mig": mig_document(gpu),
        "errors": list(gpu.errors),
    }


def document(inventory: Inventory) -> dict[str, Any]:
    return {"schema": SCHEMA, "gpus": [gpu_document(g) for g in inventory.gpus]}


def _instances(gpu: Gpu) -> str:
    if gpu.vgpus or gpu.mode in ("mdev", "sriov-mdev"):
        return _counted(len(gpu.vgpus), "vGPU", [],
                        sum(1 for v in gpu.vgpus if v.used_by),
                        sum(1 for v in gpu.vgpus if not v.available))
    gis = f", {len(gpu.mig.instances)} GI" if gpu.mig is not None and gpu.mig.enabled else ""
    if not gpu.vfs:
        return gis[2:] or "-"
    # Every VF is counted: an NVIDIA vendor VF is reported only once it has a
    # type, so "1 VF" for a GPU with eight would read as a GPU with one.
    reported = [*gpu.reported_vfs, *gpu.unread_vfs]
    kind = "typed" if any(vf.nvidia is not None for vf in gpu.vfs) else "offered"
    return _counted(len(gpu.vfs), "VF",
                    [f"{len(reported)} {kind}"] if len(reported) < len(gpu.vfs) else [],
                    sum(1 for vf in reported if vf.used_by),
                    sum(1 for vf in reported if not vf.available and not vf.used_by)) + gis


def _mode(gpu: Gpu) -> str:
    return gpu.mode + ("+mig" if gpu.mig is not None and gpu.mig.enabled else "")


def mig_lines(inventory: Inventory) -> list[str]:
    """The table's MIG section: per GPU with a layout, its mode, then a row
    per GPU instance (profile, placement, compute instances, the VF on it
    and its VM)."""
    lines = []
    for g in inventory.gpus:
        doc = mig_document(g)
        if doc is None:
            continue
        mode = doc["mode"]
        pending = "" if mode["pending"] == mode["current"] else \
            f", {mode['pending']} after a reset"
        lines.append(f"MIG {g.address}: {mode['current']}{pending}; "
                     f"{len(doc['gpu_instances'])} GPU instance(s)")
        rows = [("GI", "PROFILE", "PLACEMENT", "CI", "VF", "USED BY")]
        for gi in doc["gpu_instances"]:
            rows.append((str(gi["id"]), gi["profile"],
                         f"{gi['placement']['start']}:{gi['placement']['size']}",
                         ",".join(map(str, gi["compute_instances"])) or "-",
                         gi["vf"] or "-", gi["used_by"] or "-"))
        if len(rows) > 1:
            lines += ["  " + line.rstrip() for line in columns(rows)]
    return lines


def _counted(total: int, what: str, kinds: list[str], used: int, unavailable: int) -> str:
    parts = [*kinds, f"{used} used"] + ([f"{unavailable} unavailable"] if unavailable else [])
    return f"{total} {what}{'' if total == 1 else 's'} ({', '.join(parts)})"


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """The rows as lines of left-aligned columns two spaces apart, each column
    as wide as its widest cell (the last one unpadded): addresses differ in
    width (a PCI domain such as 10000 has five digits)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    return ["  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths)), *r[-1:]]) for r in rows]


def table(inventory: Inventory, width: Optional[int] = None) -> str:
    header = ("ADDRESS", "DEVICE", "DRIVER", "MODE", "NUMA", "IOMMU", "INSTANCES", "USED BY")
    rows = [header]
    for g in inventory.gpus:
        users = sorted({u for u in [g.used_by, *(v.used_by for v in g.vgpus),
                                    *(vf.used_by for vf in g.vfs)] if u})
        device = g.device_name if len(g.device_name) <= 34 else g.device_name[:33] + "…"
        rows.append((str(g.address), device, g.fn.driver or "-", _mode(g),
                     str(g.fn.numa_node), str(g.fn.iommu_group if g.fn.iommu_group is not None
                                               else "-"),
                     _instances(g), ", ".join(users) or "-"))
    lines = [line.rstrip() for line in columns(rows)]
    if not inventory.gpus:
        lines.append("(no GPUs found)")
    migs = mig_lines(inventory)
    if migs:
        lines += ["", *migs]
    return "\n".join(lines) + "\n"
