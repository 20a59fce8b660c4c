"""A start's plan for the devices a domain names: facts in, actions out.

The Preparer reads what it needs of the host first (`HostFacts`: the named
mdevs, live or recorded, the named PCI functions and their place among the
GPUs) and hands it, with gpulib's state and the occupancy model, to
`plan_named`. That function reads nothing and writes nothing: it validates
and refuses (every refusal of a named device is raised here, before any
sysfs write) and returns the list of typed actions the applier then carries
out through the start's Journal (write-ahead intents, rollback in reverse
order). So the same facts always give the same plan, and the planner can be
tested over random hosts without a filesystem.

Actions:
* `KeepMdev`      a live mdev: nothing to do but record it;
* `RecreateMdev`  a known mdev that is not live (after a reboot): create it
                  on its recorded parent with its recorded type (and attrs);
* `CreateDerived` an on-demand vGPU whose UUID the domain's request derives;
* `UseVf`         an NVIDIA vendor VF (with `set_type` when its type must be
                  set again);
* `UsePci`        a GPU or one of its group peers, passed whole;
* `RetypeVf`      a VF a VM holds (a retried start) that lost its type;
* `AddGroupPeer`  an endpoint of a named GPU's IOMMU group (its HDMI audio,
                  say) the domain does not name: added to the XML beside the
                  GPU, on the GPU's guest slot;
* `AdoptMdev`     a vGPU a killed start of this VM made for its request, still
                  live and of its item's type: taken over in place.

A gpulib metadata request is served by what the VM holds first (`unmet`
decides what is left, from `HeldFacts`; `plan_adoptions` what a killed start
of it left); the rest the allocator
(`gpulib.allocator`) chooses as `AllocateVgpu` / `AllocateVf` / `AllocatePci`,
one instance at a time, each applied before the next is chosen (the next
reads the capacity the last one used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional, Union

from gpulib import logger
from gpulib.domain import GpuRequest, VgpuRequest
from gpulib.errors import DeviceError
from gpulib.occupancy import Occupancy, refusal
from gpulib.pci import BRIDGE_BASE_CLASS

if TYPE_CHECKING:
    from gpulib.state import Device, State

log = logger.get(__name__)


class MdevFacts(NamedTuple):
    """What the host says of one named mdev UUID."""

    live: Optional[tuple[str, str]]  # (parent, type) of the live device
    defined: Optional[tuple[str, str, tuple[tuple[str, str], ...]]]  # mdevctl's record


class PciFacts(NamedTuple):
    """What the host says of one named PCI function."""

    exists: bool
    gpulibs: bool  # a GPU, a GPU's VF, or an endpoint in a GPU's IOMMU group
    physfn: Optional[str]  # the PF of a VF
    vendor_vf_type: Optional[int]  # an NVIDIA vendor VF's current type (0: none)
    # Why the function cannot be given whole: a GPU with declared vGPU use or
    # VFs, a VF carrying vGPUs (mdevs on VFs: live, kept, pooled or allocated).
    whole_refusal: Optional[str]


class PeerFacts(NamedTuple):
    """One other function of a GPU's IOMMU group."""

    address: str
    klass: Optional[int]  # its PCI class code (24 bits); None: unreadable
    why: str  # why the class could not be read ("" when it was)
    listed: bool  # a GPU or a GPU's VF: a device of its own, not a companion


class HostFacts(NamedTuple):
    """The snapshot of the host a plan is made from."""

    mdevs: dict[str, MdevFacts]
    pci: dict[str, PciFacts]
    physfn: dict[str, Optional[str]]  # the PF of each named mdev's parent, when a VF
    # The other functions of the IOMMU group of each display-class function the
    # domain names, read only when group peers are to be added (the
    # transformer, `add_group_functions`); absent: none to add.
    groups: dict[str, tuple[PeerFacts, ...]] = {}


class KeepMdev(NamedTuple):
    uuid: str
    on_demand: bool


class RecreateMdev(NamedTuple):
    uuid: str
    parent: str
    type_id: str
    on_demand: bool
    attrs: tuple[tuple[str, str], ...] = ()


class CreateDerived(NamedTuple):
    uuid: str
    request: VgpuRequest


class UseVf(NamedTuple):
    at: int  # the place of its hostdev among the domain's PCI hostdevs
    address: str
    set_type: Optional[int]  # the recorded type to set again; None: it has one
    on_demand: bool


class UsePci(NamedTuple):
    at: int
    address: str


class AddGroupPeer(NamedTuple):
    """An endpoint of a GPU's IOMMU group that goes to the guest beside it."""

    gpu: str
    address: str


class RetypeVf(NamedTuple):
    """An NVIDIA vendor VF a VM holds that lost its vGPU type: given it again."""

    address: str
    type_id: int
    on_demand: bool


class AdoptMdev(NamedTuple):
    """A vGPU a killed start of this VM created for its request: taken over in
    place, not removed and created again."""

    uuid: str
    parent: str
    type_id: str


Action = Union[KeepMdev, RecreateMdev, CreateDerived, UseVf, UsePci, AddGroupPeer, RetypeVf,
               AdoptMdev]


def unmanaged(state: State, facts: HostFacts, address: str) -> bool:
    """An unmanaged device (or a VF or vGPU parent of an unmanaged GPU)."""
    if address in state.unmanaged:
        return True
    pci = facts.pci.get(address)
    pf = pci.physfn if pci is not None else facts.physfn.get(address)
    return pf is not None and pf in state.unmanaged


class Refusals:
    """Where a device another VM holds is refused (or only warned about)."""

    def __init__(self, occ: Occupancy, vm: str, strict: bool = True) -> None:
        self.occ = occ
        self.vm = vm
        self.strict = strict

    def check(self, kind: str, ident: str) -> None:
        self._judge(refusal(self.occ, kind, ident, self.vm))

    def check_holds(self, kind: str, ident: str) -> None:
        """Only whether another VM holds it: for the administrator's
        unmanaged devices, which a start may name but gpulib neither makes
        nor records (hands-off, not blind)."""
        self._judge(refusal(self.occ, kind, ident, self.vm, holds_only=True))

    def _judge(self, message: Optional[str]) -> None:
        if message is None:
            return
        if self.strict:
            raise DeviceError(message)
        log.warning("%s: %s (refuse_in_use = no: starting anyway)", self.vm, message)


def plan_named(facts: HostFacts, state: State, refusals: Refusals, uuids: list[str],
               addresses: list[str], derived: dict[str, VgpuRequest]) -> list[Action]:
    """The actions that make the named devices ready; raises on any refusal.

    `uuids`/`addresses`: the domain's mdev and PCI hostdevs, validated;
    `derived`: the UUIDs the domain's request derives, with the vGPU each is.
    Reads only its arguments (the occupancy's tree included) and changes
    nothing but `refusals.occ.tree`'s record of a recreated mdev's parent.
    """
    actions: list[Action] = []
    tree = refusals.occ.tree
    for uuid in uuids:
        rec = state.vgpus.get(uuid)
        seen = facts.mdevs[uuid]
        source: Optional[tuple[str, str]] = None
        attrs: tuple[tuple[str, str], ...] = ()
        if seen.live is None:
            # The mdevctl definition is the record of a persistent vGPU (the
            # operator may have changed it); gpulib's own, of a transient one.
            if seen.defined is not None:
                source = (seen.defined[0], seen.defined[1])
                attrs = seen.defined[2]
            elif rec is not None:
                source = (rec.parent, rec.type_id)
            elif uuid in derived:
                actions.append(CreateDerived(uuid, derived[uuid]))
                continue
            else:
                raise DeviceError(
                    f"mdev {uuid} does not exist and gpulib has no record of its "
                    "parent and type (create it with gpulib mdev create)")
            tree.mdev_parents.setdefault(uuid, source[0])
            tree.mdev_types.setdefault(uuid, source[1])
        parent = seen.live[0] if seen.live is not None else source[0] if source else None
        # Unmanaged is hands-off, not blind: a device another VM holds is still
        # refused; gpulib only makes and records nothing of it (the
        # administrator's: `Occupancy.hands_off`, ARCHITECTURE.md, Whose a device is).
        if state.unmanaged and parent is not None and unmanaged(state, facts, parent):
            refusals.check_holds("mdev", uuid)
            log.info("%s: mdev %s is on unmanaged %s: left alone", refusals.vm, uuid, parent)
            continue
        refusals.check("mdev", uuid)
        on_demand = bool(rec and rec.on_demand)
        if source is None:
            actions.append(KeepMdev(uuid, on_demand))
        else:
            actions.append(RecreateMdev(uuid, source[0], source[1], on_demand, attrs))
    named = set(addresses)
    for at, addr in enumerate(addresses):
        pci = facts.pci[addr]
        if not pci.exists:
            raise DeviceError(f"PCI device {addr} does not exist on this host")
        if not pci.gpulibs:
            log.debug("%s: PCI device %s is not a GPU: not gpulib's", refusals.vm, addr)
            continue
        # The occupancy's IOMMU-group index covers the companions added later.
        # An unmanaged device is checked too (hands-off, not blind).
        if state.unmanaged and unmanaged(state, facts, addr):
            refusals.check_holds("pci", addr)
            log.info("%s: PCI device %s is unmanaged: left alone", refusals.vm, addr)
            continue
        refusals.check("pci", addr)
        if pci.vendor_vf_type is not None:
            vrec = state.vf_types.get(addr)
            if not pci.vendor_vf_type and vrec is None:
                raise DeviceError(f"NVIDIA VF {addr} has no vGPU type and gpulib has no "
                                  "record of one (set it with gpulib vf set-type)")
            set_type = vrec.type_id if not pci.vendor_vf_type and vrec is not None else None
            actions.append(UseVf(at, addr, set_type, bool(vrec and vrec.on_demand)))
            continue
        if pci.whole_refusal is not None:
            what = "VF" if pci.physfn is not None else "GPU"
            raise DeviceError(f"{what} {addr} cannot be given whole: {pci.whole_refusal}")
        actions.append(UsePci(at, addr))
        members = facts.groups.get(addr)
        if members:
            peers = plan_group_peers(addr, members, named, refusals)
            named.update(p.address for p in peers)
            actions += peers
    return actions


def plan_group_peers(gpu: str, members: tuple[PeerFacts, ...], named: set[str],
                     refusals: Optional[Refusals]) -> list[AddGroupPeer]:
    """The endpoints of `gpu`'s IOMMU group that go with it, in address order.

    `named`: the PCI functions the domain has already (never added twice);
    `refusals`: None only where nobody's holds are known (an offline edit).
    A peer whose class cannot be read is an error, not a guess: a bridge must
    never go to a guest.
    """
    out = []
    for m in members:
        if m.address == gpu or m.address in named:
            continue
        if m.klass is None:
            raise DeviceError(
                f"cannot read the PCI class of {m.address}, in the IOMMU group of {gpu}: "
                f"{m.why} (set add_group_functions = no in [transformer] of gpulib.conf to "
                "pass the GPU without its group)")
        if m.klass >> 16 == BRIDGE_BASE_CLASS:
            continue  # bridges stay with the host; only endpoints go along
        if m.listed:
            # Another GPU (or a GPU's VF) of a shared group is a device of its
            # own that the agent tracks and may give to no one else while this
            # VM runs (the occupancy's group index), not a companion to hand over.
            continue
        if refusals is not None:
            refusals.check("pci", m.address)
        out.append(AddGroupPeer(gpu, m.address))
    # Canonical addresses (fixed-width lowercase hex) sort in address order.
    return sorted(out, key=lambda p: p.address)


def new_work(actions: list[Action]) -> list[Action]:
    """The actions that change the host (a plan of only these is a no-op)."""
    return [a for a in actions if isinstance(a, (RecreateMdev, CreateDerived, AddGroupPeer,
                                                 RetypeVf)) or
            (isinstance(a, UseVf) and a.set_type is not None)]


def plan_kept(devices: list[Device], state: State, live: set[str], typed: set[str]
              ) -> list[Action]:
    """What makes ready again the devices a VM holds and asks for again (a
    retried start): a vGPU gpulib records that is not live (a reboot, a hand
    removal) is created again, a VF that lost its recorded type gets it back,
    so a VM is never handed a vGPU that is not there.

    `live`: the recorded vGPUs among them that are live; `typed`: the recorded
    VFs among them that have a type.
    """
    out: list[Action] = []
    for d in devices:
        rec = state.vgpus.get(d.id) if d.kind == "mdev" else None
        if rec is not None and d.id not in live:
            out.append(RecreateMdev(d.id, rec.parent, rec.type_id, rec.on_demand))
        rec_v = state.vf_types.get(d.id) if d.kind == "vf" else None
        if rec_v is not None and d.id not in typed:
            out.append(RetypeVf(d.id, rec_v.type_id, rec_v.on_demand))
    return out


class HeldFacts(NamedTuple):
    """One device a VM holds (named or kept), as a request sees it: at most one
    of the three is set (none: it serves nothing, a group peer say)."""

    id: str
    mdev_type: Optional[tuple[str, Optional[str]]] = None  # a vGPU's type id and name
    vf_type: Optional[tuple[int, Optional[str]]] = None  # an NVIDIA VF's type id and name
    gpu: Optional[tuple[int, int, str]] = None  # a whole GPU's vendor, device, name


def unmet(request: GpuRequest, derived: dict[str, int], held: list[HeldFacts]) -> GpuRequest:
    """What of `request` the devices a VM holds do not serve yet.

    `derived`: the UUIDs the domain's request derives, with the index of the
    item each serves. Any other held vGPU or VF serves the first item of its
    type with room left, a whole GPU the first passthrough item of its model.
    So a domain that holds what it asks for asks for nothing more.
    """
    left = [item.count for item in request.items]
    for d in held:
        fits: list[int] = []
        if d.id in derived:
            fits = [derived[d.id]]
        elif d.mdev_type is not None:
            tid, name = d.mdev_type
            fits = [i for i, item in enumerate(request.items)
                    if isinstance(item, VgpuRequest) and item.matches_type(tid, name)]
        elif d.vf_type is not None:
            vtid, vname = d.vf_type
            fits = [i for i, item in enumerate(request.items)
                    if isinstance(item, VgpuRequest) and vtid and
                    item.matches_vendor(vtid, vname)]
        elif d.gpu is not None:
            vendor, device, model = d.gpu
            fits = [i for i, item in enumerate(request.items)
                    if not isinstance(item, VgpuRequest) and
                    item.matches_device(vendor, device, model)]
        for i in fits:
            if left[i] > 0:
                left[i] -= 1
                break
    return GpuRequest(tuple(item._replace(count=n)
                            for item, n in zip(request.items, left) if n > 0))


class OrphanFacts(NamedTuple):
    """A live mdev whose write-ahead intent a killed start of this VM left."""

    parent: str
    type_id: str
    type_name: Optional[str]


def plan_adoptions(derived: dict[str, VgpuRequest], have: set[str],
                   orphans: dict[str, OrphanFacts]) -> list[AdoptMdev]:
    """The orphans a retried start takes over for its request.

    `derived`: the UUIDs the request derives, each with the item it serves (in
    the request's order); `have`: what the VM holds already (named or kept);
    `orphans`: the live mdevs of this VM's killed start, by UUID. An orphan is
    adopted when its UUID is one the request derives, the VM does not hold it
    yet, and its type serves that UUID's item: so a retry ends with the very
    devices the killed start made. Any other orphan is left to be settled.
    """
    out = []
    for uuid, item in derived.items():
        found = orphans.get(uuid)
        if uuid in have or found is None or not item.matches_type(found.type_id,
                                                                   found.type_name):
            continue
        out.append(AdoptMdev(uuid, found.parent, found.type_id))
    return out
