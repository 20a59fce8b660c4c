"""What the start and stop hooks do to gpulib's records (no XML involved).

Kept apart from `prepare` so that onStart/onStop and libvirt's `release end`
never import lxml: they run on every VM start and stop.
"""

from __future__ import annotations

import logging
from typing import Optional

from gpulib.allocator import release
from gpulib.config import Config
from gpulib.context import Context
from gpulib.lifecycle import boot_clock, open_store, release_not_running
from gpulib.state import State, utc_now
from gpulib.usage import running_names

log = logging.getLogger(__name__)


def release_stale(ctx: Context, state: State, running: set[str], config: Config,
                  keep: Optional[str] = None) -> None:
    """Release pending allocations of VMs that never started (DESIGN 6.2), once
    proven dead (lifecycle.pending_is_dead); `running`: running domains' names."""
    release_not_running(ctx, state, running,
                        destroy_on_demand=config.get_bool("release", "destroy_on_demand"),
                        pending_only=True, keep=keep)


def activate(ctx: Context, config: Config, vm: str) -> bool:
    """onStart: the VM runs, its allocation becomes active. False if it holds nothing."""
    def start(state: State) -> bool:
        # Names only (no file is parsed): onStart never needs lxml.
        release_stale(ctx, state, running_names(ctx.sysfs), config, keep=vm)
        alloc = state.allocations.get(vm)
        if alloc is None:
            return False
        if alloc.status != "active":
            alloc.status = "active"
            alloc.since = utc_now()
            alloc.boot_id, alloc.uptime = boot_clock(ctx)
        return True

    return open_store(ctx, config).update(start, host=ctx.sysfs)


def deactivate(ctx: Context, config: Config, vm: str) -> list[str]:
    """onStop / release end: release what the VM held."""
    def stop(state: State) -> list[str]:
        return release(ctx.sysfs, state, vm,
                       destroy_on_demand=config.get_bool("release", "destroy_on_demand"),
                       retry_seconds=config.get_float("release", "clear_retry_seconds"))

    actions = open_store(ctx, config).update(stop, host=ctx.sysfs)
    from gpulib import counters
    counters.note(ctx.root, "releases", times=1 if actions else 0, by="stop")
    return actions


def change(program: str, vm_arg: str, started: bool) -> str:
    """A VM started (allocation active) or stopped (released): one line for the log.

    The start/stop hook and libvirt's `started`/`release` operations share it.
    """
    from gpulib.hooks.common import start
    from gpulib.validate import check_vm_name

    vm = check_vm_name(vm_arg)
    ctx, config = start(program)
    if started:
        return "allocation active" if activate(ctx, config, vm) else "nothing held"
    return "; ".join(deactivate(ctx, config, vm)) or "nothing held"
