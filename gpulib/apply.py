"""What a start does: the planner's actions carried out through the journal.

The third part of a start (`gpulib.hooks.prepare`): the host's facts were read
(`gpulib.hostfacts`), the pure planner decided (`gpulib.plan`); here
each action becomes the journal's operations (an mdev created again, a VF
given its type, a killed start's vGPU adopted in place), so every sysfs
write is announced first and undone on failure (ARCHITECTURE.md, "The
journal's write-ahead rule"). Nothing here reads or edits the XML: what the
devices look like in the domain is `gpulib.placement`'s.
"""

from __future__ import annotations

from typing import Callable

from gpulib import logger
from gpulib.journal import Journal
from gpulib.occupancy import PENDING, Hold, Occupancy
from gpulib.pci import PciAddress
from gpulib.plan import (
    Action,
    AdoptMdev,
    CreateDerived,
    KeepMdev,
    RecreateMdev,
    RetypeVf,
    UsePci,
    UseVf,
)
from gpulib.state import Device, State, VgpuRecord, utc_now

log = logger.get(__name__)


def apply_named(journal: Journal, vm: str, actions: list[Action],
                create_derived: Callable[[CreateDerived], list[Device]]
                ) -> list[tuple[Action, list[Device]]]:
    """Carry out the plan of the devices the XML names, in its order; each
    action with the devices it made ready. `create_derived` gives an on-demand
    vGPU whose UUID the XML fixes (the allocator's choice of a parent)."""
    out: list[tuple[Action, list[Device]]] = []
    for action in actions:
        if isinstance(action, CreateDerived):
            out.append((action, create_derived(action)))
        elif isinstance(action, RecreateMdev):
            journal.create_mdev(PciAddress.parse(action.parent), action.type_id,
                                action.uuid, action.on_demand, action.attrs)
            log.info("recreated mdev %s (%s on %s) for %s", action.uuid, action.type_id,
                     action.parent, vm)
            out.append((action, [Device("mdev", action.uuid, on_demand=action.on_demand)]))
        elif isinstance(action, KeepMdev):
            on_demand = journal.keep_mdev(action.uuid, action.on_demand)
            out.append((action, [Device("mdev", action.uuid, on_demand=on_demand)]))
        elif isinstance(action, UseVf):
            if action.set_type is not None:
                journal.set_vf_type(PciAddress.parse(action.address), action.set_type,
                                    action.on_demand)
            out.append((action, [Device("vf", action.address, on_demand=action.on_demand)]))
        elif isinstance(action, UsePci):
            out.append((action, [Device("pci", action.address)]))
        else:
            # AddGroupPeer: nothing to make ready; placed beside its GPU in the XML.
            out.append((action, []))
    return out


def apply_kept(journal: Journal, actions: list[Action]) -> None:
    """Make the devices a retried start's VM holds already ready again."""
    for action in actions:
        if isinstance(action, RecreateMdev):
            journal.create_mdev(PciAddress.parse(action.parent), action.type_id,
                                action.uuid, action.on_demand)
        elif isinstance(action, RetypeVf):
            journal.set_vf_type(PciAddress.parse(action.address), action.type_id,
                                action.on_demand)


def apply_adoptions(state: State, occ: Occupancy, journal: Journal, vm: str,
                    actions: list[AdoptMdev]) -> list[Device]:
    """Take over the vGPUs a killed start of this VM made for its request; each
    is held by this VM from now (`occ`), so the request's next choice skips it."""
    out = []
    for action in actions:
        orphan = journal.adopt_mdev(action.uuid)
        if orphan is None:
            continue
        if orphan.on_demand and action.uuid not in state.vgpus:
            state.vgpus[action.uuid] = VgpuRecord(action.parent, action.type_id, None,
                                                  True, utc_now())
        occ.add(Hold(vm, PENDING, action.uuid))
        out.append(Device("mdev", action.uuid, on_demand=orphan.on_demand))
    return out
