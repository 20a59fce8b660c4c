"""Keeping the host's vGPUs and gpulib's records in step.

* `restore`: after a reboot every mdev is gone and every NVIDIA VF reads type
  0; recreate what the registry (and mdevctl's definitions) say should exist,
  with the same UUIDs on the same parents.
* `reconcile`: settle the write-ahead intents of starts that died (complete
  or undo them, `gpulib.journal`), release allocations of VMs that are not
  running (once their run is over: `liveness.run_over`), and report
  registry entries whose device vanished and live vGPUs nobody holds.
* `rebuild_state`: what a corrupt state file is replaced with: the registry
  and allocations re-learned from sysfs and libvirt's status files.
* `open_store`: the StateStore every entry point uses (with that rebuild).
"""

from __future__ import annotations

import time

from gpulib import logger
from gpulib.config import Config
from gpulib.context import Context
from gpulib.definitions import DEFINITIONS_MARKER, follow_definitions
from gpulib.domstatus import DomainDevices
from gpulib.errors import GpulibError, InputError
from gpulib.liveness import (
    ABANDONED_ARRIVAL,
    EARLIER_BOOT,
    STOPPED,
    Liveness,
    boot_clock_of,
    run_over,
    running_domains,
    since_epoch,
)

# The grace of a start and of an arrival are liveness's (run_over), named here too.
from gpulib.liveness import ARRIVAL_GRACE_SECONDS as ARRIVAL_GRACE_SECONDS
from gpulib.liveness import PENDING_GRACE_SECONDS as PENDING_GRACE_SECONDS
from gpulib.outcome import Outcome
from gpulib.pci import PciAddress, list_addresses
from gpulib.records import HANDMADE, UNRECOVERED_KEY
from gpulib.state import (
    REBUILT_FROM_KEY,
    Allocation,
    Device,
    State,
    StateStore,
    VfRecord,
    VgpuRecord,
    utc_now,
)

# The vGPU modules and the allocator are imported where a function needs
# them: onStart comes here for its store and clock, and needs neither.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Callable, Optional

log = logger.get(__name__)

def open_store(ctx: Context, config: Optional[Config] = None,
               timeout: Optional[float] = None) -> StateStore:
    if timeout is None:
        timeout = config.get_float("state", "lock_timeout") if config else 20.0
    store = StateStore.for_context(ctx, timeout=timeout)
    # A damaged file is rebuilt from its copy (the last state written) and the host.
    store.rebuild = lambda: rebuild_state(ctx, store.backup_state(), config)
    return store


def rebuild_state(ctx: Context, previous: Optional[State] = None,
                  config: Optional[Config] = None) -> State:
    """What a damaged state file is replaced with.

    `previous`: the copy the store keeps beside the file (the state as last
    written), when it is whole: everything gpulib knew, pending starts and pool
    membership included, is taken from it. Then the host adds what it can
    tell: live vGPUs that mdevctl defines, NVIDIA VF types, and the devices
    of running VMs (an active allocation for a VM the copy does not know, or
    knows as another domain). Without a copy, every mdevctl definition is
    recorded (live or not), and pool membership is re-learned from gpulib.conf
    (persistent vGPUs of a pool's type or profile on its parents, up to its
    target), so `pool apply` does not make a second set.
    """
    from gpulib import mdev, mdevctl, nvidia

    sysfs = ctx.sysfs
    state = previous.copy() if previous is not None else State()
    state.extra[REBUILT_FROM_KEY] = "its copy and the host" if previous is not None \
        else "the host"
    # Live vGPUs with a definition are persistent; gpulib cannot tell who made
    # the others (an on-demand vGPU, libvirt's transient one), so it leaves them.
    if previous is None:
        state.extra[DEFINITIONS_MARKER] = "mdevctl"
    defs = mdevctl.read_definitions(ctx)
    live = mdev.live_mdevs(sysfs)
    for uuid, m in live.items():
        known = defs.get(uuid)
        if known is not None and uuid not in state.vgpus and \
                (known.parent, known.type_id) == (str(m.parent), m.type_id):
            state.vgpus[uuid] = VgpuRecord(known.parent, known.type_id)
    if previous is None:
        # Without a copy, mdevctl's definitions are the record of what is kept
        # (gpulib defines every vGPU it keeps): one not live now (after a
        # reboot, before the boot unit ran) is recorded too, so the report
        # keeps listing it and the pools below take their members back.
        for uuid, known in defs.items():
            if uuid not in state.vgpus and uuid not in live:
                state.vgpus[uuid] = VgpuRecord(known.parent, known.type_id)
    for address in list_addresses(sysfs):
        if str(address) not in state.vf_types and nvidia.is_vendor_vf(sysfs, address):
            current = nvidia.current_type(sysfs, address) or 0
            if current:
                state.vf_types[str(address)] = VfRecord(current)
    running = running_domains(sysfs)
    for dom in running:
        # A live vGPU a running VM uses is kept whatever made it: forgetting
        # it would let its VM's next start fail after the VM's own stop.
        for u in dom.mdevs:
            used = live.get(u)
            if used is not None and u not in state.vgpus:
                state.vgpus[u] = VgpuRecord(str(used.parent), used.type_id)
    for dom in running:
        known_alloc = state.allocations.get(dom.name)
        if known_alloc is not None and known_alloc.domain_uuid in (None, dom.uuid):
            known_alloc.status = "active"
            continue
        devices = [Device("mdev", u) for u in dom.mdevs if u in state.vgpus]
        devices += [Device("vf" if str(a) in state.vf_types else "pci", str(a)) for a in dom.pci]
        if devices:
            alloc = Allocation(dom.name, dom.uuid, "active", utc_now(), devices)
            alloc.boot_id, alloc.uptime = boot_clock(ctx)
            state.allocations[dom.name] = alloc
    if previous is None and config is not None:
        _relearn_pools(ctx, state, config)
    if previous is None:
        state.extra[UNRECOVERED_KEY] = _unrecovered(state, live, config, running)
    else:
        state.extra.pop(UNRECOVERED_KEY, None)
    log.error("state rebuilt from %s: %d vGPUs, %d VF types, %d allocations",
              state.extra[REBUILT_FROM_KEY], len(state.vgpus), len(state.vf_types),
              len(state.allocations))
    for line in state.extra.get(UNRECOVERED_KEY, ()):
        log.error("state rebuilt from the host: not recovered: %s", line)
    return state


def _unrecovered(state: State, live: Iterable[str], config: Optional[Config],
                 running: list[DomainDevices]) -> list[str]:
    """What a state rebuilt from the host alone (no usable copy) cannot know, one
    line each: said in the log, `gpulib status` and metrics."""
    used = {u for d in running for u in d.mdevs}
    loose = sorted(u for u in live if u not in state.vgpus and u not in used)
    out = ["pending starts: a VM being started when the state was lost holds nothing "
           "until it runs",
           "which devices were made on demand: every recorded vGPU and VF type is kept as "
           "persistent (remove one with gpulib mdev remove / vf clear)",
           "devices marked unmanaged (gpulib device unmanage): mark them again",
           "VF types not set on their VF now (a MIG-backed pool member between VMs): "
           "gpulib pool apply sets them again"]
    if config is not None and config.pools and state.vf_types:
        out.append("which typed VFs were members of VF pools (NVIDIA vendor VFs, MIG-backed): "
                   "they keep their types as gpulib's own; gpulib pool apply may type other "
                   "VFs for the pools (gpulib vf clear frees one)")
    if loose:
        out.append(f"{len(loose)} live vGPU(s) with no mdevctl definition that no running "
                   f"VM uses ({', '.join(loose)}): not recorded (gpulib reconcile lists them)")
    return out


def _relearn_pools(ctx: Context, state: State, config: Config) -> None:
    """Pool membership from gpulib.conf: each pool takes the persistent vGPUs of
    its type on its parents that no pool has, up to its target."""
    from gpulib import mdev, profiles
    from gpulib.pci import PciFunction, physical_function

    names: dict[tuple[str, str], Optional[str]] = {}

    def type_name(rec: VgpuRecord, address: PciAddress) -> Optional[str]:
        """The name the record's type has on its parent (read once a type)."""
        key = (rec.parent, rec.type_id)
        if key not in names:
            names[key] = mdev.MdevType(ctx.sysfs, address, rec.type_id).name
        return names[key]

    for name, pool in sorted(config.pools.items()):
        if pool.type_id is None and pool.profile is None:
            continue
        taken: dict[str, int] = {}
        total = 0
        for _uuid, rec in sorted(state.vgpus.items()):
            if rec.pool is not None or rec.on_demand:
                continue
            if pool.type_id is not None and rec.type_id != pool.type_id:
                continue
            try:
                address = PciAddress.parse(rec.parent)
                # A pool named by profile takes a type of that name on the
                # record's parent (the one rule for names: profiles.serves).
                if pool.type_id is None and not profiles.serves(
                        pool.profile, None, rec.type_id, type_name(rec, address)):
                    continue
                gpu = physical_function(ctx.sysfs, address) or address
                fn = PciFunction.read_ids(ctx.sysfs, gpu)
            except (InputError, OSError):
                continue
            if not pool.parents.matches(gpu, fn.vendor_id, fn.device_id):
                continue
            if pool.per_parent is not None and taken.get(rec.parent, 0) >= pool.per_parent:
                continue
            if pool.count is not None and total >= pool.count:
                break
            rec.pool = name
            taken[rec.parent] = taken.get(rec.parent, 0) + 1
            total += 1


def remember_vgpu(ctx: Context, state: State, uuid: str) -> bool:
    """A live vGPU a running VM (or a start) names that gpulib has no record of:
    made outside gpulib (mdevctl, sysfs, another tool, before gpulib was
    installed). Remembered (parent, type, UUID), not owned (`VgpuRecord.remembered`,
    the administrator's), so the VM's next start after a reboot makes it
    again. True if it was remembered now."""
    from gpulib import mdev

    if uuid in state.vgpus:
        return False
    live = mdev.read_mdev(ctx.sysfs, uuid)
    if live is None:
        return False
    state.vgpus[uuid] = VgpuRecord(str(live.parent), live.type_id, pool=HANDMADE,
                                   remembered=True)
    log.info("mdev %s (%s on %s) was not made by gpulib: remembered, not owned, so its VM's "
             "next start after a reboot can make it again", uuid, live.type_id, live.parent)
    return True


# How long restore leaves `auto` vGPUs to mdevctl's udev autostart, where that
# is active, before it starts the missing ones itself.
AUTOSTART_WAIT_SECONDS = 10.0


# -- restore --------------------------------------------------------------------------------

def restore(ctx: Context, state: State, adopt_mdevctl: bool = True,
            autostart_wait: Optional[float] = None, destroy_on_demand: bool = True,
            checkpoint: Optional[Callable[[State], None]] = None,
            tool_timeout: float = 10.0) -> list[Outcome]:
    """Start the vGPUs that should exist and set recorded VF types.

    First, before anything is made: what interrupted runs left is settled and
    the allocations of VMs that are not running and were made in an earlier
    boot (or pending and dead) are released, so a vGPU made on demand for a VM
    of the last boot is not made again, and a GPU a VM of the last boot held
    is free. Allocations of running VMs and pending starts within their grace
    stay.

    Every `auto` mdevctl definition (only those gpulib keeps a record of when
    `adopt_mdevctl` is False) and every transient vGPU record is created if not
    live, with its attrs. `manual` definitions are left alone. Where mdevctl's
    udev rule starts `auto` definitions itself, restore first gives it
    `autostart_wait` seconds, so that one tool starts a vGPU, not both; a vGPU
    the other tool made meanwhile is reported "already live", not an error.

    The MIG GPU instances gpulib made for pools are made again at their
    placements (with NVIDIA's tool, each call bounded by `tool_timeout`)
    before the recorded VF types are set: a MIG-backed type needs its
    instance (`gpulib.migpool.restore`).
    """
    from gpulib import mdev, mdevctl, migpool, nvidia

    sysfs = ctx.sysfs
    liveness = Liveness(sysfs)
    out = settle_intents(ctx, state, liveness)
    out += release_not_running(ctx, state, liveness, destroy_on_demand, pending_only=True,
                               checkpoint=checkpoint)
    if destroy_on_demand:
        # Not made again below: an on-demand vGPU nobody owns any more.
        out += release_ownerless(ctx, state, liveness, checkpoint)
    defs = mdevctl.read_definitions(ctx)
    out += follow_definitions(ctx, state, defs)
    wanted: list[tuple[str, str, str, list[tuple[str, str]], str]] = []
    for uuid, d in sorted(defs.items()):
        if d.auto and (adopt_mdevctl or uuid in state.vgpus):
            wanted.append((uuid, d.parent, d.type_id, d.attrs, "mdevctl definition"))
    for uuid, rec in sorted(state.vgpus.items()):
        # A remembered vGPU is not gpulib's: its VM's next start makes it again.
        if uuid not in defs and not rec.remembered:
            wanted.append((uuid, rec.parent, rec.type_id, [], "gpulib record"))
    missing = [w for w in wanted if mdev.read_mdev(sysfs, w[0]) is None]
    if missing and any(w[4] == "mdevctl definition" for w in missing) and \
            mdevctl.udev_autostart(ctx):
        wait = AUTOSTART_WAIT_SECONDS if autostart_wait is None else autostart_wait
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(
                mdev.read_mdev(sysfs, w[0]) is None for w in missing
                if w[4] == "mdevctl definition" and sysfs.exists(f"{mdev.MDEV_BUS}/{w[1]}")):
            time.sleep(0.2)
    for uuid, parent, type_id, attrs, source in wanted:
        live = mdev.read_mdev(sysfs, uuid)
        if live is not None:
            if (str(live.parent), live.type_id) != (parent, type_id):
                out.append(Outcome("mdev", uuid, "check", False,
                                   f"live on {live.parent} as {live.type_id}, but the "
                                   f"{source} says {type_id} on {parent}"))
            elif any(w[0] == uuid for w in missing):
                out.append(Outcome("mdev", uuid, "already live", True,
                                   f"{type_id} on {parent}: started by mdevctl"))
            continue
        try:
            made = mdev.create(sysfs, PciAddress.parse(parent), type_id, uuid, attrs=attrs)
            if made.already_live:
                out.append(Outcome("mdev", uuid, "already live", True,
                                   f"{type_id} on {parent}: started by another tool"))
            else:
                out.append(Outcome("mdev", uuid, "recreated", True, f"{type_id} on {parent}" +
                                   (f" with {len(attrs)} attrs" if attrs else "")))
        except GpulibError as exc:
            out.append(Outcome("mdev", uuid, "recreate", False, exc.message))
    out += migpool.restore(ctx, state, tool_timeout, checkpoint)
    for addr, vrec in sorted(state.vf_types.items()):
        try:
            vf = PciAddress.parse(addr)
            current = nvidia.current_type(sysfs, vf)
            if current is None:
                raise GpulibError(f"{addr} is gone or not an NVIDIA vGPU VF")
            if current == vrec.type_id:
                continue
            nvidia.set_type(sysfs, vf, vrec.type_id)
            out.append(Outcome("vf", addr, "set type", True,
                               f"{vrec.type_id} ({vrec.name or '?'})"))
        except GpulibError as exc:
            out.append(Outcome("vf", addr, "set type", False, exc.message))
    return out


# -- reconcile --------------------------------------------------------------------------------

def age_seconds(iso: str) -> float:
    """Seconds since an ISO 8601 UTC time from the state file (inf if unreadable)."""
    epoch = since_epoch(iso)
    return float("inf") if epoch is None else time.time() - epoch


def boot_clock(ctx: Context) -> tuple[Optional[str], float]:
    """This boot's id and the seconds since it (CLOCK_BOOTTIME: no clock change moves it)."""
    return boot_clock_of(ctx.sysfs)


def stamp(ctx: Context, alloc: Allocation) -> None:
    """Mark an allocation as made now, in this boot (see liveness.run_over)."""
    alloc.since = utc_now()
    alloc.boot_id, alloc.uptime = boot_clock(ctx)


def release_not_running(ctx: Context, state: State, liveness: Liveness,
                        destroy_on_demand: bool = True, grace: float = PENDING_GRACE_SECONDS,
                        pending_only: bool = False, keep: Optional[str] = None,
                        checkpoint: Optional[Callable[[State], None]] = None,
                        arrival_grace: float = ARRIVAL_GRACE_SECONDS) -> list[Outcome]:
    """Release the allocations whose run is over (`liveness.run_over`, the one
    answer the occupancy model gives too).

    `pending_only` (the hooks' cheap cleanup) judges an active allocation of
    this boot by its VM's name alone (a stop that did not complete is
    finished now, before any start is judged); a status file under its name
    keeps it whatever UUID it names, for reconcile (not `pending_only`) to
    judge. `keep`: a VM starting or stopping now (its own hook decides for
    it)."""
    out: list[Outcome] = []
    clock = boot_clock(ctx)
    for vm, alloc in sorted(state.allocations.items()):
        if vm == keep:
            continue
        why = run_over(alloc, liveness, clock, grace, arrival_grace, by_uuid=not pending_only)
        if why is None:
            continue
        held = ", ".join(f"{d.kind} {d.id}" for d in alloc.devices) or "nothing"
        if why == STOPPED:
            # Named as what it is: the VM stopped, its stop never finished.
            log.warning("%s: held by stopped VM %s, released now (its stop did not "
                        "complete; made %s)", held, vm, alloc.since)
            detail = f"held by stopped VM {vm}, released now"
        elif why == ABANDONED_ARRIVAL:
            log.warning("%s: held by an incoming migration of %s that libvirt abandoned "
                        "(no prepare begin followed), released now", held, vm)
            detail = f"held by an abandoned incoming migration of {vm}, released now"
        else:
            boot = "an earlier boot" if why == EARLIER_BOOT else "this boot"
            log.warning("releasing the %s allocation of %s: it is not running (made %s, in %s)",
                        alloc.status, vm, alloc.since, boot)
            detail = f"made {alloc.since}, in {boot}"
        from gpulib.allocator import release

        actions = release(ctx.sysfs, state, vm, liveness, destroy_on_demand=destroy_on_demand,
                          retry_seconds=0.5, checkpoint=checkpoint)
        out.append(Outcome("vm", vm, f"released {alloc.status} allocation", True,
                           "; ".join([detail, *actions])))
    return out


# A name for the removal intents of devices no VM owns any more.
OWNERLESS = "ownerless"


def release_ownerless(ctx: Context, state: State, liveness: Liveness,
                      checkpoint: Optional[Callable[[State], None]] = None,
                      reuse: Iterable[str] = ()) -> list[Outcome]:
    """Destroy the on-demand devices no allocation and no intent names and no
    running VM uses: made for a VM whose stop left them to another VM that
    was using them (journal: "kept"), or to a replaced allocation. Their last
    user has stopped; left live, they would block their owner's next start
    (the same derived UUID). `reuse`: devices a start now running names (it
    takes them). Costs nothing when every on-demand device has an owner."""
    named = {d.id for a in state.allocations.values() for d in a.devices}
    named.update(i.id for i in state.intents)
    named.update(reuse)
    loose = [Device("mdev", u, on_demand=True) for u, r in sorted(state.vgpus.items())
             if r.on_demand and u not in named]
    loose += [Device("vf", a, on_demand=True) for a, r in sorted(state.vf_types.items())
              if r.on_demand and a not in named]
    if not loose:
        return []
    # The running domains' devices, read only now that a device may go.
    gone = [d for d in loose if liveness.user_of(d.id) is None]
    out = []
    from gpulib.journal import release_devices

    for d in loose:
        if d not in gone:
            log.info("on-demand %s %s has no owner; running VM %s uses it: kept until it "
                     "stops", d.kind, d.id, liveness.user_of(d.id))
    for d, line in zip(gone, release_devices(ctx.sysfs, state, OWNERLESS, gone, liveness,
                                             checkpoint, 0.5)):
        log.warning("on-demand %s %s: its owner stopped and no running VM uses it: %s",
                    d.kind, d.id, line)
        out.append(Outcome(d.kind, d.id, "released ownerless on-demand device",
                           not line.startswith("FAILED"), line))
    return out


def release_stale(ctx: Context, state: State, liveness: Liveness, config: Config,
                  keep: Optional[str] = None, store: Optional[StateStore] = None,
                  reuse: Iterable[str] = ()) -> None:
    """Release what VMs that are not running left (ARCHITECTURE.md, Liveness):
    the allocations whose run is over (`liveness.run_over`: stops that did
    not complete, starts past their grace, abandoned arrivals, every
    allocation of an earlier boot), then on-demand devices left without an
    owner (`release_ownerless`); removals announced first (`store`'s
    checkpoint). Every hook's and arrival's cheap cleanup, before a start is
    judged. `reuse`: devices the start now running names."""
    destroy = config.get_bool("release", "destroy_on_demand")
    checkpoint = store.checkpoint if store is not None else None
    release_not_running(ctx, state, liveness, destroy_on_demand=destroy,
                        pending_only=True, keep=keep, checkpoint=checkpoint,
                        arrival_grace=config.get_float("release", "arrival_timeout"))
    if destroy:
        release_ownerless(ctx, state, liveness, checkpoint, reuse)


def reconcile(ctx: Context, state: State, destroy_on_demand: bool = True,
              grace: float = PENDING_GRACE_SECONDS,
              running: Optional[list[DomainDevices]] = None,
              checkpoint: Optional[Callable[[State], None]] = None,
              tool_timeout: float = 10.0,
              arrival_grace: float = ARRIVAL_GRACE_SECONDS) -> list[Outcome]:
    from gpulib import mdev
    from gpulib.occupancy import Occupancy

    sysfs = ctx.sysfs
    domains = running_domains(sysfs) if running is None else running
    liveness = Liveness(sysfs, domains)
    out = settle_intents(ctx, state, liveness)
    if any(i.action in ("create-gi", "destroy-gi") for i in state.intents):
        from gpulib import migpool, migtool

        out += migpool.settle_instances(ctx, state, migtool.Tool.find(ctx.root, tool_timeout),
                                        checkpoint)
    out += release_not_running(ctx, state, liveness, destroy_on_demand, grace,
                               checkpoint=checkpoint, arrival_grace=arrival_grace)
    if destroy_on_demand:
        out += release_ownerless(ctx, state, liveness, checkpoint)
    occ = Occupancy.build(sysfs, state, domains, arrival_grace=arrival_grace)
    live = mdev.live_mdevs(sysfs)
    for uuid, rec in sorted(state.vgpus.items()):
        try:
            parent = PciAddress.parse(rec.parent)
        except InputError:
            parent = None
        if parent is None or not sysfs.exists(f"sys/bus/pci/devices/{parent}"):
            out.append(Outcome("mdev", uuid, "report", False,
                               f"parent {rec.parent} is gone from this host"))
    for uuid in occ.stray_mdevs(live, state.vgpus):
        # Made outside gpulib (mdevctl, sysfs): the administrator's
        # (`ownership.vgpu_owner`), reported and left alone, not an error.
        m = live[uuid]
        owner = occ.owner("mdev", uuid)
        out.append(Outcome("mdev", uuid, "left alone", True,
                           f"live {m.type_id} on {m.parent}, used by no running VM: "
                           f"{owner.kind}'s ({owner.reason}); gpulib mdev remove {uuid} "
                           "removes it"))
    return out


def settle_intents(ctx: Context, state: State, liveness: Liveness) -> list[Outcome]:
    """Complete or undo what interrupted starts and stops left (journal.settle)."""
    from gpulib.journal import settle

    return [Outcome("intent", line.split(" ", 2)[1], line.split(": ", 1)[-1],
                    "FAILED" not in line, line) for line in settle(ctx.sysfs, state, liveness)]
