"""`gpulib device`: which devices gpulib manages (unmanaged ones are the
administrator's: gpulib creates, types and gives nothing of them)."""

from __future__ import annotations

from typing import Any

import click

from gpulib import report
from gpulib.cli.common import Env, Group, emit_json, json_option
from gpulib.errors import GpulibError
from gpulib.hostview import discover_host
from gpulib.lifecycle import open_store
from gpulib.pci import PciAddress
from gpulib.state import State


@click.group("device", cls=Group)
def device_group() -> None:
    """Devices gpulib may allocate (unmanaged ones are never touched)."""


@device_group.command("list")
@json_option
@click.pass_obj
def device_list(env: Env, as_json: bool) -> None:
    """GPUs and VFs with their managed flag."""
    state = open_store(env.ctx, env.config).load()
    inv = discover_host(env.ctx, env.config, state=state, learn=False)
    rows: list[dict[str, Any]] = []
    for g in inv.gpus:
        rows.append({"address": str(g.address), "kind": "gpu", "device": g.device_name,
                     "managed": str(g.address) not in state.unmanaged, "used_by": g.used_by})
        for vf in g.vfs:
            rows.append({"address": str(vf.address), "kind": "vf", "device": vf.device_name,
                         "managed": str(vf.address) not in state.unmanaged
                         and str(g.address) not in state.unmanaged, "used_by": vf.used_by})
    if as_json:
        emit_json(rows)
        return
    # The flag keeps one width whether or not any device is unmanaged.
    for line in report.columns([
            (r["address"], r["kind"], "managed  " if r["managed"] else "UNMANAGED", r["device"])
            for r in rows]):
        click.echo(line)


def _set_managed(env: Env, address: str, managed: bool, force: bool = False) -> None:
    addr = str(PciAddress.parse(address))
    if not env.ctx.sysfs.exists(f"sys/bus/pci/devices/{addr}"):
        raise click.ClickException(f"no PCI device {addr} on this host")
    with open_store(env.ctx, env.config).transaction() as state:
        if managed:
            state.unmanaged.discard(addr)
        else:
            holds = _holds_in_tree(env, state, addr)
            if holds and not force:
                h = holds[0]
                raise GpulibError(f"{addr} is held by {h.describe()} ({h.device}): refusing to "
                                  "unmanage it while a VM holds any part of it (use --force "
                                  "to do it anyway)")
            if holds:
                click.echo(f"gpulib: warning: {addr} is held by {holds[0].describe()}: "
                           "unmanaged anyway (--force); gpulib still refuses starts that "
                           "conflict with it", err=True)
            state.unmanaged.add(addr)
    click.echo(f"{addr} {'managed' if managed else 'unmanaged'}")


def _holds_in_tree(env: Env, state: State, addr: str) -> list[Any]:
    """Who holds the device, its VFs or the vGPUs on either (or its IOMMU group)."""
    from gpulib.liveness import running_domains
    from gpulib.occupancy import Occupancy

    occ = Occupancy.build(env.ctx.sysfs, state, running_domains(env.ctx.sysfs),
                          arrival_grace=env.config.get_float("release", "arrival_timeout"))
    return occ.conflicts(addr)


@device_group.command("manage")
@click.argument("address")
@click.pass_obj
def device_manage(env: Env, address: str) -> None:
    """Let gpulib allocate and pool this device again."""
    _set_managed(env, address, True)


@device_group.command("unmanage")
@click.argument("address")
@click.option("--force", is_flag=True, help="Unmanage it even while a VM holds part of it.")
@click.pass_obj
def device_unmanage(env: Env, address: str, force: bool) -> None:
    """Never allocate or pool this device (or the VFs and vGPUs of this GPU);
    refused while a VM holds any of them, unless --force."""
    _set_managed(env, address, False, force)
