"""Give a plain-libvirt VM a GPU or vGPUs in its persistent definition, and take them back.

`gpulib attach` and `gpulib detach` edit the definition the way the
CloudStack transformer edits a domain at start, so the qemu hook's
`prepare begin` finds everything it needs when the VM starts:

* vGPUs: a gpulib metadata request (`<gpulib:vgpu>` in `<metadata>`) plus
  one mdev `<hostdev>` per vGPU, named by the UUID gpulib derives from the
  domain UUID (`domain.derive_uuid`, index k = the k-th vGPU of the request,
  in document order). At start, `prepare begin` sees a named UUID that is
  not live, finds it among the request's derived UUIDs and creates it on
  demand; `release end` destroys it. Nothing is created or recorded now.
* whole GPUs (or an SR-IOV VF): a PCI `<hostdev>` (managed, except NVIDIA
  vendor-specific vGPU VFs, which must keep their driver), and the GPU's
  IOMMU-group endpoints (HDMI audio) beside it on one guest slot, exactly
  as the transformer places them.

Capacity, ownership and placement are checked against the host as it is
now: the vGPUs go on the NUMA node the VM's memory is bound to when that
node has room (written as `numa=` in the request, so `prepare begin`
places them there). gpulib's state is only read: the VM's allocation is
recorded when it starts, by the hooks.

On a CloudStack host the management server owns the domain XML (it
redefines the VM on every start): attach and detach refuse there unless
forced.
"""

from __future__ import annotations

import difflib
import os
from typing import TYPE_CHECKING, NamedTuple, Optional, Protocol

from lxml import etree

from gpulib import logger
from gpulib.allocator import gpu_matches
from gpulib.config import Config, metadata_allowed
from gpulib.context import AGENT_PROPERTIES, DEFINED_DOMAINS, Context
from gpulib.domain import (
    MAX_REQUEST_COUNT,
    DeviceType,
    Domain,
    GpuRequest,
    GpuRequestItem,
    Hostdev,
    MdevHostdev,
    PassthroughRequest,
    PciHostdev,
    VgpuRequest,
    derive_uuid,
    parse_domain,
)
from gpulib.errors import DeviceError, GpulibError, InputError, NotAvailableError
from gpulib.lazyre import lazy
from gpulib.lifecycle import open_store
from gpulib.mdev import live_mdevs
from gpulib.occupancy import refusal
from gpulib.pci import BRIDGE_BASE_CLASS, PciAddress
from gpulib.profiles import same_name
from gpulib.state import State
from gpulib.sysfs import DOCUMENT_MAX
from gpulib.validate import check_uuid, check_vm_name

if TYPE_CHECKING:
    from gpulib.discovery import Gpu, Inventory
    from gpulib.virsh import DomainInfo

log = logger.get(__name__)

_VENDOR_DEVICE_RE = lazy(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{4}$")


class Libvirt(Protocol):
    """What attach/detach need from libvirt (gpulib.virsh.Virsh provides it)."""

    @property
    def where(self) -> str: ...

    def dominfo(self, name: str) -> DomainInfo: ...

    def dumpxml_inactive(self, name: str) -> str: ...

    def define(self, xml: str) -> None: ...


class Wanted(NamedTuple):
    """What `gpulib attach` was asked for: exactly one of the three."""

    profile: Optional[str] = None
    type_id: Optional[str] = None
    gpu: Optional[str] = None
    count: int = 1  # type: ignore[assignment]  # shadows tuple.count, as domain's requests do

    def check(self) -> None:
        given = [x for x in (self.profile, self.type_id, self.gpu) if x is not None]
        if len(given) != 1:
            raise InputError("say what to attach: exactly one of --profile, --type or --gpu")
        if not 1 <= self.count <= MAX_REQUEST_COUNT:
            raise InputError(f"--count must be 1..{MAX_REQUEST_COUNT}, not {self.count}")
        if self.type_id is not None or self.profile is not None:
            VgpuRequest(self.profile, self.type_id, self.count).checked()


class Change:
    """A planned edit of one VM's definition."""

    def __init__(self, vm: str, before: str, dom: Domain) -> None:
        self.vm = vm
        self.before = before
        self.dom = dom
        self.lines: list[str] = []  # one per device added or removed
        self.removed_pci: list[PciAddress] = []
        self.notes: list[str] = []

    @property
    def after(self) -> str:
        return self.dom.to_xml()

    @property
    def changed(self) -> bool:
        return self.dom.changed

    def diff(self, action: str) -> str:
        """Unified diff of the definition. Both sides serialized by lxml, so
        that libvirt's quoting style does not make every line differ."""
        old = _serialize(self.before)
        new = _serialize(self.after)
        return "".join(difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"{self.vm} (defined)", tofile=f"{self.vm} (after gpulib {action})"))


def _serialize(xml: str) -> str:
    dom = parse_domain(xml)
    text = str(etree.tostring(dom.root, encoding="unicode", with_tail=False))
    return text if text.endswith("\n") else text + "\n"


# -- the host --------------------------------------------------------------------------------


def cloudstack_host(ctx: Context) -> bool:
    """The CloudStack agent is installed: the same test as `allow_metadata_requests = auto`."""
    return ctx.sysfs.exists(AGENT_PROPERTIES)


def _refuse_cloudstack(ctx: Context, force: bool) -> None:
    if cloudstack_host(ctx) and not force:
        raise InputError("this is a CloudStack host (/etc/cloudstack/agent/agent.properties): "
                         "the management server owns the VMs' XML and would undo the edit; "
                         "use --force to edit the definition anyway")


def _inventory(ctx: Context, config: Config) -> tuple[State, Inventory]:
    from gpulib.hostview import discover_host

    state = open_store(ctx, config).load()
    return state, discover_host(ctx, config, state=state, learn=False)


def _held_by(state: State, inv: Inventory, vm: str, ident: str) -> Optional[str]:
    """Why `vm` may not take a PCI device now (one line), or None: the one
    occupancy rule of the hooks and discovery (a stopped VM's definition
    holds nothing: ARCHITECTURE.md, "Ownership of the device tree")."""
    return refusal(inv.occupancy, "pci", ident, vm)


def _whole_taken(state: State, inv: Inventory, vm: str, parent: PciAddress) -> bool:
    """Whether another VM holds a vGPU parent (a GPU or VF) whole, so that no new
    vGPU can go on it. Other vGPUs on it do not count: they share it."""
    return bool(inv.occupancy.parent_conflicts(str(parent), vm))


def _defined_users(ctx: Context, vm: str) -> dict[PciAddress, list[str]]:
    """PCI devices named in other VMs' definitions (etc/libvirt/qemu): they do
    not hold them, but only one of those VMs can run at a time."""
    out: dict[PciAddress, list[str]] = {}
    for name in sorted(ctx.sysfs.listdir(DEFINED_DOMAINS)):
        if not name.endswith(".xml"):
            continue
        try:
            data = ctx.sysfs.read_bytes(f"{DEFINED_DOMAINS}/{name}", DOCUMENT_MAX)
            if data is None or b"<hostdev" not in data:
                continue
            dom = parse_domain(data)
            other = dom.name_checked()
            addresses = [h.address for h in dom.pci_hostdevs()]
        except (GpulibError, OSError) as exc:
            log.debug("skipping the definition %s: %s", name, exc)
            continue
        if other != vm:
            for a in addresses:
                out.setdefault(a, []).append(other)
    return out


def _note_defined_elsewhere(change: Change, defined: dict[PciAddress, list[str]],
                            addr: PciAddress) -> None:
    others = defined.get(addr)
    if others:
        change.notes.append(f"{addr} is also in the definition of VM {', '.join(others)}: "
                            "only one of them can run at a time")


def _unmanaged(state: State, gpu: Gpu, address: Optional[PciAddress] = None) -> bool:
    return str(gpu.address) in state.unmanaged or \
        (address is not None and str(address) in state.unmanaged)


def _preferred_numa(dom: Domain) -> Optional[int]:
    nodes = dom.numa_nodes()
    return nodes[0] if len(nodes) == 1 else None


# -- attach ----------------------------------------------------------------------------------


def plan_attach(ctx: Context, config: Config, xml: str, wanted: Wanted) -> Change:
    """The edit `gpulib attach` makes to the definition `xml`; changes nothing."""
    wanted.check()
    dom = parse_domain(xml)
    change = Change(dom.name_checked(), xml, dom)
    state, inv = _inventory(ctx, config)
    if wanted.gpu is not None:
        _attach_pci(ctx, config, change, state, inv, wanted.gpu, wanted.count)
    else:
        _attach_vgpus(ctx, config, change, state, inv, wanted)
    return change


def _attach_vgpus(ctx: Context, config: Config, change: Change, state: State,
                  inv: Inventory, wanted: Wanted) -> None:
    dom = change.dom
    label = wanted.profile or wanted.type_id or "?"
    what = f"profile {label!r}" if wanted.profile else f"type {label!r}"
    # The starts' own rule (gpulib.config): attach never writes a request they ignore.
    if not metadata_allowed(ctx, config):
        raise InputError("gpulib metadata requests are off on this host "
                         "(allow_metadata_requests): the qemu hook would not create the "
                         "vGPUs at start; set it to yes in gpulib.conf to attach vGPUs")
    if dom.uuid is None:
        raise InputError(f"VM {change.vm} has no <uuid>: gpulib derives vGPU UUIDs from it")
    duuid = dom.uuid_checked()
    match = VgpuRequest(wanted.profile, wanted.type_id, wanted.count).checked()
    request = dom.metadata_request() or GpuRequest()
    live = live_mdevs(ctx.sysfs)
    # vGPUs this VM was already promised (attached, not live yet) need room too.
    pending = 0
    k = 0
    for v in request.vgpus:
        for _ in range(v.count):
            if _same_request(v, wanted.profile, wanted.type_id) and \
                    derive_uuid(duuid, k) not in live:
                pending += 1
            k += 1
    first = k
    free, offered, vendor_only, typed_free = _vgpu_capacity(state, inv, change.vm, match)
    if not offered:
        if typed_free:
            # A VF that already carries the profile (or gets it from gpulib's
            # registry at start) needs no new type: attach it as it is.
            raise InputError(
                f"vGPU {what} is offered only by NVIDIA vendor-specific VFs: VF "
                f"{typed_free[0]} carries it and is free: gpulib attach {change.vm} "
                f"--gpu {typed_free[0]}")
        if vendor_only:
            addr, tid = vendor_only[0]
            raise InputError(
                f"vGPU {what} is offered only by NVIDIA vendor-specific VFs ({addr}): "
                f"give a VF that type with gpulib vf set-type --keep {addr} {tid}, then "
                f"gpulib attach {change.vm} --gpu {addr}")
        raise InputError(f"no GPU on this host offers vGPU {what} "
                         "(gpulib mdev types lists the profiles)")
    need = wanted.count + pending
    total = sum(free.values())
    if total < need:
        extra = f", {pending} more already attached to {change.vm}" if pending else ""
        raise NotAvailableError(f"no capacity left for {wanted.count} vGPU(s) of {what}: "
                                f"{total} can be created on this host{extra}")
    node = _preferred_numa(dom)
    numa = node if node is not None and free.get(node, 0) >= need else None
    if node is not None and numa is None:
        change.notes.append(f"NUMA node {node} (the VM's memory) has no room for the vGPUs: "
                            "they go wherever there is room")
    items: list[GpuRequestItem] = list(request.items)
    last_vgpu = max((i for i, it in enumerate(items) if isinstance(it, VgpuRequest)),
                    default=None)
    merged = False
    if last_vgpu is not None:
        prev = items[last_vgpu]
        assert isinstance(prev, VgpuRequest)
        if _same_request(prev, wanted.profile, wanted.type_id) and prev.numa == numa \
                and prev.count + wanted.count <= MAX_REQUEST_COUNT:
            # The last vGPU item's range ends where the new UUIDs start: one item.
            items[last_vgpu] = prev._replace(count=prev.count + wanted.count)
            merged = True
    if not merged:
        items.append(VgpuRequest(wanted.profile, wanted.type_id, wanted.count, numa))
    dom.set_metadata_request(GpuRequest(tuple(items)))
    _note_missing_hook(ctx, change)
    where = f" on NUMA node {numa}" if numa is not None else ""
    for index in range(first, first + wanted.count):
        uuid = derive_uuid(duuid, index)
        if dom.find_mdev_hostdev(uuid) is not None:
            raise InputError(f"VM {change.vm} already names vGPU {uuid} outside gpulib's "
                             "request: detach it first")
        dom.add_mdev_hostdev(uuid, display="off")
        change.lines.append(f"+ vGPU {uuid} ({label}{where}; created when the VM starts)")
    _record_types(dom, inv, match, [derive_uuid(duuid, i)
                                    for i in range(first, first + wanted.count)])


def _record_types(dom: Domain, inv: Inventory, match: VgpuRequest, uuids: list[str]) -> None:
    """Record what the new vGPUs are (`<gpulib:device>`: it travels with a live
    migration) when this host offers the request as one type of one GPU model;
    otherwise the request itself says what they are."""
    offers = set()
    for gpu in inv.gpus:
        model = f"{gpu.fn.vendor_id:04x}:{gpu.fn.device_id:04x}"
        types = list(gpu.mdev_types) + [t for vf in gpu.vfs for t in vf.mdev_types]
        offers |= {(t.type_id, t.name, model) for t in types
                   if match.matches_type(t.type_id, t.name)}
    if len(offers) != 1:
        return
    type_id, name, model = offers.pop()
    dom.set_device_types(dom.device_types() + [DeviceType("mdev", u, type_id, name, model)
                                               for u in uuids])


def _note_missing_hook(ctx: Context, change: Change) -> None:
    from gpulib.context import LIBVIRT_HOOK

    # lexists: the hook is a link to /usr/libexec, which need not exist below the root.
    if not os.path.lexists(ctx.path(LIBVIRT_HOOK)):
        change.notes.append(f"gpulib's qemu hook is not installed (/{LIBVIRT_HOOK}): nothing "
                            "will create the vGPUs when the VM starts (see gpulib doctor)")


def _same_request(item: VgpuRequest, profile: Optional[str], type_id: Optional[str]) -> bool:
    """Whether a request item asks for what `--profile`/`--type` ask for (a
    profile by the one rule for names, `profiles`; a type id exactly)."""
    if profile is not None:
        return same_name(item.profile, profile)
    return item.profile is None and item.type_id == type_id


def _vgpu_capacity(state: State, inv: Inventory, vm: str, match: VgpuRequest
                   ) -> tuple[dict[int, int], bool, list[tuple[str, int]], list[str]]:
    """vGPUs of a type that can be created now, by NUMA node; whether any GPU
    offers the type as an mdev type; the VFs offering it vendor-specifically;
    the free vendor VFs that already carry it (their current type, or the one
    gpulib's registry gives them at start)."""
    taken = {d.id for a in state.allocations.values() for d in a.devices}
    free: dict[int, int] = {}
    offered = False
    # Untyped VFs that can take it (free ones, then held ones), with the type id.
    vendor: list[tuple[str, int]] = []
    held: list[tuple[str, int]] = []
    typed: list[str] = []
    for gpu in inv.gpus:
        usable = not _unmanaged(state, gpu) and not _whole_taken(state, inv, vm, gpu.address)
        types = [(t, usable) for t in gpu.mdev_types]
        for vf in gpu.vfs:
            vf_ok = usable and str(vf.address) not in taken and \
                not _whole_taken(state, inv, vm, vf.address) and \
                not _unmanaged(state, gpu, vf.address)
            types.extend((t, vf_ok) for t in vf.mdev_types)
            nv = vf.nvidia
            if nv is None:
                continue
            if nv.profile_type:
                # Offered free by discovery: no VM holds it and its GPU can give
                # it the type (the occupancy's one answer, as the hooks ask it).
                if match.matches_vendor(nv.profile_type, nv.profile_name) and \
                        vf.used_by is None and vf.available and vf_ok:
                    typed.append(str(vf.address))
            else:
                fits = [(str(vf.address), tid) for tid, name in nv.creatable.items()
                        if match.matches_vendor(tid, name)][:1]
                # A VF nobody holds is the one to type: those come first.
                (vendor if vf_ok and vf.used_by is None else held).extend(fits)
        for t, ok in types:
            if not match.matches_type(t.type_id, t.name):
                continue
            offered = True
            if ok:
                node = gpu.fn.numa_node
                free[node] = free.get(node, 0) + max(0, t.available_instances or 0)
    return free, offered, vendor + held, typed


def _attach_pci(ctx: Context, config: Config, change: Change, state: State, inv: Inventory,
                target: str, count: int) -> None:
    dom = change.dom
    defined = _defined_users(ctx, change.vm)
    try:
        address: Optional[PciAddress] = PciAddress.parse(target)
    except InputError:
        address = None
    if address is not None:
        if count != 1:
            raise InputError("--count goes with --profile, --type or --gpu VENDOR:DEVICE; "
                             "an address names one device")
        picks = [_check_address(ctx, change, state, inv, address)]
    elif _VENDOR_DEVICE_RE.match(target):
        picks = _pick_model(change, state, inv, target.lower(), count, defined)
    else:
        raise InputError(f"--gpu takes a PCI address (0000:3b:00.0) or vendor:device "
                         f"(10de:2484), not {target!r}")
    for addr, managed, name in picks:
        h = dom.add_pci_hostdev(addr, managed=managed)
        peers = _add_group_peers(ctx, config, dom, h)
        slot = h.guest_address
        on = f" on guest slot {slot.slot:#04x}" if slot is not None and peers else ""
        change.lines.append(f"+ PCI {addr} ({name}){on}")
        _note_defined_elsewhere(change, defined, addr)
        for peer in peers:
            held = _held_by(state, inv, change.vm, str(peer))
            if held is not None:
                raise DeviceError(f"{held} (in the IOMMU group of {addr})")
            change.lines.append(f"+ PCI {peer} (IOMMU group of {addr}, same guest slot)")


def _check_address(ctx: Context, change: Change, state: State, inv: Inventory,
                   addr: PciAddress) -> tuple[PciAddress, bool, str]:
    vm = change.vm
    if not ctx.sysfs.exists(f"sys/bus/pci/devices/{addr}"):
        raise InputError(f"no PCI device {addr} on this host")
    if change.dom.find_pci_hostdev(addr) is not None:
        raise InputError(f"VM {vm} already has PCI device {addr}")
    owner = inv.owner_of(addr)
    if owner is None:
        raise InputError(f"{addr} is not a GPU or a VF of one (gpulib discover lists them)")
    gpu, vf = owner
    if _unmanaged(state, gpu, addr):
        raise InputError(f"{addr} is unmanaged: gpulib leaves it alone "
                         f"(gpulib device manage {gpu.address})")
    managed = True
    name = gpu.device_name
    if vf is None:
        if not gpu.passthrough_enabled:
            raise NotAvailableError(
                f"GPU {addr} hands out vGPUs or VFs ({gpu.mode}): attach one of those with "
                "--profile, --type or the VF's address")
    else:
        name = vf.device_name or name
        if vf.mdev_parent:
            raise InputError(f"VF {addr} hands out mdev vGPUs: attach one with --profile or "
                             "--type")
        if vf.nvidia is not None:
            if not vf.nvidia.profile_type:
                raise InputError(f"NVIDIA VF {addr} has no vGPU type: give it one with "
                                 f"gpulib vf set-type --keep {addr} TYPE first")
            # libvirt would unbind the nvidia driver from a managed VF: never managed.
            managed = False
            name = vf.nvidia.profile_name or name
    held = _held_by(state, inv, vm, str(addr))
    if held is not None:
        raise DeviceError(held)
    return addr, managed, name


def _pick_model(change: Change, state: State, inv: Inventory, model: str, count: int,
                defined: dict[PciAddress, list[str]]) -> list[tuple[PciAddress, bool, str]]:
    match = PassthroughRequest(model, count).checked()
    matching = [g for g in inv.gpus if gpu_matches(match, g)]
    if not matching:
        raise InputError(f"no GPU {model} on this host (gpulib discover lists them)")
    free = []
    busy = []
    for g in matching:
        ident = str(g.address)
        if change.dom.find_pci_hostdev(g.address) is not None:
            continue
        held = _held_by(state, inv, change.vm, ident)
        if _unmanaged(state, g) or not g.passthrough_enabled or held is not None:
            busy.append(held or f"{ident} " + ("is unmanaged" if _unmanaged(state, g) else
                                               f"hands out vGPUs or VFs ({g.mode})"))
            continue
        free.append(g)
    if len(free) < count:
        why = f" ({'; '.join(busy)})" if busy else ""
        raise NotAvailableError(f"no capacity left: {len(free)} of the {count} GPU(s) "
                                f"{model} asked for are free{why}")
    node = _preferred_numa(change.dom)
    # The VM's own NUMA node first, as the allocator places vGPUs; then GPUs no
    # other VM's definition names.
    free.sort(key=lambda g: (node is not None and g.fn.numa_node != node,
                             g.address in defined, str(g.address)))
    return [(g.address, True, g.device_name) for g in free[:count]]


def _add_group_peers(ctx: Context, config: Config, dom: Domain,
                     h: PciHostdev) -> list[PciAddress]:
    """The IOMMU-group endpoints beside a GPU on one guest slot, as the
    transformer adds them (its own routine, so the two cannot drift apart)."""
    if not config.get_bool("transformer", "add_group_functions"):
        return []
    from gpulib.hostfacts import HostReader
    from gpulib.placement import Placement

    placement = Placement(dom, dom.name_checked(), config, HostReader(ctx, config))
    return [PciAddress.parse(d.id) for d in placement.add_group_peers(h)]


# -- detach ----------------------------------------------------------------------------------


def plan_detach(ctx: Context, config: Config, xml: str, targets: list[str]) -> Change:
    """The edit `gpulib detach` makes: the named devices (vGPU UUIDs, PCI
    addresses) or, with none named, every GPU, vGPU and gpulib request."""
    dom = parse_domain(xml)
    change = Change(dom.name_checked(), xml, dom)
    request = dom.metadata_request()
    derived: dict[str, int] = {}
    if request is not None and request.vgpus and dom.uuid is not None:
        duuid = dom.uuid_checked()
        total = sum(v.count for v in request.vgpus)
        derived = {derive_uuid(duuid, k): k for k in range(total)}
    _, inv = _inventory(ctx, config)
    removed: list[int] = []
    if not targets:
        for h in dom.hostdevs():
            if isinstance(h, MdevHostdev) or (isinstance(h, PciHostdev)
                                              and _is_gpu_function(inv, h.address)):
                _remove(change, h, derived, removed)
        for h in dom.pci_hostdevs():  # what is left of the GPUs' IOMMU groups
            if _group_peer_of_removed(ctx, change, h):
                _remove(change, h, derived, removed)
        if request is not None:
            dom.set_metadata_request(None)
            change.lines.append("- gpulib request " + _describe(request))
        _forget_removed(dom)
        return change
    for target in targets:
        h = _find(change, target)
        gpu_group = _group_of(ctx, h.address) if isinstance(h, PciHostdev) else None
        why = f" (IOMMU group of {h.address})" if isinstance(h, PciHostdev) else ""
        _remove(change, h, derived, removed)
        if gpu_group is not None:
            for other in dom.pci_hostdevs():
                # Another GPU of the group was attached in its own right: it stays.
                if other.address in gpu_group and _is_endpoint(ctx, other.address) \
                        and not _is_gpu_function(inv, other.address):
                    _remove(change, other, derived, removed, why)
    if removed and request is not None:
        _renumber(change, request, derived, removed)
    _forget_removed(dom)
    return change


def _forget_removed(dom: Domain) -> None:
    """Drop the records (`<gpulib:device>`) of vGPUs the domain no longer names."""
    named = set()
    for h in dom.hostdevs():
        try:
            named.add(("mdev", h.uuid_checked()) if isinstance(h, MdevHostdev)
                      else ("vf", str(h.address)))
        except InputError:
            continue  # names no device: no record either
    dom.set_device_types([r for r in dom.device_types() if (r.kind, r.id) in named])


def _describe(request: GpuRequest) -> str:
    parts = [f"{v.count} x vGPU {v.profile or v.type_id}" for v in request.vgpus]
    parts += [f"{p.count} x GPU {p.model}" for p in request.passthrough]
    return ", ".join(parts) or "(empty)"


def _find(change: Change, target: str) -> Hostdev:
    dom = change.dom
    try:
        address = PciAddress.parse(target)
    except InputError:
        address = None
    if address is not None:
        h: Optional[Hostdev] = dom.find_pci_hostdev(address)
    else:
        try:
            uuid = check_uuid(target)
        except InputError:
            raise InputError(f"{target!r} is neither a vGPU UUID nor a PCI address") from None
        h = dom.find_mdev_hostdev(uuid)
    if h is None:
        raise InputError(f"VM {change.vm} has no device {target} in its definition")
    return h


def _remove(change: Change, h: Hostdev, derived: dict[str, int], removed: list[int],
            why: str = "") -> None:
    if h.element.getparent() is None:
        return  # already removed (named twice, or a group peer named too)
    if isinstance(h, MdevHostdev):
        uuid = h.uuid_checked()
        if uuid in derived:
            removed.append(derived[uuid])
        change.lines.append(f"- vGPU {uuid}")
    else:
        change.lines.append(f"- PCI {h.address}{why}")
        change.removed_pci.append(h.address)
    change.dom.remove_hostdev(h)


def _is_gpu_function(inv: Inventory, address: PciAddress) -> bool:
    return inv.owner_of(address) is not None


def _group_of(ctx: Context, address: PciAddress) -> Optional[set[PciAddress]]:
    from gpulib.pci import PciFunction, has_gpu_class, iommu_group_members

    try:
        fn = PciFunction.read(ctx.sysfs, address)
    except OSError:
        return None
    if fn.iommu_group is None or not has_gpu_class(fn.class_code):
        return None
    return set(iommu_group_members(ctx.sysfs, fn.iommu_group))


def _is_endpoint(ctx: Context, address: PciAddress) -> bool:
    klass = ctx.sysfs.read_int(f"sys/bus/pci/devices/{address}/class", 16) or 0
    return klass >> 16 != BRIDGE_BASE_CLASS


def _group_peer_of_removed(ctx: Context, change: Change, h: PciHostdev) -> bool:
    for address in change.removed_pci:
        group = _group_of(ctx, address)
        if group is not None and h.address in group and _is_endpoint(ctx, h.address):
            return True
    return False


def _renumber(change: Change, request: GpuRequest, derived: dict[str, int],
              removed: list[int]) -> None:
    """Keep the request and the derived UUIDs in step after vGPUs were removed.

    The k-th vGPU of the request has the k-th derived UUID: removing one
    shortens its item and moves every later vGPU down one index (they are
    created on demand at each start, so a new UUID costs nothing).
    """
    dom = change.dom
    duuid = dom.uuid_checked()
    gone = set(removed)
    items: list[GpuRequestItem] = []
    k = 0
    for item in request.items:
        if isinstance(item, VgpuRequest):
            kept = sum(1 for i in range(k, k + item.count) if i not in gone)
            k += item.count
            if kept:
                items.append(item._replace(count=kept))
        else:
            items.append(item)
    dom.set_metadata_request(GpuRequest(tuple(items)))
    by_index = {index: uuid for uuid, index in derived.items()}
    for old in sorted(by_index):
        if old in gone:
            continue
        new = old - sum(1 for r in gone if r < old)
        if new == old:
            continue
        h = dom.find_mdev_hostdev(by_index[old])
        if h is None:
            continue
        new_uuid = derive_uuid(duuid, new)
        h.uuid = new_uuid
        # Its record follows it.
        dom.set_device_types([r._replace(id=new_uuid) if r.id == by_index[old] else r
                              for r in dom.device_types()])
        change.lines.append(f"~ vGPU {by_index[old]} is now {new_uuid} (its place in the "
                            "request moved)")


# -- against libvirt -------------------------------------------------------------------------


def _definition(ctx: Context, libvirt: Libvirt, vm: str, force: bool) -> tuple[str, bool]:
    """The persistent definition of `vm` and whether it runs now."""
    check_vm_name(vm)
    _refuse_cloudstack(ctx, force)
    info = libvirt.dominfo(vm)
    if not info.persistent:
        raise InputError(f"VM {vm} is transient: it has no persistent definition to edit "
                         "(virsh define it first)")
    return libvirt.dumpxml_inactive(vm), info.running


def _commit(libvirt: Libvirt, change: Change, running: bool) -> None:
    if not change.changed:
        return
    if running:
        change.notes.append(f"VM {change.vm} is running: only its definition changed, "
                            "the change applies at its next start")
    # Someone else may have redefined the VM since we read it: never undo their edit.
    if libvirt.dumpxml_inactive(change.vm) != change.before:
        raise DeviceError(f"the definition of VM {change.vm} changed while gpulib edited it; "
                          "run the command again")
    libvirt.define(change.after)
    for line in change.lines:
        log.info("VM %s definition (%s): %s", change.vm, libvirt.where, line)


def attach(ctx: Context, config: Config, libvirt: Libvirt, vm: str, wanted: Wanted,
           dry_run: bool = False, force: bool = False) -> Change:
    wanted.check()
    xml, running = _definition(ctx, libvirt, vm, force)
    change = plan_attach(ctx, config, xml, wanted)
    if dry_run:
        if running:
            change.notes.append(f"VM {vm} is running: the change would apply at its next "
                                "start")
        return change
    _commit(libvirt, change, running)
    return change


def detach(ctx: Context, config: Config, libvirt: Libvirt, vm: str, targets: list[str],
           dry_run: bool = False, force: bool = False) -> Change:
    xml, running = _definition(ctx, libvirt, vm, force)
    change = plan_detach(ctx, config, xml, targets)
    if dry_run:
        if running and change.changed:
            change.notes.append(f"VM {vm} is running: the change would apply at its next "
                                "start")
        return change
    _commit(libvirt, change, running)
    return change
