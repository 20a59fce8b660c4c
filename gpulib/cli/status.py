"""`gpulib status`: devices, profiles, pools and allocations, and each allocation's
run as the hooks judge it."""

from __future__ import annotations

from typing import Any, Optional

import click

from gpulib import report
from gpulib.cli.common import Env, emit_json, json_option
from gpulib.errors import GpulibError
from gpulib.hostview import discover_host
from gpulib.lifecycle import boot_clock, open_store
from gpulib.liveness import (
    ABANDONED_ARRIVAL,
    EARLIER_BOOT,
    EXPIRED_START,
    STOPPED,
    Liveness,
    from_other_boot,
    run_over,
)
from gpulib.records import UNRECOVERED_KEY
from gpulib.state import Allocation, State, StateStore

# The version of `gpulib status --json`'s document: raised when a key changes
# meaning or goes (new keys do not raise it).
STATUS_SCHEMA = 1


@click.command("status")
@json_option
@click.pass_obj
def status(env: Env, as_json: bool) -> None:
    """Devices, profiles, pools and allocations: who holds what."""
    from gpulib import pools

    store = open_store(env.ctx, env.config)
    state = store.load()
    repair = None
    if store.corrupt_reason is not None:
        # Never show a corrupt file as an empty state: repair it now (what
        # the next hook would do) and say what happened.
        state, repair = _repair(store)
    inv = discover_host(env.ctx, env.config, state=state, learn=False)
    clock = boot_clock(env.ctx)
    liveness = Liveness(env.ctx.sysfs)
    arrival_grace = env.config.get_float("release", "arrival_timeout")
    doc: dict[str, Any] = {
        "schema": STATUS_SCHEMA,
        "gpus": [report.gpu_document(g) for g in inv.gpus],
        "pools": pools.members(env.config, state, inv.occupancy),
        "allocations": {vm: {"status": a.status, "since": a.since, "domain_uuid": a.domain_uuid,
                             "boot_id": a.boot_id, "boot": _boot_of(a, clock),
                             "run": _run_of(a, liveness, clock, arrival_grace),
                             "devices": [{"kind": d.kind, "id": d.id, "on_demand": d.on_demand}
                                         for d in a.devices]}
                        for vm, a in sorted(state.allocations.items())},
        "unmanaged": sorted(state.unmanaged),
    }
    if repair is not None:
        doc["state_repair"] = repair
        click.echo(f"gpulib: warning: {repair['message']}", err=True)
    lost = state.extra.get(UNRECOVERED_KEY)
    if isinstance(lost, list) and lost:
        # The state was rebuilt from the host alone: what it could not know.
        doc["state_unrecovered"] = [str(line) for line in lost]
    if as_json:
        emit_json(doc)
        return
    click.echo(report.table(inv), nl=False)
    click.echo("")
    click.echo("Pools:" if doc["pools"] else "Pools: none declared")
    for name, items in doc["pools"].items():
        used = sum(1 for i in items if i["vm"])
        click.echo(f"  {name}: {len(items)} members, {used} in use")
    click.echo("Allocations:" if doc["allocations"] else "Allocations: none")
    for vm, a in doc["allocations"].items():
        devs = ", ".join(f"{d['kind']} {d['id']}" for d in a["devices"])
        click.echo(f"  {vm} ({a['status']} since {a['since']}, {a['boot']}): {devs}")
        click.echo(f"    {a['run']['words']}")
    if doc["unmanaged"]:
        click.echo("Unmanaged: " + ", ".join(doc["unmanaged"]))
    if doc.get("state_unrecovered"):
        click.echo("State rebuilt from the host; not recovered:")
        for line in doc["state_unrecovered"]:
            click.echo(f"  {line}")


# What an allocation's run is, as the hooks judge it (liveness.run_over): the
# key `status --json` gives, and the words the text gives.
_OVER_WORDS = {
    STOPPED: "over: its stop did not complete, the VM no longer runs",
    EARLIER_BOOT: "over: made in an earlier boot, the VM does not run",
    ABANDONED_ARRIVAL: "over: a live migration libvirt abandoned",
    EXPIRED_START: "over: a start libvirt never launched, past its grace",
}


def _run_of(alloc: Allocation, liveness: Liveness, clock: tuple[Optional[str], float],
            arrival_grace: float) -> dict[str, Any]:
    """The run an allocation belongs to: running, starting, arriving, or over
    (and why: what the next hook releases)."""
    why = run_over(alloc, liveness, clock, arrival_grace=arrival_grace)
    if why is not None:
        return {"state": "over", "why": why,
                "words": f"{_OVER_WORDS.get(why, why)}; the next hook releases it"}
    if alloc.status == "active":
        return {"state": "running", "why": None, "words": "running"}
    if alloc.arriving:
        return {"state": "arriving", "why": None,
                "words": "arriving: a live migration libvirt has not prepared yet"}
    if liveness.is_running(alloc.vm, alloc.domain_uuid):
        return {"state": "running", "why": None,
                "words": "running: its onStart has not come yet"}
    return {"state": "starting", "why": None,
            "words": ("starting: libvirt prepared it, QEMU does not run yet" if alloc.prepared
                      else "starting: libvirt has not launched the VM yet")}


def _boot_of(alloc: Allocation, clock: tuple[Optional[str], float]) -> str:
    """In which boot an allocation was made, in words."""
    if alloc.boot_id is None and alloc.uptime is None:
        return "boot unknown"
    if from_other_boot(alloc, clock):
        return f"an earlier boot ({alloc.boot_id or 'unknown id'})"
    return "this boot"


def _repair(store: StateStore) -> tuple[State, dict[str, Any]]:
    """Move a corrupt state file aside and rebuild it; the state and what was done."""
    reason = store.corrupt_reason
    path = store.state_path
    try:
        with store.transaction() as state:
            pass
    except GpulibError as exc:
        return State(), {"corrupt": reason, "moved_to": None, "rebuilt": None,
                         "message": f"state file {path} is corrupt ({reason}) and could not be "
                                    f"repaired: {exc.message}; showing the host without "
                                    "gpulib's records"}
    repair = store.last_repair
    if repair is None:  # another gpulib process repaired it meanwhile
        return state, {"corrupt": reason, "moved_to": None, "rebuilt": None,
                       "message": f"state file {path} was corrupt ({reason}); another gpulib "
                                  "process has repaired it meanwhile"}
    return state, {"corrupt": repair.reason, "moved_to": repair.moved_to,
                   "rebuilt": {"vgpus": sorted(repair.rebuilt.vgpus),
                               "vf_types": sorted(repair.rebuilt.vf_types),
                               "allocations": sorted(repair.rebuilt.allocations)},
                   "message": f"state file {path} was corrupt ({repair.reason}): " +
                              (f"moved it to {repair.moved_to} and " if repair.moved_to
                               else "") + f"rebuilt it: {repair.summary()}"}
