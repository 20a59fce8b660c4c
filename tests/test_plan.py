"""The start's planner (gpulib.plan) over random hosts: pure, so no filesystem.

A host here: PFs with an audio function (and a bridge) in their IOMMU group
and VFs (each in its own group), mdevs on PFs and VFs (live, recorded, defined by mdevctl,
or derived from the domain's request), NVIDIA vendor VFs with or without a
type; another VM holding random nodes (pending or active)."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpulib.domain import GpuRequest, PassthroughRequest, VgpuRequest
from gpulib.errors import DeviceError
from gpulib.occupancy import ACTIVE, PENDING, Blocked, Hold, Occupancy, Tree
from gpulib.plan import (
    Action,
    AddGroupPeer,
    CreateDerived,
    HeldFacts,
    HostFacts,
    KeepMdev,
    MdevFacts,
    OrphanFacts,
    PciFacts,
    PeerFacts,
    RecreateMdev,
    Refusals,
    RetypeVf,
    UsePci,
    UseVf,
    new_work,
    plan_adoptions,
    plan_kept,
    plan_named,
    unmet,
)
from gpulib.state import Allocation, Device, State, VfRecord, VgpuRecord

VM = "vm-a"
OTHER = "vm-b"
PFS = [f"0000:0{x}:00.0" for x in (1, 2, 3)]
AUDIO = {pf: pf[:-1] + "1" for pf in PFS}
BRIDGE = {pf: f"0000:00:0{pf[6]}.0" for pf in PFS}  # the root port of each PF's group
VFS = {pf: [f"{pf[:8]}01.{n}" for n in range(3)] for pf in PFS}
PHYSFN = {vf: pf for pf in PFS for vf in VFS[pf]}
GROUPS = {**{pf: i for i, pf in enumerate(PFS)}, **{AUDIO[pf]: i for i, pf in enumerate(PFS)},
          **{BRIDGE[pf]: i for i, pf in enumerate(PFS)},
          **{vf: 100 + i for i, vf in enumerate(PHYSFN)}}
PARENTS = PFS + list(PHYSFN)
UUIDS = [f"{n:08x}-0000-4000-8000-000000000000" for n in range(1, 7)]
TYPE = "nvidia-231"


class FactsTree(Tree):
    """The occupancy's tree from the facts, not from sysfs."""

    def __init__(self, mdev_parents: dict[str, str]) -> None:
        super().__init__(None, mdev_parents)  # type: ignore[arg-type]

    def parent(self, node: str) -> Optional[str]:
        if node.count(":") != 2:
            return self.mdev_parents.get(node)
        return PHYSFN.get(node)

    def group(self, node: str) -> Optional[int]:
        return GROUPS.get(node)

    def blocked(self, node: str) -> Optional[Blocked]:
        return None  # these facts do not model a GPU's capacity: every type fits


def _chain(node: str, parents: dict[str, str]) -> list[str]:
    out = [node]
    while True:
        up = parents.get(out[-1]) or PHYSFN.get(out[-1])
        if up is None:
            return out
        out.append(up)


def _conflict(a: str, b: str, parents: dict[str, str]) -> bool:
    """The ownership rule of ARCHITECTURE.md, written out plainly."""
    if a in _chain(b, parents) or b in _chain(a, parents):
        return True
    return a.count(":") == 2 and b.count(":") == 2 and GROUPS.get(a) == GROUPS.get(b)


@st.composite
def hosts(draw: Any) -> tuple[HostFacts, State, list[str], list[str], dict[str, VgpuRequest],
                              list[Hold]]:
    state = State()
    mdevs: dict[str, MdevFacts] = {}
    derived: dict[str, VgpuRequest] = {}
    uuids = draw(st.lists(st.sampled_from(UUIDS), unique=True, max_size=4))
    for u in uuids:
        parent = draw(st.sampled_from(PARENTS))
        live = (parent, TYPE) if draw(st.booleans()) else None
        defined = (parent, TYPE, ()) if draw(st.booleans()) else None
        if draw(st.booleans()):
            state.vgpus[u] = VgpuRecord(parent, TYPE, None, draw(st.booleans()), "x")
        if draw(st.booleans()):
            derived[u] = VgpuRequest(None, TYPE)
        mdevs[u] = MdevFacts(live, defined)
    addresses = draw(st.lists(st.sampled_from(PFS + list(AUDIO.values()) + list(PHYSFN)),
                              unique=True, max_size=4))
    pci: dict[str, PciFacts] = {}
    groups: dict[str, tuple[PeerFacts, ...]] = {}
    for a in addresses:
        vendor = draw(st.sampled_from([None, 0, 558])) if a in PHYSFN else None
        if vendor is not None and draw(st.booleans()):
            state.vf_types[a] = VfRecord(558, None, None, draw(st.booleans()))
        why = draw(st.sampled_from([None, "it carries 1 vGPU(s)"])) if a in PFS else None
        pci[a] = PciFacts(True, True, PHYSFN.get(a), vendor, why)
        if a in PFS and draw(st.booleans()):
            # What the applier reads of the group (the functions the domain
            # names aside); now and then the audio function's class is unreadable.
            audio_class = draw(st.sampled_from([0x040300, 0x040300, None]))
            groups[a] = tuple(m for m in (
                PeerFacts(BRIDGE[a], 0x060400, "", False),
                PeerFacts(AUDIO[a], audio_class, "" if audio_class else "EIO", False))
                if m.address not in addresses)
    nodes = PARENTS + list(AUDIO.values()) + UUIDS
    holds = [Hold(OTHER, draw(st.sampled_from([PENDING, ACTIVE])), n)
             for n in draw(st.lists(st.sampled_from(nodes), unique=True, max_size=3))]
    return HostFacts(mdevs, pci, {}, groups), state, uuids, addresses, derived, holds


def _occupancy(facts: HostFacts, state: State, holds: list[Hold]) -> Occupancy:
    parents = {u: r.parent for u, r in state.vgpus.items()}
    parents.update({u: f.live[0] for u, f in facts.mdevs.items() if f.live is not None})
    occ = Occupancy(FactsTree(parents))
    for h in holds:
        occ.add(h)
    for vm, alloc in state.allocations.items():
        for d in alloc.devices:
            occ.add(Hold(vm, alloc.status, d.id))
    return occ


def _device(action: Any) -> str:
    return str(action.uuid if hasattr(action, "uuid") else action.address)


def _plan(facts: HostFacts, state: State, holds: list[Hold], uuids: list[str],
          addresses: list[str], derived: dict[str, VgpuRequest]
          ) -> tuple[Occupancy, Optional[list[Action]]]:
    """The occupancy of the facts, and the plan (None: refused)."""
    occ = _occupancy(facts, state, holds)
    try:
        return occ, plan_named(facts, state, Refusals(occ, VM), uuids, addresses, derived)
    except DeviceError:
        return occ, None


@settings(max_examples=300, deadline=None)
@given(host=hosts())
def test_never_plans_a_device_another_vm_holds(host: Any) -> None:
    facts, state, uuids, addresses, derived, holds = host
    occ, actions = _plan(facts, state, holds, uuids, addresses, derived)
    if actions is None:
        return
    parents = dict(occ.tree.mdev_parents)
    for action in actions:
        if isinstance(action, CreateDerived):
            continue  # a new vGPU: the allocator picks a parent nobody holds
        device = _device(action)
        assert not any(_conflict(device, h.device, parents) for h in holds), (action, holds)


@settings(max_examples=300, deadline=None)
@given(host=hosts())
def test_planning_its_own_output_again_plans_nothing_new(host: Any) -> None:
    facts, state, uuids, addresses, derived, holds = host
    _, first = _plan(facts, state, holds, uuids, addresses, derived)
    if first is None:
        return
    # Apply the plan to the facts and the state, as the applier would.
    mdevs = dict(facts.mdevs)
    pci = dict(facts.pci)
    named = list(addresses)
    devices = []
    for action in first:
        if isinstance(action, RecreateMdev):
            mdevs[action.uuid] = MdevFacts((action.parent, action.type_id),
                                           mdevs[action.uuid].defined)
            devices.append(Device("mdev", action.uuid, action.on_demand))
        elif isinstance(action, CreateDerived):
            # A UUID another VM holds is never created for this one (the
            # allocator refuses it); otherwise its choice: a parent no other
            # VM holds (whole or above).
            assume(not any(h.device == action.uuid for h in holds))
            free = [p for p in PARENTS if not any(h.device in _chain(p, {}) for h in holds)]
            assume(free)
            mdevs[action.uuid] = MdevFacts((free[0], TYPE), None)
            state.vgpus[action.uuid] = VgpuRecord(free[0], TYPE, None, True, "x")
            devices.append(Device("mdev", action.uuid, True))
        elif isinstance(action, KeepMdev):
            devices.append(Device("mdev", action.uuid, action.on_demand))
        elif isinstance(action, UseVf):
            if action.set_type is not None:
                pci[action.address] = pci[action.address]._replace(
                    vendor_vf_type=action.set_type)
            devices.append(Device("vf", action.address, action.on_demand))
        elif isinstance(action, AddGroupPeer):
            # Now named by the domain: a GPU's group peer, not a GPU.
            named.append(action.address)
            pci[action.address] = PciFacts(True, True, None, None, None)
            devices.append(Device("pci", action.address))
        else:
            assert isinstance(action, UsePci)
            devices.append(Device("pci", action.address))
    state.allocations[VM] = Allocation(VM, None, "pending", "x", devices)
    # The applier reads the groups again, the functions the domain names aside.
    groups = {gpu: tuple(m for m in members if m.address not in named)
              for gpu, members in facts.groups.items()}
    after = HostFacts(mdevs, pci, facts.physfn, groups)
    occ = _occupancy(after, state, holds)
    second = plan_named(after, state, Refusals(occ, VM), uuids, named, derived)
    assert new_work(second) == []
    assert sorted(_device(a) for a in second) == sorted(_device(a) for a in first)


@settings(max_examples=300, deadline=None)
@given(host=hosts())
def test_group_peers_are_the_named_gpus_unnamed_endpoints(host: Any) -> None:
    """Only endpoints (never a bridge) of a GPU the plan uses, each once, after it."""
    facts, state, uuids, addresses, derived, holds = host
    _, actions = _plan(facts, state, holds, uuids, addresses, derived)
    if actions is None:
        # An unreadable peer class refuses the start: never a guess.
        return
    used = [a.address for a in actions if isinstance(a, UsePci)]
    peers = [a for a in actions if isinstance(a, AddGroupPeer)]
    assert len({p.address for p in peers}) == len(peers)
    for p in peers:
        assert p.gpu in used and p.address not in addresses
        assert p.address == AUDIO[p.gpu], p
        assert actions.index(UsePci(addresses.index(p.gpu), p.gpu)) < actions.index(p)
    for gpu in used:
        if facts.groups.get(gpu) and AUDIO[gpu] not in addresses:
            assert AddGroupPeer(gpu, AUDIO[gpu]) in peers


# -- what of a metadata request the VM's devices do not serve yet --------------------------------

PROFILES = ["GRID T4-1Q", "GRID T4-2Q"]
ITEM = st.one_of(
    st.builds(VgpuRequest, st.sampled_from(PROFILES), st.none(), st.integers(1, 3)),
    st.builds(PassthroughRequest, st.sampled_from(["10de:1eb8", "tesla"]), st.integers(1, 2)))


def _serving(item: Any, n: int, tag: str) -> list[HeldFacts]:
    """`n` held devices that serve `item`: vGPUs (mdev or vendor VF) or whole GPUs."""
    if isinstance(item, VgpuRequest):
        return [HeldFacts(f"{tag}{k}", mdev_type=("nvidia-1", item.profile)) if k % 2 else
                HeldFacts(f"{tag}{k}", vf_type=(558, item.profile)) for k in range(n)]
    return [HeldFacts(f"{tag}{k}", gpu=(0x10DE, 0x1EB8, "TU104GL [Tesla T4]"))
            for k in range(n)]


def _key(item: Any) -> str:
    return item.profile if isinstance(item, VgpuRequest) else "gpu"


@settings(max_examples=300, deadline=None)
@given(items=st.lists(ITEM, min_size=1, max_size=4), data=st.data())
def test_unmet_is_what_the_held_devices_leave_and_nothing_once_served(items: Any,
                                                                     data: Any) -> None:
    request = GpuRequest(tuple(items))
    held: list[HeldFacts] = []
    for i, item in enumerate(items):
        held += _serving(item, data.draw(st.integers(0, item.count + 1)), f"h{i}-")
    # Devices that serve nothing: a group peer, a vGPU of a type not asked for,
    # an untyped VF.
    held += data.draw(st.lists(st.sampled_from([
        HeldFacts("peer"), HeldFacts("other", mdev_type=("nvidia-9", "GRID T4-16Q")),
        HeldFacts("untyped", vf_type=(0, None))]), unique=True))
    held = data.draw(st.permutations(held))
    left = unmet(request, {}, held)
    # Per kind of device, what is asked minus what serves it (never below 0).
    asked: dict[str, int] = {}
    for item in items:
        asked[_key(item)] = asked.get(_key(item), 0) + item.count
    served = {"gpu": sum(1 for h in held if h.gpu is not None)}
    for p in PROFILES:
        served[p] = sum(1 for h in held if (h.mdev_type or h.vf_type or (0, None))[1] == p)
    wanted: dict[str, int] = {}
    for item in left.items:
        assert item.count > 0
        wanted[_key(item)] = wanted.get(_key(item), 0) + item.count
    assert wanted == {k: n - served[k] for k, n in asked.items() if n > served[k]}
    # What is left, once held too, leaves nothing: the transformer run on its
    # own output allocates nothing more.
    more = [h for i, item in enumerate(left.items) for h in _serving(item, item.count, f"n{i}-")]
    assert unmet(request, {}, held + more) == GpuRequest(())


@given(counts=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data())
def test_a_derived_uuid_serves_its_own_item(counts: list[int], data: Any) -> None:
    """Even when it is of another item's type: its place in the request decides."""
    items = tuple(VgpuRequest(PROFILES[0], None, n) for n in counts)
    derived = {f"d{k}": i for i, n in enumerate(counts) for k in range(sum(counts[:i]),
                                                                      sum(counts[:i]) + n)}
    chosen = data.draw(st.lists(st.sampled_from(sorted(derived)), unique=True))
    left = unmet(GpuRequest(items), derived, [HeldFacts(u) for u in chosen])
    expect = [n - sum(1 for u in chosen if derived[u] == i) for i, n in enumerate(counts)]
    assert [item.count for item in left.items] == [n for n in expect if n > 0]


# -- the devices a VM holds and asks for again (a retried start) ----------------------------------

@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_kept_devices_are_made_ready_once(data: Any) -> None:
    """Only recorded vGPUs that are not live and recorded VFs without a type are
    planned, each once; applied, the plan made again is empty."""
    state = State()
    devices = []
    for u in data.draw(st.lists(st.sampled_from(UUIDS), unique=True, max_size=4)):
        if data.draw(st.booleans()):
            state.vgpus[u] = VgpuRecord(data.draw(st.sampled_from(PARENTS)), TYPE, None,
                                        data.draw(st.booleans()), "x")
        devices.append(Device("mdev", u))
    for a in data.draw(st.lists(st.sampled_from(list(PHYSFN)), unique=True, max_size=3)):
        if data.draw(st.booleans()):
            state.vf_types[a] = VfRecord(558, None, None, data.draw(st.booleans()))
        devices.append(Device("vf", a))
    devices += [Device("pci", p) for p in data.draw(st.lists(st.sampled_from(PFS), unique=True))]
    ids = [d.id for d in devices]
    live = {i for i in ids if data.draw(st.booleans())}
    typed = {i for i in ids if data.draw(st.booleans())}
    actions = plan_kept(devices, state, live, typed)
    assert new_work(actions) == actions
    made = [a.uuid if isinstance(a, RecreateMdev) else a.address for a in actions]
    assert len(set(made)) == len(made)
    for a in actions:
        if isinstance(a, RecreateMdev):
            rec = state.vgpus[a.uuid]
            assert a.uuid not in live and (a.parent, a.type_id) == (rec.parent, rec.type_id)
        else:
            assert isinstance(a, RetypeVf) and a.address not in typed
            assert a.type_id == state.vf_types[a.address].type_id
    missing = {u for u in state.vgpus if u not in live} | \
        {v for v in state.vf_types if v not in typed}
    assert set(made) == missing
    assert plan_kept(devices, state, live | set(made), typed | set(made)) == []


# -- what a killed start of the VM left (a retried start) ----------------------------------------

@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_retry_adopts_exactly_the_orphans_its_request_derives_with_their_type(
        data: Any) -> None:
    counts = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=3))
    items = [VgpuRequest(data.draw(st.sampled_from(PROFILES)), None, n) for n in counts]
    flat = [item for item in items for _ in range(item.count)]
    derived = {u: item._replace(count=1) for u, item in zip(UUIDS, flat)}
    have = set(data.draw(st.lists(st.sampled_from(UUIDS), unique=True, max_size=2)))
    orphans = {u: OrphanFacts(data.draw(st.sampled_from(PARENTS)), TYPE,
                              data.draw(st.sampled_from([*PROFILES, None])))
               for u in data.draw(st.lists(st.sampled_from(UUIDS), unique=True))}
    plan = plan_adoptions(derived, have, orphans)
    adopted = [a.uuid for a in plan]
    assert adopted == [u for u in derived if u in adopted], "in the request's order"
    for u in UUIDS:
        serves = u in derived and u in orphans and orphans[u].type_name == derived[u].profile
        assert (u in adopted) == (serves and u not in have), u
    for a in plan:
        assert (a.parent, a.type_id) == (orphans[a.uuid].parent, orphans[a.uuid].type_id)
    # Adopted, they are held: planned again, nothing more is adopted.
    assert plan_adoptions(derived, have | set(adopted), orphans) == []
