"""A typed model of a host's GPUs, built from sysfs and libvirt's files.

Discovery never writes sysfs. A device that cannot be read fully is still
listed with what could be read and the error noted: the CloudStack management
server takes every device missing from a report out of allocation until an
administrator manages it again, so a passing failure must never drop a device.
Faults are kept to what they touch: a PCI function whose identity (class,
vendor: kept in the kernel's memory) cannot be read is not known to be a GPU
and is left out; an NVIDIA vendor VF whose vGPU state cannot be read is set
apart (`Gpu.unread_vfs`: reported when gpulib records a type for it or a VM
holds it, never free, and given or judged from by nothing); an mdev type whose
`name` or `description` cannot be read is left out of the offered types (its
live vGPUs stay listed); and the GPU carries the paths and reasons in
`errors`.

What counts as a GPU: display-class functions (0x03xx: VGA, XGA, 3D, Display
controller) that are not BMC or emulated adapters, and processing accelerators
(0x1200) of GPU vendors; `[discovery] include/exclude` in gpulib.conf adjust
that per address or vendor:device. Virtual functions are never GPUs: they are
listed under their physical function.
"""

from __future__ import annotations

from gpulib import logger, mdev, nvidia
from gpulib.config import Config, Match, keeps_console
from gpulib.errors import GpulibError
from gpulib.liveness import running_domains
from gpulib.occupancy import (
    ACTIVE,
    Hold,
    Occupancy,
    Tree,
    declaring_pools,
    node_id,
)
from gpulib.ownership import host_endpoint_reason, host_endpoints, whole_gpu_refusal
from gpulib.pci import (
    CLASS_PROCESSING_ACCEL,
    DISPLAY_BASE_CLASS,
    GPU_VENDORS,
    PCI_DEVICES,
    PciAddress,
    PciFunction,
    iommu_group_members,
    is_boot_vga,
    list_addresses,
    virtfn_links,
)
from gpulib.pciids import PciNames
from gpulib.sysfs import ReadFailure, Sysfs
from gpulib.validate import decimal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

    from gpulib import mig
    from gpulib.nvidiasmi import TypeNumbers

log = logger.get(__name__)

# Display adapters that are not GPUs: server BMCs and emulated/paravirtual
# devices (ASPEED, Matrox G200 BMC parts, QEMU/Bochs stdvga, Red Hat virtio/QXL,
# Cirrus, VMware SVGA, VirtualBox).
NOT_GPU_VENDORS = frozenset({0x1A03, 0x102B, 0x1234, 0x1AF4, 0x1B36, 0x1013, 0x15AD, 0x80EE})


def is_gpu_function(fn: PciFunction, include: Optional[Match] = None,
                    exclude: Optional[Match] = None) -> bool:
    if fn.is_vf:
        return False
    if exclude and exclude.matches(fn.address, fn.vendor_id, fn.device_id):
        return False
    if include and include.matches(fn.address, fn.vendor_id, fn.device_id):
        return True
    if fn.vendor_id in NOT_GPU_VENDORS:
        return False
    if fn.class_code >> 8 == DISPLAY_BASE_CLASS:
        return True
    return fn.class_code == CLASS_PROCESSING_ACCEL and fn.vendor_id in GPU_VENDORS


class NvidiaVf:
    """A VF's vendor-specific vGPU state."""

    __slots__ = ("creatable", "current_name", "current_type", "gpu_instance", "recorded_name",
                 "recorded_type")

    def __init__(self, current_type: int, creatable: dict[int, str],
                 current_name: Optional[str], gpu_instance: Optional[int] = None) -> None:
        self.current_type = current_type
        self.creatable = creatable
        self.current_name = current_name
        # The MIG GPU instance its vGPU runs on (`nvidia/gpu_instance_id` of
        # a typed VF, on drivers that have the file), else None.
        self.gpu_instance = gpu_instance
        # The type gpulib's registry gives this VF when a VM starts (0 = none).
        self.recorded_type = 0
        self.recorded_name: Optional[str] = None

    @property
    def profile_type(self) -> int:
        """The type the VF has, else the one it will get at VM start."""
        return self.current_type or self.recorded_type

    @property
    def profile_name(self) -> Optional[str]:
        return self.current_name if self.current_type else self.recorded_name


class VirtualFunction:
    def __init__(self, index: int, fn: PciFunction) -> None:
        self.index = index
        self.fn = fn
        self.mdev_parent = False
        self.nvidia: Optional[NvidiaVf] = None
        self.used_by: Optional[str] = None
        # False: no VM holds it, yet a start naming it would be refused (its
        # GPU cannot give it its recorded type now): not offered (`Occupancy.offer`).
        self.available = True
        # A killed start's typed VF, which the next start clears (the
        # journal's undo): not reported at all (`Gpu.reported_vfs`).
        self.doomed = False
        # Why its vGPU state could not be read (`Gpu.unread_vfs`), else None.
        self.unread: Optional[str] = None
        self.device_name = ""
        self._types: Optional[list[mdev.MdevType]] = []
        # Until the types are asked for: the offered type ids, the same types
        # on the VF that listed them first (which read their files), the
        # objects made so far.
        self._sysfs: Optional[Sysfs] = None
        self._offered: tuple[str, ...] = ()
        self._shared: dict[str, mdev.MdevType] = {}
        self._made: dict[str, mdev.MdevType] = {}
        self._types_rel = ""
        # `available_once`: the offered types' instances left, read once.
        self._available: Optional[list[Optional[int]]] = None

    @property
    def address(self) -> PciAddress:
        return self.fn.address

    @property
    def mdev_types(self) -> list[mdev.MdevType]:
        """The mdev types the VF offers (those whose files could be read).

        Discovery reads what they share with the same types on the GPU's other
        VFs (`MdevType.same_as`) once; their objects are made when first asked
        for: the CloudStack report needs none of a large host's 16 VFs x 24
        types a GPU."""
        if self._types is None:
            # `_make` inlined: a large host's report makes thousands at once.
            address, made, shared = self.address, self._made, self._shared
            types = []
            for n in self._offered:
                t = made.get(n)
                if t is None:
                    first = shared[n]
                    if first.parent == address:
                        t = first
                    else:
                        assert self._sysfs is not None
                        t = mdev.MdevType(self._sysfs, address, n, same_as=first,
                                          rel=self._types_rel + n)
                types.append(t)
            self._types = types
            self._offered, self._shared, self._made = (), {}, {}
        return self._types

    @mdev_types.setter
    def mdev_types(self, types: list[mdev.MdevType]) -> None:
        self._types = types
        self._offered, self._shared, self._made = (), {}, {}
        self._available = None

    def offer_types(self, sysfs: Sysfs, offered: tuple[str, ...],
                    shared: dict[str, mdev.MdevType]) -> None:
        """Offer the types `offered` (ids, each in `shared`, read already)."""
        self._types = None
        self._sysfs = sysfs
        self._offered, self._shared, self._made = offered, shared, {}
        self._available = None
        # The types' directory, made once for the VF's thousands of types.
        self._types_rel = f"{PCI_DEVICES}{self.address}/{mdev.TYPES_DIR}/"

    def offered(self) -> list[tuple[str, mdev.MdevType]]:
        """(id, the type that answers for its name) of each type in
        `mdev_types`, in that order, without an object per type when none
        was made: a report of the whole host (`gpulib metrics`, the doctor's
        `mdev` check) needs of a large host's 16 VFs x 24 types a GPU only
        their ids, names and instances left."""
        if self._types is not None:
            return [(t.type_id, t) for t in self._types]
        made, shared = self._made, self._shared
        return [(n, made.get(n) or shared[n]) for n in self._offered]

    def available_once(self) -> list[Optional[int]]:
        """`available_instances` of each type of `offered`, in its order:
        read now, a directory at a time, and answered from then on without a
        read (as `MdevType.available_once`: for a report of one instant,
        never for what a start allocates from)."""
        if self._available is None:
            if self._types is not None:
                self._available = mdev.available_all(self._types)
            else:
                assert self._sysfs is not None
                self._available = self._sysfs.read_counts(
                    self._types_rel[:-1], [n + "/available_instances" for n in self._offered],
                    high=mdev.INSTANCES_MAX)
        return self._available

    def mdev_type(self, type_id: str) -> Optional[mdev.MdevType]:
        """The offered type `type_id`, None when the VF does not offer it."""
        if self._types is not None:
            return next((t for t in self._types if t.type_id == type_id), None)
        return self._make(type_id) if type_id in self._offered else None

    def _make(self, type_id: str) -> mdev.MdevType:
        made = self._made.get(type_id)
        if made is None:
            first = self._shared[type_id]
            if first.parent == self.address:
                made = first
            else:
                assert self._sysfs is not None
                made = mdev.MdevType(self._sysfs, self.address, type_id, same_as=first,
                                     rel=self._types_rel + type_id)
            self._made[type_id] = made
        return made


class Vgpu:
    """A vGPU on a GPU (on the PF or one of its VFs): live, or gpulib's to
    recreate when a VM starts."""

    __slots__ = ("available", "doomed", "live", "mdev_type", "parent", "used_by", "uuid")

    def __init__(self, uuid: str, parent: PciAddress, mdev_type: mdev.MdevType,
                 used_by: Optional[str], live: bool = True, available: bool = True,
                 doomed: bool = False) -> None:
        self.uuid = uuid
        self.parent = parent
        self.mdev_type = mdev_type
        self.used_by = used_by
        self.live = live
        # False: no VM holds it, yet a start naming it would be refused (its
        # GPU cannot recreate it now): not offered free (`Occupancy.offer`).
        self.available = available
        # A killed start's vGPU, which the next start removes (the journal's
        # undo): not reported at all (`Gpu.reported_vgpus`).
        self.doomed = doomed


class Gpu:
    def __init__(self, fn: PciFunction) -> None:
        self.fn = fn
        self.vendor_name = ""
        self.device_name = ""
        self.sriov_totalvfs = 0
        self.sriov_numvfs = 0
        self.vfs: list[VirtualFunction] = []
        # NVIDIA vendor VFs whose vGPU state cannot be read, that gpulib
        # records a type for or a VM holds: in no other list (nothing may be
        # given or judged from them), yet still reported (`VirtualFunction.unread`).
        self.unread_vfs: list[VirtualFunction] = []
        self.mdev_parent = False
        self.mdev_types: list[mdev.MdevType] = []
        self.vgpus: list[Vgpu] = []
        self.group_members: list[PciAddress] = []
        self.description: Optional[str] = None  # the GPU's own `description`, if any
        # The VM holding the GPU whole (`Occupancy.whole_user`), not a user of
        # one of its vGPUs or VFs.
        self.used_by: Optional[str] = None
        self.pools: list[str] = []  # pools of gpulib.conf declaring vGPUs on it
        self.boot_vga = False  # the firmware's console (`boot_vga` 1)
        # The boot VGA device kept for the host (`config.keeps_console`):
        # never offered or given whole; its vGPUs may be.
        self.console = False
        # Why the host or its administrator keeps it whole (`gpulib.ownership`):
        # an endpoint of its IOMMU group a host driver uses, its unmanaging.
        self.host_endpoint: Optional[str] = None
        self.unmanaged: Optional[str] = None
        # The numbers of its NVIDIA vendor-specific VF types by type id, from
        # NVIDIA's tool (`hostview.attach_type_numbers`; discovery itself runs nothing).
        self.nvidia_numbers: dict[int, TypeNumbers] = {}
        # Its MIG mode and instances, from NVIDIA's tool (`migtool.attach`);
        # None: not asked, or the GPU has no MIG.
        self.mig: Optional[mig.Layout] = None
        self.errors: list[str] = []
        # Where its files are read: a file read after discovery (the
        # instances left of its types, `mdev_offers`) that cannot be read is
        # noted in `errors` as discovery's own reads are.
        self._sysfs: Optional[Sysfs] = None

    @property
    def address(self) -> PciAddress:
        return self.fn.address

    @property
    def mode(self) -> str:
        """How the GPU is offered: mdev, sriov-mdev, nvidia-vf, sriov, passthrough."""
        if self.mdev_parent:
            return "mdev"
        if any(vf.mdev_parent for vf in self.vfs):
            return "sriov-mdev"
        if any(vf.nvidia is not None for vf in self.vfs):
            return "nvidia-vf"
        if self.vfs:
            return "sriov"
        return "passthrough"

    @property
    def reported_vfs(self) -> list[VirtualFunction]:
        """VFs reported as instances, free or not (`available`): a VF whose
        capacity is offered as mdev types is not also a VF instance (its
        mdevs are the instances), and an NVIDIA vendor VF only with a type it
        has or gpulib records for it. A report must not drop a device for a
        passing reason (the CloudStack management server takes a device
        missing from one report out of allocation for good, ARCHITECTURE.md,
        The agent's discovery JSON), so one whose recorded type its GPU cannot
        give now is reported, not free; only what a killed start made, which
        the next start undoes, is left out."""
        return [vf for vf in self.vfs if not vf.mdev_parent and not vf.doomed
                and (vf.nvidia is None or vf.nvidia.profile_type)]

    def mdev_offers(self) -> list[tuple[PciAddress, list[tuple[str, mdev.MdevType]],
                                        list[Optional[int]]]]:
        """Each mdev parent of the GPU (itself, then its VFs) with its types as
        `VirtualFunction.offered` gives them and their `available_instances`
        in the same order: read a parent's directory at a time, once, and
        kept for whatever else the same report asks (`gpulib metrics` runs
        the doctor, whose `mdev` check asks again). A count that cannot be
        read is None, and the file and the reason go into `errors`."""
        sysfs = self._sysfs
        mark = len(sysfs.failures) if sysfs is not None else 0
        out = []
        if self.mdev_types:
            types = self.mdev_types
            out.append((self.address, [(t.type_id, t) for t in types],
                        mdev.available_all(types)))
        for vf in self.vfs:
            offered = vf.offered()
            if offered:
                out.append((vf.address, offered, vf.available_once()))
        if sysfs is not None and len(sysfs.failures) > mark:
            self.note_failures(sysfs.failures[mark:])
        return out

    def vendor_vf_types(self, hands_off: frozenset[str] = frozenset()
                        ) -> dict[int, tuple[str, int, int, int]]:
        """Each vGPU type of the GPU's NVIDIA vendor-specific VFs: type id ->
        (its name, VFs that have it, of those held by a VM, idle VFs that could
        be given it now). An idle VF counts for every type it could take (the
        GPU gives one at a time): the one count of what is left, for `gpulib
        mdev types` and metrics alike, bounded by how many of the type the GPU
        runs (`max_instances` of NVIDIA's numbers, where attached) less those
        it has. VFs in `hands_off` (the administrator's) count for nothing."""
        out: dict[int, list[Any]] = {}
        for vf in self.vfs:
            nv = vf.nvidia
            if nv is None or (hands_off and str(vf.address) in hands_off):
                continue
            if nv.current_type:
                row = out.setdefault(nv.current_type, [str(nv.current_type), 0, 0, 0])
                if nv.current_name and row[0] == str(nv.current_type):
                    row[0] = nv.current_name
                row[1] += 1
                row[2] += vf.used_by is not None
            else:
                for tid, name in nv.creatable.items():
                    row = out.setdefault(tid, [name, 0, 0, 0])
                    if row[0] == str(tid):
                        row[0] = name
                    row[3] += 1
        for tid, r in out.items():
            known = self.nvidia_numbers.get(tid)
            if known is not None and known.max_instances:
                r[3] = max(0, min(r[3], known.max_instances - r[1]))
        return {tid: (r[0], r[1], r[2], r[3]) for tid, r in sorted(out.items())}

    def note_failures(self, failures: list[tuple[str, str]]) -> None:
        """Files of the GPU (or its VFs) that could not be read, into `errors`."""
        for rel, reason in failures:
            note = f"{rel}: {reason}"
            if note not in self.errors:
                self.errors.append(note)

    @property
    def reported_vgpus(self) -> list[Vgpu]:
        """vGPUs reported as instances, free or not (`available`): all but a
        killed start's, which the next start removes (see `reported_vfs`)."""
        return [v for v in self.vgpus if not v.doomed]

    @property
    def whole_refusal(self) -> Optional[str]:
        """Why the GPU is not given whole (the hooks ask the same function)."""
        typed = sum(1 for vf in self.vfs if vf.nvidia is not None and vf.nvidia.profile_type)
        return whole_gpu_refusal(max(len(self.vfs), self.sriov_numvfs), len(self.vgpus), typed,
                                 self.pools, self.console, self.host_endpoint, self.unmanaged)

    @property
    def passthrough_enabled(self) -> bool:
        return self.whole_refusal is None


class Inventory:
    def __init__(self, gpus: list[Gpu], occupancy: Occupancy,
                 live: Optional[frozenset[str]] = None) -> None:
        self.gpus = gpus
        self.occupancy = occupancy
        # The UUIDs of the mdevs live when the host was read (None: not
        # listed), so a report of the same instant asks the bus no more.
        self.live = live

    def gpu(self, address: PciAddress) -> Optional[Gpu]:
        for g in self.gpus:
            if g.address == address:
                return g
        return None

    def vendor_vf_gpus(self) -> list[PciAddress]:
        """The GPUs with NVIDIA vendor-specific VFs (read or not): those whose
        types' numbers a report asks NVIDIA's tool for."""
        return [g.address for g in self.gpus
                if any(vf.nvidia is not None for vf in [*g.vfs, *g.unread_vfs])]

    def owner_of(self, address: PciAddress) -> Optional[tuple[Gpu, Optional[VirtualFunction]]]:
        """The GPU (and VF) a PCI address belongs to."""
        for g in self.gpus:
            if g.address == address:
                return g, None
            for vf in g.vfs:
                if vf.address == address:
                    return g, vf
        return None


def learned_names_key(vendor_id: int, device_id: int) -> str:
    return f"{vendor_id:04x}:{device_id:04x}"


class Known:
    """What gpulib itself knows beyond sysfs (from its state file).

    learned:     'vvvv:dddd' -> {type id: name}, NVIDIA names seen before
    allocations: vm -> [(kind, id)], the first source of "who uses what"
    vf_types:    VF address -> (type id, name) the VF gets at VM start
    registry:    mdev uuid -> (parent address, type id) of vGPUs gpulib keeps
    """

    def __init__(self, learned: Optional[dict[str, dict[str, str]]] = None,
                 allocations: Optional[dict[str, list[tuple[str, str]]]] = None,
                 vf_types: Optional[dict[str, tuple[int, Optional[str]]]] = None,
                 registry: Optional[dict[str, tuple[str, str]]] = None,
                 occupancy: Optional[Occupancy] = None) -> None:
        self.learned = learned or {}
        self.allocations = allocations or {}
        self.vf_types = vf_types or {}
        self.registry = registry or {}
        # Who holds what; built from `allocations` and the running domains if absent.
        self.occupancy = occupancy


class Discovery:
    """Builds an Inventory from sysfs, libvirt's files and what gpulib knows."""

    def __init__(self, sysfs: Sysfs, config: Optional[Config] = None,
                 known: Optional[Known] = None) -> None:
        self.sysfs = sysfs
        self.config = config or Config()
        known = known or Known()
        self.learned = known.learned
        self.allocations = known.allocations
        self.vf_types = known.vf_types
        self.registry = known.registry
        self.occupancy = known.occupancy
        self.names = PciNames(sysfs)
        self.keeps_console = keeps_console(self.config)
        # Names seen in creatable lists during this scan, for the state file.
        self.new_names: dict[str, dict[str, str]] = {}

    def run(self) -> Inventory:
        sysfs = self.sysfs
        include = self.config.match("discovery", "include")
        exclude = self.config.match("discovery", "exclude")
        usage = self.occupancy
        if usage is None:
            usage = Occupancy(Tree(sysfs, {u: p for u, (p, _) in self.registry.items()},
                                   {u: t for u, (_, t) in self.registry.items()},
                                   {a: t for a, (t, _) in self.vf_types.items()}))
            for vm, devices in self.allocations.items():
                for kind, ident in devices:
                    try:
                        usage.add(Hold(vm, ACTIVE, node_id(kind, ident)))
                    except GpulibError:
                        continue
            usage.add_running(running_domains(sysfs))
        live = mdev.live_mdevs(sysfs)
        live_now = frozenset(live)
        # vGPUs gpulib keeps but the kernel does not have now (after a reboot):
        # listed as instances, recreated when a VM starts, never reported missing.
        for uuid, (parent, type_id) in self.registry.items():
            if uuid not in live:
                try:
                    live[uuid] = mdev.Mdev(uuid, PciAddress.parse(parent), type_id, live=False)
                except GpulibError:
                    continue
        gpus: list[Gpu] = []
        # Raises only when sys/bus/pci/devices exists but cannot be listed:
        # an empty report would tell the agent that every GPU failed.
        addresses = list_addresses(sysfs)
        # The VFs read under their GPU: never GPUs themselves, so not read again.
        read_vfs: set[PciAddress] = set()
        for address in addresses:
            if address in read_vfs:
                continue
            mark = len(sysfs.failures)
            # One device's fault never costs the others: whatever goes wrong
            # with this function (an odd file, a bug on odd input) stays here.
            try:
                fn = PciFunction.read_ids(sysfs, address)
                if not is_gpu_function(fn, include, exclude):
                    continue
                fn.read_details(sysfs)
                usage.tree.seed_group(str(address), fn.iommu_group)
                gpu = self._gpu(fn, usage, live)
            except Exception as exc:
                log.warning("PCI device %s left out: cannot read it: %s", address, exc)
                continue
            # The files of this GPU (and its VFs) that could not be read.
            gpu.note_failures(sysfs.failures[mark:])
            gpus.append(gpu)
            read_vfs.update(vf.address for vf in gpu.vfs)
        # A VF is never also a GPU, even when its own `physfn` is unreadable.
        vfs = {vf.address for g in gpus for vf in g.vfs}
        for g in gpus:
            if g.address in vfs:
                log.warning("%s is a VF of another GPU: not listed as a GPU", g.address)
        return Inventory([g for g in gpus if g.address not in vfs], usage, live_now)

    def _gpu(self, fn: PciFunction, usage: Occupancy, live: dict[str, mdev.Mdev]) -> Gpu:
        gpu = Gpu(fn)
        gpu._sysfs = self.sysfs
        steps: tuple[tuple[str, Callable[[], None]], ...] = (
            ("names", lambda: self._names(gpu)),
            ("sriov", lambda: self._sriov(gpu)),
            ("iommu group", lambda: self._group(gpu)),
            ("mdev types", lambda: self._mdev_types(gpu)),
            ("virtual functions", lambda: self._vfs(gpu, usage)),
            ("vGPUs", lambda: self._vgpus(gpu, usage, live)),
        )
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # the GPU is still listed with what could be read
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                gpu.errors.append(f"{what}: {reason}")
                log.warning("GPU %s: cannot read %s: %s", fn.address, what, reason)
        # Only a VM holding the GPU whole is its user; those of its vGPUs and
        # VFs are theirs (the CloudStack report copies this onto the GPU's row).
        gpu.used_by = usage.whole_user(str(fn.address))
        gpu.boot_vga = is_boot_vga(self.sysfs, fn.address, fn.class_code)
        gpu.console = gpu.boot_vga and self.keeps_console
        gpu.host_endpoint = host_endpoint_reason(host_endpoints(
            self.sysfs, fn.address, fn.iommu_group, gpu.group_members or None))
        hands_off = usage.hands_off(str(fn.address))
        gpu.unmanaged = hands_off.reason if hands_off is not None else None
        if self.config.pools and gpu.mdev_types:
            gpu.pools = declaring_pools(self.config, fn.address, fn.vendor_id, fn.device_id,
                                        gpu.mdev_types)
        return gpu

    def _vgpus(self, gpu: Gpu, usage: Occupancy, live: dict[str, mdev.Mdev]) -> None:
        parents = {gpu.address: None} if gpu.mdev_parent else {}
        for vf in gpu.vfs:
            if vf.mdev_parent:
                parents[vf.address] = None
        if not parents:
            return
        types: dict[tuple[PciAddress, str], mdev.MdevType] = {}
        for t in gpu.mdev_types:
            types[(t.parent, t.type_id)] = t
        vfs = {vf.address: vf for vf in gpu.vfs}
        for m in sorted(live.values(), key=lambda m: (m.parent, m.type_id, m.uuid)):
            if m.parent in parents:
                # A live vGPU of a type left out (unreadable files) is still
                # listed, with what could be read (its type id as the name).
                owner = vfs.get(m.parent)
                found = owner.mdev_type(m.type_id) if owner is not None else \
                    types.get((m.parent, m.type_id))
                if found is None:
                    found = mdev.MdevType(self.sysfs, m.parent, m.type_id)
                    found.load()
                used_by, available = usage.offer("mdev", m.uuid)
                gpu.vgpus.append(Vgpu(m.uuid, m.parent, found, used_by, m.live, available,
                                      not available and m.uuid in usage.undone))

    def _names(self, gpu: Gpu) -> None:
        fn = gpu.fn
        gpu.vendor_name = self.names.vendor(fn.vendor_id, fn.address)
        gpu.device_name = self.names.device(fn.vendor_id, fn.device_id, fn.address)

    def _sriov(self, gpu: Gpu) -> None:
        rel = gpu.fn.rel
        gpu.description = self.sysfs.read(rel + "/description")
        # The PCIe SR-IOV capability counts VFs in 16 bits.
        gpu.sriov_totalvfs = self.sysfs.read_int(rel + "/sriov_totalvfs", low=0,
                                                 high=0xFFFF) or 0
        gpu.sriov_numvfs = self.sysfs.read_int(rel + "/sriov_numvfs", low=0, high=0xFFFF) or 0

    def _group(self, gpu: Gpu) -> None:
        if gpu.fn.iommu_group is not None:
            gpu.group_members = iommu_group_members(self.sysfs, gpu.fn.iommu_group)

    def _mdev_types(self, gpu: Gpu) -> None:
        gpu.mdev_parent = mdev.is_parent(self.sysfs, gpu.address)
        if gpu.mdev_parent:
            gpu.mdev_types = _loaded_types(gpu, mdev.list_types(self.sysfs, gpu.address))

    def _vf(self, gpu: Gpu, index: int, address: PciAddress, usage: Occupancy,
            names: dict[int, str], vf_types: dict[str, mdev.MdevType]) -> VirtualFunction:
        """One VF; raises when it vanished or its vGPU state cannot be read."""
        sysfs = self.sysfs
        key = learned_names_key(gpu.fn.vendor_id, gpu.fn.device_id)
        fn = PciFunction.read(sysfs, address, vf_of=gpu.fn)
        # The occupancy asks the VF's group of the same link: read once.
        usage.tree.seed_group(str(address), fn.iommu_group)
        vf = VirtualFunction(index, fn)
        # Listed at once, not first asked whether it is a directory (a stat
        # less on each of hundreds of VFs): absent or not a directory, the VF
        # is no mdev parent; any other failure asks what `is_parent` asks.
        types_rel = f"{PCI_DEVICES}{address}/{mdev.TYPES_DIR}"
        listing = sysfs.listdir_result(types_rel)
        if isinstance(listing, ReadFailure):
            vf.mdev_parent = not listing.missing and mdev.is_parent(sysfs, address)
            if vf.mdev_parent:
                sysfs.failed(types_rel, listing.reason)
            listing = []
        else:
            vf.mdev_parent = True
        if vf.mdev_parent:
            vf.offer_types(sysfs, _offered_types(gpu, address, listing, sysfs, vf_types),
                           vf_types)
        if gpu.fn.vendor_id == nvidia.NVIDIA_VENDOR and nvidia.is_vendor_vf(sysfs, address):
            # Offering a VF whose vGPU state is unknown could hand a VM a VF
            # that already has a vGPU: such a VF is set apart (`unread`).
            current_rel = nvidia.vf_rel(address) + "/current_vgpu_type"
            raw = sysfs.read_result(current_rel)
            current = None
            if isinstance(raw, ReadFailure):
                vf.unread = f"{raw.path}: {raw.reason}"
            else:
                current = decimal(raw.decode("utf-8", "replace").strip(),
                                  nvidia.TYPE_ID_DIGITS)
                if current is None:
                    vf.unread = f"{sysfs.path(current_rel)}: not a vGPU type id"
            if current is None:
                return self._unread_vf(vf, usage, names)
            creatable = nvidia.creatable_types(sysfs, address)
            for tid, name in creatable.items():
                if names.get(tid) != name:
                    names[tid] = name
                    self.new_names.setdefault(key, {})[str(tid)] = name
            vf.nvidia = NvidiaVf(current, creatable, None,
                                 nvidia.gpu_instance(sysfs, address) if current else None)
            recorded = self.vf_types.get(str(address))
            if recorded is not None:
                vf.nvidia.recorded_type = recorded[0]
                if recorded[1]:
                    names.setdefault(recorded[0], recorded[1])
            # The occupancy judges whether its GPU can type it from what was just read.
            usage.tree.seed_vf(str(address), current, creatable)
        vf.used_by, vf.available = usage.offer("pci", str(address))
        vf.doomed = not vf.available and str(address) in usage.undone
        return vf

    def _unread_vf(self, vf: VirtualFunction, usage: Occupancy,
                   names: dict[int, str]) -> VirtualFunction:
        """A vendor VF whose vGPU state cannot be read: what is known of it
        (its record, who holds it), never free."""
        address = str(vf.address)
        vf.nvidia = NvidiaVf(0, {}, None)
        recorded = self.vf_types.get(address)
        if recorded is not None:
            vf.nvidia.recorded_type = recorded[0]
            if recorded[1]:
                names.setdefault(recorded[0], recorded[1])
        vf.used_by, _ = usage.offer("pci", address)
        vf.available = False
        return vf

    def _vfs(self, gpu: Gpu, usage: Occupancy) -> None:
        sysfs = self.sysfs
        key = learned_names_key(gpu.fn.vendor_id, gpu.fn.device_id)
        names: dict[int, str] = {int(k): v for k, v in self.learned.get(key, {}).items()
                                 if k.isdigit()}
        nvidia_vfs: list[VirtualFunction] = []
        vf_types: dict[str, mdev.MdevType] = {}  # shared names/descriptions across VFs
        for index, address in virtfn_links(sysfs, gpu.address):
            # One bad VF is left out; the VFs after it are still read.
            try:
                vf = self._vf(gpu, index, address, usage, names, vf_types)
            except Exception as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                gpu.errors.append(f"VF {address} left out: {reason}")
                log.warning("GPU %s: VF %s left out: %s", gpu.address, address, reason)
                continue
            if vf.unread is not None:
                gpu.errors.append(f"VF {address} not offered: {vf.unread}")
                log.warning("GPU %s: VF %s not offered: %s", gpu.address, address, vf.unread)
                assert vf.nvidia is not None
                if vf.nvidia.recorded_type or vf.used_by is not None:
                    nvidia_vfs.append(vf)
                    gpu.unread_vfs.append(vf)
                continue
            if vf.nvidia is not None:
                nvidia_vfs.append(vf)
            gpu.vfs.append(vf)
        for vf in nvidia_vfs:
            assert vf.nvidia is not None
            if vf.nvidia.current_type:
                vf.nvidia.current_name = names.get(vf.nvidia.current_type)
            elif vf.nvidia.recorded_type:
                vf.nvidia.recorded_name = names.get(vf.nvidia.recorded_type)
        if gpu.vfs or gpu.unread_vfs:
            # VFs of one device id share a name; look it up once.
            cache: dict[tuple[int, int], str] = {}
            for vf in [*gpu.vfs, *gpu.unread_vfs]:
                ids = (vf.fn.vendor_id or gpu.fn.vendor_id, vf.fn.device_id or gpu.fn.device_id)
                if ids not in cache:
                    cache[ids] = self.names.device(ids[0], ids[1], vf.address)
                vf.device_name = cache[ids]


def _offered_types(gpu: Gpu, address: PciAddress, listing: list[str], sysfs: Sysfs,
                   shared: dict[str, mdev.MdevType]) -> tuple[str, ...]:
    """The ids of the types a VF offers (`listing`: its types directory's
    entries), as `_loaded_types(list_types(...))` would keep them, without an
    object for each: a type the VF lists first is made and read here (its
    failures noted on the GPU); one a sibling listed first is offered if its
    files could be read there."""
    base = f"{PCI_DEVICES}{address}/{mdev.TYPES_DIR}/"
    offered = []
    for n in sorted(listing):
        first = shared.get(n)
        if first is None:
            if not mdev.valid_type_id(n):
                sysfs.failed(base + n, "not a type id")
                continue
            first = shared[n] = mdev.MdevType(sysfs, address, n, rel=base + n)
            failures = first.load()
            if failures:
                gpu.errors.extend(failures)
                continue
        elif first.failures:  # read when its VF listed it (load() would answer the same)
            continue
        offered.append(n)
    return tuple(offered)


def _loaded_types(gpu: Gpu, types: list[mdev.MdevType]) -> list[mdev.MdevType]:
    """`types` with name and description read; one whose files cannot be read
    is left out (its failure noted on the GPU), the others stay."""
    out = []
    for t in types:
        sibling = t.same_as
        if sibling is not None:
            # Shares the files of the same type on another VF, read (and
            # its failures noted) once already.
            if not sibling.load():
                out.append(t)
            continue
        failures = t.load()
        if failures:
            gpu.errors.extend(failures)
            continue
        out.append(t)
    return out


def discover(sysfs: Sysfs, config: Optional[Config] = None,
             known: Optional[Known] = None) -> Inventory:
    return Discovery(sysfs, config, known).run()
