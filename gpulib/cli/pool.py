"""`gpulib pool`, `restore`, `reconcile`, `release`: keeping vGPUs and records in step."""

from __future__ import annotations

import click

from gpulib import pools
from gpulib.allocator import release as release_vm
from gpulib.cli.common import Env, Group, emit_json, json_option
from gpulib.errors import GpulibError
from gpulib.hostview import discover_host
from gpulib.lifecycle import open_store, reconcile, restore
from gpulib.outcome import Outcome
from gpulib.validate import check_vm_name


def _report(outcomes: list[Outcome], as_json: bool, empty: str) -> None:
    if as_json:
        emit_json([o.as_dict() for o in outcomes])
    elif not outcomes:
        click.echo(empty)
    else:
        for o in outcomes:
            click.echo(str(o))
    if any(not o.ok for o in outcomes):
        raise click.exceptions.Exit(1)


@click.group("pool", cls=Group)
def pool_group() -> None:
    """vGPU pools declared in gpulib.conf."""


@pool_group.command("apply")
@click.option("--dry-run", is_flag=True, help="Only show what would change.")
@json_option
@click.pass_obj
def pool_apply(env: Env, dry_run: bool, as_json: bool) -> None:
    """Create what the pools miss; a second run changes nothing."""
    store = open_store(env.ctx, env.config)
    with store.transaction() as state:
        inventory = discover_host(env.ctx, env.config, state=state, learn=False)
        outcomes = pools.apply(env.ctx, env.config, state, inventory, dry_run=dry_run,
                               checkpoint=None if dry_run else store.checkpoint)
    _report(outcomes, as_json, "pools are complete: nothing to do")


@pool_group.command("list")
@json_option
@click.pass_obj
def pool_list(env: Env, as_json: bool) -> None:
    """Pools and their members."""
    from gpulib.liveness import running_domains
    from gpulib.occupancy import Occupancy

    state = open_store(env.ctx, env.config).load()
    doc = pools.members(env.config, state,
                        Occupancy.build(env.ctx.sysfs, state, running_domains(env.ctx.sysfs)))
    if as_json:
        emit_json(doc)
        return
    for name, items in doc.items():
        used = sum(1 for i in items if i["vm"])
        click.echo(f"{name}: {len(items)} members, {used} in use")
        for i in items:
            click.echo(f"  {i['kind']:4s} {i['id']}  type {i['type']}  vm={i['vm'] or '-'}")


@click.command("restore")
@json_option
@click.pass_obj
def restore_cmd(env: Env, as_json: bool) -> None:
    """Recreate every known vGPU that is not live (run at boot)."""
    store = open_store(env.ctx, env.config)
    with store.transaction() as state:
        outcomes = restore(env.ctx, state,
                           destroy_on_demand=env.config.get_bool("release", "destroy_on_demand"),
                           checkpoint=store.checkpoint,
                           tool_timeout=env.config.get_float("discovery", "nvidia_smi_timeout"))
    _report(outcomes, as_json, "every known vGPU is live: nothing to do")


@click.command("reconcile")
@json_option
@click.pass_obj
def reconcile_cmd(env: Env, as_json: bool) -> None:
    """Release allocations of VMs not running; report stray or vanished vGPUs."""
    store = open_store(env.ctx, env.config)
    with store.transaction() as state:
        outcomes = reconcile(env.ctx, state,
                             destroy_on_demand=env.config.get_bool("release",
                                                                   "destroy_on_demand"),
                             checkpoint=store.checkpoint,
                             tool_timeout=env.config.get_float("discovery",
                                                               "nvidia_smi_timeout"),
                             arrival_grace=env.config.get_float("release",
                                                                "arrival_timeout"))
    from gpulib import counters
    counters.note(env.ctx.root, "releases", by="reconcile",
                  times=sum(o.action.startswith("released") for o in outcomes))
    _report(outcomes, as_json, "state and host agree: nothing to do")


@click.command("release")
@click.argument("vm")
@click.option("--force", is_flag=True,
              help="Release it even while the VM runs or starts (its vGPUs are destroyed "
                   "under it).")
@click.pass_obj
def release_cmd(env: Env, vm: str, force: bool) -> None:
    """Release what VM holds (as its stop hook does); refused while it runs or starts."""
    from gpulib.liveness import Liveness

    vm = check_vm_name(vm)
    store = open_store(env.ctx, env.config)
    liveness = Liveness(env.ctx.sysfs)
    with store.transaction() as state:
        alloc = state.allocations.get(vm)
        if alloc is not None and not force and liveness.is_running(vm, alloc.domain_uuid):
            raise GpulibError(f"{vm} is running: its devices stay held (stop it first, or "
                              "use --force to take them from the running VM)")
        if alloc is not None and alloc.status == "pending" and not \
                liveness.is_running(vm, alloc.domain_uuid):
            # A pending allocation is a start under way: `mdev remove` and
            # `device unmanage` refuse its devices too (one notion of held).
            if not force:
                raise GpulibError(f"{vm} is starting (pending allocation since {alloc.since}): "
                                  "its devices stay held (let the start finish or fail, run "
                                  "gpulib reconcile once it is over, or use --force)")
            click.echo(f"gpulib: warning: {vm} is starting: releasing its devices anyway "
                       "(--force)", err=True)
        if alloc is not None and force and liveness.is_running(vm, alloc.domain_uuid):
            click.echo(f"gpulib: warning: {vm} is running: releasing its devices anyway "
                       "(--force)", err=True)
        actions = release_vm(env.ctx.sysfs, state, vm, liveness,
                             destroy_on_demand=env.config.get_bool("release",
                                                                   "destroy_on_demand"),
                             retry_seconds=env.config.get_float("release",
                                                                "clear_retry_seconds"),
                             checkpoint=store.checkpoint, force=force)
    from gpulib import counters
    counters.note(env.ctx.root, "releases", times=1 if actions else 0, by="command")
    click.echo("\n".join(actions) if actions else f"{vm} holds nothing")
