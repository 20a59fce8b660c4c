"""Choose, create and record the devices a VM gets; release them again.

Every function here runs inside one `StateStore.transaction()`: the caller
holds the lock, passes the State it got, and the allocation is written when
the transaction ends. Concurrent VM starts are therefore serialised, and no
device is ever given twice.

Order of preference for a vGPU request:
1. a free pool vGPU of that type (already live, or recreated now),
2. a free pool VF that already carries the type,
3. a new on-demand vGPU: an mdev on a parent with instances left, or an idle
   NVIDIA vendor VF that can take the type.
Among candidates, `spread` (default) takes the least-loaded GPU first, `pack`
the most-loaded one that still has room.
Devices the operator unmanaged are never chosen, nor any device the
occupancy model (`gpulib.occupancy`) says another VM holds: an allocation
(pending or active) or a running domain, on that node or one it conflicts
with in the PF/VF/mdev tree or the IOMMU group. Sysfs changes go through the
start's Journal (write-ahead intents, rollback) when one is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Union

from gpulib import logger, mdev, nvidia
from gpulib.errors import InputError, NotAvailableError
from gpulib.pci import PciAddress
from gpulib.records import pool_of
from gpulib.state import Allocation, Device, State, VfRecord, VgpuRecord, utc_now
from gpulib.sysfs import Sysfs

if TYPE_CHECKING:  # the hooks' start/stop path imports this module: keep it light
    from gpulib.discovery import Gpu, Inventory
    from gpulib.domain import PassthroughRequest, VgpuRequest
    from gpulib.journal import Journal
    from gpulib.liveness import Liveness
    from gpulib.occupancy import Occupancy

log = logger.get(__name__)


def gpu_matches(req: PassthroughRequest, gpu: Gpu) -> bool:
    return req.matches_device(gpu.fn.vendor_id, gpu.fn.device_id, gpu.device_name)


class AllocateVgpu(NamedTuple):
    """An mdev for a request: a pool member (made live again when it is not)
    or a new on-demand vGPU."""

    uuid: str
    parent: str
    type_id: str
    on_demand: bool
    pool: Optional[str] = None


class AllocateVf(NamedTuple):
    """An NVIDIA vendor VF for a request: a pool member (given its type again
    when it lost it) or an idle VF given the type on demand."""

    address: str
    type_id: int
    name: Optional[str]
    on_demand: bool
    pool: Optional[str] = None


# A whole GPU for a passthrough request. The functional form, with a real
# type (see pci.PciAddress).
AllocatePci = NamedTuple("AllocatePci", [("address", str)])  # noqa: UP014


AllocationAction = Union[AllocateVgpu, AllocateVf, AllocatePci]


class Candidate:
    """One way to satisfy one instance of a request (a new mdev's UUID is
    given once it is chosen)."""

    def __init__(self, gpu: Gpu, kind: str, ident: str, load: int,
                 action: Union[AllocateVgpu, AllocateVf]) -> None:
        self.gpu = gpu
        self.kind = kind
        self.ident = ident
        self.load = load
        self.action = action


class Allocator:
    def __init__(self, sysfs: Sysfs, state: State, inventory: Inventory,
                 policy: str = "spread", prefer_numa: Optional[int] = None,
                 occupancy: Optional[Occupancy] = None,
                 journal: Optional[Journal] = None) -> None:
        """`prefer_numa`: the node the VM's memory is bound to (its <numatune>):
        GPUs there come first, others still serve when it has none left.
        `occupancy`: who holds what (default: the inventory's, built from the
        same state); what this allocator gives is added to it."""
        self.prefer_numa = prefer_numa
        self.sysfs = sysfs
        self.state = state
        self.inv = inventory
        self.policy = policy
        self.occ = occupancy if occupancy is not None else inventory.occupancy
        self.journal = journal
        self.added_load: dict[PciAddress, int] = {}
        self._types: dict[tuple[PciAddress, str], mdev.MdevType] = {}
        # Each GPU's load when this allocator started; what it gives is added_load.
        self._base_load: dict[PciAddress, int] = {}
        # What it chose: never chosen again, even for the same VM (the occupancy
        # only keeps a device from other VMs).
        self._chosen: set[str] = set()
        # Which candidates may serve at all (a migration: the same kind of
        # device, on a GPU of the same model); None: any.
        self.accept: Optional[Callable[[Candidate], bool]] = None
        # Choices nobody applies (a question, `gpulib migrate check`): the new
        # vGPUs chosen so far count against their type's capacity here, as the
        # kernel would count them once made.
        self.dry_run = False
        self._planned: dict[str, int] = {}

    def _held(self, node: str, vm: Optional[str] = None) -> bool:
        return self.occ.is_held(node, vm)

    def _hold(self, vm: str, node: str) -> None:
        from gpulib.occupancy import PENDING, Hold

        self.occ.add(Hold(vm, PENDING, node))

    # -- helpers ----------------------------------------------------------------------
    def _unmanaged(self, gpu: Gpu, address: Optional[PciAddress] = None) -> bool:
        um = self.state.unmanaged
        if not um:
            return False
        return str(gpu.address) in um or (address is not None and str(address) in um)

    def _load(self, gpu: Gpu) -> int:
        used = self._base_load.get(gpu.address)
        if used is None:
            used = sum(1 for v in gpu.vgpus if self._held(v.uuid))
            used += sum(1 for vf in gpu.vfs if self._held(str(vf.address)))
            self._base_load[gpu.address] = used
        return used + self.added_load.get(gpu.address, 0)

    def _numa_ok(self, gpu: Gpu, numa: Optional[int]) -> bool:
        return numa is None or gpu.fn.numa_node == numa

    def _order(self, cands: list[Candidate]) -> list[Candidate]:
        sign = -1 if self.policy == "pack" else 1
        return sorted(cands, key=lambda c: (
            self.prefer_numa is not None and c.gpu.fn.numa_node != self.prefer_numa,
            sign * c.load, str(c.gpu.address), c.ident))

    # -- candidates -----------------------------------------------------------------------
    def pool_candidates(self, req: VgpuRequest, vm: str) -> list[Candidate]:
        """Free pool members that satisfy one instance of `req` for `vm`."""
        return self._pool_candidates(req, vm)

    def _pool_candidates(self, req: VgpuRequest, vm: str) -> list[Candidate]:
        with self.occ.tree.live_listed():
            return self._pool_candidates_now(req, vm)

    def _pool_candidates_now(self, req: VgpuRequest, vm: str) -> list[Candidate]:
        out = []
        for uuid, rec in sorted(self.state.vgpus.items()):
            # A member its GPU cannot recreate now would fail the start: the
            # hooks refuse it by name too (`Occupancy.unavailable`).
            # Pool members only: a hand-made vGPU is its administrator's.
            if pool_of(rec) is None or uuid in self._chosen or not self.occ.takeable(uuid, vm):
                continue
            try:
                parent = PciAddress.parse(rec.parent)
            except InputError:
                continue
            owner = self.inv.owner_of(parent)
            if owner is None:
                continue
            gpu = owner[0]
            if self._unmanaged(gpu, parent) or not self._numa_ok(gpu, req.numa):
                continue
            # One read of a type's name per parent, not one per pool member.
            t = self._types.get((parent, rec.type_id))
            if t is None:
                t = self._types[(parent, rec.type_id)] = mdev.MdevType(self.sysfs, parent,
                                                                       rec.type_id)
            if not req.matches_type(t.type_id, t.name):
                continue
            out.append(Candidate(gpu, "mdev", uuid, self._load(gpu),
                                 AllocateVgpu(uuid, rec.parent, rec.type_id, False, rec.pool)))
        for addr, vrec in sorted(self.state.vf_types.items()):
            if pool_of(vrec) is None or addr in self._chosen or not self.occ.takeable(addr, vm):
                continue
            if not req.matches_vendor(vrec.type_id, vrec.name):
                continue
            owner = self.inv.owner_of(PciAddress.parse(addr))
            if owner is None or self._unmanaged(owner[0], PciAddress.parse(addr)):
                continue
            if not self._numa_ok(owner[0], req.numa):
                continue
            out.append(Candidate(owner[0], "vf", addr, self._load(owner[0]),
                                 AllocateVf(addr, vrec.type_id, vrec.name, False, vrec.pool)))
        return out

    def _new_candidates(self, req: VgpuRequest, vm: str) -> list[Candidate]:
        out: list[Candidate] = []
        for gpu in self.inv.gpus:
            if self._unmanaged(gpu) or not self._numa_ok(gpu, req.numa):
                continue
            types = list(gpu.mdev_types)
            for vf in gpu.vfs:
                if not self._unmanaged(gpu, vf.address):
                    types.extend(vf.mdev_types)
            for t in types:
                # The parent (or its PF) held whole by another VM: no vGPU on it.
                if not req.matches_type(t.type_id, t.name) or \
                        self.occ.parent_conflicts(str(t.parent), vm):
                    continue
                avail = t.available_instances or 0
                if avail <= 0:
                    continue
                action = AllocateVgpu("", str(t.parent), t.type_id, True)
                for _ in range(avail):
                    out.append(Candidate(gpu, "mdev", f"{t.parent}/{t.type_id}",
                                         self._load(gpu), action))
            for vf in gpu.vfs:
                nv = vf.nvidia
                if nv is None or nv.current_type or str(vf.address) in self._chosen or \
                        self._held(str(vf.address), vm) or \
                        self._unmanaged(gpu, vf.address) or \
                        str(vf.address) in self.state.vf_types:
                    continue
                for tid, name in nv.creatable.items():
                    if req.matches_vendor(tid, name):
                        out.append(Candidate(gpu, "vf", str(vf.address), self._load(gpu),
                                             AllocateVf(str(vf.address), tid, name, True)))
                        break
        return out

    def _usable(self, cands: list[Candidate]) -> list[Candidate]:
        """The candidates `accept` allows, less (in a dry run) the capacity of the
        new vGPUs chosen already (one candidate stands for one instance)."""
        if self.accept is not None:
            cands = [c for c in cands if self.accept(c)]
        if not self._planned:
            return cands
        seen: dict[str, int] = {}
        out = []
        for c in cands:
            if c.kind == "mdev" and c.action.on_demand:
                n = seen[c.ident] = seen.get(c.ident, 0) + 1
                if n <= self._planned.get(c.ident, 0):
                    continue
            out.append(c)
        return out

    def reserve(self, ident: str, made: Optional[AllocationAction] = None) -> None:
        """A device the caller gave without this allocator (a migration keeps
        the one its XML names): never chosen here again; in a dry run, the
        instance its making takes (`made`, an mdev created again) is counted
        against its type's capacity as a chosen new vGPU's is."""
        self._chosen.add(ident)
        if self.dry_run and isinstance(made, AllocateVgpu) and \
                mdev.read_mdev(self.sysfs, made.uuid) is None:
            key = f"{made.parent}/{made.type_id}"
            self._planned[key] = self._planned.get(key, 0) + 1

    # -- requests ----------------------------------------------------------------------------
    def choose_vgpu(self, vm: str, req: VgpuRequest, uuid_for: Callable[[], str],
                    fresh_only: bool = False, found: int = 0
                    ) -> Union[AllocateVgpu, AllocateVf]:
        """The device for one instance of `req`, held for `vm` from now on (this
        allocator does not choose it again); nothing is written.

        `uuid_for`: the UUID of a new vGPU (asked only when one is chosen);
        `fresh_only`: only new vGPUs (the XML already fixes the UUID to use);
        `found`: how many instances of `req` are chosen already (for the error).
        The choice reads the host's present capacity: the caller applies it
        (`apply_allocation`) before it asks for the next one.
        """
        cands = [] if fresh_only else self._order(self._usable(self._pool_candidates(req, vm)))
        if not cands:
            # New vGPUs read every GPU's types: only when no pool member serves.
            fresh = self._usable(self._new_candidates(req, vm))
            if fresh_only:
                fresh = [c for c in fresh if c.kind == "mdev"]
            cands = self._order(fresh)
        if not cands:
            raise NotAvailableError(
                f"no free vGPU of {req.label} for {vm}"
                + (f" on NUMA node {req.numa}" if req.numa is not None else "")
                + f" ({found} of {req.count} found)")
        chosen = cands[0]
        action = chosen.action
        if self.dry_run and isinstance(action, AllocateVgpu) and action.on_demand:
            self._planned[chosen.ident] = self._planned.get(chosen.ident, 0) + 1
        if isinstance(action, AllocateVgpu) and not action.uuid:
            action = action._replace(uuid=uuid_for())
        ident = action.uuid if isinstance(action, AllocateVgpu) else action.address
        self._chosen.add(ident)
        self._hold(vm, ident)
        gpu_addr = chosen.gpu.address
        self.added_load[gpu_addr] = self.added_load.get(gpu_addr, 0) + 1
        return action

    def allocate_vgpus(self, vm: str, req: VgpuRequest, uuid_for: Callable[[], str],
                       fresh_only: bool = False) -> list[Device]:
        """Choose and make ready `req.count` vGPUs (see `choose_vgpu`)."""
        devices: list[Device] = []
        try:
            for _ in range(req.count):
                action = self.choose_vgpu(vm, req, uuid_for, fresh_only, len(devices))
                devices.append(apply_allocation(self.sysfs, self.state, self.journal, action))
        except Exception:
            # Roll back what this request created: a half-done allocation
            # must not leave vGPUs nobody will ever release. With a journal,
            # the start rolls back everything it did, this request included.
            if self.journal is None:
                for dev in reversed(devices):
                    if dev.on_demand:
                        self.destroy(dev)
            raise
        return devices

    def choose_passthrough(self, vm: str, req: PassthroughRequest) -> list[AllocatePci]:
        """The whole GPUs for `req`, held for `vm` from now on; nothing is written."""
        out: list[AllocatePci] = []
        for gpu in sorted(self.inv.gpus, key=lambda g: str(g.address)):
            if len(out) == req.count:
                break
            if not gpu_matches(req, gpu) or self._unmanaged(gpu) or \
                    str(gpu.address) in self._chosen or \
                    self._held(str(gpu.address), vm) or not gpu.passthrough_enabled or \
                    not self._numa_ok(gpu, req.numa):
                continue
            self._chosen.add(str(gpu.address))
            self._hold(vm, str(gpu.address))
            out.append(AllocatePci(str(gpu.address)))
        if len(out) < req.count:
            raise NotAvailableError(f"no free GPU matching {req.model!r} for {vm} "
                                    f"({len(out)} of {req.count} found)")
        return out

    def allocate_passthrough(self, vm: str, req: PassthroughRequest) -> list[Device]:
        return [Device("pci", a.address) for a in self.choose_passthrough(vm, req)]

    def destroy(self, dev: Device) -> None:
        destroy_device(self.sysfs, self.state, dev)


def apply_allocation(sysfs: Sysfs, state: State, journal: Optional[Journal],
                     action: AllocationAction) -> Device:
    """Make a chosen device ready (through the start's journal when given:
    write-ahead intent, undone on its rollback) and record a new one."""
    if isinstance(action, AllocatePci):
        return Device("pci", action.address)
    if isinstance(action, AllocateVgpu):
        parent = PciAddress.parse(action.parent)
        if action.on_demand:
            _create(sysfs, journal, parent, action.type_id, action.uuid, True)
            state.vgpus[action.uuid] = VgpuRecord(action.parent, action.type_id, None, True,
                                                  utc_now())
        elif mdev.read_mdev(sysfs, action.uuid) is None:
            # A pool member is kept across VMs; after a reboot it is made again.
            _create(sysfs, journal, parent, action.type_id, action.uuid, False)
        return Device("mdev", action.uuid, on_demand=action.on_demand)
    vf = PciAddress.parse(action.address)
    if action.on_demand:
        _set_type(sysfs, journal, vf, action.type_id, True)
        state.vf_types[action.address] = VfRecord(action.type_id, action.name, None, True)
    elif nvidia.current_type(sysfs, vf) != action.type_id:
        _set_type(sysfs, journal, vf, action.type_id, False)
    return Device("vf", action.address, on_demand=action.on_demand)


def _create(sysfs: Sysfs, journal: Optional[Journal], parent: PciAddress, type_id: str,
            uuid: str, on_demand: bool) -> mdev.Mdev:
    if journal is not None:
        return journal.create_mdev(parent, type_id, uuid, on_demand)
    return mdev.create(sysfs, parent, type_id, uuid)


def _set_type(sysfs: Sysfs, journal: Optional[Journal], vf: PciAddress, type_id: int,
              on_demand: bool) -> None:
    if journal is not None:
        journal.set_vf_type(vf, type_id, on_demand)
    else:
        nvidia.set_type(sysfs, vf, type_id)


def record(state: State, vm: str, domain_uuid: Optional[str], devices: list[Device],
           status: str = "pending",
           clock: Optional[tuple[Optional[str], float]] = None) -> Allocation:
    """Add devices to a VM's allocation (created pending unless told otherwise).

    `clock`: this boot's id and CLOCK_BOOTTIME (lifecycle.boot_clock), recorded
    with a new allocation so a dead pending start can be proven dead. An
    allocation of another domain under that name is replaced, never merged
    into (what it held and this one does not name is then no one's:
    `lifecycle.release_ownerless`)."""
    alloc = state.allocations.get(vm)
    if alloc is not None and domain_uuid is not None and \
            alloc.domain_uuid not in (None, domain_uuid):
        log.warning("%s: the allocation of domain %s is replaced by one of domain %s", vm,
                    alloc.domain_uuid, domain_uuid)
        alloc = None
    if alloc is None:
        alloc = Allocation(vm, domain_uuid, status, utc_now(), [],
                           boot_id=clock[0] if clock else None,
                           uptime=clock[1] if clock else None)
        state.allocations[vm] = alloc
    known = {(d.kind, d.id) for d in alloc.devices}
    for d in devices:
        if (d.kind, d.id) not in known:
            alloc.devices.append(d)
    return alloc


def destroy_device(sysfs: Sysfs, state: State, dev: Device, retry_seconds: float = 0.0) -> None:
    """Undo an on-demand device and forget it (an allocator's own rollback,
    before any VM held it)."""
    if dev.kind == "mdev":
        mdev.remove(sysfs, dev.id, retry_seconds=retry_seconds)
        state.vgpus.pop(dev.id, None)
    elif dev.kind == "vf":
        vf = PciAddress.parse(dev.id)
        if nvidia.current_type(sysfs, vf):
            nvidia.clear_type(sysfs, vf, retry_seconds=retry_seconds)
        state.vf_types.pop(dev.id, None)


def release(sysfs: Sysfs, state: State, vm: str, liveness: Liveness,
            destroy_on_demand: bool = True, retry_seconds: float = 5.0,
            checkpoint: Optional[Callable[[State], None]] = None,
            force: bool = False) -> list[str]:
    """Release what `vm` holds; returns one line per action. Unknown VM: [].

    Never while the VM runs (libvirt's status file names it with the
    allocation's domain UUID): a late or repeated stop, a stop that failed or
    a start under its name changes nothing, says so and logs it. Only
    `force` (an administrator's --force) releases a running VM's devices, with
    a warning. On-demand devices are destroyed through the journal: the
    allocation's end and a removal intent per device are written
    (`checkpoint`) before the first removal (journal.release_devices). A
    MIG-backed pool VF is returned the same way, its type cleared and its GPU
    instance kept for the pool."""
    from gpulib.journal import release_devices

    alloc = state.allocations.get(vm)
    if alloc is None:
        return []
    if liveness.is_running(vm, alloc.domain_uuid):
        if not force:
            log.warning("%s is running (libvirt's status file names it): its devices stay "
                        "held; nothing released", vm)
            return [f"kept: {vm} is running"]
        log.warning("%s is running, but its release was forced: its devices are taken "
                    "from a running VM", vm)
    del state.allocations[vm]
    actions: list[str] = []
    doomed = []
    for dev in alloc.devices:
        if dev.on_demand and destroy_on_demand and dev.kind in ("mdev", "vf"):
            doomed.append(dev)
            continue
        rec_m = state.vgpus.get(dev.id) if dev.kind == "mdev" else None
        rec_v = state.vf_types.get(dev.id) if dev.kind == "vf" else None
        if rec_v is not None and rec_v.gi_profile is not None and not dev.on_demand:
            # A MIG-backed member gives its GPU instance back to the pool: its
            # type is cleared (the record stays; the next start types it again
            # while a GPU instance of its profile is free).
            doomed.append(Device("vf", dev.id, on_demand=False))
            continue
        actions.append(f"returned {dev.kind} {dev.id}" + (" to its pool" if
                                                          (rec_m or rec_v) else ""))
    # A forced release of a running VM: its own status file does not keep
    # the removal from happening.
    actions += release_devices(sysfs, state, vm, doomed, liveness, checkpoint, retry_seconds,
                               ignore_vm=vm if force else None)
    return actions
