"""What the start and stop hooks do to gpulib's records (no XML involved).

Kept apart from `prepare` so that onStart/onStop and libvirt's `release end`
never import lxml: they run on every VM start and stop.
"""

from __future__ import annotations

from gpulib import logger
from gpulib.config import Config
from gpulib.context import Context
from gpulib.lifecycle import boot_clock, open_store, release_stale
from gpulib.liveness import ABANDONED_ARRIVAL, EARLIER_BOOT, Liveness, run_over
from gpulib.state import Allocation, State, utc_now

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

log = logger.get(__name__)


def settle_left(ctx: Context, state: State, liveness: Liveness) -> None:
    """Finish what a run killed mid-way left (its intents), when there is any:
    a stop's removals are completed, a start's changes undone (journal.settle)."""
    if state.intents:
        from gpulib.journal import settle

        settle(ctx.sysfs, state, liveness)


def activate(ctx: Context, config: Config, vm: str) -> bool:
    """onStart / `started begin`: the VM runs, its allocation becomes active.
    False if it holds nothing.

    A hook acts on its own run (ARCHITECTURE.md, Liveness): a pending allocation
    becomes active only when libvirt launched its run (`Liveness.launched`:
    the VM's status file names its domain and is no older than the
    allocation). A late onStart of the run before finds the newer start not
    launched: it stays pending, a start of its own, and its onStart or
    `started begin` makes it active."""
    store = open_store(ctx, config)

    def start(state: State) -> bool:
        # Names only (no file is parsed): onStart never needs lxml.
        liveness = Liveness(ctx.sysfs)
        settle_left(ctx, state, liveness)
        release_stale(ctx, state, liveness, config, keep=_own_run(ctx, state, vm, liveness),
                      store=store)
        alloc = state.allocations.get(vm)
        if alloc is None:
            return False
        if alloc.status != "active":
            if not liveness.launched(alloc):
                log.warning("a late onStart of %s: its allocation is a newer start libvirt "
                            "has not launched (no status file of domain %s since %s): it "
                            "stays pending", vm, alloc.domain_uuid or "?", alloc.since)
                return True
            alloc.status = "active"
            alloc.since = utc_now()
            alloc.boot_id, alloc.uptime = boot_clock(ctx)
        return True

    return store.update(start)


def deactivate(ctx: Context, config: Config, vm: str, ends_run: bool = True) -> list[str]:
    """onStop / release end: release what the VM held, unless it runs (a late,
    repeated or failed stop: libvirt's status file still names it).

    A stop belongs to the run it ends (ARCHITECTURE.md, Liveness). libvirt's
    `release end` (`ends_run`: serialized per domain, after a stop or a
    failed start) ends an active run, or a pending one libvirt prepared (its
    `prepare begin` ran: `Allocation.prepared`) or is migrating in; a
    pending allocation only the transformer made is a newer start, whose
    `prepare begin` libvirt cannot run before this run's stop is over.
    CloudStack's onStop names the VM only and comes when it comes: a
    *pending* allocation is a newer start, which it never releases nor
    destroys anything of."""
    from gpulib.allocator import release

    store = open_store(ctx, config)

    def stop(state: State) -> list[str]:
        liveness = Liveness(ctx.sysfs)
        settle_left(ctx, state, liveness)
        release_stale(ctx, state, liveness, config, keep=_own_run(ctx, state, vm, liveness),
                      store=store)
        alloc = state.allocations.get(vm)
        if alloc is not None and alloc.status == "pending" and not _stop_ends(
                alloc, ends_run, liveness, ctx, config):
            hook = "release end" if ends_run else "onStop"
            why = ", which libvirt has not prepared" if ends_run else ""
            log.warning("a late %s of %s: its allocation is pending (a newer start since "
                        "%s%s): nothing released", hook, vm, alloc.since, why)
            return [f"kept: {vm} is starting again (pending allocation)"]
        return release(ctx.sysfs, state, vm, liveness,
                       destroy_on_demand=config.get_bool("release", "destroy_on_demand"),
                       retry_seconds=config.get_float("release", "clear_retry_seconds"),
                       checkpoint=store.checkpoint)

    actions = store.update(stop)
    from gpulib import counters

    released = any(not a.startswith("kept") for a in actions)
    counters.note(ctx.root, "releases", times=1 if released else 0, by="stop")
    return actions


def _own_run(ctx: Context, state: State, vm: str, liveness: Liveness) -> Optional[str]:
    """What the sweep before a VM's own onStart or stop keeps: the VM's own
    allocation (the run the hook is about, judged by the hook itself), but not
    one of an earlier boot, whose run is over whatever comes now."""
    own = state.allocations.get(vm)
    if own is not None and run_over(own, liveness, boot_clock(ctx)) == EARLIER_BOOT:
        return None
    return vm


def _stop_ends(alloc: Allocation, ends_run: bool, liveness: Liveness, ctx: Context,
               config: Config) -> bool:
    """Whether a stop ends a pending allocation: `release end` one libvirt
    prepared or is migrating in; either stop an arrival libvirt abandoned
    (no start: any hook releases it)."""
    if ends_run and (alloc.prepared or alloc.arriving):
        return True
    return alloc.arriving and run_over(
        alloc, liveness, boot_clock(ctx),
        arrival_grace=config.get_float("release", "arrival_timeout")) == ABANDONED_ARRIVAL


def replace_other_domain(ctx: Context, config: Config, vm: str, domain_uuid: str) -> bool:
    """`reconnect begin` of a domain that names no GPU: an allocation under its
    name of another domain (not the one that runs) is gone for good, and is
    released as a start or a reconnect with GPUs replaces it. Reads the state
    only (no lock, no write) when there is nothing to release. True if it
    released one."""
    store = open_store(ctx, config)
    alloc = store.load().allocations.get(vm)
    if alloc is None or alloc.domain_uuid in (None, domain_uuid):
        return False

    def replace(state: State) -> bool:
        alloc = state.allocations.get(vm)
        if alloc is None or alloc.domain_uuid in (None, domain_uuid):
            return False
        from gpulib.allocator import release

        log.warning("%s runs as domain %s: the allocation of domain %s under its name is "
                    "released", vm, domain_uuid, alloc.domain_uuid)
        release(ctx.sysfs, state, vm, Liveness(ctx.sysfs),
                destroy_on_demand=config.get_bool("release", "destroy_on_demand"),
                retry_seconds=0.5, checkpoint=store.checkpoint)
        return True

    return store.update(replace)


def change(program: str, vm_arg: str, started: bool, ends_run: bool = True) -> str:
    """A VM started (allocation active) or stopped (released): one line for the log.

    The start/stop hook and libvirt's `started`/`release` operations share it;
    `ends_run` False: the agent's onStop (see `deactivate`)."""
    from gpulib.hooks.common import start
    from gpulib.validate import check_vm_name

    vm = check_vm_name(vm_arg)
    ctx, config = start(program)
    if started:
        return "allocation active" if activate(ctx, config, vm) else "nothing held"
    return "; ".join(deactivate(ctx, config, vm, ends_run)) or "nothing held"
