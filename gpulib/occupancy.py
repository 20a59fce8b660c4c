"""Who holds which device, and the few questions everyone asks about it.

One model, built from gpulib's state (its allocations, pending and active) and
the status files of running domains, answers "who holds this device and why"
for discovery (`used_by`), the CloudStack report, the allocator, the hooks,
reconcile, pools and the CLI. Nothing else decides whether a device is free:
so the device the report offers free is the device a start accepts.

Holds (why a VM holds a device):
* `active`  an allocation of a VM that started (onStart, `started begin`);
* `pending` an allocation recorded by the transformer or `prepare begin`
  whose VM has not started yet. It holds exactly like a running VM until
  released or its run is over (`liveness.run_over`);
* `running` a `<hostdev>` of a running domain's status file (a device
  libvirt gave it whether or not gpulib knows).
Defined but stopped domains hold nothing.

Ownership is of the device tree (ARCHITECTURE.md, its section of that
name). The tree of a node is its chain of ancestors: an mdev -> its parent
(a PF, or a VF) -> that VF's PF.
Two holds conflict when one node is the other or an ancestor of it (a whole
GPU against its VFs and the vGPUs on either, both ways), and when both are
whole PCI functions in one IOMMU group (vfio gives a group to one VM: a
passthrough GPU's companions). Two vGPUs on one parent, or two VFs of one PF,
do not conflict. A VM never conflicts with itself.

A device gpulib makes ready at start (a known vGPU to recreate, a vendor VF
to type) may be one its GPU cannot make now (`Tree.blocked`: a GPU runs one
vGPU type at a time, capacity runs out, the parent is gone). The VMs whose
devices on that GPU keep it hold it too; when none does (a stray vGPU, an
idle pool member keeps it) it is `unavailable`: not offered, and refused.
"""

from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from gpulib import logger, mdev, nvidia
from gpulib.errors import GpulibError, InputError
from gpulib.ownership import NOBODYS, RUN, Owner, device_owner, unmanaged_owner
from gpulib.pci import PciAddress, group_number, physical_function
from gpulib.profiles import serves
from gpulib.records import GPU_INSTANCE_ACTIONS, REMOVALS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NamedTuple, Optional

    from gpulib.config import Config
    from gpulib.domstatus import DomainDevices
    from gpulib.state import State
    from gpulib.sysfs import Sysfs

log = logger.get(__name__)

ACTIVE = "active"
PENDING = "pending"
RUNNING = "running"


def node_id(kind: str, ident: str) -> str:
    """The node name of a device: an mdev's lowercase UUID, else its PCI address."""
    if kind == "mdev":
        return ident.lower()
    return str(PciAddress.parse(ident))


class Hold:
    """One VM holding one device, and why."""

    __slots__ = ("device", "vm", "why")

    def __init__(self, vm: str, why: str, device: str) -> None:
        self.vm = vm
        self.why = why
        self.device = device

    def __repr__(self) -> str:
        return f"Hold({self.vm!r}, {self.why}, {self.device})"

    def describe(self) -> str:
        what = {ACTIVE: "running VM", PENDING: "starting VM", RUNNING: "running VM"}[self.why]
        return f"{what} {self.vm}" + ("" if self.why != PENDING else " (pending allocation)")


def _is_pci(node: str) -> bool:
    return node.count(":") == 2


def _is_mdev(node: str) -> bool:
    """A vGPU's node: an 8-4-4-4-12 UUID (node_id lowercases it)."""
    return len(node) == 36 and node.count("-") == 4


# `scopes`: the nodes whose holds (other VMs' vGPUs or VFs below them) keep
# the device: the first with any names them. Empty: nothing a VM holds does.
if TYPE_CHECKING:
    class Blocked(NamedTuple):
        scopes: tuple[str, ...]
        reason: str
else:  # without typing (see pci.PciAddress)
    Blocked = namedtuple("Blocked", ("scopes", "reason"))
Blocked.__doc__ = "Why a device cannot be made ready now (`Tree.blocked`)."


class Tree:
    """The PF/VF/mdev relations and IOMMU groups of the nodes asked about, read lazily."""

    def __init__(self, sysfs: Sysfs, mdev_parents: Optional[dict[str, str]] = None,
                 mdev_types: Optional[dict[str, str]] = None,
                 vf_types: Optional[dict[str, int]] = None) -> None:
        self.sysfs = sysfs
        self.mdev_parents = dict(mdev_parents or {})
        # The type of each known vGPU: one not live is recreated with it.
        self.mdev_types = dict(mdev_types or {})
        # The type gpulib's registry gives each NVIDIA vendor VF at VM start.
        self.vf_types = dict(vf_types or {})
        # The VFs whose recorded type is MIG-backed (runs on a GPU instance).
        self.mig_vfs: frozenset[str] = frozenset()
        # The live mdevs, listed once for a pass over many (`live_listed`).
        self._live: Optional[frozenset[str]] = None
        self._chains: dict[str, list[str]] = {}
        self._groups: dict[str, Optional[int]] = {}
        self._vf_seen: dict[str, tuple[int, dict[int, str]]] = {}

    def parent(self, node: str) -> Optional[str]:
        if not _is_pci(node):
            parent = self.mdev_parents.get(node)
            if parent is None:
                # The live device's link ends in <parent>/<uuid>: one readlink,
                # not a resolution of every component (64 running VMs' vGPUs).
                try:
                    target = os.readlink(self.sysfs.path(f"{mdev.MDEV_DEVICES}/{node}"))
                except OSError:
                    return None
                parent = os.path.basename(os.path.dirname(target)) or None
            return parent
        try:
            address = PciAddress.parse(node)
        except InputError:
            return None
        pf = physical_function(self.sysfs, address)
        return str(pf) if pf is not None else None

    def chain(self, node: str) -> list[str]:
        """The node, then its ancestors up to the PF (at most three)."""
        found = self._chains.get(node)
        if found is None:
            # Placed first, so a link loop in a broken tree ends here.
            found = self._chains[node] = [node]
            parent = self.parent(node)
            if parent is not None:
                # The parent's chain is shared: 64 vGPUs on one GPU read its links once.
                found.extend(self.chain(parent)[:3])
        return found

    @contextmanager
    def live_listed(self) -> Iterator[None]:
        """Within: whether a vGPU is live is answered from one listing of the
        mdev bus (the allocator asks about every pool member, under the state
        lock). Nothing may create or remove an mdev meanwhile."""
        self._live = frozenset(self.sysfs.listdir(mdev.MDEV_DEVICES))
        try:
            yield
        finally:
            self._live = None

    def _is_live(self, node: str) -> bool:
        if self._live is not None:
            return node in self._live
        return self.sysfs.exists(f"{mdev.MDEV_DEVICES}/{node}")

    def seed_vf(self, vf: str, current: int, creatable: dict[int, str]) -> None:
        """What an NVIDIA vendor VF showed the caller (its current type, its
        creatable list): `blocked` asks no file again (discovery reads them)."""
        self._vf_seen[vf] = (current, creatable)

    def _vf_state(self, vf: str) -> Optional[tuple[int, dict[int, str]]]:
        seen = self._vf_seen.get(vf)
        if seen is None:
            # Read each time asked: a start that sets a type changes its siblings' lists.
            address = PciAddress.parse(vf)
            current = nvidia.current_type(self.sysfs, address)
            if current is None:
                return None  # not a vendor VF (or its type cannot be read: not ours to judge)
            seen = (current, nvidia.creatable_types(self.sysfs, address))
        return seen

    def blocked(self, node: str) -> Optional[Blocked]:
        """Why a device a VM may name cannot be made ready now, whoever holds
        what: a known vGPU that is not live and that its recorded parent cannot
        create (the parent is gone, does not offer the type, or has no instance
        of it left: another type is live on the GPU, or the type is full), or an
        NVIDIA vendor VF without a type whose recorded type its GPU cannot give
        it now. None when the device is live, typed, unknown or can be made.
        Asked afresh each time (a start's own writes change the answer)."""
        return self._mdev_blocked(node) if not _is_pci(node) else self._vf_blocked(node)

    def _mdev_blocked(self, node: str) -> Optional[Blocked]:
        parent, type_id = self.mdev_parents.get(node), self.mdev_types.get(node)
        if parent is None or type_id is None or self._is_live(node):
            return None
        try:
            address = PciAddress.parse(parent)
            available = mdev.find_type(self.sysfs, address, type_id).available_instances
        except InputError:
            return None
        except (GpulibError, OSError) as exc:
            reason = exc.message if isinstance(exc, GpulibError) else str(exc)
            return Blocked((), f"it cannot be recreated: {reason}")
        if available is None or available > 0:
            return None
        # The VMs holding vGPUs on the parent keep it, else those on its GPU
        # (an SR-IOV GPU's VFs run one type between them).
        return Blocked(tuple(self.chain(parent)),
                       f"it cannot be recreated: {parent} has no instance of {type_id} left "
                       "(another vGPU type is live on the GPU, or the type is full)")

    def _vf_blocked(self, node: str) -> Optional[Blocked]:
        recorded = self.vf_types.get(node)
        if not recorded:
            return None
        try:
            seen = self._vf_state(node)
        except InputError:
            return None
        if seen is None or seen[0] or recorded in seen[1]:
            return None
        pf = self.parent(node)
        return Blocked((pf,) if pf is not None else (), self._vf_why(node, recorded, seen[1]))

    def _vf_why(self, node: str, recorded: int, creatable: dict[int, str]) -> str:
        if node not in self.mig_vfs:
            return (f"its GPU cannot give it its vGPU type {recorded} now (the GPU's other "
                    "VFs leave no room for it)")
        from gpulib.mig import mig_backed_slices

        if creatable and all(mig_backed_slices(n) is None for n in creatable.values()):
            return (f"its MIG-backed vGPU type {recorded} needs MIG mode, which is off on its "
                    "GPU now (its VFs offer time-sliced types only): `gpulib doctor --check "
                    "mig` says more")
        return (f"its MIG-backed vGPU type {recorded} needs a free GPU instance of its profile "
                "with a compute instance, and its GPU has none now (gone since a reboot or a "
                "reset, or other VFs run on them): `gpulib restore` or `gpulib pool apply` "
                "makes them")

    def seed_group(self, node: str, group: Optional[int]) -> None:
        """The IOMMU group the caller read for the PCI function `node` (by
        `group_number` of the same link): `group` reads it no more (discovery
        has read every GPU's and VF's)."""
        self._groups[node] = group

    def group(self, node: str) -> Optional[int]:
        if node not in self._groups:
            self._groups[node] = group_number(
                self.sysfs.link_name(f"sys/bus/pci/devices/{node}/iommu_group")) \
                if _is_pci(node) else None
        return self._groups[node]


class Occupancy:
    """Every hold on the host, indexed by node, by ancestor and by IOMMU group."""

    def __init__(self, tree: Tree, holds: Iterable[Hold] = ()) -> None:
        self.tree = tree
        self.holds: list[Hold] = []
        self._exact: dict[str, list[Hold]] = {}
        # By ancestor and by IOMMU group: built when first asked (`_indexed`).
        # Questions about a vGPU need neither, and building them reads the
        # links of every held device (a start asks about one or two).
        self._below: dict[str, list[Hold]] = {}
        self._group: dict[int, list[Hold]] = {}
        self._unindexed: list[Hold] = []
        # What the next start undoes (journal.settle): a vGPU or a VF type
        # that a start which died made, named by no allocation of its VM.
        self.undone: frozenset[str] = frozenset()
        # gpulib's state, for whose a device is (`owner`): its unmanaged
        # devices, its records of what it made (None: nothing recorded).
        self.state: Optional[State] = None
        for h in holds:
            self.add(h)

    @classmethod
    def build(cls, sysfs: Sysfs, state: State, running: Iterable[DomainDevices] = (),
              arrival_grace: Optional[float] = None) -> Occupancy:
        """From gpulib's allocations and the running domains' devices.

        An allocation whose run is over (`liveness.run_is_over`, the one
        answer the hooks' cleanup asks too: a stop that did not complete, a
        start past its grace, an abandoned arrival, anything of an earlier
        boot whose VM does not run) holds nothing: the next hook releases
        it, and the report does not call its devices used meanwhile; its
        on-demand devices are not offered either (they are about to go).
        `running` must be every running domain; `arrival_grace`: the arrivals'
        bound (`[release] arrival_timeout`; `arrival_grace_of` reads it)."""
        from gpulib.liveness import (
            ARRIVAL_GRACE_SECONDS,
            Liveness,
            boot_clock_of,
            run_is_over,
        )

        tree = Tree(sysfs, {u: r.parent for u, r in state.vgpus.items()},
                    {u: r.type_id for u, r in state.vgpus.items()},
                    {a: r.type_id for a, r in state.vf_types.items()})
        tree.mig_vfs = frozenset(a for a, r in state.vf_types.items()
                                 if r.gi_profile is not None)
        occ = cls(tree)
        occ.state = state
        occ.undone = frozenset(
            i.id for i in state.intents if i.action not in REMOVALS
            and i.action not in GPU_INSTANCE_ACTIONS and not any(
                d.id == i.id for d in getattr(state.allocations.get(i.vm), "devices", ())))
        running = list(running)
        if arrival_grace is None:
            arrival_grace = ARRIVAL_GRACE_SECONDS
        liveness = Liveness(sysfs, running)
        clock: Optional[tuple[Optional[str], float]] = None
        over: list[str] = []
        for vm, alloc in state.allocations.items():
            if clock is None:
                clock = boot_clock_of(sysfs)
            if run_is_over(alloc, liveness, clock, arrival_grace=arrival_grace):
                over += [node_id(d.kind, d.id) for d in alloc.devices if d.on_demand]
                continue
            for d in alloc.devices:
                occ.add(Hold(vm, alloc.status, node_id(d.kind, d.id)))
        if over:
            # Its on-demand devices are destroyed then: not offered meanwhile.
            occ.undone = occ.undone | frozenset(over)
        occ.add_running(running)
        return occ

    def add_running(self, running: Iterable[DomainDevices]) -> None:
        """Every hostdev of the running domains holds its device."""
        for dom in running:
            for u in dom.mdevs:
                self.add(Hold(dom.name, RUNNING, u))
            for a in dom.pci:
                self.add(Hold(dom.name, RUNNING, str(a)))

    def add(self, hold: Hold) -> None:
        """Record one hold (the allocator adds what it just gave)."""
        self.holds.append(hold)
        self._exact.setdefault(hold.device, []).append(hold)
        self._unindexed.append(hold)

    def _indexed(self, node: str) -> bool:
        """Whether `node` may have holds below it or in its IOMMU group (a PCI
        function, or any parent that is not a vGPU); if so, index every hold."""
        if not _is_pci(node) and _is_mdev(node):
            return False  # nothing is below a vGPU, and it has no IOMMU group
        pending, self._unindexed = self._unindexed, []
        for hold in pending:
            for ancestor in self.tree.chain(hold.device)[1:]:
                self._below.setdefault(ancestor, []).append(hold)
            if _is_pci(hold.device):
                group = self.tree.group(hold.device)
                if group is not None:
                    self._group.setdefault(group, []).append(hold)
        return True

    # -- the questions --------------------------------------------------------------
    def conflicts(self, node: str, vm: Optional[str] = None) -> list[Hold]:
        """Holds of VMs other than `vm` that exclude `node` (all holds when vm is None)."""
        return self._conflicts(node, vm, self.tree.blocked(node))

    def _conflicts(self, node: str, vm: Optional[str], blocked: Optional[Blocked]
                   ) -> list[Hold]:
        found: list[Hold] = []
        for n in self.tree.chain(node):
            found += self._exact.get(n, ())
        if self._indexed(node):
            found += self._below.get(node, ())
        if _is_pci(node):
            group = self.tree.group(node)
            if group is not None:
                found += self._group.get(group, ())
        out = self._unique(found, vm)
        # A vGPU to recreate (or a vendor VF to type) that its GPU cannot make
        # now is kept from `vm` by the other VMs' vGPUs and VFs on that GPU (a
        # GPU runs one vGPU type at a time): reported used by them, refused
        # naming them. Kept by nothing a VM holds, it is `unavailable`.
        if blocked is not None:
            for scope in blocked.scopes:
                self._indexed(scope)
                keeping = self._unique(self._below.get(scope, ()), vm)
                if keeping:
                    out = self._unique(out + keeping, vm)
                    break
        # Running and active holds first: they name who really has it.
        out.sort(key=lambda h: (h.why == PENDING, h.vm, h.device))
        return out

    @staticmethod
    def _unique(found: Iterable[Hold], vm: Optional[str]) -> list[Hold]:
        """The holds of VMs other than `vm`, each once."""
        seen: set[int] = set()
        out = []
        for h in found:
            if h.vm != vm and id(h) not in seen:
                seen.add(id(h))
                out.append(h)
        return out

    def is_held(self, node: str, vm: Optional[str] = None) -> bool:
        """`conflicts(node, vm)` is not empty (cheaper: the allocator asks it often)."""
        if self._held_by_others(node, vm):
            return True
        # A vGPU to recreate (a vendor VF to type) may be kept by the VMs of its
        # GPU's other vGPUs (VFs).
        blocked = self.tree.blocked(node)
        return blocked is not None and bool(self._conflicts(node, vm, blocked))

    def takeable(self, node: str, vm: str) -> bool:
        """`free_for(node, vm)`, asking the tree whether it is blocked once:
        a blocked device is either kept by another VM or unavailable."""
        if self.hands_off(node) is not None:
            return False
        try:
            if self.tree.blocked(node) is not None:
                return False
        except InputError:
            pass
        return not self._held_by_others(node, vm)

    def _held_by_others(self, node: str, vm: Optional[str]) -> bool:
        """A hold of a VM other than `vm` on the node, its ancestors, below it
        or in its IOMMU group (what `conflicts` finds without `Tree.blocked`)."""
        for n in self.tree.chain(node):
            if any(h.vm != vm for h in self._exact.get(n, ())):
                return True
        if self._indexed(node) and any(h.vm != vm for h in self._below.get(node, ())):
            return True
        if _is_pci(node):
            group = self.tree.group(node)
            if group is not None and any(h.vm != vm for h in self._group.get(group, ())):
                return True
        return False

    def holder(self, node: str) -> Optional[Hold]:
        """Who keeps `node` from anyone else (None: free)."""
        found = self.conflicts(node)
        return found[0] if found else None

    def user(self, kind: str, ident: str) -> Optional[str]:
        """The VM name discovery reports as `used_by` (None: free for allocation)."""
        try:
            hold = self.holder(node_id(kind, ident))
        except InputError:
            return None
        return hold.vm if hold is not None else None

    def whole_user(self, address: str) -> Optional[str]:
        """The VM holding the PCI function `address` whole (None: none does): a
        hold of the function itself, or of a function in its IOMMU group that
        is not below it (a companion vfio gives along). A VM holding one of its
        vGPUs or VFs is their user, not the function's: the CloudStack report
        names only the whole holder on a GPU's own entry, as the management
        server copies that name onto the GPU's row."""
        try:
            node = node_id("pci", address)
        except InputError:
            return None
        found = list(self._exact.get(node, ()))
        group = self.tree.group(node)
        if group is not None and self._indexed(node):
            found += [h for h in self._group.get(group, ())
                      if node not in self.tree.chain(h.device)[1:]]
        found.sort(key=lambda h: (h.why == PENDING, h.vm, h.device))
        return found[0].vm if found else None

    def parent_conflicts(self, parent: str, vm: Optional[str] = None) -> list[Hold]:
        """Holds that keep `vm` from a new vGPU on `parent`: the parent or one of
        its ancestors held whole (other vGPUs on it do not conflict)."""
        out = []
        for n in self.tree.chain(parent):
            out += [h for h in self._exact.get(n, ()) if h.vm != vm]
        return out

    def unavailable(self, node: str) -> Optional[str]:
        """Why no VM can take `node` now, whoever holds what (None: nothing
        but holds keeps it): a vGPU its GPU cannot recreate, a vendor VF its GPU
        cannot type (`Tree.blocked`). Such a device is not offered (when no VM
        holds what keeps it, there is no one to report it used by) and a start
        naming it is refused before any write: one answer for both."""
        hands_off = self.hands_off(node)
        if hands_off is not None:
            return hands_off.reason
        try:
            blocked = self.tree.blocked(node)
        except InputError:
            return None
        return blocked.reason if blocked is not None else None

    def hands_off(self, node: str) -> Optional[Owner]:
        """The administrator's unmanaged device (or one below it) that `node`
        is: never offered, given, made or typed (`ownership.unmanaged_owner`)."""
        if self.state is None or not self.state.unmanaged:
            return None
        try:
            return unmanaged_owner(self.state.unmanaged, self.tree.chain(node))
        except InputError:
            return None

    def owner(self, kind: str, ident: str, vm: Optional[str] = None) -> Owner:
        """Whose the device is (ARCHITECTURE.md, Whose a device is): the
        host's or the administrator's by the rules of `gpulib.ownership`, else a
        run's (a VM other than `vm` holds it or what excludes it), else a
        pool's or nobody's. The host's whole-GPU rules (console, group
        endpoints) are the GPU's (`ownership.whole_gpu_refusal`)."""
        node = node_id(kind, ident)
        chain = self.tree.chain(node)
        found = self.hands_off(node)
        if found is not None:
            return found
        holds = self.conflicts(node, vm)
        if holds:
            h = holds[0]
            return Owner(RUN, f"in use by {h.describe()}", name=h.vm)
        if self.state is None:
            return NOBODYS
        current = None
        if kind in ("pci", "vf"):  # a VF is asked of by either kind
            seen = self.tree._vf_state(node)
            current = seen[0] if seen is not None else None
        return device_owner(self.state, kind, node, chain,
                            live=kind == "mdev" and self.tree._is_live(node),
                            current_type=current)

    def offer(self, kind: str, ident: str) -> tuple[Optional[str], bool]:
        """What discovery reports of a device: the VM it is used by (None:
        none), and whether it is offered at all (a device kept by nothing a VM
        holds but that a start would be refused is not)."""
        try:
            node = node_id(kind, ident)
        except InputError:
            return None, True
        blocked = self.tree.blocked(node)
        found = self._conflicts(node, None, blocked)
        if found:
            return found[0].vm, True
        if self.hands_off(node) is not None:
            return None, False  # the administrator's: not gpulib's to offer
        if node in self.undone:
            # Not free either: whatever starts next removes it (or clears
            # the type) first, and then has nothing to give.
            return None, False
        return None, blocked is None

    def free_for(self, node: str, vm: str) -> bool:
        """Whether `vm` may take `node` now."""
        return not self.conflicts(node, vm) and self.unavailable(node) is None

    def stray_mdevs(self, live: Iterable[str], known: Iterable[str]) -> list[str]:
        """Live mdevs no registry entry names and nobody holds."""
        known_set = set(known)
        return sorted(u for u in live if u not in known_set and u not in self._exact)


def refusal(occ: Occupancy, kind: str, ident: str, vm: str, holds_only: bool = False
            ) -> Optional[str]:
    """The one-line reason `vm` may not take a device, or None. `holds_only`:
    only another VM's hold refuses it (an unmanaged device a start names)."""
    node = node_id(kind, ident)
    found = occ.conflicts(node, vm)
    label = "mdev" if kind == "mdev" else "PCI device"
    if not found and holds_only:
        return None
    if not found:
        why = occ.unavailable(node)
        return f"{label} {ident} is not available: {why}" if why is not None else None
    h = found[0]
    if h.device == node:
        return f"{label} {ident} is in use by {h.describe()}"
    return f"{label} {ident} conflicts with {h.device}, in use by {h.describe()}"


def declaring_pools(config: Config, address: PciAddress, vendor_id: int, device_id: int,
                    types: Iterable[mdev.MdevType]) -> list[str]:
    """The pools of gpulib.conf that select this GPU and whose type it offers on
    its own function: its vGPU use is declared even before `pool apply` ran."""
    out = []
    listed = list(types)
    for name, pool in sorted(config.pools.items()):
        if not pool.parents.matches(address, vendor_id, device_id):
            continue
        if any(serves(pool.profile, pool.type_id, t.type_id, t.name) for t in listed):
            out.append(name)
    return out
