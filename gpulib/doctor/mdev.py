"""`mdev`: mdev types offered, instances left, pools name offered types."""

from __future__ import annotations

from gpulib import mdev
from gpulib.context import CONFIG_FILE
from gpulib.doctor.core import OK, WARN, Result, host_path
from gpulib.pci import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

    from gpulib.doctor.facts import Doctor


def check(d: Doctor) -> list[Result]:
    cid = "mdev"
    # (parent, type id, the type that answers for its name, instances left)
    # of every offered type, as discovery keeps them: a large host has
    # thousands, each read once (by `gpulib metrics` already when it runs this).
    offers: list[tuple[PciAddress, str, mdev.MdevType, Optional[int]]] = []
    parents: set[PciAddress] = set()
    for gpu in d.inventory.gpus:
        for parent, types, available in gpu.mdev_offers():
            parents.add(parent)
            offers.extend((parent, type_id, t, n) for (type_id, t), n in zip(types, available))
    for parent in mdev.list_parents(d.sysfs):
        if parent not in parents:
            parents.add(parent)
            listed = mdev.list_types(d.sysfs, parent)
            offers.extend((parent, t.type_id, t, n)
                          for t, n in zip(listed, mdev.available_all(listed)))
    problems: list[Result] = []
    for name, pool in sorted(d.config.pools.items()):
        if pool.type_id and not any(type_id == pool.type_id for _, type_id, _, _ in offers):
            what = f"type {pool.type_id}"
        elif pool.profile and not any(t.profile_name == pool.profile for _, _, t, _ in offers):
            what = f"profile {pool.profile!r}"
        else:
            continue
        problems.append(Result(
            cid, WARN, f"pool {name}",
            f"pool {name} in {host_path(CONFIG_FILE)} asks for {what}, which no mdev "
            "parent offers",
            f"list the offered types with `gpulib mdev types`, then set type (or profile) "
            f"in [pool {name}] of {host_path(CONFIG_FILE)}"))
    if not parents:
        return problems or [Result(cid, OK, "/sys/class/mdev_bus",
                                   "no mdev parent: no GPU offers mediated-device vGPU "
                                   "types")]
    left = [(parent, type_id, t, n) for parent, type_id, t, n in offers if n]
    if not left:
        problems.append(Result(
            cid, WARN, "/sys/class/mdev_bus",
            f"{len(parents)} mdev parent(s) offer {len(offers)} type(s), but every type "
            "has 0 instances available: no vGPU can be created",
            "remove the vGPUs no VM uses: `gpulib mdev list`, then "
            "`gpulib mdev remove <uuid>`"))
    if problems:
        return problems
    per_type: dict[str, int] = {}
    for _, type_id, t, n in left:
        type_name = t.name
        label = f"{type_id} ({type_name})" if type_name else type_id
        per_type[label] = per_type.get(label, 0) + (n or 0)

    def details() -> list[dict[str, Any]]:
        # Made when asked for (doctor --json), not for metrics' status: a
        # large host has thousands of types with instances left.
        return [{"parent": str(parent), "type_id": type_id, "name": t.name,
                 "available_instances": n} for parent, type_id, t, n in left]

    shown = ", ".join(f"{label} x{n}" for label, n in list(per_type.items())[:6])
    more = f", +{len(per_type) - 6} more" if len(per_type) > 6 else ""
    return [Result(cid, OK, "/sys/class/mdev_bus",
                   f"{len(parents)} mdev parent(s) offer {len(offers)} type(s); "
                   f"{len(left)} with instances left: {shown}{more}", details=details)]
