"""mdevctl's definitions as the record of gpulib's persistent vGPUs.

The persistent record of a vGPU (parent, type, start policy, attrs) is its
mdevctl definition; gpulib's state keeps only what mdevctl has no field for
(pool, on-demand, owner). A state written before definitions were the record
carries no marker: its persistent vGPUs get definitions once, then the state
follows the definitions.

Below the lifecycle and the pools, which both follow the definitions
(ARCHITECTURE.md, Layers).
"""

from __future__ import annotations

from gpulib import logger
from gpulib.errors import GpulibError, InputError
from gpulib.outcome import Outcome
from gpulib.records import pool_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib import mdevctl
    from gpulib.context import Context
    from gpulib.records import State, VgpuRecord

log = logger.get(__name__)

DEFINITIONS_MARKER = "vgpu_definitions"


def _held_by(state: State, uuid: str) -> Optional[str]:
    for vm, alloc in state.allocations.items():
        if any(d.kind == "mdev" and d.id == uuid for d in alloc.devices):
            return vm
    return None


def definition_for(rec: VgpuRecord, uuid: str) -> mdevctl.Definition:
    from gpulib import mdevctl

    return mdevctl.Definition(uuid, rec.parent, rec.type_id, "auto")


def follow_definitions(ctx: Context, state: State,
                       defs: Optional[dict[str, mdevctl.Definition]] = None,
                       migrate: bool = True) -> list[Outcome]:
    """Bring the state's persistent vGPU records in line with mdevctl's definitions.

    An undefined vGPU is forgotten (a pool then counts one member less and
    `pool apply` makes another); a changed type or parent is taken over.
    On-demand vGPUs are transient and have no definition. A state from before
    definitions were the record first gets definitions for its persistent
    vGPUs; with `migrate` False (a read-only listing) it is left as it is.
    """
    from gpulib import mdevctl

    defs = mdevctl.read_definitions(ctx) if defs is None else defs
    out: list[Outcome] = []
    if state.extra.get(DEFINITIONS_MARKER) != "mdevctl":
        if not migrate:
            return out
        ok = True
        for uuid, rec in sorted(state.vgpus.items()):
            if rec.on_demand or rec.remembered or uuid in defs:
                continue
            d = definition_for(rec, uuid)
            try:
                mdevctl.write_definition(ctx, d)
            except (OSError, InputError) as exc:
                ok = False
                out.append(Outcome("mdev", uuid, "define for mdevctl", False, str(exc)))
                continue
            defs[uuid] = d
            out.append(Outcome("mdev", uuid, "defined for mdevctl", True,
                               f"{rec.type_id} on {rec.parent}"))
        if not ok:
            return out  # try again next time; forget nothing meanwhile
        state.extra[DEFINITIONS_MARKER] = "mdevctl"
    for uuid, rec in sorted(state.vgpus.items()):
        found = defs.get(uuid)
        if rec.on_demand or (rec.remembered and found is None):
            # (A vGPU made outside gpulib is remembered, not defined: its
            # record is not mdevctl's to end.)
            continue
        if found is None:
            del state.vgpus[uuid]
            holder = _held_by(state, uuid)
            log.info("mdev %s was undefined in mdevctl: gpulib forgets it%s", uuid,
                     f" (VM {holder} still holds it until it stops)" if holder else "")
            out.append(Outcome("mdev", uuid, "forgotten", True,
                               "its mdevctl definition is gone" + (f"; pool {pool_of(rec)} "
                                                                    "needs another member"
                                                                    if pool_of(rec) else "")))
        elif (rec.parent, rec.type_id) != (found.parent, found.type_id):
            log.info("mdev %s follows its mdevctl definition: %s on %s (was %s on %s)", uuid,
                     found.type_id, found.parent, rec.type_id, rec.parent)
            rec.parent, rec.type_id = found.parent, found.type_id
    return out


def plan_definition(ctx: Context, uuid: str, parent: str, type_id: str,
                    start: Optional[str] = None,
                    attrs: Optional[list[tuple[str, str]]] = None) -> mdevctl.Definition:
    """The definition a persistent vGPU should have, keeping what the operator set.

    An existing definition keeps its start policy and attrs unless `start` or
    `attrs` is given. A UUID defined on another parent, or as another type, is
    refused with both named. Nothing is written.
    """
    from gpulib import mdevctl

    old = mdevctl.read_definition(ctx, uuid)
    if old is None:
        return mdevctl.Definition(uuid, parent, type_id, start or "auto", attrs or [])
    if old.parent != parent:
        raise InputError(f"mdev {uuid} is defined on parent {old.parent}; refusing to define "
                         f"it on {parent} too (undefine it there first: "
                         f"mdevctl undefine -u {uuid})")
    if old.type_id != type_id:
        raise InputError(f"mdev {uuid} is defined as {old.type_id} on {parent}, not "
                         f"{type_id} (change it with: mdevctl modify -u {uuid} -t {type_id})")
    return mdevctl.Definition(uuid, parent, type_id, start or old.start,
                              old.attrs if attrs is None else attrs, old.extra)


def save_definition(ctx: Context, d: mdevctl.Definition) -> None:
    """Write a definition unless the file already says the same."""
    from gpulib import mdevctl

    if mdevctl.read_definition(ctx, d.uuid) == d:
        return
    try:
        mdevctl.write_definition(ctx, d)
    except OSError as exc:
        raise GpulibError(f"cannot write the mdevctl definition of {d.uuid}: "
                          f"{exc.strerror or exc}") from None
