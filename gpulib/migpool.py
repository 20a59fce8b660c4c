"""Pools of MIG-backed vGPUs: the GPU instances a pool needs, and its VFs.

A pool whose type is MIG-backed on its GPUs (`profile = NVIDIA H100-1-10C`:
NVIDIA's tool names the GPU instance profile it runs on) is kept in two
layers, both through the journal's write-ahead intents:

1. GPU instances: for each GPU in MIG mode the pool selects, as many
   instances of the type's profile as the pool wants there (`count` spread
   over the GPUs, or `per_parent`), each made with its compute instance at
   the placement `mig.choose_placement` picks among NVIDIA's (`-lgipp`) so
   that larger profiles still fit. Each is announced (`create-gi`, the
   state written) before `nvidia-smi mig -cgi <profile>:<start> -C` runs,
   and recorded (`GpuInstanceRecord`, the intent dropped) in the same write
   after it; a creation that fails is undone (the instance destroyed if it
   was made).
2. VFs: that many idle VFs of the GPU are given the type (`set-vf-type`
   intents, then a `VfRecord` with the profile), each taking one free
   instance (the driver's choice of which).

Surplus is removed only when nobody holds it: a member VF a VM holds stays
typed, and so does the instance it runs on; free surplus VFs are cleared
first, then instances no VF runs on are destroyed (`destroy-gi` intents).
A member whose VM stopped has its type cleared and its instance kept (the
allocator's release); `pool apply` and `gpulib restore` type it again.

Only commands run NVIDIA's tool (pool apply, restore, reconcile): a hook
settles no GPU instance intent (`settle_instances` is for the commands) and
types a VF only when its creatable list shows a free instance.
"""

from __future__ import annotations

from gpulib import logger, mig, migtool, nvidia, nvidiasmi
from gpulib.config import Config, PoolConfig
from gpulib.context import Context
from gpulib.discovery import Gpu, Inventory
from gpulib.errors import GpulibError
from gpulib.nvidiasmi import ToolFailed
from gpulib.occupancy import Occupancy
from gpulib.outcome import Outcome
from gpulib.ownership import GI_BOOT, made_by_gpulib
from gpulib.pci import PciAddress, physical_function
from gpulib.profiles import serves
from gpulib.state import GpuInstanceRecord, Intent, State, VfRecord, placement_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

    from gpulib.sysfs import Sysfs

    Checkpoint = Optional[Callable[[State], None]]

log = logger.get(__name__)


def _this_boot(sysfs: Sysfs) -> Optional[str]:
    from gpulib.liveness import boot_clock_of

    return boot_clock_of(sysfs)[0]


def is_ours(marker: Optional[str], rec: GpuInstanceRecord, found: Optional[mig.Instance],
            boot: Optional[str]) -> bool:
    """Whether the instance `found` at `rec`'s placement is the one gpulib made
    (a pool's, `ownership.made_by_gpulib`, the answer `gpu_instance_owner`
    gives), not one made by hand beside or in place of it (the
    administrator's: never counted, given or destroyed)."""
    return found is not None and made_by_gpulib(marker, rec.gi, found.id, boot)


def pool_tag(name: str) -> str:
    """What a pool's intents name as their `vm` (no VM starts under it)."""
    return f"pool:{name}"


class MigPlan:
    """A MIG-backed pool on one GPU: the type and the profile it runs on."""

    def __init__(self, gpu: Gpu, type_id: int, name: str, profile: int,
                 per_gi: int = 1) -> None:
        self.gpu = gpu
        self.type_id = type_id
        self.name = name
        self.profile = profile
        # vGPUs of the type one GPU instance runs (NVIDIA's "Max Instances Per GI").
        self.per_gi = max(1, per_gi)


def _bound(sysfs: Sysfs, gpu: Gpu) -> dict[int, list[PciAddress]]:
    """GPU instance id -> the VFs whose vGPUs run on it (one, or several
    for a type with more than one vGPU per instance), read now."""
    out: dict[int, list[PciAddress]] = {}
    for vf in gpu.vfs:
        if vf.nvidia is None:
            continue
        if nvidia.current_type(sysfs, vf.address):
            gi = nvidia.gpu_instance(sysfs, vf.address)
            if gi is not None:
                out.setdefault(gi, []).append(vf.address)
    return out


class Applier:
    """One `pool apply` (or restore) of MIG-backed pools: the tool, the state,
    the journal's checkpoint, the outcomes."""

    def __init__(self, ctx: Context, state: State, tool: migtool.Tool, dry_run: bool = False,
                 checkpoint: Checkpoint = None) -> None:
        self.ctx = ctx
        self.sysfs = ctx.sysfs
        self.state = state
        self.tool = tool
        self.dry_run = dry_run
        self.checkpoint = checkpoint
        self.out: list[Outcome] = []
        self.layouts: dict[PciAddress, mig.Layout] = {}
        self.changed = False
        # The boot the records' instance ids are of, before this run made any.
        self.gi_boot: Optional[str] = state.extra.get(GI_BOOT)
        boot = _this_boot(self.sysfs)
        if not dry_run and self.gi_boot is not None and boot is not None and \
                self.gi_boot != boot:
            # Ids of an earlier boot name nothing now: an instance gpulib makes
            # again gets its new one; one found where none was made is not ours.
            for r in state.gpu_instances:
                r.gi = None
            state.extra[GI_BOOT] = boot

    # -- the journal ---------------------------------------------------------------------------
    def _intend(self, intent: Intent) -> None:
        self.state.intents.append(intent)
        self._write()

    def _done(self, intent: Intent) -> None:
        if intent in self.state.intents:
            self.state.intents.remove(intent)
        self._write()

    def _write(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint(self.state)

    def layout(self, gpu: PciAddress, fresh: bool = False) -> mig.Layout:
        if fresh or gpu not in self.layouts:
            self.layouts[gpu] = self.tool.layout(gpu)
        return self.layouts[gpu]

    # -- GPU instances ---------------------------------------------------------------------------
    def create(self, gpu: PciAddress, profile: mig.Profile, start: int, pool: Optional[str],
               again: bool = False) -> bool:
        """A GPU instance (and its compute instance) at `start`, announced
        first; undone when it fails. Whether it was made."""
        what = f"GPU instance {profile.name} at {start}:{profile.size} on {gpu}"
        label = (f"for pool {pool}" if pool else "") + (" again" if again else "")
        if self.dry_run:
            self.out.append(Outcome("gi", f"{gpu}@{start}", f"would create {what} {label}",
                                    True))
            return True
        intent = Intent("create-gi", str(gpu), pool_tag(pool or "-"), None,
                        f"{profile.id}@{start}")
        self._intend(intent)
        self.changed = True
        try:
            gi, ci = self.tool.create(gpu, profile.id, start)
            if ci is None:
                self.tool.create_compute(gpu, gi)
        except ToolFailed as exc:
            left = self._undo_create(gpu, profile.id, start)
            if left is None:
                self._done(intent)  # else kept: the next command settles it
            self.out.append(Outcome("gi", f"{gpu}@{start}", f"create {what}", False,
                                    str(exc)))
            return False
        self.state.gpu_instances = [r for r in self.state.gpu_instances
                                    if r.key != (str(gpu), start)]
        self.state.gpu_instances.append(GpuInstanceRecord(str(gpu), profile.id, start,
                                                          profile.size, gi, pool))
        boot = _this_boot(self.sysfs)
        if boot is not None:
            self.state.extra[GI_BOOT] = boot
        self.layouts.pop(gpu, None)
        self._done(intent)
        self.out.append(Outcome("gi", f"{gpu}@{start}", f"created {what} {label}".rstrip(),
                                True, f"GPU instance {gi}"))
        return True

    def _undo_create(self, gpu: PciAddress, profile: int, start: int) -> Optional[str]:
        """Destroy what a failed or interrupted creation made, if it runs no
        vGPU: None when nothing is left, else why it stays."""
        try:
            layout = self.tool.layout(gpu)
        except ToolFailed as exc:
            return str(exc)
        made = layout.at(start, profile)
        if made is None:
            return None
        try:
            self.tool.destroy(gpu, made.id)
        except ToolFailed as exc:
            return str(exc)
        return None

    def destroy(self, gpu: PciAddress, rec: GpuInstanceRecord, reason: str) -> bool:
        what = f"GPU instance {rec.gi} ({rec.profile}@{rec.start}) on {gpu}"
        if self.dry_run:
            self.out.append(Outcome("gi", f"{gpu}@{rec.start}",
                                    f"would destroy {what}: {reason}", True))
            return True
        intent = Intent("destroy-gi", rec.gpu, pool_tag(rec.pool or "-"), None,
                        f"{rec.profile}@{rec.start}")
        self._intend(intent)
        self.changed = True
        try:
            if rec.gi is not None:
                self.tool.destroy(gpu, rec.gi)
        except ToolFailed as exc:
            self._done(intent)
            self.out.append(Outcome("gi", f"{gpu}@{rec.start}", f"destroy {what}", False,
                                    str(exc)))
            return False
        self.state.gpu_instances = [r for r in self.state.gpu_instances if r is not rec]
        self.layouts.pop(gpu, None)
        self._done(intent)
        self.out.append(Outcome("gi", f"{gpu}@{rec.start}", f"destroyed {what}", True, reason))
        return True

    # -- VFs ---------------------------------------------------------------------------------------
    def type_vf(self, vf: PciAddress, plan: MigPlan, pool: str, why: str) -> bool:
        label = f"{plan.type_id} ({plan.name})"
        if self.dry_run:
            self.out.append(Outcome("vf", str(vf), f"would {why} {label} for pool {pool}", True))
            return True
        intent = Intent("set-vf-type", str(vf), pool_tag(pool), None, str(plan.type_id))
        self._intend(intent)
        self.changed = True
        try:
            nvidia.set_type(self.sysfs, vf, plan.type_id)
        except GpulibError as exc:
            self._done(intent)
            self.out.append(Outcome("vf", str(vf), f"{why} {label} for pool {pool}", False,
                                    exc.message))
            return False
        gi = nvidia.gpu_instance(self.sysfs, vf)
        ours = {r.gi for r in self.state.gpu_instances if r.gpu == str(plan.gpu.address)}
        if gi is not None and gi not in ours:
            # The driver put it on a GPU instance gpulib did not make: the
            # administrator's, never given to a pool's VM. Undone.
            try:
                nvidia.clear_type(self.sysfs, vf, retry_seconds=0.5)
            except GpulibError:
                pass  # the intent stays: the next command settles it
            else:
                self._done(intent)
            self.out.append(Outcome(
                "vf", str(vf), f"{why} {label} for pool {pool}", False,
                f"the driver gave it GPU instance {gi}, which gpulib did not make (the "
                "administrator's): cleared; destroy or keep that instance by hand"))
            return False
        self.state.vf_types[str(vf)] = VfRecord(plan.type_id, plan.name, pool=pool,
                                                gi_profile=plan.profile)
        self._done(intent)
        self.out.append(Outcome("vf", str(vf), f"{why} {label} for pool {pool}", True,
                                f"GPU instance {nvidia.gpu_instance(self.sysfs, vf)}"))
        return True

    def untype_member(self, vf: PciAddress, pool: str) -> bool:
        """A member's type cleared (it stays the pool's, as after its VM's
        stop), so that the instance it ran on can go."""
        self.changed = True
        try:
            nvidia.clear_type(self.sysfs, vf, retry_seconds=0.5)
        except GpulibError as exc:
            self.out.append(Outcome("vf", str(vf), f"move member of pool {pool}", False,
                                    exc.message))
            return False
        self.out.append(Outcome("vf", str(vf), f"move member of pool {pool}", True,
                                "its GPU instance goes; typed again on one kept"))
        return True

    def clear_vf(self, vf: str, pool: str) -> bool:
        if self.dry_run:
            self.out.append(Outcome("vf", vf, f"would clear surplus of pool {pool}", True))
            return True
        intent = Intent("clear-vf-type", vf, pool_tag(pool), on_demand=True)
        self._intend(intent)
        self.changed = True
        try:
            nvidia.clear_type(self.sysfs, PciAddress.parse(vf), retry_seconds=0.5)
        except GpulibError as exc:
            self._done(intent)
            self.out.append(Outcome("vf", vf, f"clear surplus of pool {pool}", False,
                                    exc.message))
            return False
        self.state.vf_types.pop(vf, None)
        self._done(intent)
        self.out.append(Outcome("vf", vf, f"clear surplus of pool {pool}", True))
        return True


# -- which pools are MIG-backed ------------------------------------------------------------------

def plans(pool: PoolConfig, inventory: Inventory, numbers: nvidiasmi.Numbers,
          unmanaged: frozenset[str]) -> list[MigPlan]:
    """The GPUs the pool selects on which its type is MIG-backed (NVIDIA's
    tool names its GPU instance profile), in address order."""
    out = []
    for gpu in inventory.gpus:
        if str(gpu.address) in unmanaged or \
                not pool.parents.matches(gpu.address, gpu.fn.vendor_id, gpu.fn.device_id) or \
                not any(vf.nvidia is not None for vf in gpu.vfs):
            continue
        for tid, n in sorted(numbers.get(gpu.address, {}).items()):
            if n.gi_profile is not None and serves(pool.profile, pool.type_id, tid, n.name):
                out.append(MigPlan(gpu, tid, n.name or str(tid), n.gi_profile,
                                   n.per_gi or 1))
                break
    return out


def mig_backed(config: Config, inventory: Inventory, state: State, root: str,
               timeout: float) -> tuple[dict[str, list[MigPlan]], Optional[migtool.Tool]]:
    """The pools of gpulib.conf whose type is MIG-backed on their GPUs, with
    their plans, and the tool to make them (None without NVIDIA's tool, or
    when no pool selects a GPU with vendor VFs: then nothing is asked)."""
    candidates = [g for g in inventory.gpus if any(vf.nvidia is not None for vf in g.vfs)]
    if not config.pools or not candidates:
        return {}, None
    if not any(p.parents.matches(g.address, g.fn.vendor_id, g.fn.device_id)
               for p in config.pools.values() for g in candidates):
        return {}, None
    tool = migtool.Tool.find(root, timeout)
    if tool is None:
        return {}, None
    try:
        # Asked now, not from the reports' cache: the types follow MIG mode.
        numbers = nvidiasmi.parse(nvidiasmi.run_tool(tool.path, timeout))
    except ToolFailed as exc:
        log.warning("MIG-backed pools unknown: %s", exc)
        return {}, None
    unmanaged = frozenset(state.unmanaged)
    found = {name: plans(pool, inventory, numbers, unmanaged)
             for name, pool in sorted(config.pools.items())}
    return {name: p for name, p in found.items() if p}, tool


# -- pool apply ----------------------------------------------------------------------------------

class GpuWork:
    """One MIG-backed pool on one GPU in one `pool apply`: how many it
    wants there, its member VFs (those a VM holds apart) and its records."""

    def __init__(self, pool: str, plan: MigPlan, want: int) -> None:
        self.pool = pool
        self.plan = plan
        self.want = want
        self.members: list[str] = []
        self.held: set[str] = set()

    @property
    def need(self) -> int:
        """The instances it keeps: enough for what it wants and for every
        held member (one each, or one per `per_gi` of them)."""
        return -(-max(self.want, len(self.held)) // self.plan.per_gi)


def apply(ctx: Context, config: Config, state: State, inventory: Inventory,
          pools: dict[str, list[MigPlan]], tool: migtool.Tool, dry_run: bool = False,
          checkpoint: Checkpoint = None) -> list[Outcome]:
    """Bring the MIG-backed pools to their size (see the module's notes) in
    one run: every pool's surplus goes first (free VFs, then instances no
    VF runs on, those that leave the most room for larger profiles), so that
    what one pool gives up is there for another; then each GPU's missing
    instances are made, larger profiles first whatever their pool; then the
    VFs are typed."""
    run = Applier(ctx, state, tool, dry_run, checkpoint)
    if not dry_run:
        run.out += settle_instances(ctx, state, tool, checkpoint)
    occ = inventory.occupancy
    work: list[GpuWork] = []
    for name in sorted(pools):
        ready = _ready(run, name, pools[name])
        want = config.pools[name].targets([str(p.gpu.address) for p in ready])
        work += [GpuWork(name, p, want.get(str(p.gpu.address), 0)) for p in ready]
    for w in work:
        _shrink(run, w, occ)
    for w in sorted(work, key=lambda w: (-_profile_size(run, w.plan), w.pool)):
        _grow(run, w)
    for w in work:
        _type_members(run, w, occ)
    if run.changed:
        migtool.forget(ctx.root)
    return run.out


def _profile_size(run: Applier, plan: MigPlan) -> int:
    try:
        p = run.layout(plan.gpu.address).profiles.get(plan.profile)
    except ToolFailed:
        return 0
    return p.size if p is not None else 0


def _ready(run: Applier, name: str, plans_: list[MigPlan]) -> list[MigPlan]:
    """The plans whose GPU is in MIG mode and has the type's profile (the
    others reported)."""
    ready = []
    for plan in plans_:
        try:
            layout = run.layout(plan.gpu.address)
        except ToolFailed as exc:
            run.out.append(Outcome("pool", name, "plan", False, str(exc)))
            continue
        if not layout.enabled:
            pending = " (enabled after the GPU's next reset)" if layout.pending == mig.ENABLED \
                else ""
            run.out.append(Outcome("pool", name, "plan", False,
                                   f"MIG mode is not on on {plan.gpu.address}{pending}"))
            continue
        if layout.profiles.get(plan.profile) is None:
            run.out.append(Outcome("pool", name, "plan", False,
                                   f"{plan.gpu.address} has no GPU instance profile "
                                   f"{plan.profile} for {plan.name}"))
            continue
        ready.append(plan)
    return ready


def _members(state: State, name: str, gpu: Gpu) -> list[str]:
    vfs = {str(vf.address) for vf in gpu.vfs}
    return sorted(a for a, r in state.vf_types.items() if r.pool == name and a in vfs)


def _records(state: State, w: GpuWork) -> list[GpuInstanceRecord]:
    gpu = str(w.plan.gpu.address)
    return sorted((r for r in state.gpu_instances if r.pool == w.pool and r.gpu == gpu),
                  key=lambda r: r.start)


def _shrink(run: Applier, w: GpuWork, occ: Occupancy) -> None:
    """The pool's surplus on the GPU: free member VFs cleared first (so
    their instances are free), then instances no VF runs on destroyed."""
    gpu, state = w.plan.gpu, run.state
    w.members = _members(state, w.pool, gpu)
    w.held = {a for a in w.members if occ.holder(a) is not None}
    for addr in reversed(list(w.members)):
        if len(w.members) <= w.want:
            break
        if addr in w.held:
            continue
        if run.clear_vf(addr, w.pool):
            w.members.remove(addr)
    layout = run.layout(gpu.address)
    boot = _this_boot(run.sysfs)
    live = []
    for r in _records(state, w):
        found = layout.at(r.start, r.profile)
        # Only the instances gpulib made count; one made by hand at a recorded
        # placement is the administrator's (never the pool's, never destroyed).
        if found is None or not is_ours(run.gi_boot, r, found, boot):
            continue
        if found.id != r.gi and not run.dry_run:
            r.gi = found.id
        live.append(r)
    bound = _bound(run.sysfs, gpu) if not run.dry_run else {}
    # A member no VM holds may leave its instance: it is typed again
    # (on an instance kept) when the VFs' turn comes.
    movable = {gi: vfs for gi, vfs in bound.items()
               if all(str(vf) in w.members and str(vf) not in w.held for vf in vfs)}
    free = [r for r in live if r.gi not in bound or r.gi in movable]
    keep = max(0, w.need - (len(live) - len(free)))
    if len(free) <= keep:
        return
    starts = {r.start for r in free}
    profile = layout.profiles.get(w.plan.profile)
    kept = mig.choose_kept(profile, layout.profiles.values(),
                           [i for i in layout.instances if i.start not in starts],
                           sorted(starts), keep) if profile is not None else \
        sorted(starts)[len(starts) - keep:]
    for rec in free:
        if rec.start in kept:
            continue
        vfs = movable.get(rec.gi, []) if rec.gi is not None else []
        if not all(run.untype_member(vf, w.pool) for vf in vfs):
            break
        if not run.destroy(gpu.address, rec, f"surplus of pool {w.pool}"):
            break


def _grow(run: Applier, w: GpuWork) -> None:
    """The instances the pool lacks on the GPU: those gone since they were
    made (a reboot) made again where they were, else elsewhere; then new
    ones where `mig.choose_placement` puts them, within the profile's total."""
    gpu, state = w.plan.gpu, run.state
    layout = run.layout(gpu.address)
    profile = layout.profiles[w.plan.profile]
    profiles = list(layout.profiles.values())
    records = _records(state, w)
    boot = _this_boot(run.sysfs)
    live = [r for r in records if is_ours(run.gi_boot, r, layout.at(r.start, r.profile), boot)]
    used = list(layout.instances)
    for r in records:
        if r in live:
            continue
        if len(live) >= w.need or r.start not in mig.free_placements(profile, used):
            # Not wanted any more, or its place is taken: a record of
            # nothing, dropped (a new instance goes elsewhere below).
            if not run.dry_run:
                state.gpu_instances = [x for x in state.gpu_instances if x is not r]
                run.changed = True
            continue
        if _at_total(run, w, profile, used):
            break
        if run.create(gpu.address, profile, r.start, w.pool, again=True):
            live.append(r)
            used.append(mig.Instance(-1, profile.id, profile.name, r.start, profile.size))
    while len(live) < w.need:
        if _at_total(run, w, profile, used):
            break
        start = mig.choose_placement(profile, profiles, used)
        if start is None:
            run.out.append(Outcome("pool", w.pool, "plan", False,
                                   f"no room for another {profile.name} on {gpu.address} "
                                   f"({len(live)} of {w.need})"))
            break
        if not run.create(gpu.address, profile, start, w.pool):
            break
        used.append(mig.Instance(-1, profile.id, profile.name, start, profile.size))
        live.append(GpuInstanceRecord(str(gpu.address), profile.id, start, profile.size))


def _at_total(run: Applier, w: GpuWork, profile: mig.Profile,
              used: list[mig.Instance]) -> bool:
    """Whether the GPU has all the instances of `profile` it can hold (a
    `+me` profile: one), reported; the driver is not asked then."""
    if profile.total <= 0 or sum(1 for i in used if i.profile_id == profile.id) < profile.total:
        return False
    run.out.append(Outcome("pool", w.pool, "plan", False,
                           f"{w.plan.gpu.address} holds at most {profile.total} "
                           f"{profile.name} GPU instance(s), all made"))
    return True


def _type_members(run: Applier, w: GpuWork, occ: Occupancy) -> None:
    """The members each given its type again, then new ones from idle VFs;
    the first refusal ends the pool's VFs on this GPU (the next would be
    refused for the same want of a free instance)."""
    gpu, state, sysfs, plan = w.plan.gpu, run.state, run.sysfs, w.plan
    members = w.members
    for addr in members:
        member = PciAddress.parse(addr)
        # A VM that holds it types it itself when it starts.
        if addr not in w.held and nvidia.current_type(sysfs, member) == 0 and \
                not run.type_vf(member, plan, w.pool, "set pool member type"):
            return
    idle = [vf.address for vf in gpu.vfs if vf.nvidia is not None
            and str(vf.address) not in members and str(vf.address) not in state.vf_types
            and str(vf.address) not in state.unmanaged and occ.holder(str(vf.address)) is None]
    for address in idle:
        if len(members) >= w.want:
            break
        if nvidia.current_type(sysfs, address) != 0 and not run.dry_run:
            continue
        if not run.dry_run and plan.type_id not in nvidia.creatable_types(sysfs, address):
            # The driver offers the type only while an instance is free:
            # asked now, it would refuse, and so would every other idle VF.
            run.out.append(Outcome("pool", w.pool, "set type", False,
                                   f"no free GPU instance for {plan.type_id} ({plan.name}) on "
                                   f"{gpu.address} ({len(members)} of {w.want} VFs)"))
            return
        if not run.type_vf(address, plan, w.pool, "set type"):
            return
        members.append(str(address))


# -- restore and the settling of interrupted runs ------------------------------------------------

def settle_instances(ctx: Context, state: State, tool: Optional[migtool.Tool],
                     checkpoint: Checkpoint = None) -> list[Outcome]:
    """Complete or undo the GPU instance intents of runs that died: a
    creation is complete when its record exists, else what it made is
    destroyed (if no vGPU runs on it); a destruction is finished unless a
    vGPU runs on the instance again (then it stays, recorded). Without
    NVIDIA's tool they wait (reported)."""
    todo = [i for i in state.intents if i.action in ("create-gi", "destroy-gi")]
    out: list[Outcome] = []
    if not todo:
        return out
    if tool is None:
        return [Outcome("intent", i.id, i.action, False, "needs nvidia-smi, which is not "
                        "installed: left for later") for i in todo]
    for intent in todo:
        placed = placement_of(intent.type_id)
        if placed is None:
            continue
        profile, start = placed
        gpu = PciAddress.parse(intent.id)
        rec = next((r for r in state.gpu_instances if r.key == (intent.id, start)), None)
        try:
            layout = tool.layout(gpu)
            made = layout.at(start, profile)
            busy = made is not None and _runs_vgpu(ctx, gpu, made.id)
            if intent.action == "create-gi":
                if rec is not None:
                    line = "completed"
                elif made is None:
                    line = "nothing to undo"
                elif busy:
                    line = "kept: a vGPU runs on it"
                else:
                    tool.destroy(gpu, made.id)
                    line = "undone (destroyed)"
            else:
                if made is not None and busy:
                    line = "void: a vGPU runs on it"
                else:
                    if made is not None:
                        tool.destroy(gpu, made.id)
                    if rec is not None:
                        state.gpu_instances.remove(rec)
                    line = "finished"
        except ToolFailed as exc:
            out.append(Outcome("intent", intent.id, intent.action, False, str(exc)))
            continue
        state.intents.remove(intent)
        log.warning("settled an interrupted run: %s %s %s of %s: %s", intent.action, intent.id,
                    intent.type_id, intent.vm, line)
        out.append(Outcome("intent", intent.id, f"{intent.action} {intent.type_id}", True, line))
    if checkpoint is not None:
        checkpoint(state)
    migtool.forget(ctx.root)
    return out


def _runs_vgpu(ctx: Context, gpu: PciAddress, gi: int) -> bool:
    from gpulib.pci import virtfn_links

    for _, vf in virtfn_links(ctx.sysfs, gpu):
        if nvidia.current_type(ctx.sysfs, vf) and nvidia.gpu_instance(ctx.sysfs, vf) == gi:
            return True
    return False


def restore(ctx: Context, state: State, timeout: float,
            checkpoint: Checkpoint = None) -> list[Outcome]:
    """After a reboot: the recorded GPU instances made again at their
    placements (before the recorded VF types are set), after the intents of
    interrupted runs are settled. Asks nothing when nothing is recorded."""
    if not state.gpu_instances and not any(i.action in ("create-gi", "destroy-gi")
                                           for i in state.intents):
        return []
    tool = migtool.Tool.find(ctx.root, timeout)
    out = settle_instances(ctx, state, tool, checkpoint)
    if tool is None:
        return out + [Outcome("gi", f"{r.gpu}@{r.start}", "recreate", False,
                              "needs nvidia-smi, which is not installed")
                      for r in state.gpu_instances]
    run = Applier(ctx, state, tool, checkpoint=checkpoint)
    for gpu_addr in sorted({r.gpu for r in state.gpu_instances}):
        address = PciAddress.parse(gpu_addr)
        if physical_function(ctx.sysfs, address) is not None:
            continue
        try:
            layout = run.layout(address)
        except ToolFailed as exc:
            out.append(Outcome("gi", gpu_addr, "recreate", False, str(exc)))
            continue
        if not layout.enabled:
            out.append(Outcome("gi", gpu_addr, "recreate", False,
                               f"MIG mode is not on on {gpu_addr}"))
            continue
        # Larger instances first: their placements are the fewest.
        boot = _this_boot(ctx.sysfs)
        todo = sorted((r for r in state.gpu_instances if r.gpu == gpu_addr),
                      key=lambda r: (-r.size, r.start))
        for n, r in enumerate(todo):
            found = layout.at(r.start, r.profile)
            if found is not None:
                if is_ours(run.gi_boot, r, found, boot):
                    if r.gi is None:  # a record from before instance ids were kept
                        r.gi = found.id
                    continue
                # Made by hand where the pool's was (before the boot unit
                # ran): the administrator's, left alone; the pool's is made
                # again at another placement below.
                out.append(Outcome(
                    "gi", f"{gpu_addr}@{r.start}", "recreate", True,
                    f"GPU instance {found.id} at its placement was not made by gpulib "
                    "(the administrator's): left alone"))
            profile = layout.profiles.get(r.profile)
            if profile is None:
                out.append(Outcome("gi", f"{gpu_addr}@{r.start}", "recreate", False,
                                   f"{gpu_addr} has no GPU instance profile {r.profile}"))
                continue
            start: Optional[int] = r.start
            if start not in mig.free_placements(profile, layout.instances):
                # Its place is taken (another tool made an instance there):
                # another placement of the profile keeps the pool whole.
                # Not where the records still to be made were.
                used = [*layout.instances, *(
                    mig.Instance(-1, x.profile, "", x.start, x.size) for x in todo[n + 1:]
                    if layout.at(x.start, x.profile) is None)]
                start = None if sum(1 for i in layout.instances if i.profile_id == profile.id) \
                    >= profile.total else mig.choose_placement(
                        profile, list(layout.profiles.values()), used)
                if start is None:
                    out.append(Outcome("gi", f"{gpu_addr}@{r.start}", "recreate", False,
                                       f"its placement {r.start}:{r.size} is taken and no "
                                       f"other {profile.name} fits on {gpu_addr}"))
                    continue
            if run.create(address, profile, start, r.pool, again=True) and start != r.start:
                state.gpu_instances = [x for x in state.gpu_instances if x is not r]
                run.out[-1].detail += f" (placement {r.start} was taken)"
            layout = run.layout(address, fresh=True)
    if run.changed:
        migtool.forget(ctx.root)
    return out + run.out
