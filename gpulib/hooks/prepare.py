"""Make the devices a domain names ready, and record what the VM holds.

Shared by the CloudStack transformer (which may also edit the XML) and
libvirt's `prepare begin` / `migrate begin` / `restore begin` (which may not):
the same checks in both, so a start the transformer refused (and the agent
went on with anyway, with its own XML) fails at libvirt with gpulib's line.

A start is planned, then applied, inside one state transaction:

* plan (no sysfs write): every name, UUID, address and type is validated;
  who holds what comes from the occupancy model (`gpulib.occupancy`): a
  device another VM holds (active or pending allocation, running domain),
  on the same node or one it conflicts with in the PF/VF/mdev tree or the
  IOMMU group, is refused; so is a whole GPU whose vGPU use is declared or
  whose VFs are enabled. PCI devices that are neither GPUs nor a GPU's VFs
  nor a GPU's group peers are not gpulib's: left alone, recorded nowhere.
* apply: mdevs not live but known (registry, mdevctl) are created again, an
  NVIDIA vendor VF gets its recorded type, on-demand vGPUs whose UUID the
  XML fixes are created, gpulib metadata requests are allocated and
  inserted; every sysfs write goes through a Journal (write-ahead intent in
  the state, undo in reverse order on any failure, then the first error's
  exit code);
* the allocation is recorded pending (with this boot's id and clock);
  onStart (or the VM showing up running) makes it active.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from gpulib import mdev, nvidia
from gpulib.allocator import (
    Allocator,
    PassthroughRequest,
    VgpuRequest,
    record,
    release,
)
from gpulib.config import Config
from gpulib.context import CLOUDSTACK_AGENT_DIR, Context
from gpulib.domain import Domain, DomainXmlError, GpuRequest, PciHostdev, derive_uuid
from gpulib.errors import DeviceError, InputError
from gpulib.hooks.vmstate import release_stale
from gpulib.journal import Journal, settle
from gpulib.lifecycle import boot_clock, follow_definitions, open_store
from gpulib.mdevctl import Definition, read_definitions
from gpulib.occupancy import Occupancy, declaring_pools, refusal, whole_gpu_refusal
from gpulib.pci import (
    PciAddress,
    PciFunction,
    iommu_group_members,
    libvirt_uint,
    list_addresses,
)
from gpulib.state import Device, State, validate_vm_name
from gpulib.sysfs import ReadFailure
from gpulib.usage import DomainDevices, running_domains

if TYPE_CHECKING:
    from gpulib.discovery import Inventory

log = logging.getLogger(__name__)

BRIDGE_BASE_CLASS = 0x06
# Guest slots gpulib uses for a GPU that has no fixed guest address but needs
# its group peers beside it; low slots are left to the machine's own devices.
FIRST_GUEST_SLOT = 0x10
AGENT_421_BUG = ("CloudStack 4.21 agent bug: a PCI domain other than 0000 rendered as "
                 "bus and slot (apache/cloudstack issue 12960)")


DERIVED = "derived"  # an MdevStep source: created on demand, its UUID from the domain's


class MdevStep:
    """One named mdev in a start's plan: recreate it from `source` (parent, type),
    create it on demand (source DERIVED), or keep it (source None: it is live)."""

    __slots__ = ("attrs", "on_demand", "source", "uuid")

    def __init__(self, uuid: str, source: Optional[tuple[str, str]], on_demand: bool,
                 attrs: Optional[list[tuple[str, str]]] = None) -> None:
        self.attrs = attrs or []  # the definition's, written in order after creation
        self.uuid = uuid
        self.source = source
        self.on_demand = on_demand


def metadata_allowed(ctx: Context, config: Config) -> bool:
    """`allow_metadata_requests`: auto = on for plain libvirt, off under CloudStack.

    Under CloudStack tenants can put XML into a domain (extraconfig), so a
    request there could claim GPUs nobody paid for.
    """
    value = config.get("transformer", "allow_metadata_requests").lower()
    if value == "auto":
        return not ctx.sysfs.exists(CLOUDSTACK_AGENT_DIR + "/agent.properties")
    return value in ("1", "yes", "true", "on")


class Preparer:
    def __init__(self, ctx: Context, config: Config, dom: Domain, edit_xml: bool,
                 allow_metadata: bool) -> None:
        self.ctx = ctx
        self.sysfs = ctx.sysfs
        self.config = config
        self.dom = dom
        self.edit_xml = edit_xml
        self.allow_metadata = allow_metadata
        # Bad input is exit 2 and found before anything is read or written.
        self.vm = validate_vm_name(dom.name_checked())
        self.domain_uuid = dom.uuid_checked() if dom.uuid else None
        self.store = open_store(ctx, config)
        self._gpu_cache: dict[PciAddress, bool] = {}
        self._host: Optional[Inventory] = None
        self._light: Optional[Inventory] = None  # the pools' GPUs, read before the lock

    # -- the start ------------------------------------------------------------------------
    def _validate(self) -> tuple[list[str], list[PciAddress], Optional[GpuRequest]]:
        """Every UUID, address and request of the XML, checked before anything else."""
        uuids = [h.uuid_checked() for h in self.dom.mdev_hostdevs()]
        addresses = [self._address(h) for h in self.dom.pci_hostdevs()]
        request = self.dom.metadata_request() if self.allow_metadata else None
        return uuids, addresses, request

    def run(self) -> list[Device]:
        uuids, addresses, request = self._validate()
        # Read before the lock what can be: the running domains (re-checked under
        # the lock against their file identity and mtime, see usage.py) and, for a
        # metadata request, the host's GPUs. Who holds what is decided under the
        # lock from the state and those files (the occupancy model), never from
        # this early read; the host's topology and types do not change meanwhile.
        running_domains(self.sysfs, save_cache=True)
        if request is not None and (self.edit_xml or any(
                mdev.read_mdev(self.sysfs, u) is None for u in uuids)):
            early = self.store.load()
            pooled = any(r.pool for r in early.vgpus.values()) or \
                any(r.pool for r in early.vf_types.values())
            if self.edit_xml and pooled and request.vgpus and not request.passthrough:
                # Pools usually serve a request: their GPUs are then all it needs to
                # read (whether they suffice is decided under the lock).
                from gpulib.occupancy import Tree
                from gpulib.runtime import pool_inventory

                self._light = pool_inventory(self.ctx, early, Occupancy(Tree(self.sysfs)))
            else:
                from gpulib.runtime import discover_host

                self._host = discover_host(self.ctx, self.config, state=early, learn=False)
        with self.store.transaction() as state:
            running = running_domains(self.sysfs)
            settle(self.sysfs, state)
            release_stale(self.ctx, state, {d.name for d in running}, self.config, keep=self.vm)
            alloc = state.allocations.get(self.vm)
            if alloc is not None and alloc.domain_uuid not in (None, self.domain_uuid):
                # Same name, another domain: the old one is gone for good. Before
                # anything is prepared, so its release cannot undo this start's work.
                release(self.sysfs, state, self.vm, retry_seconds=0.5)
                alloc = None
            occ = Occupancy.build(self.sysfs, state, running)
            journal = Journal(self.sysfs, state, self.vm, checkpoint=self.store.checkpoint)
            try:
                devices = self._named_devices(state, occ, journal, uuids, addresses, request,
                                              running)
                if request is not None and self.edit_xml:
                    devices += self._requested_devices(state, occ, journal, request, devices)
                if devices:
                    record(state, self.vm, self.domain_uuid, devices,
                           status=alloc.status if alloc else "pending",
                           clock=boot_clock(self.ctx))
                journal.commit()
            except BaseException:
                if journal.rollback():
                    # Nothing is left to settle: the state file as it was found.
                    # (Otherwise the intents stay, and the next run settles them.)
                    self.store.revert_checkpoints()
                raise
            return devices

    def run_reconnect(self) -> None:
        """Record what a running VM holds, creating nothing (it already runs)."""
        with self.store.transaction() as state:
            devices = []
            for h in self.dom.mdev_hostdevs():
                uuid = h.uuid_checked()
                rec = state.vgpus.get(uuid)
                devices.append(Device("mdev", uuid, on_demand=bool(rec and rec.on_demand)))
            for pci in self.dom.pci_hostdevs():
                try:
                    address = pci.address
                except DomainXmlError:
                    continue
                ident = str(address)
                vrec = state.vf_types.get(ident)
                kind = "vf" if nvidia.is_vendor_vf(self.sysfs, address) else "pci"
                devices.append(Device(kind, ident, on_demand=bool(vrec and vrec.on_demand)))
            if devices:
                record(state, self.vm, self.domain_uuid, devices, status="active",
                       clock=boot_clock(self.ctx)).status = "active"

    # -- checks ---------------------------------------------------------------------------
    def _refuse(self, occ: Occupancy, kind: str, ident: str) -> None:
        message = refusal(occ, kind, ident, self.vm)
        if message is None:
            return
        if self.config.get_bool("transformer", "refuse_in_use"):
            raise DeviceError(message)
        log.warning("%s: %s (refuse_in_use = no: starting anyway)", self.vm, message)

    def _unmanaged(self, state: State, address: PciAddress) -> bool:
        """An unmanaged device (or a VF or vGPU of an unmanaged GPU) is left alone."""
        if str(address) in state.unmanaged:
            return True
        physfn = self.sysfs.link_name(f"sys/bus/pci/devices/{address}/physfn")
        return physfn is not None and physfn in state.unmanaged

    def _is_gpu_fn(self, address: PciAddress) -> bool:
        """Whether discovery counts this function as a GPU (its include/exclude too)."""
        found = self._gpu_cache.get(address)
        if found is None:
            from gpulib.discovery import is_gpu_function

            fn = PciFunction.read_ids(self.sysfs, address)
            found = is_gpu_function(fn, self.config.match("discovery", "include"),
                                    self.config.match("discovery", "exclude"))
            self._gpu_cache[address] = found
        return found

    def _is_gpulibs(self, address: PciAddress) -> bool:
        """A GPU, a GPU's VF, or an endpoint in a GPU's IOMMU group."""
        physfn = self.sysfs.link_name(f"sys/bus/pci/devices/{address}/physfn")
        if physfn is not None:
            try:
                return self._is_gpu_fn(PciAddress.parse(physfn))
            except InputError:
                return False
        if self._is_gpu_fn(address):
            return True
        group = self.sysfs.link_name(f"sys/bus/pci/devices/{address}/iommu_group")
        if group is None or not group.isdigit():
            return False
        return any(m != address and self._is_gpu_fn(m)
                   for m in iommu_group_members(self.sysfs, int(group)))

    def _whole_gpu_refusal(self, state: State, address: PciAddress) -> Optional[str]:
        """The discovery rule (`Gpu.whole_refusal`) from the same facts, read directly."""
        rel = f"sys/bus/pci/devices/{address}"
        numvfs = self.sysfs.read_int(rel + "/sriov_numvfs") or 0
        virtfns = sum(1 for n in self.sysfs.listdir(rel) if n.startswith("virtfn"))
        parent = str(address)
        vgpus = {u for u, r in state.vgpus.items() if r.parent == parent}
        pools: list[str] = []
        if mdev.is_parent(self.sysfs, address):
            vgpus |= {u for u, m in mdev.live_mdevs(self.sysfs).items() if m.parent == address}
            if self.config.pools:
                fn = PciFunction.read_ids(self.sysfs, address)
                pools = declaring_pools(self.config, address, fn.vendor_id, fn.device_id,
                                        mdev.list_types(self.sysfs, address))
        return whole_gpu_refusal(max(numvfs, virtfns), len(vgpus), pools=pools)

    def _address(self, h: PciHostdev) -> PciAddress:
        """The host address; CloudStack 4.21's mangled PCI domain repaired when exactly
        one GPU function of this host matches, refused naming the agent bug otherwise."""
        try:
            return h.address
        except DomainXmlError:
            mangled = h.agent421_mangled()
            if mangled is None:
                raise
        domain, bus, function = mangled
        matches = [a for a in list_addresses(self.sysfs)
                   if (a.domain, a.bus, a.function) == (domain, bus, function)
                   and self._is_gpu_fn(a)]
        src = h.element.find("source/address")
        written = " ".join(f"{k}='{src.get(k)}'" for k in ("domain", "bus", "slot", "function"))
        if len(matches) != 1:
            raise DomainXmlError(
                f"PCI hostdev <address {written}> is not an address: {AGENT_421_BUG}; "
                f"{len(matches)} GPU functions of this host match {domain:04x}:{bus:02x}:??."
                f"{function}, so it cannot be repaired (upgrade the agent)")
        fixed = matches[0]
        if self.edit_xml:
            for name, value in fixed.libvirt().items():
                src.set(name, value)
            self.dom.mark_changed()
        log.warning("%s: repaired PCI hostdev <address %s> to %s (%s)", self.vm, written, fixed,
                    AGENT_421_BUG)
        return fixed

    # -- devices the XML names: plan, then apply ---------------------------------------------
    def _named_devices(self, state: State, occ: Occupancy, journal: Journal,
                       uuids: list[str], addresses: list[PciAddress],
                       request: Optional[GpuRequest],
                       running: list[DomainDevices]) -> list[Device]:
        derived = self._derived_uuids(request)
        mdev_steps, pci_steps = self._plan_named(state, occ, uuids, addresses, derived)
        return self._apply_named(state, occ, journal, mdev_steps, pci_steps, derived, running)

    def _plan_named(self, state: State, occ: Occupancy, uuids: list[str],
                    addresses: list[PciAddress], derived: dict[str, VgpuRequest]
                    ) -> tuple[list[MdevStep], list[tuple[PciHostdev, PciAddress]]]:
        """What each named device needs, every refusal raised here: no write at all."""
        defs: Optional[dict[str, Definition]] = None
        mdev_steps: list[MdevStep] = []
        for uuid in uuids:
            rec = state.vgpus.get(uuid)
            source: Optional[tuple[str, str]] = None
            attrs: list[tuple[str, str]] = []
            if mdev.read_mdev(self.sysfs, uuid) is None:
                # The mdevctl definition is the record of a persistent vGPU
                # (the operator may have changed it); gpulib's own record is
                # the one of a transient one.
                if defs is None:
                    defs = read_definitions(self.ctx)
                    follow_definitions(self.ctx, state, defs, migrate=False)
                    rec = state.vgpus.get(uuid)
                d = defs.get(uuid)
                if d is not None:
                    source = (d.parent, d.type_id)
                    attrs = list(d.attrs)
                elif rec is not None:
                    source = (rec.parent, rec.type_id)
                else:
                    if uuid in derived:
                        source = (DERIVED, "")
                    else:
                        raise DeviceError(
                            f"mdev {uuid} does not exist and gpulib has no record of its "
                            "parent and type (create it with gpulib mdev create)")
                if source[0] != DERIVED:
                    occ.tree.mdev_parents.setdefault(uuid, source[0])
                    occ.tree.mdev_types.setdefault(uuid, source[1])
            parent = occ.tree.parent(uuid)
            if rec is not None and state.unmanaged and parent is not None and \
                    self._unmanaged(state, PciAddress.parse(parent)):
                log.info("%s: mdev %s is on unmanaged %s: left alone", self.vm, uuid, parent)
                continue
            if source is None or source[0] != DERIVED:
                self._refuse(occ, "mdev", uuid)
            mdev_steps.append(MdevStep(uuid, source, bool(rec and rec.on_demand), attrs))
        pci_steps: list[tuple[PciHostdev, PciAddress]] = []
        for h, addr in zip(self.dom.pci_hostdevs(), addresses):
            if not self.sysfs.exists(f"sys/bus/pci/devices/{addr}"):
                raise DeviceError(f"PCI device {addr} does not exist on this host")
            if not self._is_gpulibs(addr):
                log.debug("%s: PCI device %s is not a GPU: not gpulib's", self.vm, addr)
                continue
            if state.unmanaged and self._unmanaged(state, addr):
                log.info("%s: PCI device %s is unmanaged: left alone", self.vm, addr)
                continue
            # The occupancy's IOMMU-group index covers the companions added later.
            self._refuse(occ, "pci", str(addr))
            if nvidia.is_vendor_vf(self.sysfs, addr):
                if not nvidia.current_type(self.sysfs, addr) and str(addr) not in state.vf_types:
                    raise DeviceError(f"NVIDIA VF {addr} has no vGPU type and gpulib has no "
                                      "record of one (set it with gpulib vf set-type)")
            elif self.sysfs.link_name(f"sys/bus/pci/devices/{addr}/physfn") is None and \
                    self._is_gpu_fn(addr):
                why = self._whole_gpu_refusal(state, addr)
                if why is not None:
                    raise DeviceError(f"GPU {addr} cannot be given whole: {why}")
            pci_steps.append((h, addr))
        return mdev_steps, pci_steps

    def _apply_named(self, state: State, occ: Occupancy, journal: Journal,
                     mdev_steps: list[MdevStep], pci_steps: list[tuple[PciHostdev, PciAddress]],
                     derived: dict[str, VgpuRequest],
                     running: list[DomainDevices]) -> list[Device]:
        """Carry the plan out; every sysfs write goes through the journal."""
        devices: list[Device] = []
        for step in mdev_steps:
            if step.source is not None and step.source[0] == DERIVED:
                devices += self._create_derived(state, occ, journal, step.uuid,
                                                derived[step.uuid], running)
                continue
            if step.source is not None:
                parent, type_id = step.source
                journal.create_mdev(PciAddress.parse(parent), type_id, step.uuid,
                                    step.on_demand, step.attrs)
                log.info("recreated mdev %s (%s on %s) for %s", step.uuid, type_id, parent,
                         self.vm)
            devices.append(Device("mdev", step.uuid, on_demand=step.on_demand))
        for h, addr in pci_steps:
            devices += self._pci_device(state, occ, journal, h, addr)
        return devices

    def _pci_device(self, state: State, occ: Occupancy, journal: Journal, h: PciHostdev,
                    addr: PciAddress) -> list[Device]:
        ident = str(addr)
        if h.display or h.ramfb:
            log.info("%s: display/ramfb on PCI hostdev %s has no effect (libvirt ignores "
                     "them for PCI devices)", self.vm, addr)
        if nvidia.is_vendor_vf(self.sysfs, addr):
            rec = state.vf_types.get(ident)
            if not nvidia.current_type(self.sysfs, addr) and rec is not None:
                journal.set_vf_type(addr, rec.type_id, rec.on_demand)
            if h.managed and self.edit_xml:
                # libvirt would unbind the nvidia driver from a managed VF and
                # lose the vGPU: these VFs go to guests unmanaged.
                h.managed = False
                log.info("%s: NVIDIA vGPU VF %s set to managed='no'", self.vm, addr)
            return [Device("vf", ident, on_demand=bool(rec and rec.on_demand))]
        out = [Device("pci", ident)]
        if self.edit_xml and self.config.get_bool("transformer", "add_group_functions"):
            out += self._add_group_peers(h, occ)
        return out

    def _add_group_peers(self, h: PciHostdev, occ: Optional[Occupancy] = None
                         ) -> list[Device]:
        fn = PciFunction.read(self.sysfs, h.address)
        if fn.iommu_group is None or fn.class_code >> 8 not in (0x03, 0x12):
            return []
        named = {x.address for x in self.dom.pci_hostdevs()}
        peers = []
        for member in iommu_group_members(self.sysfs, fn.iommu_group):
            if member == h.address or member in named:
                continue
            klass = self._peer_class(h.address, member)
            if klass >> 16 == BRIDGE_BASE_CLASS:
                continue  # bridges stay with the host; only endpoints go along
            if occ is not None:
                self._refuse(occ, "pci", str(member))
            peers.append(member)
        if not peers:
            return []
        guest = h.guest_address or PciAddress(0, 0, self._free_guest_slot(), 0)
        if guest.function != 0 or len(peers) > 7:
            log.warning("%s: cannot place the group peers of %s beside it", self.vm, h.address)
            return []
        h.set_guest_address(guest, multifunction=True)
        out = []
        for i, member in enumerate(sorted(peers), start=1):
            self.dom.add_pci_hostdev(member, managed=h.managed,
                                     guest_address=PciAddress(guest.domain, guest.bus,
                                                              guest.slot, i))
            log.info("%s: added %s, in the IOMMU group of %s", self.vm, member, h.address)
            out.append(Device("pci", str(member)))
        return out

    def _peer_class(self, gpu: PciAddress, member: PciAddress) -> int:
        """A group peer's class; a clear error when it cannot be known (a
        bridge must never go to a guest, so an unknown class is not guessed)."""
        rel = f"sys/bus/pci/devices/{member}/class"
        raw = self.sysfs.read_result(rel)
        if isinstance(raw, ReadFailure):
            reason = raw.reason
        else:
            text = raw.decode("ascii", "replace").strip()
            try:
                klass = int(text, 16) if len(text) <= 8 else -1
            except ValueError:
                klass = -1
            if 0 <= klass <= 0xFFFFFF:
                return klass
            reason = "not a PCI class code"
        raise DeviceError(f"cannot read the PCI class of {member}, in the IOMMU group of "
                          f"{gpu}: {reason} (set add_group_functions = no in [transformer] "
                          "of gpulib.conf to pass the GPU without its group)")

    def _free_guest_slot(self) -> int:
        used = set()
        for elem in self.dom.root.iter("address"):
            # Read as libvirt reads them (bus='00' is bus 0 too).
            if elem.get("type") == "pci" and libvirt_uint(elem.get("bus") or "0") == 0:
                slot = libvirt_uint(elem.get("slot") or "0")
                if slot is not None:
                    used.add(slot)
        for slot in range(FIRST_GUEST_SLOT, 0x1F):
            if slot not in used:
                return slot
        raise DeviceError(f"no free guest PCI slot on bus 0 for the GPU of {self.vm}")

    # -- metadata requests ----------------------------------------------------------------------
    def _derived_uuids(self, request: Optional[GpuRequest]) -> dict[str, VgpuRequest]:
        if request is None or self.domain_uuid is None:
            return {}
        out = {}
        k = 0
        for v in request.vgpus:
            for _ in range(v.count):
                out[derive_uuid(self.domain_uuid, k)] = VgpuRequest(v.profile, v.type_id, 1,
                                                                     v.numa)
                k += 1
        return out

    def _inventory(self, state: State, occ: Occupancy) -> Inventory:
        # Only metadata requests need the whole host: imported here, not on
        # the common path of a VM that names its devices.
        if self._host is not None:
            return self._host  # read before the lock; the allocator asks `occ`
        from gpulib.runtime import discover_host

        return discover_host(self.ctx, self.config, state=state, learn=False, occupancy=occ)

    def _pools_suffice(self, state: State, occ: Occupancy, request: GpuRequest,
                       inventory: Optional[Inventory] = None) -> Optional[Inventory]:
        """The pools' GPUs, when free pool members can serve every vGPU of the
        request (and it asks for no whole GPU): then that is all the allocator
        needs to read. None otherwise. `inventory`: the pools' GPUs read earlier
        (topology does not change; who holds what is `occ`'s, read now)."""
        if request.passthrough or not request.vgpus:
            return None
        if inventory is None:
            from gpulib.runtime import pool_inventory

            inventory = pool_inventory(self.ctx, state, occ)
        allocator = Allocator(self.sysfs, state, inventory, occupancy=occ)
        enough = all(len(allocator.pool_candidates(
            VgpuRequest(v.profile, v.type_id, v.count, v.numa), self.vm)) >= v.count
            for v in request.vgpus)
        return inventory if enough else None

    def _create_derived(self, state: State, occ: Occupancy, journal: Journal, uuid: str,
                        req: VgpuRequest, running: list[DomainDevices]) -> list[Device]:
        allocator = Allocator(self.sysfs, state, self._inventory(state, occ),
                              policy=self.config.get("allocator", "policy"), occupancy=occ,
                              journal=journal)
        return allocator.allocate_vgpus(self.vm, req, lambda: uuid, fresh_only=True)

    def _requested_devices(self, state: State, occ: Occupancy, journal: Journal,
                           request: GpuRequest, named: list[Device]) -> list[Device]:
        have = {d.id for d in named}
        previous = state.allocations.get(self.vm)
        if previous is not None and previous.domain_uuid == self.domain_uuid:
            # Asked again for the same VM (a retried start): give what it holds.
            again = [d for d in previous.devices if d.id not in have]
            for d in again:
                # Never hand out a vGPU that is not live (a reboot, a hand removal).
                rec = state.vgpus.get(d.id) if d.kind == "mdev" else None
                if rec is not None and mdev.read_mdev(self.sysfs, d.id) is None:
                    journal.create_mdev(PciAddress.parse(rec.parent), rec.type_id, d.id,
                                        rec.on_demand)
                rec_v = state.vf_types.get(d.id) if d.kind == "vf" else None
                if rec_v is not None and \
                        not nvidia.current_type(self.sysfs, PciAddress.parse(d.id)):
                    journal.set_vf_type(PciAddress.parse(d.id), rec_v.type_id, rec_v.on_demand)
            if again:
                return again + self._insert(again, occ)
        if self.domain_uuid is None:
            raise DeviceError(f"domain {self.vm} has no <uuid>: gpulib derives vGPU UUIDs "
                              "from it")
        nodes = self.dom.numa_nodes()
        light = None
        if self._host is None:
            light = self._pools_suffice(state, occ, request, self._light)
        inventory = light if light is not None else self._inventory(state, occ)
        allocator = Allocator(self.sysfs, state, inventory,
                              policy=self.config.get("allocator", "policy"),
                              prefer_numa=nodes[0] if len(nodes) == 1 else None,
                              occupancy=occ, journal=journal)
        devices: list[Device] = []
        k = 0
        duuid = self.domain_uuid

        def next_uuid() -> str:
            nonlocal k
            while True:
                u = derive_uuid(duuid, k)
                k += 1
                if u not in have:
                    return u

        # A failure rolls back through the start's journal (Preparer.run).
        for v in request.vgpus:
            devices += allocator.allocate_vgpus(
                self.vm, VgpuRequest(v.profile, v.type_id, v.count, v.numa), next_uuid)
        for p in request.passthrough:
            devices += allocator.allocate_passthrough(
                self.vm, PassthroughRequest(p.model, p.count, p.numa))
        return devices + self._insert(devices, occ)

    def _insert(self, devices: list[Device], occ: Occupancy) -> list[Device]:
        """Put devices into the XML; returns the group peers added beside GPUs."""
        peers: list[Device] = []
        for d in devices:
            if d.kind == "mdev":
                if self.dom.find_mdev_hostdev(d.id) is None:
                    self.dom.add_mdev_hostdev(d.id, display="off")
            elif d.kind == "vf" and self.dom.find_pci_hostdev(PciAddress.parse(d.id)) is None:
                self.dom.add_pci_hostdev(PciAddress.parse(d.id), managed=False)
        # Whole GPUs first: their group peers go beside them, on the same slot.
        gpus = [d for d in devices if d.kind == "pci" and self._is_gpu(d.id)]
        for d in gpus:
            addr = PciAddress.parse(d.id)
            if self.dom.find_pci_hostdev(addr) is None:
                h = self.dom.add_pci_hostdev(addr, managed=True)
                if self.config.get_bool("transformer", "add_group_functions"):
                    peers += self._add_group_peers(h, occ)
        for d in devices:
            if d.kind == "pci" and self.dom.find_pci_hostdev(PciAddress.parse(d.id)) is None:
                self.dom.add_pci_hostdev(PciAddress.parse(d.id), managed=True)
        known = {d.id for d in devices}
        return [p for p in peers if p.id not in known]

    def _is_gpu(self, ident: str) -> bool:
        klass = self.sysfs.read_int(f"sys/bus/pci/devices/{ident}/class", 16) or 0
        return klass >> 16 in (0x03, 0x12)
