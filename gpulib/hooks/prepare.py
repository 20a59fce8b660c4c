"""Make the devices a domain names ready, and record what the VM holds.

Shared by the CloudStack transformer (which may also edit the XML) and
libvirt's `prepare begin` / `migrate begin` / `restore begin` (which may not).
Everything happens inside one state transaction, so concurrent VM starts are
serialised and a device is never given to two VMs (DESIGN section 6.1):

* mdev with a live UUID: kept; refused if another running VM uses it;
* mdev not live but known (gpulib's registry, mdevctl's definitions): created
  again on its parent with its type (after a reboot);
* mdev whose UUID a gpulib metadata request derives from the domain UUID:
  created on demand (plain libvirt hosts name them in their XML);
* NVIDIA vendor VF whose `current_vgpu_type` is 0: given its recorded type;
* a passthrough GPU: the other endpoint functions of its IOMMU group are
  added (HDMI audio, USB-C controller) on the same guest slot, when editing;
* gpulib metadata requests (transformer only, when allowed): allocated,
  created, and inserted as hostdevs.
The allocation is recorded pending; onStart (or the VM showing up running)
makes it active.
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
from gpulib.domain import Domain, GpuRequest, PciHostdev, derive_uuid
from gpulib.errors import DeviceError
from gpulib.hooks.vmstate import release_stale
from gpulib.lifecycle import follow_definitions, open_store
from gpulib.mdevctl import Definition, read_definitions
from gpulib.pci import PciAddress, PciFunction, iommu_group_members
from gpulib.state import Device, State
from gpulib.usage import Usage, read_usage

if TYPE_CHECKING:
    from gpulib.discovery import Inventory

log = logging.getLogger(__name__)

BRIDGE_BASE_CLASS = 0x06
# Guest slots gpulib uses for a GPU that has no fixed guest address but needs
# its group peers beside it; low slots are left to the machine's own devices.
FIRST_GUEST_SLOT = 0x10


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
        self.vm = dom.name_checked()
        self.domain_uuid = dom.uuid_checked() if dom.uuid else None

    def run(self) -> list[Device]:
        with open_store(self.ctx, self.config).transaction() as state:
            usage = read_usage(self.sysfs, include_defined=False)
            release_stale(self.ctx, state, usage, self.config, keep=self.vm)
            alloc = state.allocations.get(self.vm)
            if alloc is not None and alloc.domain_uuid not in (None, self.domain_uuid):
                # Same name, another domain: the old one is gone for good. Before
                # anything is prepared, so its release cannot undo this start's work.
                release(self.sysfs, state, self.vm, retry_seconds=0.5)
                alloc = None
            request = self.dom.metadata_request() if self.allow_metadata else None
            devices = self._named_devices(state, usage, request)
            if request is not None and self.edit_xml:
                devices += self._requested_devices(state, request, devices)
            if devices:
                record(state, self.vm, self.domain_uuid, devices,
                       status=alloc.status if alloc else "pending")
            return devices

    def run_reconnect(self) -> None:
        """Record what a running VM holds, creating nothing (it already runs)."""
        with open_store(self.ctx, self.config).transaction() as state:
            devices = []
            for h in self.dom.mdev_hostdevs():
                uuid = h.uuid_checked()
                rec = state.vgpus.get(uuid)
                if rec is not None:
                    rec.vm = self.vm
                devices.append(Device("mdev", uuid, on_demand=bool(rec and rec.on_demand)))
            for pci in self.dom.pci_hostdevs():
                ident = str(pci.address)
                vrec = state.vf_types.get(ident)
                if vrec is not None:
                    vrec.vm = self.vm
                kind = "vf" if nvidia.is_vendor_vf(self.sysfs, pci.address) else "pci"
                devices.append(Device(kind, ident, on_demand=bool(vrec and vrec.on_demand)))
            if devices:
                record(state, self.vm, self.domain_uuid, devices, status="active").status = \
                    "active"

    # -- devices the XML names ---------------------------------------------------------------
    def _refuse_if_used(self, state: State, usage: Usage, kind: str, ident: str,
                        user: Optional[str]) -> None:
        holder = user if user is not None and user != self.vm else None
        if holder is None:
            for vm, alloc in state.allocations.items():
                if vm != self.vm and alloc.status == "active" and \
                        any(d.id == ident for d in alloc.devices):
                    holder = vm
                    break
        if holder is None:
            return
        message = f"{kind} {ident} is in use by running VM {holder}"
        if self.config.get_bool("transformer", "refuse_in_use"):
            raise DeviceError(message)
        log.warning("%s: %s (refuse_in_use = no: starting anyway)", self.vm, message)

    def _unmanaged(self, state: State, address: PciAddress) -> bool:
        """An unmanaged device (or a VF or vGPU of an unmanaged GPU) is left alone."""
        if str(address) in state.unmanaged:
            return True
        physfn = self.sysfs.link_name(f"sys/bus/pci/devices/{address}/physfn")
        return physfn is not None and physfn in state.unmanaged

    def _named_devices(self, state: State, usage: Usage,
                       request: Optional[GpuRequest]) -> list[Device]:
        devices: list[Device] = []
        derived = self._derived_uuids(request)
        defs: Optional[dict[str, Definition]] = None
        for h in self.dom.mdev_hostdevs():
            uuid = h.uuid_checked()
            self._refuse_if_used(state, usage, "mdev", uuid, usage.vm_for_mdev(uuid))
            rec = state.vgpus.get(uuid)
            if rec is not None and state.unmanaged and \
                    self._unmanaged(state, PciAddress.parse(rec.parent)):
                log.info("%s: mdev %s is on unmanaged %s: left alone", self.vm, uuid,
                         rec.parent)
                continue
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
                    mdev.create(self.sysfs, PciAddress.parse(d.parent), d.type_id, uuid,
                                attrs=d.attrs)
                    log.info("created mdev %s (%s on %s) from its mdevctl definition for %s",
                             uuid, d.type_id, d.parent, self.vm)
                elif rec is not None:
                    mdev.create(self.sysfs, PciAddress.parse(rec.parent), rec.type_id, uuid)
                    log.info("recreated mdev %s (%s on %s) for %s", uuid, rec.type_id,
                             rec.parent, self.vm)
                else:
                    if uuid in derived:
                        devices += self._create_derived(state, uuid, derived[uuid])
                        continue
                    else:
                        raise DeviceError(
                            f"mdev {uuid} does not exist and gpulib has no record of its "
                            "parent and type (create it with gpulib mdev create)")
            if rec is not None:
                rec.vm = self.vm
            devices.append(Device("mdev", uuid, on_demand=bool(rec and rec.on_demand)))
        for pci in self.dom.pci_hostdevs():
            devices += self._pci_device(state, usage, pci)
        return devices

    def _pci_device(self, state: State, usage: Usage, h: PciHostdev) -> list[Device]:
        addr = h.address
        ident = str(addr)
        if not self.sysfs.exists(f"sys/bus/pci/devices/{addr}"):
            raise DeviceError(f"PCI device {addr} does not exist on this host")
        self._refuse_if_used(state, usage, "PCI device", ident, usage.vm_for_pci(addr))
        if state.unmanaged and self._unmanaged(state, addr):
            log.info("%s: PCI device %s is unmanaged: left alone", self.vm, addr)
            return []
        if h.display or h.ramfb:
            log.info("%s: display/ramfb on PCI hostdev %s has no effect (libvirt ignores "
                     "them for PCI devices)", self.vm, addr)
        if nvidia.is_vendor_vf(self.sysfs, addr):
            rec = state.vf_types.get(ident)
            if not nvidia.current_type(self.sysfs, addr):
                if rec is None:
                    raise DeviceError(f"NVIDIA VF {addr} has no vGPU type and gpulib has no "
                                      "record of one (set it with gpulib vf set-type)")
                nvidia.set_type(self.sysfs, addr, rec.type_id)
            if rec is not None:
                rec.vm = self.vm
            if h.managed and self.edit_xml:
                # libvirt would unbind the nvidia driver from a managed VF and
                # lose the vGPU: these VFs go to guests unmanaged.
                h.managed = False
                log.info("%s: NVIDIA vGPU VF %s set to managed='no'", self.vm, addr)
            return [Device("vf", ident, on_demand=bool(rec and rec.on_demand))]
        out = [Device("pci", ident)]
        if self.edit_xml and self.config.get_bool("transformer", "add_group_functions"):
            out += self._add_group_peers(h)
        return out

    def _add_group_peers(self, h: PciHostdev) -> list[Device]:
        fn = PciFunction.read(self.sysfs, h.address)
        if fn.iommu_group is None or fn.class_code >> 8 not in (0x03, 0x12):
            return []
        named = {x.address for x in self.dom.pci_hostdevs()}
        peers = []
        for member in iommu_group_members(self.sysfs, fn.iommu_group):
            if member == h.address or member in named:
                continue
            klass = self.sysfs.read_int(f"sys/bus/pci/devices/{member}/class", 16) or 0
            if klass >> 16 == BRIDGE_BASE_CLASS:
                continue  # bridges stay with the host; only endpoints go along
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

    def _free_guest_slot(self) -> int:
        used = set()
        for elem in self.dom.root.iter("address"):
            if elem.get("type") == "pci" and (elem.get("bus") or "0x00") in ("0x00", "0x0", "0"):
                try:
                    used.add(int(elem.get("slot") or "0", 0))
                except ValueError:
                    continue
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

    def _inventory(self, state: State) -> Inventory:
        # Only metadata requests need the whole host: imported here, not on
        # the common path of a VM that names its devices.
        from gpulib.runtime import discover_host

        return discover_host(self.ctx, self.config, state=state, learn=False)

    def _create_derived(self, state: State, uuid: str, req: VgpuRequest) -> list[Device]:
        allocator = Allocator(self.sysfs, state, self._inventory(state),
                              policy=self.config.get("allocator", "policy"))
        return allocator.allocate_vgpus(self.vm, req, lambda: uuid, fresh_only=True)

    def _requested_devices(self, state: State, request: GpuRequest,
                           named: list[Device]) -> list[Device]:
        have = {d.id for d in named}
        previous = state.allocations.get(self.vm)
        if previous is not None and previous.domain_uuid == self.domain_uuid:
            # Asked again for the same VM (a retried start): give what it holds.
            again = [d for d in previous.devices if d.id not in have]
            if again:
                return again + self._insert(again)
        if self.domain_uuid is None:
            raise DeviceError(f"domain {self.vm} has no <uuid>: gpulib derives vGPU UUIDs "
                              "from it")
        nodes = self.dom.numa_nodes()
        allocator = Allocator(self.sysfs, state, self._inventory(state),
                              policy=self.config.get("allocator", "policy"),
                              prefer_numa=nodes[0] if len(nodes) == 1 else None)
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

        try:
            for v in request.vgpus:
                devices += allocator.allocate_vgpus(
                    self.vm, VgpuRequest(v.profile, v.type_id, v.count, v.numa), next_uuid)
            for p in request.passthrough:
                devices += allocator.allocate_passthrough(
                    self.vm, PassthroughRequest(p.model, p.count, p.numa))
        except Exception:
            for d in devices:
                if d.on_demand:
                    allocator.destroy(d)
            raise
        return devices + self._insert(devices)

    def _insert(self, devices: list[Device]) -> list[Device]:
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
                    peers += self._add_group_peers(h)
        for d in devices:
            if d.kind == "pci" and self.dom.find_pci_hostdev(PciAddress.parse(d.id)) is None:
                self.dom.add_pci_hostdev(PciAddress.parse(d.id), managed=True)
        known = {d.id for d in devices}
        return [p for p in peers if p.id not in known]

    def _is_gpu(self, ident: str) -> bool:
        klass = self.sysfs.read_int(f"sys/bus/pci/devices/{ident}/class", 16) or 0
        return klass >> 16 in (0x03, 0x12)
