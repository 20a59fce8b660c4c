"""A VM arriving by live migration: give it vGPUs equal to the source's, here.

libvirt runs the qemu hook's `migrate begin` on the destination with the
incoming domain XML, and uses what the hook prints as the XML to start
(ARCHITECTURE.md, "Executables"). That XML names the *source's* devices: an mdev UUID or an
NVIDIA vendor VF's PCI address that means nothing here, or names a device
another VM holds. For every vGPU hostdev it names, this module

* learns what the vGPU is from gpulib's metadata (`<gpulib:device>`: type,
  type name, GPU model; written where gpulib gave the VM the vGPU, see
  `devicetype`), or from this host's registry when it knows the UUID;
* keeps the source's device when it exists here as the same type on the same
  GPU model and nobody else holds it (a retried arrival also keeps what its
  earlier attempt made); else chooses a free equivalent: the same type on a
  GPU of the same vendor:device, by the allocator's rules (pool members
  first, then a new vGPU; NUMA as at start);
* makes it ready through the journal (write-ahead intents: a kill at any
  write is settled by the retry or the next run) and records it held by the
  incoming VM (pending) in the same state write;
* rewrites only each hostdev's source (`MdevHostdev.uuid`, `PciHostdev.address`)
  and the metadata record that follows it: everything the guest sees (guest
  address, model, display, ramfb, the rest of the XML) stays as it was, so
  libvirt's ABI-stability check passes.

All or nothing: when one vGPU cannot be given, everything made for the others
is undone and the arrival is refused with one line (libvirt then cancels the
migration). Whole GPUs and VFs given whole are refused: their state cannot
move with the guest. A migration that fails later ends with libvirt's
`release end` on this host, which releases the pending allocation like any
failed start (on-demand vGPUs destroyed, pool members kept).

`check` answers the same question without changing anything (`gpulib
migrate check`): the choice is made on the state as read, nothing applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from gpulib import logger, mdev, nvidia
from gpulib.allocator import (
    AllocateVf,
    AllocateVgpu,
    AllocationAction,
    Allocator,
    Candidate,
    apply_allocation,
    record,
    release,
)
from gpulib.devicetype import gpu_model
from gpulib.domain import DeviceType, Domain, DomainXmlError, MdevHostdev, VgpuRequest, derive_uuid
from gpulib.errors import DeviceError, GpulibError, NotAvailableError
from gpulib.journal import Journal, settle
from gpulib.lifecycle import boot_clock, open_store, release_stale
from gpulib.liveness import Liveness
from gpulib.occupancy import Occupancy
from gpulib.pci import PciAddress
from gpulib.state import Device, State
from gpulib.usage import running_domains
from gpulib.validate import check_vm_name

if TYPE_CHECKING:
    from gpulib.config import Config
    from gpulib.context import Context
    from gpulib.discovery import Inventory
    from gpulib.sysfs import Sysfs

log = logger.get(__name__)

# How far the UUIDs derived for an arriving VM's new vGPUs are searched for
# one this host does not use (each VM has at most a few vGPUs).
MAX_DERIVED = 64


class Need(NamedTuple):
    """One vGPU of the incoming XML: where it is, and what it must be."""

    at: int  # its index among Domain.hostdevs()
    type: DeviceType  # `type.id`: the source's device (mdev UUID, VF address)
    want: VgpuRequest  # what serves it: its type (a record), or its request's profile

    @property
    def label(self) -> str:
        t = self.type
        what = (t.type_id if t.kind == "mdev" else f"vGPU type {t.type_id}") if t.type_id \
            else f"profile {t.name}"
        name = f" ({t.name})" if t.name and t.type_id else ""
        return f"{t.kind} {t.id}, {what}{name}"

    @property
    def what(self) -> str:
        t = self.type
        return f"{t.name or t.type_id}" + (f" (type {t.type_id})" if t.type_id else "")


class Choice(NamedTuple):
    """The device here that serves a Need, and how it becomes ready."""

    need: Need
    target: str  # mdev UUID or VF address on this host
    how: str  # 'kept' (ready as it is), 'pool' (a pool member), 'new' (made on demand)
    action: Optional[AllocationAction]  # what makes it ready; None: it is
    on_demand: bool
    parent: Optional[str] = None  # the new mdev's parent, for the report

    def as_dict(self) -> dict[str, object]:
        t = self.need.type
        return {"kind": t.kind, "source": t.id, "type": t.type_id, "name": t.name,
                "gpu": t.gpu, "target": self.target, "how": self.how,
                "parent": self.parent, "rewritten": self.target != t.id}

    def __str__(self) -> str:
        if self.how == "kept":
            return f"{self.need.label}: {self.target} as it is"
        where = f" on {self.parent}" if self.parent else ""
        what = "pool member" if self.how == "pool" else "new"
        return f"{self.need.label}: {what} {self.target}{where}"


def needs(sysfs: Sysfs, state: State, dom: Domain) -> list[Need]:
    """What each hostdev of the incoming XML must get here; DeviceError naming the
    first that no equivalent can be given for (a whole GPU or VF, an unknown type)."""
    records = {(r.kind, r.id): r for r in dom.device_types()}
    requested = _requested(dom)
    out = []
    for i, h in enumerate(dom.hostdevs()):
        if isinstance(h, MdevHostdev):
            uuid = h.uuid_checked()
            rec = records.get(("mdev", uuid))
            if rec is None and uuid in requested:
                # A vGPU of gpulib's request (`gpulib attach`): the request says what.
                item = requested[uuid]
                rec = DeviceType("mdev", uuid, item.type_id or "", item.profile, None)
                out.append(Need(i, rec, item._replace(count=1, numa=None)))
                continue
            if rec is None:
                known = state.vgpus.get(uuid)  # this host's registry knows the UUID
                if known is not None:
                    try:
                        parent = PciAddress.parse(known.parent)
                    except GpulibError:
                        parent = None
                    rec = DeviceType("mdev", uuid, known.type_id, None,
                                     gpu_model(sysfs, parent) if parent else None)
            if rec is None:
                raise DeviceError(
                    f"mdev {uuid}: gpulib's metadata does not say what vGPU type it is (it "
                    "was not given by gpulib) and this host does not know it: no "
                    "equivalent vGPU can be chosen, the migration is refused")
        else:
            address = h.address
            rec = records.get(("vf", str(address)))
            if rec is None:
                raise DeviceError(
                    f"PCI hostdev {address} is a device given whole (a GPU or VF passed "
                    "through): its state cannot move with the guest, the migration is "
                    "refused (only vGPUs migrate: mdevs and NVIDIA vGPU VFs)")
        want = VgpuRequest(None, rec.type_id if rec.kind == "mdev" else f"nvidia-{rec.type_id}")
        out.append(Need(i, rec, want))
    return out


def _requested(dom: Domain) -> dict[str, VgpuRequest]:
    """The derived UUIDs of the domain's metadata request, with what each asks for."""
    try:
        request = dom.metadata_request()
    except DomainXmlError:
        return {}
    if request is None or dom.uuid is None:
        return {}
    duuid = dom.uuid_checked()
    out = {}
    k = 0
    for v in request.vgpus:
        for _ in range(v.count):
            out[derive_uuid(duuid, k)] = v
            k += 1
    return out


class Planner:
    """Chooses, for one arriving VM, the device each Need gets (no write)."""

    def __init__(self, sysfs: Sysfs, state: State, occ: Occupancy,
                 allocator: Callable[[], Allocator], vm: str, domain_uuid: str,
                 own: list[Device]) -> None:
        """`allocator`: makes the allocator when a vGPU needs one (it reads the
        whole host: not when every vGPU keeps its device). `own`: what this VM
        already holds here (an earlier attempt's allocation, the changes a killed
        attempt left): kept when it serves."""
        self.sysfs = sysfs
        self.state = state
        self.occ = occ
        self._make_allocator = allocator
        self._allocator: Optional[Allocator] = None
        self.vm = vm
        self.domain_uuid = domain_uuid
        self.own = own
        self.chosen: set[str] = set()
        self._models: dict[str, Optional[str]] = {}

    def _model(self, address: PciAddress) -> Optional[str]:
        key = str(address)
        if key not in self._models:
            self._models[key] = gpu_model(self.sysfs, address)
        return self._models[key]

    def _same_gpu(self, want: Optional[str], address: PciAddress) -> bool:
        return want is None or self._model(address) == want

    def _keepable(self, need: Need, ident: str) -> bool:
        """Whether the device `ident` here is the vGPU `need` asks for, ready and free."""
        t = need.type
        if ident in self.chosen or ident in self.state.unmanaged or \
                not self.occ.takeable(ident, self.vm):
            return False
        if t.kind == "mdev":
            live = mdev.read_mdev(self.sysfs, ident)
            if live is None or str(live.parent) in self.state.unmanaged or \
                    not self._same_gpu(t.gpu, live.parent):
                return False
            name = mdev.MdevType(self.sysfs, live.parent, live.type_id).name
            return need.want.matches_type(live.type_id, name)
        try:
            vf = PciAddress.parse(ident)
        except GpulibError:
            return False
        return nvidia.is_vendor_vf(self.sysfs, vf) and \
            str(nvidia.current_type(self.sysfs, vf) or 0) == t.type_id and \
            self._same_gpu(t.gpu, vf)

    def _free_uuid(self, uuid: str) -> bool:
        return uuid not in self.chosen and uuid not in self.state.vgpus and \
            not any(i.id == uuid for i in self.state.intents) and \
            mdev.read_mdev(self.sysfs, uuid) is None and not self.occ.is_held(uuid)

    def _new_uuid(self, need: Need) -> str:
        """The source's UUID when this host does not use it (nothing to rewrite),
        else the first UUID derived from the domain's that it does not use: the
        same on a retry, so what a killed attempt made is found again."""
        if self._free_uuid(need.type.id):
            return need.type.id
        for k in range(MAX_DERIVED):
            u = derive_uuid(self.domain_uuid, k)
            if self._free_uuid(u):
                return u
        raise NotAvailableError(f"no free mdev UUID for {self.vm} (derived indexes "
                                f"0..{MAX_DERIVED - 1} all in use)")

    def choose(self, need: Need) -> Choice:
        t = need.type
        for ident in [t.id] + [d.id for d in self.own if d.kind == t.kind]:
            if self._keepable(need, ident):
                self.chosen.add(ident)
                from gpulib.occupancy import PENDING, Hold

                self.occ.add(Hold(self.vm, PENDING, ident))
                rec_m = self.state.vgpus.get(ident) if t.kind == "mdev" else None
                rec_v = self.state.vf_types.get(ident) if t.kind == "vf" else None
                mine = next((d for d in self.own if d.id == ident), None)
                on_demand = mine.on_demand if mine is not None else \
                    bool(rec_m and rec_m.on_demand) or bool(rec_v and rec_v.on_demand)
                return Choice(need, ident, "kept", None, on_demand)

        def serves(c: Candidate) -> bool:
            return c.kind == t.kind and (t.gpu is None or
                                         f"{c.gpu.fn.vendor_id:04x}:{c.gpu.fn.device_id:04x}"
                                         == t.gpu)

        if self._allocator is None:
            self._allocator = self._make_allocator()
        self._allocator.accept = serves
        on = f" on a {t.gpu} GPU" if t.gpu else ""
        try:
            action = self._allocator.choose_vgpu(self.vm, need.want,
                                                 lambda: self._new_uuid(need))
        except NotAvailableError:
            raise NotAvailableError(
                f"no free vGPU of {need.what}{on} for {self.vm}: "
                f"{need.label} has no equivalent here") from None
        if isinstance(action, AllocateVgpu):
            target, parent = action.uuid, action.parent
        else:
            assert isinstance(action, AllocateVf)
            target, parent = action.address, None
        self.chosen.add(target)
        return Choice(need, target, "new" if action.on_demand else "pool", action,
                      action.on_demand, parent)


def apply(sysfs: Sysfs, state: State, journal: Journal, choice: Choice) -> Device:
    """Make a chosen device ready (through the journal) and name it as held."""
    kind = choice.need.type.kind
    if choice.action is not None:
        return apply_allocation(sysfs, state, journal, choice.action)
    on_demand = choice.on_demand
    if kind == "mdev":
        # Made by a killed attempt of this VM: adopted, on demand as it was then.
        on_demand = journal.keep_mdev(choice.target, on_demand)
    else:
        orphan = journal.orphan("set-vf-type", choice.target)
        if orphan is not None:
            vf = PciAddress.parse(choice.target)
            journal.set_vf_type(vf, int(choice.need.type.type_id), orphan.on_demand)
            on_demand = orphan.on_demand
    return Device(kind, choice.target, on_demand=on_demand)


def rewrite(dom: Domain, choices: list[Choice]) -> None:
    """Point each hostdev at its device here; nothing else of the XML changes
    (the metadata records follow their devices)."""
    hostdevs = dom.hostdevs()
    moved = {}
    for c in choices:
        h = hostdevs[c.need.at]
        if isinstance(h, MdevHostdev):
            h.uuid = c.target
        else:
            h.address = PciAddress.parse(c.target)
        moved[(c.need.type.kind, c.need.type.id)] = c.target
    records = [r._replace(id=moved.get((r.kind, r.id), r.id)) for r in dom.device_types()]
    dom.set_device_types(records)


def _own(state: State, vm: str, domain_uuid: str) -> list[Device]:
    """What this VM holds here already: an earlier attempt's allocation, and the
    vGPUs a killed attempt made (its start intents)."""
    out: list[Device] = []
    alloc = state.allocations.get(vm)
    if alloc is not None and alloc.domain_uuid in (None, domain_uuid):
        out += alloc.devices
    for i in state.intents:
        if i.vm == vm and i.action == "create-mdev":
            out.append(Device("mdev", i.id, on_demand=i.on_demand))
        elif i.vm == vm and i.action == "set-vf-type":
            out.append(Device("vf", i.id, on_demand=i.on_demand))
    return out


def _inventory(ctx: Context, config: Config, state: State, occ: Occupancy) -> Inventory:
    from gpulib.runtime import discover_host

    return discover_host(ctx, config, state=state, learn=False, occupancy=occ)


def _allocator(ctx: Context, config: Config, dom: Domain, state: State, occ: Occupancy,
               journal: Optional[Journal]) -> Allocator:
    nodes = dom.numa_nodes()
    return Allocator(ctx.sysfs, state, _inventory(ctx, config, state, occ),
                     policy=config.get("allocator", "policy"),
                     prefer_numa=nodes[0] if len(nodes) == 1 else None,
                     occupancy=occ, journal=journal)


def _identity(dom: Domain) -> tuple[str, str]:
    vm = check_vm_name(dom.name_checked())
    if dom.uuid is None:
        raise DomainXmlError(f"domain {vm} has no <uuid>")
    return vm, dom.uuid_checked()


def arrive(ctx: Context, config: Config, dom: Domain) -> list[Choice]:
    """`migrate begin`: give the incoming VM its vGPUs here and rewrite `dom` to
    name them (in place); what was chosen. Raises (nothing changed) when one
    cannot be given."""
    vm, domain_uuid = _identity(dom)
    sysfs = ctx.sysfs
    store = open_store(ctx, config)
    running_domains(sysfs, save_cache=True)  # read before the lock, re-checked under it

    def give(state: State) -> list[Choice]:
        # Runs once (StateStore.update); `dom` is rewritten only after the
        # commit, so a refusal leaves it as it came.
        running = running_domains(sysfs)
        liveness = Liveness(sysfs, running)
        if liveness.is_running(vm):
            raise DeviceError(f"{vm} already runs on this host: an incoming migration under "
                              "its name is refused and changes nothing")
        wanted = needs(sysfs, state, dom)
        if not wanted:
            return []
        # Others' interrupted runs settled, dead starts released: their capacity
        # is free for this VM. This VM's own intents are its journal's (adopted
        # when kept, settled on commit).
        settle(sysfs, state, liveness, keep=vm)
        release_stale(ctx, state, liveness, config, keep=vm, store=store)
        alloc = state.allocations.get(vm)
        if alloc is not None and alloc.domain_uuid not in (None, domain_uuid):
            # Same name, another domain that does not run: gone for good.
            release(sysfs, state, vm, liveness, retry_seconds=0.5, checkpoint=store.checkpoint)
            alloc = None
        occ = Occupancy.build(sysfs, state, running)
        journal = Journal(sysfs, state, vm, liveness, checkpoint=store.checkpoint,
                          held_by_other=lambda device: occ.is_held(device, vm))
        try:
            planner = Planner(sysfs, state, occ,
                              lambda: _allocator(ctx, config, dom, state, occ, journal),
                              vm, domain_uuid, _own(state, vm, domain_uuid))
            choices: list[Choice] = []
            devices: list[Device] = []
            for need in wanted:
                # Applied before the next is chosen: the next reads the capacity
                # this one used.
                choice = planner.choose(need)
                devices.append(apply(sysfs, state, journal, choice))
                choices.append(choice)
            if alloc is not None:
                # An earlier attempt: what it holds and this one does not is dropped.
                planned = {d.id for d in devices}
                dropped = [d for d in alloc.devices if d.id not in planned]
                del state.allocations[vm]
                destroy = config.get_bool("release", "destroy_on_demand")
                journal.release([d for d in dropped if d.on_demand and destroy],
                                retry_seconds=0.5)
            record(state, vm, domain_uuid, devices, status="pending", clock=boot_clock(ctx))
            journal.commit()
        except BaseException:
            if journal.rollback():
                store.revert_checkpoints()
            raise
        rewrite(dom, choices)
        return choices

    choices = store.update(give)
    for c in choices:
        log.info("%s arrives: %s", vm, c)
    return choices


class Answer(NamedTuple):
    """Whether this host can take a VM now (`check`)."""

    vm: str
    choices: list[Choice]
    refusal: Optional[str]

    @property
    def ok(self) -> bool:
        return self.refusal is None

    def as_dict(self) -> dict[str, object]:
        return {"vm": self.vm, "ok": self.ok, "reason": self.refusal,
                "devices": [c.as_dict() for c in self.choices]}

    def lines(self) -> list[str]:
        out = [str(c) for c in self.choices]
        if self.refusal is not None:
            out.append(f"refused: {self.refusal}")
        else:
            out.append(f"{self.vm} can migrate here" + ("" if self.choices else
                                                          " (it has no vGPU)"))
        return out


def check(ctx: Context, config: Config, dom: Domain) -> Answer:
    """Whether `dom` (as its source's libvirt would send it) could arrive here now,
    and which device each vGPU would get; nothing is written."""
    vm, domain_uuid = _identity(dom)
    sysfs = ctx.sysfs
    state = open_store(ctx, config).load()
    running = running_domains(sysfs)
    liveness = Liveness(sysfs, running)
    choices: list[Choice] = []
    try:
        if liveness.is_running(vm):
            raise DeviceError(f"{vm} already runs on this host")
        wanted = needs(sysfs, state, dom)
        if not wanted:
            return Answer(vm, [], None)
        occ = Occupancy.build(sysfs, state, running)
        def dry_allocator() -> Allocator:
            allocator = _allocator(ctx, config, dom, state, occ, None)
            allocator.dry_run = True
            return allocator

        planner = Planner(sysfs, state, occ, dry_allocator, vm, domain_uuid,
                          _own(state, vm, domain_uuid))
        for need in wanted:
            choices.append(planner.choose(need))
    except DeviceError as exc:
        return Answer(vm, choices, exc.message)
    return Answer(vm, choices, None)


def annotate(ctx: Context, config: Config, dom: Domain) -> list[DeviceType]:
    """On the source: record in `dom` (in place) what each of its vGPUs is, from
    this host (live devices, gpulib's registry), for a VM given its vGPUs before
    gpulib recorded them; the records. Nothing is written to the host."""
    from gpulib.devicetype import record_types

    record_types(ctx.sysfs, open_store(ctx, config).load(), dom)
    return dom.device_types()

