"""`mdev`: mdev types offered, instances left, pools name offered types."""

from __future__ import annotations

from gpulib import mdev
from gpulib.context import CONFIG_FILE
from gpulib.doctor.core import OK, WARN, Result, host_path
from gpulib.pci import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpulib.doctor.facts import Doctor


def check(d: Doctor) -> list[Result]:
    cid = "mdev"
    types: dict[PciAddress, list[mdev.MdevType]] = {}
    for gpu in d.inventory.gpus:
        if gpu.mdev_types:
            types[gpu.address] = list(gpu.mdev_types)
        for vf in gpu.vfs:
            if vf.mdev_types:
                types[vf.address] = list(vf.mdev_types)
    for parent in mdev.list_parents(d.sysfs):
        if parent not in types:
            types[parent] = mdev.list_types(d.sysfs, parent)
    problems: list[Result] = []
    all_types = [t for ts in types.values() for t in ts]
    for name, pool in sorted(d.config.pools.items()):
        if pool.type_id and not any(t.type_id == pool.type_id for t in all_types):
            what = f"type {pool.type_id}"
        elif pool.profile and not any(t.profile_name == pool.profile for t in all_types):
            what = f"profile {pool.profile!r}"
        else:
            continue
        problems.append(Result(
            cid, WARN, f"pool {name}",
            f"pool {name} in {host_path(CONFIG_FILE)} asks for {what}, which no mdev "
            "parent offers",
            f"list the offered types with `gpulib mdev types`, then set type (or profile) "
            f"in [pool {name}] of {host_path(CONFIG_FILE)}"))
    if not types:
        return problems or [Result(cid, OK, "/sys/class/mdev_bus",
                                   "no mdev parent: no GPU offers mediated-device vGPU "
                                   "types")]
    # Each type's file read once: a large host has thousands.
    left = [(t, n) for t, n in ((t, t.available_instances or 0) for t in all_types) if n > 0]
    if not left:
        problems.append(Result(
            cid, WARN, "/sys/class/mdev_bus",
            f"{len(types)} mdev parent(s) offer {len(all_types)} type(s), but every type "
            "has 0 instances available: no vGPU can be created",
            "remove the vGPUs no VM uses: `gpulib mdev list`, then "
            "`gpulib mdev remove <uuid>`"))
    if problems:
        return problems
    per_type: dict[str, int] = {}
    for t, n in left:
        type_name = t.name
        label = f"{t.type_id} ({type_name})" if type_name else t.type_id
        per_type[label] = per_type.get(label, 0) + n

    def details() -> list[dict[str, Any]]:
        # Made when asked for (doctor --json), not for metrics' status: a
        # large host has thousands of types with instances left.
        return [{"parent": str(t.parent), "type_id": t.type_id, "name": t.name,
                 "available_instances": n} for t, n in left]

    shown = ", ".join(f"{label} x{n}" for label, n in list(per_type.items())[:6])
    more = f", +{len(per_type) - 6} more" if len(per_type) > 6 else ""
    return [Result(cid, OK, "/sys/class/mdev_bus",
                   f"{len(types)} mdev parent(s) offer {len(all_types)} type(s); "
                   f"{len(left)} with instances left: {shown}{more}", details=details)]
