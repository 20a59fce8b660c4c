"""What a start reads of the host for the devices a domain names (no write).

The facts side of a start (`gpulib.hooks.prepare`): whether a named PCI
function is a GPU, a GPU's VF or a GPU's group peer (discovery's rule, its
include/exclude too), why a whole GPU or VF cannot be given, the IOMMU-group
members beside a GPU, and the live, defined and recorded state of named
mdevs, gathered into `plan.HostFacts` for the pure planner; for a metadata
request, what the devices a VM holds already are (`plan.HeldFacts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from gpulib import mdev, nvidia
from gpulib.config import Config, keeps_console
from gpulib.context import Context
from gpulib.definitions import follow_definitions
from gpulib.errors import InputError
from gpulib.mdevctl import Definition, read_definitions
from gpulib.occupancy import declaring_pools
from gpulib.ownership import host_endpoint_reason, host_endpoints, whole_gpu_refusal
from gpulib.pci import (
    BRIDGE_BASE_CLASS,
    PciAddress,
    PciFunction,
    group_number,
    has_gpu_class,
    iommu_group_members,
    is_boot_vga,
    physical_function,
)
from gpulib.plan import HeldFacts, HostFacts, MdevFacts, PciFacts, PeerFacts
from gpulib.state import Device, State
from gpulib.sysfs import ReadFailure

if TYPE_CHECKING:
    from gpulib.discovery import Inventory
    from gpulib.domain import GpuRequest


class HostReader:
    """Reads, for one start, what its plan needs of the host (cached per start)."""

    def __init__(self, ctx: Context, config: Config) -> None:
        self.ctx = ctx
        self.sysfs = ctx.sysfs
        self.config = config
        self._gpu_cache: dict[PciAddress, bool] = {}

    def is_gpu_fn(self, address: PciAddress) -> bool:
        """Whether discovery counts this function as a GPU (its include/exclude too)."""
        found = self._gpu_cache.get(address)
        if found is None:
            from gpulib.discovery import is_gpu_function

            fn = PciFunction.read_ids(self.sysfs, address)
            found = is_gpu_function(fn, self.config.match("discovery", "include"),
                                    self.config.match("discovery", "exclude"))
            self._gpu_cache[address] = found
        return found

    def is_listed(self, address: PciAddress, physfn: Optional[PciAddress]) -> bool:
        """A GPU or a GPU's VF: a device discovery reports in its own right.

        `physfn`: its PF, as `physical_function` finds it (a VF whose own
        `physfn` loops is still found by its PF's `virtfnN` links)."""
        if physfn is not None:
            return self.is_gpu_fn(physfn)
        return self.is_gpu_fn(address)

    def is_gpulibs(self, address: PciAddress, physfn: Optional[PciAddress]) -> bool:
        """A GPU, a GPU's VF, or an endpoint in a GPU's IOMMU group."""
        if self.is_listed(address, physfn):
            return True
        if physfn is not None:
            return False  # a VF of a device that is no GPU
        group = group_number(self.sysfs.link_name(f"sys/bus/pci/devices/{address}/iommu_group"))
        if group is None:
            return False
        return any(m != address and self.is_gpu_fn(m)
                   for m in iommu_group_members(self.sysfs, group))

    def whole_gpu_refusal(self, state: State, address: PciAddress) -> Optional[str]:
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
        group = group_number(self.sysfs.link_name(f"{rel}/iommu_group"))
        return whole_gpu_refusal(max(numvfs, virtfns), len(vgpus), pools=pools,
                                 console=self.is_console(address),
                                 host_endpoint=host_endpoint_reason(
                                     host_endpoints(self.sysfs, address, group)))

    def is_console(self, address: PciAddress) -> bool:
        """The boot VGA device, kept for the host (`config.keeps_console`)."""
        if not keeps_console(self.config):
            return False
        klass = self.sysfs.read_id(f"sys/bus/pci/devices/{address}/class", 24) or 0
        return is_boot_vga(self.sysfs, address, klass >> 8)

    def vf_refusal(self, state: State, address: PciAddress) -> Optional[str]:
        """Why a VF cannot be given whole: it carries vGPUs (mdevs on VFs), live
        or recorded (kept, pooled or allocated), as a PF with vGPUs cannot."""
        if not mdev.is_parent(self.sysfs, address):
            return None
        parent = str(address)
        vgpus = {u for u, r in state.vgpus.items() if r.parent == parent}
        vgpus |= {u for u, m in mdev.live_mdevs(self.sysfs).items() if m.parent == address}
        return whole_gpu_refusal(0, len(vgpus))

    def facts(self, state: State, uuids: list[str], addresses: list[PciAddress],
              peers_wanted: bool) -> HostFacts:
        """What the plan needs of the host, read now (the state may follow mdevctl's
        definitions: they are the record of persistent vGPUs)."""
        defs: Optional[dict[str, Definition]] = None
        mdevs: dict[str, MdevFacts] = {}
        for uuid in uuids:
            m = mdev.read_mdev(self.sysfs, uuid)
            defined = None
            if m is None:
                if defs is None:
                    defs = read_definitions(self.ctx)
                    follow_definitions(self.ctx, state, defs, migrate=False)
                d = defs.get(uuid)
                if d is not None:
                    defined = (d.parent, d.type_id, tuple(d.attrs))
            mdevs[uuid] = MdevFacts((str(m.parent), m.type_id) if m is not None else None,
                                    defined)
        physfn: dict[str, Optional[str]] = {}
        if state.unmanaged:
            for uuid, f in mdevs.items():
                rec = state.vgpus.get(uuid)
                parent = f.live[0] if f.live is not None else \
                    f.defined[0] if f.defined is not None else rec.parent if rec else None
                if parent is not None and parent not in physfn:
                    of_parent = None
                    try:
                        of_parent = physical_function(self.sysfs, PciAddress.parse(parent))
                    except InputError:
                        pass  # not an address: no PF either
                    physfn[parent] = str(of_parent) if of_parent is not None else None
        pci: dict[str, PciFacts] = {}
        groups: dict[str, tuple[PeerFacts, ...]] = {}
        for addr in addresses:
            ident = str(addr)
            if ident in pci:
                continue
            if not self.sysfs.exists(f"sys/bus/pci/devices/{addr}"):
                pci[ident] = PciFacts(False, False, None, None, None)
                continue
            physfn_of = physical_function(self.sysfs, addr)
            pf = str(physfn_of) if physfn_of is not None else None
            gpulibs = self.is_gpulibs(addr, physfn_of)
            vendor = None
            if gpulibs and nvidia.is_vendor_vf(self.sysfs, addr):
                vendor = nvidia.current_type(self.sysfs, addr) or 0
            whole = gpulibs and vendor is None and pf is None and self.is_gpu_fn(addr)
            why = self.whole_gpu_refusal(state, addr) if whole else None
            if gpulibs and vendor is None and physfn_of is not None:
                why = self.vf_refusal(state, addr)
            pci[ident] = PciFacts(True, gpulibs, pf, vendor, why)
            if peers_wanted and gpulibs and vendor is None:
                members = self.group_facts(addr, set(addresses))
                if members:
                    groups[ident] = members
        return HostFacts(mdevs, pci, physfn, groups)

    def group_facts(self, address: PciAddress, named: set[PciAddress]
                     ) -> Optional[tuple[PeerFacts, ...]]:
        """The other functions of a display-class function's IOMMU group (those
        the domain names aside: they are never added); None: not one, or no group."""
        rel = f"sys/bus/pci/devices/{address}"
        klass = self.sysfs.read_id(rel + "/class", 24)
        if klass is None or not has_gpu_class(klass >> 8):
            return None
        group = group_number(self.sysfs.link_name(rel + "/iommu_group"))
        if group is None:
            return None
        out = []
        for member in iommu_group_members(self.sysfs, group):
            if member == address or member in named:
                continue
            peer_class, why = self.peer_class(member)
            # Whether it is a device of its own matters only for an endpoint.
            listed = peer_class is not None and peer_class >> 16 != BRIDGE_BASE_CLASS and \
                self.is_listed(member, physical_function(self.sysfs, member))
            out.append(PeerFacts(str(member), peer_class, why, listed))
        return tuple(out)

    def peer_class(self, member: PciAddress) -> tuple[Optional[int], str]:
        """A group peer's class, or None and why it cannot be known (the planner
        refuses then: a bridge must never go to a guest, so it is not guessed)."""
        rel = f"sys/bus/pci/devices/{member}/class"
        raw = self.sysfs.read_result(rel)
        if isinstance(raw, ReadFailure):
            return None, raw.reason
        text = raw.decode("ascii", "replace").strip()
        try:
            klass = int(text, 16) if len(text) <= 8 else -1
        except ValueError:
            klass = -1
        if 0 <= klass <= 0xFFFFFF:
            return klass, ""
        return None, "not a PCI class code"

    def is_gpu(self, ident: str) -> bool:
        klass = self.sysfs.read_int(f"sys/bus/pci/devices/{ident}/class", 16) or 0
        return has_gpu_class(klass >> 8)

    def held_facts(self, state: State, request: GpuRequest, held: list[Device],
                   derived: dict[str, int], inventory: Callable[[], Inventory]
                   ) -> list[HeldFacts]:
        """What a request needs to know of the devices a VM holds (for the
        planner's `unmet`): a vGPU's or a VF's type, a whole GPU's model (read
        only when the request asks for one: `inventory` is the whole host)."""
        out = []
        host: Optional[Inventory] = None
        for d in held:
            if d.id in derived:
                out.append(HeldFacts(d.id))
            elif d.kind == "mdev":
                m = mdev.read_mdev(self.sysfs, d.id)
                rec = state.vgpus.get(d.id)
                source = (m.parent, m.type_id) if m is not None else \
                    (PciAddress.parse(rec.parent), rec.type_id) if rec is not None else None
                if source is None:
                    out.append(HeldFacts(d.id))
                    continue
                t = mdev.MdevType(self.sysfs, source[0], source[1])
                out.append(HeldFacts(d.id, mdev_type=(t.type_id, t.name)))
            elif d.kind == "vf":
                rec_v = state.vf_types.get(d.id)
                tid = rec_v.type_id if rec_v is not None else \
                    nvidia.current_type(self.sysfs, PciAddress.parse(d.id))
                out.append(HeldFacts(d.id, vf_type=(tid or 0,
                                                    rec_v.name if rec_v is not None else None)))
            elif request.passthrough and self.is_gpu(d.id):
                if host is None:
                    host = inventory()
                owner = host.owner_of(PciAddress.parse(d.id))
                gpu = owner[0] if owner is not None and owner[1] is None else None
                out.append(HeldFacts(d.id, gpu=None if gpu is None else (
                    gpu.fn.vendor_id, gpu.fn.device_id, gpu.device_name)))
            else:
                out.append(HeldFacts(d.id))
        return out
