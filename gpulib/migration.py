"""A VM arriving by live migration: give it vGPUs equal to the source's, here.

libvirt runs the qemu hook's `migrate begin` on the destination with the
incoming domain XML, and uses what the hook prints as the XML to start
(ARCHITECTURE.md, "Executables"). Each vGPU hostdev of that XML names either
the *source's* device (plain libvirt) or, when a CloudStack agent migrates
(4.21.0.0 on, `updateGpuDevicesIfNeeded`), the device the management server
chose *here* (docs/cloudstack.md, "Live migration"). For every vGPU hostdev
this module

* learns what the vGPU is from gpulib's metadata (`<gpulib:device>`: type,
  type name, GPU model; written where gpulib gave the VM the vGPU, see
  `devicetype`), paired with its hostdev by the device it names, else by
  position (the agent replaces the hostdevs and keeps the metadata); a record
  whose kind contradicts its hostdev is refused; else from the request whose
  derived UUID it is, or this host's registry when it knows the UUID;
* keeps the device the hostdev names when it exists here, nobody else holds
  it, and it is of the VM's type on the same GPU model (types by name, the id
  a hint: `profiles`), making it ready when it is not (an mdev gpulib knows
  created again, an idle VF given the type); a retried arrival also keeps
  what its earlier attempt made; else chooses a free equivalent: the same
  type on a GPU of the same vendor:device, by the allocator's rules (pool
  members first, then a new vGPU; NUMA as at start), and says so when it
  was CloudStack's choice (its record is corrected by the next report);
* makes it ready through the journal (write-ahead intents: a kill at any
  write is settled by the retry or the next run) and records it held by the
  incoming VM (pending) in the same state write;
* rewrites only each hostdev's source (`MdevHostdev.uuid`, `PciHostdev.address`)
  and the metadata records (what each vGPU is here): everything the guest
  sees (guest address, model, display, ramfb, the rest of the XML) stays as
  it was, so libvirt's ABI-stability check here passes. (The check of an
  agent's rewrite runs on the source, before this hook: docs/cloudstack.md.)

All or nothing: when one vGPU cannot be given, everything made for the others
is undone and the arrival is refused with one line (libvirt then cancels the
migration). Whole GPUs and VFs given whole are refused: their state cannot
move with the guest. A migration that fails later ends with libvirt's
`release end` on this host, which releases the pending allocation like any
failed start (on-demand vGPUs destroyed, pool members kept). A VM without
hostdevs arrives as it is, its metadata not read.

`check` answers the same question without changing anything (`gpulib
migrate check`): the choice is made on the state as read, nothing applied.
"""

from __future__ import annotations

from collections.abc import Iterable
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
from gpulib.devicetype import gpu_model, mdev_type, vf_type, vf_type_name
from gpulib.domain import (
    DeviceType,
    Domain,
    DomainXmlError,
    Hostdev,
    MdevHostdev,
    VgpuRequest,
    derive_uuid,
)
from gpulib.errors import DeviceError, GpulibError, NotAvailableError
from gpulib.journal import Journal, settle
from gpulib.lifecycle import boot_clock, open_store, release_stale
from gpulib.liveness import Liveness, running_domains
from gpulib.occupancy import Occupancy, node_id, refusal
from gpulib.pci import PCI_DEVICES, PciAddress, PciFunction, has_gpu_class
from gpulib.profiles import pick
from gpulib.state import Device, State
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
    type: DeviceType  # what it is: its record (`type.id`: the device the record names)
    want: VgpuRequest  # what serves it: its recorded type, or its request's profile
    named: str  # the device the hostdev names (mdev UUID, VF address)
    recorded: bool = True  # the XML carries the record (not a request's derived vGPU)

    @property
    def rewritten(self) -> bool:
        """The hostdev names another device than its record: a source agent put
        the management server's choice here (CloudStack's
        updateGpuDevicesIfNeeded), not the source's device."""
        return self.named != self.type.id

    @property
    def label(self) -> str:
        t = self.type
        what = (t.type_id if t.kind == "mdev" else f"vGPU type {t.type_id}") if t.type_id \
            else f"profile {t.name}"
        name = f" ({t.name})" if t.name and t.type_id else ""
        return f"{t.kind} {self.named}, {what}{name}"

    @property
    def what(self) -> str:
        t = self.type
        return f"{t.name or t.type_id}" + (f" (type {t.type_id})" if t.type_id else "")


class Choice(NamedTuple):
    """The device here that serves a Need, and how it becomes ready."""

    need: Need
    target: str  # mdev UUID or VF address on this host
    # 'kept' (the device the XML names, ready as it is), 'readied' (that device,
    # made ready: its mdev created, the VF typed), 'pool' (a pool member),
    # 'new' (made on demand)
    how: str
    action: Optional[AllocationAction]  # what makes it ready; None: it is
    on_demand: bool
    parent: Optional[str] = None  # the new mdev's parent, for the report

    def as_dict(self) -> dict[str, object]:
        t = self.need.type
        return {"kind": t.kind, "source": t.id, "named": self.need.named, "type": t.type_id,
                "name": t.name, "gpu": t.gpu, "target": self.target, "how": self.how,
                "parent": self.parent, "rewritten": self.target != self.need.named}

    def __str__(self) -> str:
        if self.how == "kept":
            return f"{self.need.label}: {self.target} as it is"
        if self.how == "readied":
            made = "created again" if self.need.type.kind == "mdev" else \
                f"given vGPU type {getattr(self.action, 'type_id', '?')}"
            return f"{self.need.label}: {self.target}, {made}"
        where = f" on {self.parent}" if self.parent else ""
        what = "pool member" if self.how == "pool" else "new"
        return f"{self.need.label}: {what} {self.target}{where}"


_RECORD_KIND = {"mdev": "mdev", "pci": "vf"}


def _named(h: Hostdev) -> tuple[str, str]:
    """('mdev', UUID) or ('pci', address) of a hostdev; DomainXmlError when unreadable."""
    if isinstance(h, MdevHostdev):
        return "mdev", h.uuid_checked()
    return "pci", str(h.address)


def pair(named: list[tuple[str, str]], records: list[DeviceType],
         skip: Iterable[int] = ()) -> list[Optional[DeviceType]]:
    """Each hostdev's record: the one naming its device, else (a source agent
    replaced the devices) the next record no hostdev named, in document order
    (gpulib writes them so). `skip`: hostdevs that take no record by position
    (a request's derived vGPUs). The kinds are not checked here."""
    out: list[Optional[DeviceType]] = [None] * len(named)
    left = list(records)
    for i, (kind, ident) in enumerate(named):
        for r in left:
            if r.kind == _RECORD_KIND[kind] and r.id == ident:
                out[i] = r
                left.remove(r)
                break
    skipped = set(skip)
    free = [i for i in range(len(named)) if out[i] is None and i not in skipped]
    for i, r in zip(free, left):
        out[i] = r
    return out


def _whole_here(sysfs: Sysfs, address: PciAddress) -> bool:
    """Whether `address` is, on this host, a GPU function that is no NVIDIA
    vendor VF (a GPU or VF given whole)."""
    if nvidia.is_vendor_vf(sysfs, address) or not sysfs.exists(f"{PCI_DEVICES}{address}"):
        return False
    return has_gpu_class(PciFunction.read_ids(sysfs, address).class_code)


def needs(sysfs: Sysfs, state: State, dom: Domain) -> list[Need]:
    """What each hostdev of the incoming XML must get here; DeviceError naming the
    first that no equivalent can be given for (a whole GPU or VF, an unknown type,
    a record that contradicts its hostdev)."""
    hostdevs = dom.hostdevs()
    if not hostdevs:
        # No vGPU to give: gpulib's metadata, parsable or not, asks nothing here.
        return []
    named = [_named(h) for h in hostdevs]
    requested = _requested(dom)
    records = pair(named, dom.device_types(),
                   skip=[i for i, (kind, ident) in enumerate(named)
                         if kind == "mdev" and ident in requested])
    out = []
    for i, ((kind, ident), rec) in enumerate(zip(named, records)):
        if rec is not None and rec.kind != _RECORD_KIND[kind]:
            what = "an mdev" if rec.kind == "mdev" else "an NVIDIA vGPU VF"
            where = f"mdev {ident}" if kind == "mdev" else f"PCI hostdev {ident}"
            raise DeviceError(
                f"{where}: gpulib's metadata records {what} ({rec.id}) for it: the record "
                "contradicts the XML, the migration is refused")
        if kind == "mdev":
            if rec is None and ident in requested:
                # A vGPU of gpulib's request (`gpulib attach`): the request says what.
                item = requested[ident]
                rec = DeviceType("mdev", ident, item.type_id or "", item.profile, None)
                out.append(Need(i, rec, item._replace(count=1, numa=None), ident, False))
                continue
            if rec is None:
                known = state.vgpus.get(ident)  # this host's registry knows the UUID
                if known is not None:
                    try:
                        parent = PciAddress.parse(known.parent)
                    except GpulibError:
                        parent = None
                    rec = DeviceType("mdev", ident, known.type_id, None,
                                     gpu_model(sysfs, parent) if parent else None)
                    out.append(Need(i, rec, VgpuRequest(None, rec.type_id), ident, False))
                    continue
                raise DeviceError(
                    f"mdev {ident}: gpulib's metadata does not say what vGPU type it is (it "
                    "was not given by gpulib) and this host does not know it: no "
                    "equivalent vGPU can be chosen, the migration is refused")
        else:
            if rec is None:
                raise DeviceError(
                    f"PCI hostdev {ident} is a device given whole (a GPU or VF passed "
                    "through): its state cannot move with the guest, the migration is "
                    "refused (only vGPUs migrate: mdevs and NVIDIA vGPU VFs)")
            if _whole_here(sysfs, PciAddress.parse(ident)):
                raise DeviceError(
                    f"PCI hostdev {ident}: gpulib's metadata records an NVIDIA vGPU VF, but "
                    f"{ident} is a GPU given whole here: the record contradicts the XML, "
                    "the migration is refused")
        # The recorded type: its name decides, its id is a hint (profiles.serves).
        out.append(Need(i, rec, VgpuRequest(rec.name, rec.type_id), ident))
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
                 own: list[Device], left_over: frozenset[str] = frozenset()) -> None:
        """`allocator`: makes the allocator when a vGPU needs one (it reads the
        whole host: not when every vGPU keeps its device). `own`: what this VM
        already holds here (an earlier attempt's allocation, the changes a killed
        attempt left): kept when it serves. `left_over`: on-demand devices of
        runs that are over, which the arrival's cleanup destroys before it
        chooses (`check` foresees it: it destroys nothing)."""
        self.sysfs = sysfs
        self.state = state
        self.occ = occ
        self._make_allocator = allocator
        self._allocator: Optional[Allocator] = None
        self.vm = vm
        self.domain_uuid = domain_uuid
        self.own = own
        self.left_over = left_over
        self.chosen: set[str] = set()
        # The devices kept so far and what makes each ready (None: nothing).
        self._kept: list[tuple[str, Optional[AllocationAction]]] = []
        self._models: dict[str, Optional[str]] = {}

    def _model(self, address: PciAddress) -> Optional[str]:
        key = str(address)
        if key not in self._models:
            self._models[key] = gpu_model(self.sysfs, address)
        return self._models[key]

    def _same_gpu(self, want: Optional[str], address: PciAddress) -> bool:
        return want is None or self._model(address) == want

    def _taken(self, need: Need, ident: str) -> Optional[str]:
        """Why `ident` cannot be this VM's, whatever it is (None: it can)."""
        if ident in self.chosen:
            return "given to another of its vGPUs"
        if ident in self.left_over:
            return "left by a run that is over: the arrival's cleanup destroys it"
        hands_off = self.occ.hands_off(ident)
        if hands_off is not None:
            return hands_off.reason
        if not self.occ.takeable(ident, self.vm):
            return refusal(self.occ, need.type.kind, ident, self.vm) or "held"
        return None

    def _keep(self, need: Need, ident: str) -> tuple[Optional[Choice], str]:
        """The device `ident` here as the vGPU `need` asks for, made ready when it
        is not (an mdev gpulib knows created, an idle VF typed); else None and
        why not."""
        why = self._taken(need, ident)
        if why is not None:
            return None, why
        if need.type.kind == "mdev":
            return self._keep_mdev(need, ident)
        return self._keep_vf(need, ident)

    def _keep_mdev(self, need: Need, uuid: str) -> tuple[Optional[Choice], str]:
        t = need.type
        live = mdev.read_mdev(self.sysfs, uuid)
        rec = self.state.vgpus.get(uuid)
        action: Optional[AllocationAction] = None
        if live is not None:
            parent, type_id = live.parent, live.type_id
        elif rec is not None:
            try:
                parent, type_id = PciAddress.parse(rec.parent), rec.type_id
            except GpulibError:
                return None, "not here"
            action = AllocateVgpu(uuid, rec.parent, rec.type_id, rec.on_demand, rec.pool)
        else:
            return None, "not here"
        if str(parent) in self.state.unmanaged:
            return None, f"on the unmanaged {parent}"
        if not self._same_gpu(t.gpu, parent):
            return None, f"on a {self._model(parent)} GPU, not a {t.gpu}"
        kind = mdev.MdevType(self.sysfs, parent, type_id)
        if not need.want.matches_type(type_id, kind.name):
            return None, f"of type {type_id} ({kind.name})"
        if action is not None and not kind.available_instances:
            return None, f"not live, and {parent} has no room to create it again"
        on_demand = rec.on_demand if rec is not None else False
        return Choice(need, uuid, "readied" if action else "kept", action, on_demand), ""

    def _keep_vf(self, need: Need, ident: str) -> tuple[Optional[Choice], str]:
        t = need.type
        try:
            vf = PciAddress.parse(ident)
        except GpulibError:
            return None, "no PCI address"
        if not nvidia.is_vendor_vf(self.sysfs, vf):
            return None, "no NVIDIA vGPU VF here"
        if not self._same_gpu(t.gpu, vf):
            return None, f"on a {self._model(vf)} GPU, not a {t.gpu}"
        rec = self.state.vf_types.get(ident)
        current = nvidia.current_type(self.sysfs, vf) or 0
        if current:
            name = vf_type_name(self.sysfs, self.state, vf, current, self._model(vf))
            if not need.want.matches_vendor(current, name):
                return None, f"of vGPU type {current} ({name})"
            on_demand = rec.on_demand if rec is not None and rec.type_id == current else False
            return Choice(need, ident, "kept", None, on_demand), ""
        creatable = nvidia.creatable_types(self.sysfs, vf)
        if rec is not None:
            # A VF gpulib records a type for (a pool member, one typed by hand)
            # that lost it (a reboot): its own type or none.
            if rec.type_id not in creatable or not need.want.matches_vendor(
                    rec.type_id, vf_type_name(self.sysfs, self.state, vf, rec.type_id)):
                return None, f"recorded for vGPU type {rec.type_id}"
            on_demand = rec.on_demand and rec.pool is None
            action = AllocateVf(ident, rec.type_id, rec.name, on_demand, rec.pool)
            return Choice(need, ident, "readied", action, on_demand), ""
        tid = pick(creatable, need.want.type_id, need.want.profile)
        if tid is None:
            return None, f"idle, and it cannot take {need.what} now"
        return Choice(need, ident, "readied", AllocateVf(ident, tid, creatable[tid], True),
                      True), ""

    def _free_uuid(self, uuid: str) -> bool:
        return uuid not in self.chosen and uuid not in self.state.vgpus and \
            not any(i.id == uuid for i in self.state.intents) and \
            mdev.read_mdev(self.sysfs, uuid) is None and not self.occ.is_held(uuid)

    def _new_uuid(self, need: Need) -> str:
        """The UUID the XML names when this host does not use it (nothing to
        rewrite), else the first UUID derived from the domain's that it does not
        use: the same on a retry, so what a killed attempt made is found again."""
        if self._free_uuid(need.named):
            return need.named
        for k in range(MAX_DERIVED):
            u = derive_uuid(self.domain_uuid, k)
            if self._free_uuid(u):
                return u
        raise NotAvailableError(f"no free mdev UUID for {self.vm} (derived indexes "
                                f"0..{MAX_DERIVED - 1} all in use)")

    def choose(self, need: Need) -> Choice:
        t = need.type
        # The device the XML names (the source's, or the one the management
        # server chose here), then what this VM holds here already.
        tried = [need.named] + [d.id for d in self.own if d.kind == t.kind and d.id != need.named]
        why = ""
        for ident in tried:
            choice, reason = self._keep(need, ident)
            if choice is not None:
                self._hold(choice.target, choice.action)
                return choice
            if ident == need.named:
                why = reason

        def serves(c: Candidate) -> bool:
            return c.kind == t.kind and (t.gpu is None or
                                         f"{c.gpu.fn.vendor_id:04x}:{c.gpu.fn.device_id:04x}"
                                         == t.gpu)

        if self._allocator is None:
            self._allocator = self._make_allocator()
            for ident, made in self._kept:
                self._allocator.reserve(ident, made)
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
        if need.rewritten and target != need.named:
            log.warning("%s: %s %s, which the incoming XML names (the management server's "
                        "choice, when a CloudStack agent rewrote it), is %s here: %s is given "
                        "instead; CloudStack's record is corrected by the next discovery "
                        "report", self.vm, t.kind, need.named, why or "not usable", target)
        return Choice(need, target, "new" if action.on_demand else "pool", action,
                      action.on_demand, parent)

    def _hold(self, ident: str, made: Optional[AllocationAction]) -> None:
        """`ident` is this VM's from now on: for the occupancy, and for the
        allocator (made later, or already) which must not offer it again nor,
        in a dry run, the capacity its making takes."""
        from gpulib.occupancy import PENDING, Hold

        self.chosen.add(ident)
        self.occ.add(Hold(self.vm, PENDING, ident))
        self._kept.append((ident, made))
        if self._allocator is not None:
            self._allocator.reserve(ident, made)


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
            journal.set_vf_type(vf, nvidia.current_type(sysfs, vf) or 0, orphan.on_demand)
            on_demand = orphan.on_demand
    return Device(kind, choice.target, on_demand=on_demand)


def records_here(sysfs: Sysfs, state: State, choices: list[Choice]) -> list[DeviceType]:
    """What each recorded vGPU is on this host now (its device ready), for the
    metadata that travels on: the type's id and name here, in hostdev order."""
    out = []
    for c in choices:
        if not c.need.recorded:
            continue
        found: Optional[DeviceType]
        if c.need.type.kind == "mdev":
            found = mdev_type(sysfs, state, c.target)
        else:
            found = vf_type(sysfs, state, PciAddress.parse(c.target))
        if found is None:
            found = c.need.type._replace(id=c.target)
        elif found.name is None and found.type_id == c.need.type.type_id:
            # Nothing here names the type (a typed VF's list no longer shows
            # it): the same id, so the incoming record's name still holds.
            found = found._replace(name=c.need.type.name)
        out.append(found)
    return out


def rewrite(dom: Domain, choices: list[Choice], records: list[DeviceType]) -> None:
    """Point each hostdev at its device here and record what each vGPU is;
    nothing else of the XML changes."""
    hostdevs = dom.hostdevs()
    for c in choices:
        h = hostdevs[c.need.at]
        if isinstance(h, MdevHostdev):
            h.uuid = c.target
        else:
            h.address = PciAddress.parse(c.target)
    if any(c.need.recorded for c in choices):
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
    from gpulib.hostview import discover_host

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
        occ = Occupancy.build(sysfs, state, running,
                              arrival_grace=config.get_float("release", "arrival_timeout"))
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
            # Arriving until `prepare begin` records the start again: an
            # arrival libvirt abandons is dead after [release] arrival_timeout.
            record(state, vm, domain_uuid, devices, status="pending",
                   clock=boot_clock(ctx)).arriving = True
            records = records_here(sysfs, state, choices)
            journal.commit()
        except BaseException:
            if journal.rollback():
                store.revert_checkpoints()
            raise
        rewrite(dom, choices, records)
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


def _left_over(config: Config, state: State, occ: Occupancy) -> frozenset[str]:
    """The on-demand devices no run holds, which an arrival's cleanup
    (`release_stale`) destroys before it chooses: not there for it to keep."""
    if not config.get_bool("release", "destroy_on_demand"):
        return frozenset()
    recorded = [(node_id("mdev", u), r.on_demand) for u, r in state.vgpus.items()]
    recorded += [(node_id("vf", a), r.on_demand) for a, r in state.vf_types.items()]
    return frozenset(n for n, on_demand in recorded if on_demand and not occ.is_held(n))


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
        occ = Occupancy.build(sysfs, state, running,
                              arrival_grace=config.get_float("release", "arrival_timeout"))
        def dry_allocator() -> Allocator:
            allocator = _allocator(ctx, config, dom, state, occ, None)
            allocator.dry_run = True
            return allocator

        planner = Planner(sysfs, state, occ, dry_allocator, vm, domain_uuid,
                          _own(state, vm, domain_uuid), _left_over(config, state, occ))
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

