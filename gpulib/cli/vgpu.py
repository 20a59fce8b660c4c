"""`gpulib mdev ...` and `gpulib vf ...`: vGPUs by hand."""

from __future__ import annotations

from typing import Optional

import click

from gpulib import mdev, mdevctl, nvidia, report, validate
from gpulib.cli.common import Env, Group, emit_json, json_option
from gpulib.definitions import follow_definitions, plan_definition, save_definition
from gpulib.errors import DeviceError, GpulibError, InputError
from gpulib.lifecycle import open_store
from gpulib.liveness import running_domains
from gpulib.occupancy import Occupancy
from gpulib.pci import PciAddress, physical_function
from gpulib.records import HANDMADE, is_handmade, pool_of
from gpulib.state import State, VfRecord, VgpuRecord
from gpulib.sysfs import Sysfs


def _occupancy(sysfs: Sysfs, state: State) -> Occupancy:
    return Occupancy.build(sysfs, state, running_domains(sysfs))


def _refuse_held(sysfs: Sysfs, state: State, kind: str, ident: str, force: bool) -> None:
    """A device a VM holds (or a node it conflicts with) is not taken without --force."""
    hold = _occupancy(sysfs, state).holder(ident)
    if hold is None:
        return
    if not force:
        raise click.ClickException(
            f"{kind} {ident} is held by {hold.describe()}"
            + ("" if hold.device == ident else f" (through {hold.device})")
            + f"; stop or release {hold.vm} first, or use --force")
    click.echo(f"warning: taking {kind} {ident} from {hold.describe()} (--force)", err=True)


def _refuse_hands_off(sysfs: Sysfs, state: State, node: str) -> None:
    """An unmanaged device (or one below it) is the administrator's:
    gpulib makes, types, clears and removes nothing of it
    (`Occupancy.hands_off`, ARCHITECTURE.md, Whose a device is)."""
    found = _occupancy(sysfs, state).hands_off(node)
    if found is not None:
        raise DeviceError(f"{found.reason}: gpulib leaves it alone")


@click.group("mdev", cls=Group)
def mdev_group() -> None:
    """Mediated devices (mdev vGPUs): list, types, create, remove."""


@mdev_group.command("types")
@click.option("--parent", help="Only this parent device (PCI address).")
@json_option
@click.pass_obj
def mdev_types(env: Env, parent: Optional[str], as_json: bool) -> None:
    """List the mdev types each parent offers, with instances left, and the
    types NVIDIA vendor-specific VFs can take (numbers from nvidia-smi)."""
    sysfs = env.ctx.sysfs
    wanted = PciAddress.parse(parent) if parent is not None else None
    parents = [wanted] if wanted is not None else mdev.list_parents(sysfs)
    rows: list[dict[str, object]] = []
    for p in parents:
        if wanted is not None and not mdev.is_parent(sysfs, p):
            continue  # a vendor VF, listed below
        for t in mdev.list_types(sysfs, p):
            d = t.description
            rows.append({"parent": str(p), "kind": "mdev", "type_id": t.type_id, "name": t.name,
                         "available_instances": t.available_instances,
                         "max_instances": d.max_instance, "framebuffer_mb": d.framebuffer_mb,
                         "num_heads": d.num_heads,
                         "max_resolution": f"{d.max_resolution[0]}x{d.max_resolution[1]}"
                         if d.max_resolution else None,
                         "device_api": t.device_api, "description": t.description_text})
    rows += _vendor_vf_types(env, wanted)
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo(f"{wanted} offers no vGPU types" if wanted is not None else
                   "no vGPU types on this host: no device offers mdev types and no NVIDIA "
                   "vendor-specific VF can take a vGPU type")
        return
    table = [("PARENT", "KIND", "TYPE", "NAME", "AVAILABLE", "MAX", "FRAMEBUFFER")]
    for r in rows:
        fb = r["framebuffer_mb"]
        table.append((str(r["parent"]), str(r["kind"]), str(r["type_id"]), str(r["name"] or "-"),
                      str(r["available_instances"]), _or_dash(r["max_instances"]),
                      f"{fb} MB" if fb is not None else "-"))
    for line in report.columns(table):
        click.echo(line)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _vendor_vf_types(env: Env, only: Optional[PciAddress]) -> list[dict[str, object]]:
    """The types NVIDIA vendor-specific VFs can be given now: one row for each
    GPU and type, AVAILABLE the idle VFs that could take it (`Gpu.vendor_vf_types`,
    the count metrics give too; an unmanaged GPU's or VF's count nothing), or
    with `--parent VF` that VF's own types; the numbers NVIDIA's tool's (as
    `gpulib discover` reports them; null without)."""
    from gpulib import nvidiasmi
    from gpulib.hostview import discover_host

    sysfs = env.ctx.sysfs
    one_vf = only if only is not None and physical_function(sysfs, only) is not None else None
    if one_vf is not None and not nvidia.is_vendor_vf(sysfs, one_vf):
        return []
    inventory = discover_host(env.ctx, env.config, learn=False)
    occ = inventory.occupancy
    gpus = [g for g in inventory.gpus if any(vf.nvidia is not None for vf in g.vfs)
            and (only is None or g.address == only
                 or (one_vf is not None and any(vf.address == one_vf for vf in g.vfs)))]
    if not gpus:
        return []
    found = nvidiasmi.numbers(env.ctx.root, [g.address for g in gpus],
                              env.config.get_float("discovery", "nvidia_smi_timeout"))
    for gpu in gpus:
        gpu.nvidia_numbers = found.get(gpu.address, {})
    rows: list[dict[str, object]] = []
    for gpu in gpus:
        hands_off = frozenset(str(vf.address) for vf in gpu.vfs
                              if occ.hands_off(str(vf.address)) is not None)
        if one_vf is not None:
            vf = next(v for v in gpu.vfs if v.address == one_vf)
            types = {tid: (name, 1) for tid, name in
                     (vf.nvidia.creatable.items() if vf.nvidia is not None
                      and str(vf.address) not in hands_off else ())}
        else:
            types = {tid: (name, free) for tid, (name, _typed, _held, free)
                     in gpu.vendor_vf_types(hands_off).items() if free}
        for tid, (name, free) in sorted(types.items()):
            n = found.get(gpu.address, {}).get(tid)
            res = n.max_resolution if n else None
            rows.append({"parent": str(one_vf or gpu.address), "kind": "nvidia-vf",
                         "type_id": str(tid), "name": name, "available_instances": free,
                         "max_instances": n.max_instances if n else None,
                         "framebuffer_mb": n.framebuffer_mb if n else None,
                         "num_heads": n.num_heads if n else None,
                         "max_resolution": f"{res[0]}x{res[1]}" if res else None,
                         "device_api": "vfio-pci", "description": None})
    return rows


@mdev_group.command("list")
@json_option
@click.pass_obj
def mdev_list(env: Env, as_json: bool) -> None:
    """List live mdevs, mdevctl's definitions and the vGPUs gpulib keeps.

    `definition` is the persistent record (mdevctl's: parent, type, start
    policy, attrs; null for a transient vGPU); `pool`, `handmade` (made with
    `mdev create`: kept, never a pool member), `on_demand` and `vm` are
    gpulib's.
    """
    sysfs = env.ctx.sysfs
    state = open_store(env.ctx, env.config).load()
    defs = mdevctl.read_definitions(env.ctx)
    follow_definitions(env.ctx, state, defs, migrate=False)  # a view: nothing written
    live = mdev.live_mdevs(sysfs)
    occ = _occupancy(sysfs, state)
    rows = []
    for uuid in sorted(set(live) | set(state.vgpus) | set(defs)):
        m = live.get(uuid)
        rec = state.vgpus.get(uuid)
        d = defs.get(uuid)
        parent = str(m.parent) if m else d.parent if d else rec.parent if rec else None
        type_id = m.type_id if m else d.type_id if d else rec.type_id if rec else None
        rows.append({"uuid": uuid, "parent": parent, "type_id": type_id,
                     "live": m is not None, "definition": d.as_dict() if d else None,
                     "pool": pool_of(rec) if rec else None,
                     "handmade": rec is not None and is_handmade(rec),
                     "on_demand": rec.on_demand if rec else False,
                     "vm": occ.user("mdev", uuid),
                     "known": rec is not None})
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no vGPUs: none live, none defined for mdevctl, none known to gpulib")
        return
    table = [("UUID", "PARENT", "TYPE", "LIVE", "PERSISTENCE", "POOL", "VM")]
    for r in rows:
        rec = state.vgpus.get(str(r["uuid"]))
        table.append((str(r["uuid"]), str(r["parent"]), str(r["type_id"]),
                      "yes" if r["live"] else "no",
                      _persistence(defs.get(str(r["uuid"])), rec),
                      "by hand" if rec is not None and is_handmade(rec) else str(r["pool"] or "-"),
                      str(r["vm"] or "-")))
    for line in report.columns(table):
        click.echo(line)


def _persistence(definition: Optional[mdevctl.Definition], rec: Optional[VgpuRecord]) -> str:
    """What keeps a vGPU across a reboot, in words."""
    if definition is not None:
        return f"mdevctl {definition.start}"  # started at boot (auto) or by hand (manual)
    if rec is not None and rec.on_demand:
        return "on demand"  # made for its VM's start, destroyed when the VM stops
    if rec is not None:
        # A record from before mdevctl's definitions were the record (the
        # view writes nothing): gpulib defines it at its next change.
        return "gpulib"
    return "none"  # nobody keeps it: gone at the next reboot


@mdev_group.command("create")
@click.option("--parent", required=True, help="Parent device PCI address.")
@click.option("--type", "type_id", required=True, help="mdev type id, e.g. nvidia-232.")
@click.option("--uuid", help="UUID to use (default: a new one).")
@click.option("--keep/--no-keep", default=True,
              help="Define it persistently (an mdevctl definition) so it is restored after "
                   "reboots.")
@click.option("--start", "start", type=click.Choice(mdevctl.START_POLICIES),
              help="Start policy of the definition (default: keep an existing one's, else "
                   "auto).")
@click.option("--attr", "attrs", multiple=True, metavar="NAME=VALUE",
              help="Attribute written after creation, in order; repeat for several. "
                   "Given, it replaces an existing definition's attrs.")
@click.pass_obj
def mdev_create(env: Env, parent: str, type_id: str, uuid: Optional[str], keep: bool,
                start: Optional[str], attrs: tuple[str, ...]) -> None:
    """Create an mdev and print its UUID."""
    address = PciAddress.parse(parent)
    _check_type_given_by_id(env.ctx.sysfs, address, type_id)
    if uuid:
        uuid = validate.check_uuid(uuid)
    pairs = [mdevctl.parse_attr(a) for a in attrs] if attrs else None
    if not keep and start:
        raise click.UsageError("--start is the policy of a definition: not with --no-keep")
    with open_store(env.ctx, env.config).transaction() as state:
        _refuse_hands_off(env.ctx.sysfs, state, str(address))
        follow_definitions(env.ctx, state)
        definition = plan_definition(env.ctx, uuid, str(address), type_id, start, pairs) \
            if keep and uuid else None
        apply = definition.attrs if definition else (pairs or [])
        made = mdev.create(env.ctx.sysfs, address, type_id, uuid, attrs=apply)
        if keep:
            if definition is None:
                definition = mdevctl.Definition(made.uuid, str(address), type_id,
                                                start or "auto", pairs or [])
            try:
                save_definition(env.ctx, definition)
            except GpulibError:
                if not made.already_live:
                    mdev.remove(env.ctx.sysfs, made.uuid)
                raise
            state.vgpus.setdefault(made.uuid, VgpuRecord(str(address), type_id,
                                                              pool=HANDMADE))
    click.echo(made.uuid)
    if made.already_live:
        click.echo(f"mdev {made.uuid} was already live ({type_id} on {address})", err=True)


def _check_type_given_by_id(sysfs: Sysfs, parent: PciAddress, given: str) -> None:
    """`--type` is an mdev type id; a type's name (what `mdev types` and
    CloudStack call the profile) is refused with the id it stands for, or the
    ids of the types whose names contain it."""
    if validate.is_type_id(given) and (not mdev.is_parent(sysfs, parent)
                                       or sysfs.isdir(mdev.MdevType(sysfs, parent, given).rel)):
        return  # an id: offered, or mdev.create says what is wrong
    from gpulib import profiles

    types = mdev.list_types(sysfs, parent) if mdev.is_parent(sysfs, parent) else []
    named = [t for t in types if profiles.same_name(t.name, given)]
    wanted = profiles.key(given)
    like = named or [t for t in types if wanted and t.name and wanted in profiles.key(t.name)]
    if named:
        raise InputError(f"{given!r} is the name of mdev type {named[0].type_id} on {parent}: "
                         f"--type takes the id (--type {named[0].type_id})")
    if like:
        raise InputError(f"{parent} offers no mdev type {given!r}; types whose names contain "
                         "it: " + ", ".join(f"{t.type_id} ({t.name})" for t in like))
    validate.check_type_id(given)


@mdev_group.command("remove")
@click.argument("uuid")
@click.option("--force", is_flag=True, help="Remove even if a VM holds it.")
@click.pass_obj
def mdev_remove(env: Env, uuid: str, force: bool) -> None:
    """Remove an mdev, its mdevctl definition, and forget it."""
    value = validate.check_uuid(uuid)
    with open_store(env.ctx, env.config).transaction() as state:
        rec = state.vgpus.get(value)
        _refuse_hands_off(env.ctx.sysfs, state, value)
        _refuse_held(env.ctx.sysfs, state, "mdev", value, force)
        removed = mdev.remove(env.ctx.sysfs, value)
        undefined = mdevctl.remove_definition(env.ctx, value)
        if rec is not None:
            del state.vgpus[value]
        elif not removed and not undefined:
            raise click.ClickException(f"no mdev {value} (not live, not defined, not known)")
    click.echo(f"removed {value}")


@click.group("vf", cls=Group)
def vf_group() -> None:
    """NVIDIA vendor-specific vGPU types on SR-IOV VFs."""


@vf_group.command("set-type")
@click.argument("address")
@click.argument("type_id", metavar="TYPE")
@click.option("--keep/--no-keep", default=True, help="Record it so restore sets it after reboots.")
@click.pass_obj
def vf_set_type(env: Env, address: str, type_id: str, keep: bool) -> None:
    """Give a VF a vGPU type: the numeric id or the name (case-insensitive) as
    its nvidia/creatable_vgpu_types lists it, e.g. 594 or "NVIDIA A10-6Q"."""
    vf = PciAddress.parse(address)
    tid = nvidia.resolve_type(env.ctx.sysfs, vf, type_id)
    with open_store(env.ctx, env.config).transaction() as state:
        _refuse_hands_off(env.ctx.sysfs, state, str(vf))
        name = nvidia.creatable_types(env.ctx.sysfs, vf).get(tid)
        nvidia.set_type(env.ctx.sysfs, vf, tid)
        if keep:
            state.vf_types[str(vf)] = VfRecord(tid, name, pool=HANDMADE)
    click.echo(f"{vf} now has vGPU type {tid}" + (f" ({name})" if name else ""))


@vf_group.command("clear")
@click.argument("address")
@click.option("--retry", default=5.0, show_default=True, help="Seconds to retry while busy.")
@click.option("--force", is_flag=True, help="Clear even if a VM holds it.")
@click.pass_obj
def vf_clear(env: Env, address: str, retry: float, force: bool) -> None:
    """Clear a VF's vGPU type (write 0) and forget it."""
    vf = PciAddress.parse(address)
    with open_store(env.ctx, env.config).transaction() as state:
        _refuse_hands_off(env.ctx.sysfs, state, str(vf))
        _refuse_held(env.ctx.sysfs, state, "VF", str(vf), force)
        nvidia.clear_type(env.ctx.sysfs, vf, retry_seconds=retry)
        state.vf_types.pop(str(vf), None)
    click.echo(f"{vf} cleared")
