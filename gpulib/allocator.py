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

import logging
from typing import TYPE_CHECKING, Callable, Optional

from gpulib import mdev, nvidia
from gpulib.errors import InputError, NotAvailableError
from gpulib.pci import PciAddress
from gpulib.state import Allocation, Device, State, VfRecord, VgpuRecord, utc_now
from gpulib.sysfs import Sysfs

if TYPE_CHECKING:  # the hooks' start/stop path imports this module: keep it light
    from gpulib.discovery import Gpu, Inventory
    from gpulib.domain import PassthroughRequest, VgpuRequest
    from gpulib.journal import Journal
    from gpulib.occupancy import Occupancy

log = logging.getLogger(__name__)


def gpu_matches(req: PassthroughRequest, gpu: Gpu) -> bool:
    return req.matches_device(gpu.fn.vendor_id, gpu.fn.device_id, gpu.device_name)


class Candidate:
    """One way to satisfy one instance of a request."""

    def __init__(self, gpu: Gpu, kind: str, ident: str, load: int,
                 make: Callable[[], Device]) -> None:
        self.gpu = gpu
        self.kind = kind
        self.ident = ident
        self.load = load
        self.make = make


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

    def _held(self, node: str, vm: Optional[str] = None) -> bool:
        return self.occ.is_held(node, vm)

    def _hold(self, vm: str, node: str) -> None:
        from gpulib.occupancy import PENDING, Hold

        self.occ.add(Hold(vm, PENDING, node))

    # -- helpers ----------------------------------------------------------------------
    def _unmanaged(self, gpu: Gpu, address: Optional[PciAddress] = None) -> bool:
        um = self.state.unmanaged
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
        out = []
        for uuid, rec in sorted(self.state.vgpus.items()):
            # A member its GPU cannot recreate now would fail the start: the
            # hooks refuse it by name too (`Occupancy.unavailable`).
            if rec.pool is None or self._held(uuid, vm) or \
                    self.occ.unavailable(uuid) is not None:
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
                                 self._use_pool_mdev(uuid, rec, vm)))
        for addr, vrec in sorted(self.state.vf_types.items()):
            if vrec.pool is None or self._held(addr, vm) or \
                    self.occ.unavailable(addr) is not None:
                continue
            if not req.matches_vendor(vrec.type_id, vrec.name):
                continue
            owner = self.inv.owner_of(PciAddress.parse(addr))
            if owner is None or self._unmanaged(owner[0], PciAddress.parse(addr)):
                continue
            if not self._numa_ok(owner[0], req.numa):
                continue
            out.append(Candidate(owner[0], "vf", addr, self._load(owner[0]),
                                 self._use_pool_vf(addr, vrec, vm)))
        return out

    def _new_candidates(self, req: VgpuRequest, vm: str,
                        uuid_for: Callable[[], str]) -> list[Candidate]:
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
                for _ in range(avail):
                    out.append(Candidate(gpu, "mdev", f"{t.parent}/{t.type_id}",
                                         self._load(gpu), self._new_mdev(t, vm, uuid_for)))
            for vf in gpu.vfs:
                nv = vf.nvidia
                if nv is None or nv.current_type or self._held(str(vf.address), vm) or \
                        self._unmanaged(gpu, vf.address) or \
                        str(vf.address) in self.state.vf_types:
                    continue
                for tid, name in nv.creatable.items():
                    if req.matches_vendor(tid, name):
                        out.append(Candidate(gpu, "vf", str(vf.address), self._load(gpu),
                                             self._new_vf(vf.address, tid, name, vm)))
                        break
        return out

    # -- making devices ready -------------------------------------------------------------
    def _use_pool_mdev(self, uuid: str, rec: VgpuRecord, vm: str) -> Callable[[], Device]:
        def make() -> Device:
            if mdev.read_mdev(self.sysfs, uuid) is None:
                self._create(PciAddress.parse(rec.parent), rec.type_id, uuid, False)
            return Device("mdev", uuid, on_demand=False)
        return make

    def _use_pool_vf(self, addr: str, rec: VfRecord, vm: str) -> Callable[[], Device]:
        def make() -> Device:
            vf = PciAddress.parse(addr)
            if nvidia.current_type(self.sysfs, vf) != rec.type_id:
                self._set_type(vf, rec.type_id, False)
            return Device("vf", addr, on_demand=False)
        return make

    def _new_mdev(self, t: mdev.MdevType, vm: str,
                  uuid_for: Callable[[], str]) -> Callable[[], Device]:
        def make() -> Device:
            uuid = uuid_for()
            made = self._create(t.parent, t.type_id, uuid, True)
            self.state.vgpus[made.uuid] = VgpuRecord(str(t.parent), t.type_id, None, True,
                                                     utc_now())
            return Device("mdev", made.uuid, on_demand=True)
        return make

    def _new_vf(self, vf: PciAddress, tid: int, name: Optional[str],
                vm: str) -> Callable[[], Device]:
        def make() -> Device:
            self._set_type(vf, tid, True)
            self.state.vf_types[str(vf)] = VfRecord(tid, name, None, True)
            return Device("vf", str(vf), on_demand=True)
        return make

    def _create(self, parent: PciAddress, type_id: str, uuid: str,
                on_demand: bool) -> mdev.Mdev:
        if self.journal is not None:
            return self.journal.create_mdev(parent, type_id, uuid, on_demand)
        return mdev.create(self.sysfs, parent, type_id, uuid)

    def _set_type(self, vf: PciAddress, type_id: int, on_demand: bool) -> None:
        if self.journal is not None:
            self.journal.set_vf_type(vf, type_id, on_demand)
        else:
            nvidia.set_type(self.sysfs, vf, type_id)

    # -- requests ----------------------------------------------------------------------------
    def allocate_vgpus(self, vm: str, req: VgpuRequest, uuid_for: Callable[[], str],
                       fresh_only: bool = False) -> list[Device]:
        """`fresh_only`: only new vGPUs (the XML already fixes the UUID to use)."""
        devices: list[Device] = []
        made: list[Device] = []
        try:
            for _ in range(req.count):
                pool = [] if fresh_only else self._order(self._pool_candidates(req, vm))
                fresh = self._new_candidates(req, vm, uuid_for)
                if fresh_only:
                    fresh = [c for c in fresh if c.kind == "mdev"]
                cands = pool or self._order(fresh)
                if not cands:
                    raise NotAvailableError(
                        f"no free vGPU of {req.label} for {vm}"
                        + (f" on NUMA node {req.numa}" if req.numa is not None else "")
                        + f" ({len(devices)} of {req.count} found)")
                dev = cands[0].make()
                made.append(dev)
                self._hold(vm, dev.id)
                gpu_addr = cands[0].gpu.address
                self.added_load[gpu_addr] = self.added_load.get(gpu_addr, 0) + 1
                devices.append(dev)
        except Exception:
            # Roll back what this request created: a half-done allocation
            # must not leave vGPUs nobody will ever release. With a journal,
            # the start rolls back everything it did, this request included.
            if self.journal is None:
                for dev in reversed(made):
                    if dev.on_demand:
                        self.destroy(dev)
            raise
        return devices

    def allocate_passthrough(self, vm: str, req: PassthroughRequest) -> list[Device]:
        out: list[Device] = []
        for gpu in sorted(self.inv.gpus, key=lambda g: str(g.address)):
            if len(out) == req.count:
                break
            if not gpu_matches(req, gpu) or self._unmanaged(gpu) or \
                    self._held(str(gpu.address), vm) or not gpu.passthrough_enabled or \
                    not self._numa_ok(gpu, req.numa):
                continue
            self._hold(vm, str(gpu.address))
            out.append(Device("pci", str(gpu.address)))
        if len(out) < req.count:
            raise NotAvailableError(f"no free GPU matching {req.model!r} for {vm} "
                                    f"({len(out)} of {req.count} found)")
        return out

    def destroy(self, dev: Device) -> None:
        destroy_device(self.sysfs, self.state, dev)


def record(state: State, vm: str, domain_uuid: Optional[str], devices: list[Device],
           status: str = "pending",
           clock: Optional[tuple[Optional[str], float]] = None) -> Allocation:
    """Add devices to a VM's allocation (created pending unless told otherwise).

    `clock`: this boot's id and CLOCK_BOOTTIME (lifecycle.boot_clock), recorded
    with a new allocation so a dead pending start can be proven dead."""
    alloc = state.allocations.get(vm)
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
    """Undo an on-demand device and forget it."""
    if dev.kind == "mdev":
        mdev.remove(sysfs, dev.id, retry_seconds=retry_seconds)
        state.vgpus.pop(dev.id, None)
    elif dev.kind == "vf":
        vf = PciAddress.parse(dev.id)
        if nvidia.current_type(sysfs, vf):
            nvidia.clear_type(sysfs, vf, retry_seconds=retry_seconds)
        state.vf_types.pop(dev.id, None)


def release(sysfs: Sysfs, state: State, vm: str, destroy_on_demand: bool = True,
            retry_seconds: float = 5.0) -> list[str]:
    """Release what `vm` holds; returns one line per action. Unknown VM: []."""
    alloc = state.allocations.get(vm)
    actions: list[str] = []
    if alloc is None:
        return actions
    failed: list[Device] = []
    for dev in alloc.devices:
        if dev.on_demand and destroy_on_demand:
            try:
                destroy_device(sysfs, state, dev, retry_seconds)
                actions.append(f"destroyed {dev.kind} {dev.id}")
            except Exception as exc:  # keep the record: reconcile retries it later
                log.error("releasing %s %s of %s failed: %s", dev.kind, dev.id, vm, exc)
                failed.append(dev)
                continue
        else:
            rec_m = state.vgpus.get(dev.id) if dev.kind == "mdev" else None
            rec_v = state.vf_types.get(dev.id) if dev.kind == "vf" else None
            actions.append(f"returned {dev.kind} {dev.id}" + (" to its pool" if
                                                              (rec_m or rec_v) else ""))
    if failed:
        alloc.devices = failed
    else:
        del state.allocations[vm]
    return actions
