"""What the start and stop hooks do to gpulib's records (no XML involved).

Kept apart from `prepare` so that onStart/onStop and libvirt's `release end`
never import lxml: they run on every VM start and stop.
"""

from __future__ import annotations

from gpulib import logger
from gpulib.config import Config
from gpulib.context import Context
from gpulib.lifecycle import boot_clock, open_store, pending_is_dead, release_stale
from gpulib.liveness import Liveness
from gpulib.state import State, utc_now

log = logger.get(__name__)


def settle_left(ctx: Context, state: State, liveness: Liveness) -> None:
    """Finish what a run killed mid-way left (its intents), when there is any:
    a stop's removals are completed, a start's changes undone (journal.settle)."""
    if state.intents:
        from gpulib.journal import settle

        settle(ctx.sysfs, state, liveness)


def activate(ctx: Context, config: Config, vm: str) -> bool:
    """onStart: the VM runs, its allocation becomes active. False if it holds nothing."""
    store = open_store(ctx, config)

    def start(state: State) -> bool:
        # Names only (no file is parsed): onStart never needs lxml.
        liveness = Liveness(ctx.sysfs)
        settle_left(ctx, state, liveness)
        release_stale(ctx, state, liveness, config, keep=vm, store=store)
        alloc = state.allocations.get(vm)
        if alloc is None:
            return False
        if alloc.status != "active":
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
    failed start) ends the run whatever its allocation's status. CloudStack's
    onStop names the VM only and comes when it comes: a *pending* allocation
    is a newer start, which it never releases nor destroys anything of."""
    from gpulib.allocator import release

    store = open_store(ctx, config)

    def stop(state: State) -> list[str]:
        liveness = Liveness(ctx.sysfs)
        settle_left(ctx, state, liveness)
        release_stale(ctx, state, liveness, config, keep=vm, store=store)
        alloc = state.allocations.get(vm)
        if not ends_run and alloc is not None and alloc.status == "pending" and not (
                alloc.arriving and pending_is_dead(
                    alloc, liveness, boot_clock(ctx),
                    arrival_grace=config.get_float("release", "arrival_timeout"))):
            # (An arrival libvirt abandoned is no start: it goes, as any hook
            # releases it.)
            log.warning("a late onStop of %s: its allocation is pending (a newer start, "
                        "since %s): nothing released", vm, alloc.since)
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
