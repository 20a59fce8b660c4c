"""Make the devices a domain names ready, and record what the VM holds.

Shared by the CloudStack transformer (which may also edit the XML) and
libvirt's `prepare begin` / `restore begin` (which may not):
the same checks in both, so a start the transformer refused (and the agent
went on with anyway, with its own XML) fails at libvirt with gpulib's line.

The start is in four parts: what it reads of the host (`hostfacts.HostReader`),
what it decides (the pure planner, `gpulib.plan`), what it does (`gpulib.apply`:
the plan's actions as journal operations) and how it edits the XML
(`placement.Placement`; `placement.FixedXml` edits nothing). The entry
chooses the start (`StartMode`): the transformer edits the XML, libvirt's
`prepare begin` / `restore begin` never does, both honour metadata requests
as `allow_metadata_requests` says; `reconnect begin` only records what a
running VM holds (`record_running`). A live migration's arrival (`migrate
begin`) is `gpulib.migration`'s.

A start is planned, then applied, inside one state transaction:

* plan (no sysfs write): every name, UUID, address and type is validated;
  the facts the named devices need are read (`HostFacts`) and the pure
  planner `gpulib.plan` turns them into typed actions. Who holds what
  comes from the occupancy model (`gpulib.occupancy`): a
  device another VM holds (active or pending allocation, running domain),
  on the same node or one it conflicts with in the PF/VF/mdev tree or the
  IOMMU group, is refused; so is a whole GPU whose vGPU use is declared or
  whose VFs are enabled. PCI devices that are neither GPUs nor a GPU's VFs
  nor a GPU's group peers are not gpulib's: left alone, recorded nowhere.
  The planner also picks a named GPU's IOMMU-group companions
  (`AddGroupPeer`) and, for a metadata request, what the VM's devices leave
  unmet (`unmet`, from `HeldFacts`).
* apply: mdevs not live but known (registry, mdevctl) are created again, an
  NVIDIA vendor VF gets its recorded type, group peers are placed beside
  their GPU, on-demand vGPUs whose UUID the XML fixes are created, and what
  a metadata request still needs is chosen by the allocator (a typed
  choice per instance, applied before the next is chosen: the next reads
  the capacity the last one used) and inserted; every sysfs write goes
  through a Journal (write-ahead intent in the state, undo in reverse order
  on any failure, then the first error's exit code);
* the allocation is recorded pending (with this boot's id and clock);
  onStart (or the VM showing up running) makes it active.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gpulib import logger, mdev, nvidia
from gpulib.allocator import Allocator, record, release
from gpulib.apply import apply_adoptions, apply_kept, apply_named
from gpulib.config import Config, metadata_allowed
from gpulib.context import Context
from gpulib.counters import counted_start
from gpulib.domain import (
    Domain,
    DomainXmlError,
    GpuRequest,
    PciHostdev,
    VgpuRequest,
    derive_uuid,
)
from gpulib.domstatus import DomainDevices
from gpulib.errors import DeviceError, GpulibError
from gpulib.hostfacts import HostReader
from gpulib.journal import Journal, settle
from gpulib.lifecycle import boot_clock, open_store, release_stale, remember_vgpu
from gpulib.liveness import Liveness, running_domains
from gpulib.occupancy import Occupancy
from gpulib.pci import (
    PciAddress,
    list_addresses,
    physical_function,
)
from gpulib.placement import AGENT_421_BUG, AGENT_LOST_VF, FixedXml, Placement
from gpulib.plan import (
    OrphanFacts,
    Refusals,
    plan_adoptions,
    plan_kept,
    plan_named,
    unmet,
)
from gpulib.records import pool_of
from gpulib.state import Device, State
from gpulib.validate import check_vm_name

if TYPE_CHECKING:
    from gpulib.discovery import Inventory

log = logger.get(__name__)


class StartMode:
    """Which start an entry makes, chosen there and fixed for the run.

    `hook`: the counters' label. `edits_xml`: the XML is the start's output
    (the transformer's stdout is what the agent starts), so it gets the
    editing XML side (`placement.Placement`: repairs, unmanaged VFs, group
    peers, a request's devices) rather than `placement.FixedXml`.
    `requests`: gpulib metadata requests are read at all (per
    `allow_metadata_requests`, `gpulib.config.metadata_allowed`).
    """

    __slots__ = ("edits_xml", "hook", "requests")

    hook: str
    edits_xml: bool
    requests: bool

    def __init__(self, hook: str, edits_xml: bool, requests: bool) -> None:
        object.__setattr__(self, "hook", hook)
        object.__setattr__(self, "edits_xml", edits_xml)
        object.__setattr__(self, "requests", requests)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a StartMode is fixed by its entry")

    def __repr__(self) -> str:
        return (f"StartMode({self.hook!r}, edits_xml={self.edits_xml}, "
                f"requests={self.requests})")

    @classmethod
    def transformer(cls, ctx: Context, config: Config) -> StartMode:
        """The CloudStack transformer (and the pipe workflow): it edits the XML."""
        return cls("transformer", edits_xml=True, requests=metadata_allowed(ctx, config))

    @classmethod
    def libvirt_start(cls, ctx: Context, config: Config) -> StartMode:
        """libvirt's `prepare begin` / `restore begin`: the XML is fixed (stdout ignored)."""
        return cls("qemu", edits_xml=False, requests=metadata_allowed(ctx, config))


class Preparer:
    """One start: what it reads (`hostfacts.HostReader`), what it decides
    (`gpulib.plan`), what it does (`gpulib.apply`, through the journal) and
    how it edits the XML (`self.xml`, chosen by the entry's `StartMode`)."""

    def __init__(self, ctx: Context, config: Config, dom: Domain, mode: StartMode) -> None:
        self.ctx = ctx
        self.sysfs = ctx.sysfs
        self.config = config
        self.dom = dom
        self.mode = mode
        # Bad input is exit 2 and found before anything is read or written.
        self.vm = check_vm_name(dom.name_checked())
        self.domain_uuid = dom.uuid_checked() if dom.uuid else None
        self.store = open_store(ctx, config)
        # What it reads of the host, and how it edits the XML: one each per start.
        self.reader = HostReader(ctx, config)
        xml_side = Placement if mode.edits_xml else FixedXml
        self.xml: Placement = xml_side(dom, self.vm, config, self.reader)
        self._host: Optional[Inventory] = None
        self._light: Optional[Inventory] = None  # the pools' GPUs, read before the lock

    @property
    def hook(self) -> str:
        return self.mode.hook

    # -- the start ------------------------------------------------------------------------
    def _validate(self) -> tuple[list[str], list[PciAddress], Optional[GpuRequest]]:
        """Every UUID, address and request of the XML, checked before anything else."""
        uuids = [h.uuid_checked() for h in self.dom.mdev_hostdevs()]
        addresses = [self._address(h) for h in self.dom.pci_hostdevs()]
        request = self.dom.metadata_request() if self.mode.requests else None
        return uuids, addresses, request

    @counted_start
    def run(self) -> list[Device]:
        uuids, addresses, request = self._validate()
        # Read before the lock what can be: the running domains (re-checked under
        # the lock against their file identity and mtime, see usage.py) and, for a
        # metadata request, the host's GPUs. Who holds what is decided under the
        # lock from the state and those files (the occupancy model), never from
        # this early read; the host's topology and types do not change meanwhile.
        running_domains(self.sysfs, save_cache=True)
        if request is not None:
            self._derived_uuids(request)  # loads their hash module now, not under the lock
        # A request is filled only where its devices can go into the XML; else
        # it serves only the on-demand vGPUs the XML names by derived UUID.
        fills = request is not None and self.xml.takes_new_devices
        if request is not None and (fills or any(
                mdev.read_mdev(self.sysfs, u) is None for u in uuids)):
            early = self.store.load()
            pooled = any(pool_of(r) for r in early.vgpus.values()) or \
                any(pool_of(r) for r in early.vf_types.values())
            if fills and pooled and request.vgpus and not request.passthrough:
                # Pools usually serve a request: their GPUs are then all it needs to
                # read (whether they suffice is decided under the lock).
                from gpulib.hostview import pool_inventory
                from gpulib.occupancy import Tree

                self._light = pool_inventory(self.ctx, early, Occupancy(Tree(self.sysfs)))
            else:
                from gpulib.hostview import discover_host

                self._host = discover_host(self.ctx, self.config, state=early, learn=False)

        def prepare(state: State) -> list[Device]:
            # Runs once, under the state lock (StateStore.update).
            running = running_domains(self.sysfs)
            liveness = Liveness(self.sysfs, running)
            if liveness.is_running(self.vm):
                running_as = liveness.domain_uuid(self.vm)
                # libvirt refuses to start a domain under a running one's name; the
                # running VM keeps everything it holds, whatever this start names.
                other = "" if running_as in (None, self.domain_uuid) else \
                    f" as domain {running_as}, not {self.domain_uuid}"
                raise DeviceError(f"{self.vm} is already running{other}: a start under its "
                                  "name is refused and changes nothing")
            wanted = set(uuids) | {str(a) for a in addresses} | \
                set(self._derived_uuids(request))
            # This VM's own start intents (a killed start of it) are left to its
            # journal when this start names or derives their device: what the
            # retry makes again is adopted in place. The others are settled now:
            # they must not hold the capacity this start needs. A removal this
            # start names again is void: the device stays, for this start.
            settle(self.sysfs, state, liveness, keep=self.vm, reuse=sorted(wanted))
            settle(self.sysfs, state, liveness,
                   only=[i for i in state.intents if i.vm == self.vm and i.id not in wanted])
            release_stale(self.ctx, state, liveness, self.config, keep=self.vm,
                          store=self.store, reuse=wanted)
            for dom in running:
                for u in dom.mdevs:
                    # A running VM's vGPU gpulib did not make (a host gpulib did
                    # not set up): remembered, so its next start after a reboot
                    # can make it again.
                    if u not in state.vgpus:
                        remember_vgpu(self.ctx, state, u)
            alloc = state.allocations.get(self.vm)
            if alloc is not None and alloc.domain_uuid not in (None, self.domain_uuid):
                # Same name, another domain (the old one is not running): it is
                # gone for good. Before anything is prepared, so its release
                # cannot undo this start's work.
                release(self.sysfs, state, self.vm, liveness, retry_seconds=0.5,
                        checkpoint=self.store.checkpoint)
                alloc = None
            occ = Occupancy.build(self.sysfs, state, running, arrival_grace=self.config.get_float(
                "release", "arrival_timeout"))
            vm = self.vm
            journal = Journal(self.sysfs, state, vm, liveness, checkpoint=self.store.checkpoint,
                              held_by_other=lambda device: occ.is_held(device, vm))
            try:
                devices = self._named_devices(state, occ, journal, uuids, addresses, request,
                                              running)
                if fills and request is not None:
                    devices += self._requested_devices(state, occ, journal, request, devices)
                elif request is not None:
                    self._refuse_unmet(state, occ, request, devices)
                if alloc is not None:
                    # A retried start (the VM is not running): its allocation is what
                    # this start plans, no more. What only the earlier attempt had
                    # goes (made on demand: destroyed, through the journal).
                    planned = {d.id for d in devices}
                    dropped = [d for d in alloc.devices if d.id not in planned]
                    del state.allocations[self.vm]
                    if dropped:
                        log.info("%s: a retried start drops what its earlier attempt "
                                 "held: %s", self.vm, ", ".join(d.id for d in dropped))
                        destroy = self.config.get_bool("release", "destroy_on_demand")
                        journal.release([d for d in dropped if d.on_demand and destroy],
                                        retry_seconds=0.5)
                for d in devices:
                    if d.kind == "mdev" and d.id not in state.vgpus:
                        # A live vGPU gpulib did not make (a running VM's, an
                        # administrator's): remembered for the next reboot.
                        remember_vgpu(self.ctx, state, d.id)
                if devices:
                    # Pending from now: the clock of a retried start starts again.
                    # libvirt's own start prepares this run: its `release end`
                    # ends it (hooks.vmstate.deactivate).
                    record(state, self.vm, self.domain_uuid, devices, status="pending",
                           clock=boot_clock(self.ctx)).prepared = not self.mode.edits_xml
                self.xml.record_types(self.sysfs, state, devices)
                journal.commit()
            except BaseException:
                if journal.rollback():
                    # Nothing is left to settle: the state file as it was found.
                    # (Otherwise the intents stay, and the next run settles them.)
                    self.store.revert_checkpoints()
                raise
            return devices

        try:
            return self.store.update(prepare)
        except GpulibError:
            if not self.mode.edits_xml:
                self._prepared_anyway()
            raise

    def _prepared_anyway(self) -> None:
        """libvirt's `prepare begin` failed: libvirt calls `release end` next, for
        this run. A pending allocation the transformer recorded for it is then
        a run libvirt prepared, which that `release end` ends (not a newer
        start it must keep)."""
        def mark(state: State) -> None:
            alloc = state.allocations.get(self.vm)
            if alloc is not None and alloc.status == "pending" and \
                    alloc.domain_uuid in (None, self.domain_uuid):
                alloc.prepared = True

        try:
            self.store.update(mark)
        except GpulibError as exc:
            log.warning("%s: cannot mark its start as prepared by libvirt: %s", self.vm,
                        exc.message)

    # -- checks ---------------------------------------------------------------------------
    def _is_gpu_fn(self, address: PciAddress) -> bool:
        """Whether discovery counts this function as a GPU (its include/exclude too)."""
        return self.reader.is_gpu_fn(address)

    def _address(self, h: PciHostdev) -> PciAddress:
        """The host address; CloudStack 4.21's mangled PCI domain repaired when exactly
        one GPU function of this host matches, refused naming the agent bug otherwise."""
        mangled = h.agent421_mangled()
        if mangled is None:
            return h.address
        # The rendering may still read as a valid address (000f:01:00.0 as
        # 0000:0f:01.0), maybe of another device: that one counts only if it
        # is a GPU itself, and then the XML is ambiguous.
        try:
            literal: Optional[PciAddress] = h.address
        except DomainXmlError:
            literal = None
        domain, bus, function = mangled
        src = h.element.find("source/address")
        written = " ".join(f"{k}='{src.get(k)}'" for k in ("domain", "bus", "slot", "function"))
        # A GPU's VF on that bus may have been meant, or its PF, or another VF:
        # which cannot be known, so none is picked.
        on_bus = [a for a in list_addresses(self.sysfs) if (a.domain, a.bus) == (domain, bus)]
        vfs = [a for a, pf in ((a, physical_function(self.sysfs, a)) for a in on_bus)
               if pf is not None and self._is_gpu_fn(pf)]
        if vfs:
            raise DomainXmlError(
                f"PCI hostdev <address {written}> may name any of the {len(vfs)} VFs on "
                f"{domain:04x}:{bus:02x} or their GPU: {AGENT_LOST_VF}")
        matches = [a for a in on_bus if a.function == function and self._is_gpu_fn(a)]
        if literal is not None:
            if not matches:
                return literal  # a bus written long, nothing to repair
            if literal not in matches and self._is_gpu_fn(literal):
                matches.append(literal)
        if len(matches) != 1:
            also = f" (and {literal} as written)" if literal in matches else ""
            raise DomainXmlError(
                f"PCI hostdev <address {written}> is not an address: {AGENT_421_BUG}; "
                f"{len(matches)} GPU functions of this host match {domain:04x}:{bus:02x}:??."
                f"{function}{also}, so it cannot be repaired (upgrade the agent)")
        fixed = matches[0]
        if fixed == literal:
            return fixed
        self.xml.repair_address(h, fixed, literal, written)
        log.warning("%s: repaired PCI hostdev <address %s> to %s (%s)", self.vm, written, fixed,
                    AGENT_421_BUG)
        return fixed

    # -- devices the XML names: facts, plan, apply, XML ---------------------------------------
    def _named_devices(self, state: State, occ: Occupancy, journal: Journal,
                       uuids: list[str], addresses: list[PciAddress],
                       request: Optional[GpuRequest],
                       running: list[DomainDevices]) -> list[Device]:
        """Facts read first, then gpulib.plan decides (no write), gpulib.apply
        carries the plan out through the journal, and the XML side places it."""
        derived = self._derived_uuids(request)
        names = [str(a) for a in addresses]
        facts = self.reader.facts(state, uuids, addresses, self.xml.peers_wanted())
        refusals = Refusals(occ, self.vm,
                            strict=self.config.get_bool("transformer", "refuse_in_use"))
        actions = plan_named(facts, state, refusals, uuids, names, derived)
        applied = apply_named(journal, self.vm, actions,
                              lambda a: self._create_derived(state, occ, journal, a.uuid,
                                                             a.request, running))
        return self.xml.place_named(applied, addresses)

    # -- metadata requests ----------------------------------------------------------------------
    def _derived_uuids(self, request: Optional[GpuRequest]) -> dict[str, VgpuRequest]:
        if request is None or self.domain_uuid is None:
            return {}
        out = {}
        k = 0
        for v in request.vgpus:
            for _ in range(v.count):
                out[derive_uuid(self.domain_uuid, k)] = v._replace(count=1)
                k += 1
        return out

    def _inventory(self, state: State, occ: Occupancy) -> Inventory:
        # Only metadata requests need the whole host: imported here, not on
        # the common path of a VM that names its devices.
        if self._host is not None:
            return self._host  # read before the lock; the allocator asks `occ`
        from gpulib.hostview import discover_host

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
            from gpulib.hostview import pool_inventory

            inventory = pool_inventory(self.ctx, state, occ)
        allocator = Allocator(self.sysfs, state, inventory, occupancy=occ)
        enough = all(len(allocator.pool_candidates(v, self.vm)) >= v.count
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
        again: list[Device] = []
        if previous is not None and previous.domain_uuid == self.domain_uuid:
            # Asked again for the same VM (a retried start): give what it holds.
            again = [d for d in previous.devices if d.id not in have]
            live = {d.id for d in again if d.kind == "mdev" and d.id in state.vgpus and
                    mdev.read_mdev(self.sysfs, d.id) is not None}
            typed = {d.id for d in again if d.kind == "vf" and d.id in state.vf_types and
                     nvidia.current_type(self.sysfs, PciAddress.parse(d.id))}
            apply_kept(journal, plan_kept(again, state, live, typed))
        again += self._adopt_requested(state, occ, journal, request,
                                       have | {d.id for d in again})
        kept = again + self.xml.insert(again, occ) if again else []
        # What the XML names (and the VM already holds) counts against the request:
        # the transformer run on its own output allocates nothing more.
        missing = self._unmet(state, occ, request, named + again)
        if not missing.items:
            return kept
        if self.domain_uuid is None:
            raise DeviceError(f"domain {self.vm} has no <uuid>: gpulib derives vGPU UUIDs "
                              "from it")
        nodes = self.dom.numa_nodes()
        light = None
        if self._host is None:
            light = self._pools_suffice(state, occ, missing, self._light)
        inventory = light if light is not None else self._inventory(state, occ)
        allocator = Allocator(self.sysfs, state, inventory,
                              policy=self.config.get("allocator", "policy"),
                              prefer_numa=nodes[0] if len(nodes) == 1 else None,
                              occupancy=occ, journal=journal)
        devices: list[Device] = []
        k = 0
        duuid = self.domain_uuid
        have |= {d.id for d in again}

        def next_uuid() -> str:
            nonlocal k
            while True:
                u = derive_uuid(duuid, k)
                k += 1
                if u not in have:
                    return u

        # A failure rolls back through the start's journal (Preparer.run).
        for v in missing.vgpus:
            devices += allocator.allocate_vgpus(self.vm, v, next_uuid)
        for p in missing.passthrough:
            devices += allocator.allocate_passthrough(self.vm, p)
        return kept + devices + self.xml.insert(devices, occ)

    def _adopt_requested(self, state: State, occ: Occupancy, journal: Journal,
                         request: GpuRequest, have: set[str]) -> list[Device]:
        """The vGPUs a killed start of this VM created for its request, taken over
        in place (`plan_adoptions`, from the orphans read here)."""
        if self.domain_uuid is None or not any(i.vm == self.vm for i in state.intents):
            return []
        derived = self._derived_uuids(request)
        orphans: dict[str, OrphanFacts] = {}
        for uuid in derived:
            if uuid in have or journal.orphan("create-mdev", uuid) is None:
                continue
            live = mdev.read_mdev(self.sysfs, uuid)
            if live is not None:
                t = mdev.MdevType(self.sysfs, live.parent, live.type_id)
                orphans[uuid] = OrphanFacts(str(live.parent), live.type_id, t.name)
        return apply_adoptions(state, occ, journal, self.vm,
                               plan_adoptions(derived, have, orphans))

    def _refuse_unmet(self, state: State, occ: Occupancy, request: GpuRequest,
                      held: list[Device]) -> None:
        """A start that cannot add devices (libvirt's `prepare begin`, whose
        stdout is ignored) of a domain whose gpulib metadata asks for more than
        its hostdevs give: refused, rather than started without them."""
        missing = self._unmet(state, occ, request, held)
        if not missing.items:
            return
        asked = ", ".join(
            f"{item.count} x {item.label if isinstance(item, VgpuRequest) else item.model}"
            for item in missing.items)
        raise DeviceError(
            f"{self.vm}: its gpulib metadata asks for {asked} with no hostdev for them in "
            f"its definition (libvirt cannot add devices at start): give them with "
            f"`gpulib attach {self.vm}`")

    def _unmet(self, state: State, occ: Occupancy, request: GpuRequest,
               held: list[Device]) -> GpuRequest:
        """What of `request` the devices this VM holds do not serve yet (the
        planner's `unmet`, from the held devices' types read now)."""
        index: dict[str, int] = {}
        if self.domain_uuid is not None:
            k = 0
            for i, item in enumerate(request.items):
                if isinstance(item, VgpuRequest):
                    for _ in range(item.count):
                        index[derive_uuid(self.domain_uuid, k)] = i
                        k += 1
        facts = self.reader.held_facts(state, request, held, index,
                                       lambda: self._inventory(state, occ))
        return unmet(request, index, facts)


def record_running(ctx: Context, config: Config, dom: Domain) -> None:
    """libvirt's `reconnect begin`: record what a running VM holds, creating
    nothing (it already runs); no metadata request is read, no XML edited."""
    # Bad input is refused before anything is read or written, as at a start.
    vm = check_vm_name(dom.name_checked())
    domain_uuid = dom.uuid_checked() if dom.uuid else None
    sysfs = ctx.sysfs
    store = open_store(ctx, config)
    with store.transaction() as state:
        alloc = state.allocations.get(vm)
        if alloc is not None and domain_uuid is not None and \
                alloc.domain_uuid not in (None, domain_uuid):
            # The allocation of another domain of that name (not the one that
            # runs): replaced, as a start replaces it. Its on-demand devices
            # go, through the journal, unless the running domain names them.
            log.warning("%s runs as domain %s: the allocation of domain %s under its name "
                        "is released", vm, domain_uuid, alloc.domain_uuid)
            release(sysfs, state, vm, Liveness(sysfs), retry_seconds=0.5,
                    destroy_on_demand=config.get_bool("release", "destroy_on_demand"),
                    checkpoint=store.checkpoint)
        devices = []
        for h in dom.mdev_hostdevs():
            uuid = h.uuid_checked()
            remember_vgpu(ctx, state, uuid)  # made outside gpulib: remembered, not owned
            rec = state.vgpus.get(uuid)
            devices.append(Device("mdev", uuid, on_demand=bool(rec and rec.on_demand)))
        for pci in dom.pci_hostdevs():
            try:
                address = pci.address
            except DomainXmlError:
                continue
            ident = str(address)
            vrec = state.vf_types.get(ident)
            kind = "vf" if nvidia.is_vendor_vf(sysfs, address) else "pci"
            devices.append(Device(kind, ident, on_demand=bool(vrec and vrec.on_demand)))
        if devices:
            record(state, vm, domain_uuid, devices, status="active",
                   clock=boot_clock(ctx)).status = "active"
