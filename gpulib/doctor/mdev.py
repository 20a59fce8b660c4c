"""`mdev`: mdev types offered, instances left, every pool finds its type on its GPUs."""

from __future__ import annotations

from gpulib import mdev, nvidiasmi
from gpulib.context import CONFIG_FILE
from gpulib.doctor.core import OK, WARN, Result, host_path
from gpulib.pci import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

    from gpulib.config import PoolConfig
    from gpulib.doctor.facts import Facts


def _mig_backed_numbers(d: Facts) -> nvidiasmi.Numbers:
    """The numbers of NVIDIA's tool: those the reports cached, else asked
    now and not kept (the doctor writes nothing). A fresh host, where no
    report ran yet, is asked: its MIG-backed types are offered only once a
    GPU instance is made, by the first `gpulib pool apply`."""
    from gpulib import migtool

    gpus = [g.address for g in migtool.wanted(d.inventory)]
    found, _cache, _changed = nvidiasmi.lookup(
        d.ctx.root, gpus, d.config.get_float("discovery", "nvidia_smi_timeout"))
    return found


def _mig_backed(d: Facts, name: str, pool: PoolConfig, numbers: nvidiasmi.Numbers) -> bool:
    """Whether the pool's type is MIG-backed on its GPUs (NVIDIA's tool said
    so, or its members say so): it is offered only while a GPU instance is free."""
    from gpulib import migpool

    if any(r.pool == name and r.gi_profile is not None for r in d.state.vf_types.values()):
        return True
    return bool(migpool.plans(pool, d.inventory, numbers, frozenset()))


def check(d: Facts) -> list[Result]:
    cid = "mdev"
    # Each parent with its (type id, the type that answers for its name)
    # pairs and their instances left, as discovery keeps them: a large host
    # has thousands of pairs, each read once (by `gpulib metrics` already
    # when it runs this), and walked here once.
    offers: list[tuple[PciAddress, list[tuple[str, mdev.MdevType]], list[Optional[int]]]] = []
    problems: list[Result] = []
    for gpu in d.inventory.gpus:
        offers.extend(gpu.mdev_offers())
        # Counts that could not be read (noted by `mdev_offers`, whoever
        # asked first): that capacity is unknown, and missing from metrics.
        unread = [e for e in gpu.errors
                  if e.partition(": ")[0].endswith("/available_instances")]
        if unread:
            problems.append(Result(
                cid, WARN, str(gpu.address),
                f"{d.label(gpu)}: the instances left of {len(unread)} vGPU type(s) cannot "
                f"be read, so how many more it can create is unknown: {unread[0]}"
                + (f" (+{len(unread) - 1} more)" if len(unread) > 1 else ""),
                "check `dmesg` for errors of the GPU's driver; gpulib metrics counts such "
                "files in gpulib_gpu_read_errors"))
    parents = {parent for parent, _, _ in offers}
    for parent in mdev.list_parents(d.sysfs):
        if parent not in parents:
            parents.add(parent)
            listed = mdev.list_types(d.sysfs, parent)
            offers.append((parent, [(t.type_id, t) for t in listed], mdev.available_all(listed)))
    pools = sorted(d.config.pools.items())
    if pools:
        # Asked of the plan `gpulib pool apply` follows: the pool's own GPUs
        # (its `parents`), mdev types and NVIDIA vendor VF types alike, a
        # profile matching a type's name or, as a request does, its id.
        from gpulib.pools import plan

        mig_types = _mig_backed_numbers(d)
        for name, pool in pools:
            p = plan(pool, d.inventory)
            if p.mdev_parents or p.vf_parents:
                continue
            if _mig_backed(d, name, pool, mig_types):
                continue  # its GPU instances are the `mig` check's
            what = f"type {pool.type_id}" if pool.type_id else f"profile {pool.profile!r}"
            problems.append(Result(
                cid, WARN, f"pool {name}",
                f"pool {name} in {host_path(CONFIG_FILE)} asks for {what}, which none of "
                "the GPUs its parents select offers: `gpulib pool apply` makes none",
                "list the offered types with `gpulib mdev types` (NVIDIA vendor VFs: "
                "`gpulib discover`), then set type (or profile) or parents in "
                f"[pool {name}] of {host_path(CONFIG_FILE)}"))
    if not parents:
        return problems or [Result(cid, OK, "/sys/class/mdev_bus",
                                   "no mdev parent: no GPU offers mediated-device vGPU "
                                   "types")]
    # (type id, the type answering for its name) -> instances left on every parent.
    per_pair: dict[tuple[str, mdev.MdevType], int] = {}
    offered = left = 0
    for _, types, available in offers:
        offered += len(types)
        for pair, n in zip(types, available):
            if n:
                left += 1
                per_pair[pair] = per_pair.get(pair, 0) + n
    if not left:
        problems.append(Result(
            cid, WARN, "/sys/class/mdev_bus",
            f"{len(parents)} mdev parent(s) offer {offered} type(s), but every type "
            "has 0 instances available: no vGPU can be created",
            "remove the vGPUs no VM uses: `gpulib mdev list`, then "
            "`gpulib mdev remove <uuid>`"))
    if problems:
        return problems
    per_type: dict[str, int] = {}
    for (type_id, t), n in per_pair.items():
        type_name = t.name
        label = f"{type_id} ({type_name})" if type_name else type_id
        per_type[label] = per_type.get(label, 0) + n

    def details() -> list[dict[str, Any]]:
        # Made when asked for (doctor --json), not for metrics' status: a
        # large host has thousands of types with instances left.
        return [{"parent": str(parent), "type_id": type_id, "name": t.name,
                 "available_instances": n}
                for parent, types, available in offers
                for (type_id, t), n in zip(types, available) if n]

    shown = ", ".join(f"{label} x{n}" for label, n in list(per_type.items())[:6])
    more = f", +{len(per_type) - 6} more" if len(per_type) > 6 else ""
    return [Result(cid, OK, "/sys/class/mdev_bus",
                   f"{len(parents)} mdev parent(s) offer {offered} type(s); "
                   f"{left} with instances left: {shown}{more}", details=details)]
