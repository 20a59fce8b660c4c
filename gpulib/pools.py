"""vGPU pools declared in gpulib.conf and kept alive by gpulib.

A pool names its parents (`all`, PCI addresses or vendor:device ids of the
GPUs), a type (`type = nvidia-232`, or `profile = GRID T4-4Q`; for NVIDIA
vendor VFs the numeric id or the profile name) and a size (`per_parent` on
every matching parent, or `count` spread over them). `apply` creates what
is missing, removes free surplus members, and reports every change; a second
run changes nothing. Pool members survive VM stops and reboots (`restore`).
"""

from __future__ import annotations

from gpulib import logger, mdev, mdevctl, nvidia
from gpulib.config import Config, PoolConfig
from gpulib.context import Context
from gpulib.definitions import follow_definitions, plan_definition, save_definition
from gpulib.discovery import Gpu, Inventory
from gpulib.errors import GpulibError
from gpulib.occupancy import Occupancy
from gpulib.outcome import Outcome
from gpulib.ownership import unmanaged_reason
from gpulib.pci import PciAddress
from gpulib.profiles import serves
from gpulib.records import is_handmade, pool_of
from gpulib.state import State, VfRecord, VgpuRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

log = logger.get(__name__)


def _gpu_matches(pool: PoolConfig, gpu: Gpu) -> bool:
    return pool.parents.matches(gpu.address, gpu.fn.vendor_id, gpu.fn.device_id)


def _type_matches(pool: PoolConfig, t: mdev.MdevType) -> bool:
    return serves(pool.profile, pool.type_id, t.type_id, t.name)


def _vendor_matches(pool: PoolConfig, type_id: int, name: Optional[str]) -> bool:
    return serves(pool.profile, pool.type_id, type_id, name)


class PoolPlan:
    """What one pool has and wants, per parent."""

    def __init__(self, pool: PoolConfig) -> None:
        self.pool = pool
        self.mdev_parents: list[tuple[Gpu, mdev.MdevType]] = []
        self.vf_parents: list[tuple[Gpu, PciAddress, int, str]] = []


def plan(pool: PoolConfig, inventory: Inventory, unmanaged: frozenset[str] = frozenset()
         ) -> PoolPlan:
    """Parents of the pool's type on the selected GPUs; unmanaged devices never."""
    p = PoolPlan(pool)
    for gpu in inventory.gpus:
        if not _gpu_matches(pool, gpu) or unmanaged_reason(unmanaged, [str(gpu.address)]):
            continue
        types = list(gpu.mdev_types) + [t for vf in gpu.vfs for t in vf.mdev_types
                                        if not unmanaged_reason(unmanaged, [str(vf.address)])]
        for t in types:
            if _type_matches(pool, t):
                p.mdev_parents.append((gpu, t))
        for vf in gpu.vfs:
            nv = vf.nvidia
            if nv is None or unmanaged_reason(unmanaged, [str(vf.address)]):
                continue
            options = dict(nv.creatable)
            if nv.current_type and nv.current_name:
                options[nv.current_type] = nv.current_name
            for tid, name in options.items():
                if _vendor_matches(pool, tid, name):
                    p.vf_parents.append((gpu, vf.address, tid, name))
                    break
    return p


def apply(ctx: Context, config: Config, state: State, inventory: Inventory,
          dry_run: bool = False, checkpoint: Optional[Callable[[State], None]] = None
          ) -> list[Outcome]:
    """Bring every pool to its declared size; returns the changes (made or planned).

    A member anyone holds (the occupancy model: allocations, running domains,
    a conflicting node of its tree) is never removed or cleared. A pool whose
    type is MIG-backed on its GPUs is `gpulib.migpool`'s: its GPU instances,
    then its VFs, through the journal (`checkpoint` writes each intent)."""
    from gpulib import migpool

    # Members the operator undefined in mdevctl are no longer members.
    out: list[Outcome] = [] if dry_run else follow_definitions(ctx, state)
    mig_pools, tool = migpool.mig_backed(config, inventory, state, ctx.root,
                                         config.get_float("discovery", "nvidia_smi_timeout"))
    for name, pool in sorted(config.pools.items()):
        if name in mig_pools:
            continue
        p = plan(pool, inventory, frozenset(state.unmanaged))
        if not p.mdev_parents and not p.vf_parents:
            out.append(Outcome("pool", name, "plan", False,
                               "no parent offers "
                               f"{pool.type_id or pool.profile} among the selected GPUs"))
            continue
        if p.mdev_parents:
            out += _apply_mdev(ctx, state, name, pool, p, dry_run, inventory.occupancy)
        else:
            out += _apply_vf(ctx, state, name, pool, p, dry_run, inventory.occupancy)
    if tool is not None:
        out += migpool.apply(ctx, config, state, inventory, mig_pools, tool, dry_run, checkpoint)
    return out


def _apply_mdev(ctx: Context, state: State, name: str, pool: PoolConfig, p: PoolPlan,
                dry_run: bool, occ: Occupancy) -> list[Outcome]:
    sysfs = ctx.sysfs
    out: list[Outcome] = []
    by_parent = {str(t.parent): t for _, t in p.mdev_parents}
    targets = pool.targets(sorted(by_parent))
    members: dict[str, list[str]] = {k: [] for k in by_parent}
    for uuid, rec in sorted(state.vgpus.items()):
        if rec.pool != name or is_handmade(rec):
            continue
        t = by_parent.get(rec.parent)
        if t is not None and rec.type_id != t.type_id and not rec.on_demand:
            # The operator changed its definition's type (mdevctl modify -t):
            # it is no pool member any more; the pool makes another.
            out.append(Outcome("mdev", uuid, f"left pool {name}", True,
                               f"its definition is now {rec.type_id}, not {t.type_id}"))
            if not dry_run:
                rec.pool = None
            continue
        members.setdefault(rec.parent, []).append(uuid)
    for parent, uuids in sorted(members.items()):
        want = targets.get(parent, 0)
        t = by_parent.get(parent)
        for uuid in uuids:
            if mdev.read_mdev(sysfs, uuid) is None and t is not None and \
                    uuids.index(uuid) < want:
                def recreate(u: str = uuid, t: mdev.MdevType = t) -> None:
                    # Every pool member has a definition, so mdevctl and
                    # libvirt list it as persistent.
                    d = plan_definition(ctx, u, str(t.parent), t.type_id)
                    mdev.create(sysfs, t.parent, t.type_id, u, attrs=d.attrs)
                    save_definition(ctx, d)
                out.append(_do(dry_run, "mdev", uuid, "recreate pool member", recreate))
        have = len(uuids)
        if have > want:
            # Free surplus members only; a VM's vGPU is never taken away.
            for uuid in reversed(uuids):
                if have <= want:
                    break
                if occ.holder(uuid) is not None:
                    continue
                def drop(u: str = uuid, parent: str = parent) -> None:
                    mdev.remove(sysfs, u)
                    del state.vgpus[u]
                    mdevctl.remove_definition(ctx, u, parent)
                out.append(_do(dry_run, "mdev", uuid, f"remove surplus of pool {name}", drop))
                have -= 1
        while t is not None and have < want:
            uuid = mdev.new_uuid()

            def create(u: str = uuid, t: mdev.MdevType = t) -> None:
                mdev.create(sysfs, t.parent, t.type_id, u)
                try:
                    save_definition(ctx, mdevctl.Definition(u, str(t.parent), t.type_id))
                except GpulibError:
                    mdev.remove(sysfs, u)  # a member without a record would be lost
                    raise
                state.vgpus[u] = VgpuRecord(str(t.parent), t.type_id, pool=name)
            result = _do(dry_run, "mdev", uuid if not dry_run else "(new)",
                         f"create {t.type_id} on {t.parent} for pool {name}", create)
            out.append(result)
            if not result.ok:
                break
            have += 1
    return out


def _apply_vf(ctx: Context, state: State, name: str, pool: PoolConfig, p: PoolPlan,
              dry_run: bool, occ: Occupancy) -> list[Outcome]:
    sysfs = ctx.sysfs
    out: list[Outcome] = []
    by_gpu: dict[str, list[tuple[PciAddress, int, str]]] = {}
    for gpu, vf, tid, tname in p.vf_parents:
        by_gpu.setdefault(str(gpu.address), []).append((vf, tid, tname))
    targets = pool.targets(sorted(by_gpu))
    for gpu_addr, vfs in sorted(by_gpu.items()):
        want = targets.get(gpu_addr, 0)
        members = [a for a, r in state.vf_types.items() if r.pool == name and
                   not is_handmade(r) and any(str(v) == a for v, _, _ in vfs)]
        have = len(members)
        for addr in members:
            rec = state.vf_types[addr]
            if nvidia.current_type(sysfs, PciAddress.parse(addr)) != rec.type_id:
                def reset(a: str = addr, r: VfRecord = rec) -> None:
                    nvidia.set_type(sysfs, PciAddress.parse(a), r.type_id)
                out.append(_do(dry_run, "vf", addr, "set pool member type", reset))
        for addr in reversed(sorted(members)):
            if have <= want:
                break
            if occ.holder(addr) is not None:
                continue
            def clear(a: str = addr) -> None:
                nvidia.clear_type(sysfs, PciAddress.parse(a))
                del state.vf_types[a]
            out.append(_do(dry_run, "vf", addr, f"clear surplus of pool {name}", clear))
            have -= 1
        for vf, tid, tname in vfs:
            if have >= want:
                break
            if str(vf) in state.vf_types:
                continue
            # Only a VF that is nobody's joins the pool: not one typed
            # outside gpulib (the administrator's), not one a VM holds.
            if not occ.owner("pci", str(vf)).may_give:
                continue
            def set_type(v: PciAddress = vf, t: int = tid, n: str = tname) -> None:
                nvidia.set_type(sysfs, v, t)
                state.vf_types[str(v)] = VfRecord(t, n, pool=name)
            result = _do(dry_run, "vf", str(vf), f"set type {tid} ({tname}) for pool {name}",
                         set_type)
            out.append(result)
            if result.ok:
                have += 1
    return out


def _do(dry_run: bool, kind: str, ident: str, action: str,
        fn: Callable[[], object]) -> Outcome:
    if dry_run:
        return Outcome(kind, ident, "would " + action, True)
    try:
        fn()
        return Outcome(kind, ident, action, True)
    except GpulibError as exc:
        return Outcome(kind, ident, action, False, exc.message)


def members(config: Config, state: State, occupancy: Occupancy
            ) -> dict[str, list[dict[str, object]]]:
    """`gpulib pool list`: every pool's members and who holds them."""
    out: dict[str, list[dict[str, object]]] = {name: [] for name in config.pools}
    for uuid, rec in sorted(state.vgpus.items()):
        pool = pool_of(rec)
        if pool is not None:
            out.setdefault(pool, []).append(
                {"kind": "mdev", "id": uuid, "parent": rec.parent, "type": rec.type_id,
                 "vm": occupancy.user("mdev", uuid)})
    for addr, vrec in sorted(state.vf_types.items()):
        pool = pool_of(vrec)
        if pool is not None:
            out.setdefault(pool, []).append(
                {"kind": "vf", "id": addr, "type": vrec.type_id, "name": vrec.name,
                 "vm": occupancy.user("vf", addr)})
    return out
