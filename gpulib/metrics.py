"""The host's GPU facts in Prometheus' text exposition format (`gpulib metrics`).

Everything comes from the model discovery and the hooks share: the
Inventory (`gpulib.hostview.discover_host`, with the occupancy of gpulib's
allocations and the running domains), gpulib's state file, the doctor's
checks and the hooks' counters (`gpulib.counters`). Nothing here writes but
the counters' fold and, with `--output`, the file it renders (atomically, so
node_exporter's textfile collector never reads half of it).

Naming follows Prometheus' practice: a `gpulib_` prefix, base units
(seconds), `_total` on counters, capacity and use as separate metrics, and
labels drawn from bounded sets (the host's GPUs, its vGPU types, the doctor's
check ids, the counters' fixed values). A GPU is named by `pci_bus_id` as
NVIDIA's tools write it (`00000000:3B:00.0`, dcgm-exporter's label), so its
series join with the GPU's telemetry; `gpulib_gpu_info` also gives the
address as gpulib's commands take it. vGPU series are per GPU and type: a
large host's VFs each offer every type with room for one vGPU or none, and
per (VF, type) that is thousands of series of 0 or 1 (`[metrics] parent_series
= yes` gives them, with a `parent` label). The live, held and pooled
instances are given only where the GPU has a vGPU of that type (a missing
series is 0).

Which sums mean something: a type's creatable count on a GPU assumes no
other type is made (creating one uses what the others count), so sum
creatable instances by type (over GPUs and parents), never across types;
an idle NVIDIA vendor VF counts as creatable for every type it could take,
likewise. Live, held and pool counts add up over anything.

Series (labels in braces; `gpu` below is `pci_bus_id`):
  gpulib_gpu_info{pci_bus_id,address,vendor_id,device_id,vendor,device,driver,mode,numa_node} 1
  gpulib_gpu_managed{gpu}                    0 when unmanaged (gpulib device unmanage)
  gpulib_gpu_unmanaged_vfs{gpu}              its VFs gpulib leaves alone
  gpulib_gpu_in_use{gpu}                     1 when a VM holds the GPU whole
  gpulib_gpu_whole_offered{gpu}              1 when it may be given whole
  gpulib_gpu_read_errors{gpu}                files of the GPU that could not be read
  gpulib_vgpu_creatable_instances{gpu,type,profile} (parent_series: also parent)
  gpulib_vgpu_live_instances{...}, gpulib_vgpu_held_instances{...},
  gpulib_vgpu_pool_instances{...}
  gpulib_nvidia_vfs{gpu}, gpulib_nvidia_vfs_typed{gpu}, gpulib_nvidia_vfs_held{gpu}
  gpulib_nvidia_vf_type_typed_vfs{gpu,type,profile}, ..._held_vfs, ..._creatable_vfs
  gpulib_allocations{state}                  state: active | pending
  gpulib_allocation_pending_oldest_age_seconds, gpulib_allocation_pending_grace_seconds
  gpulib_stray_vgpus
  gpulib_handmade_devices{kind}              kind: mdev | vf (never pool members)
  gpulib_pool_members{pool}, gpulib_pool_held_members{pool}, gpulib_pool_target_members{pool}
  gpulib_mig_mode_enabled{gpu}, gpulib_mig_mode_pending_reset{gpu}
  gpulib_mig_gpu_instances{gpu,profile,state}  state: free | held (a VM holds the VF on it)
  gpulib_mig_profile_creatable_instances{gpu,profile}
  gpulib_readiness_check_status{check}       0 ok, 1 warn, 2 fail
  gpulib_state_healthy, gpulib_state_last_write_timestamp_seconds, gpulib_state_intents,
  gpulib_state_unrecovered
  gpulib_starts_prepared_total{hook}, gpulib_starts_refused_total{hook,reason},
  gpulib_vgpus_created_total{kind}, gpulib_vgpus_destroyed_total{kind},
  gpulib_releases_total{by}
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from gpulib import counters
from gpulib.cloudstack import unavailable_instances
from gpulib.records import HANDMADE, is_handmade

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional, Union

    from gpulib.config import Config
    from gpulib.context import Context
    from gpulib.discovery import Gpu, Inventory
    from gpulib.mdev import MdevType
    from gpulib.pci import PciAddress
    from gpulib.state import State, VgpuRecord

    Number = Union[int, float]

STATUS_VALUES = {"ok": 0, "warn": 1, "fail": 2}


def escape_label(value: str) -> str:
    """A label value as the text format writes it between double quotes."""
    if "\\" in value or "\"" in value or "\n" in value:
        return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")
    return value


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def number(value: Number) -> str:
    if isinstance(value, bool):  # an int to Python, not a sample value to Prometheus
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def label_set(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """`{name="value",...}` (empty without labels): made once for a device and
    type, and shared by every family that has the same labels."""
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{escape_label(v)}"' for n, v in zip(names, values)) + "}"


class Family:
    """One metric: its name, type, help and samples, each a rendered label
    set (`label_set` of the family's label names) and a value."""

    def __init__(self, name: str, kind: str, help_text: str, labels: tuple[str, ...] = ()
                 ) -> None:
        self.name = name
        self.kind = kind
        self.help = help_text
        self.labels = labels
        self.samples: list[tuple[str, Number]] = []

    def add(self, value: Number, *values: str) -> None:
        assert len(values) == len(self.labels), (self.name, values)
        self.samples.append((label_set(self.labels, values), value))

    def add_set(self, value: Number, labels: str) -> None:
        """A sample whose label set (of this family's label names) is rendered."""
        self.samples.append((labels, value))

    def lines(self) -> Iterable[str]:
        yield f"# HELP {self.name} {escape_help(self.help)}"
        yield f"# TYPE {self.name} {self.kind}"
        name = self.name
        for labels, value in self.samples:
            # Most samples are counts: ints (a bool goes through `number`).
            yield f"{name}{labels} {value}" if type(value) is int else \
                f"{name}{labels} {number(value)}"


class Exposition:
    """The families of one scrape, in the order they were made."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def family(self, name: str, kind: str, help_text: str, *labels: str) -> Family:
        fam = self.families[name] = Family(name, kind, help_text, labels)
        return fam

    def text(self) -> str:
        out: list[str] = []
        for fam in self.families.values():
            out.extend(fam.lines())
        return "\n".join(out) + "\n"


# -- the host's devices ---------------------------------------------------------------


def pci_bus_id(address: PciAddress) -> str:
    """A PCI address as NVIDIA's tools write it (NVML's bus id, dcgm-exporter's
    `pci_bus_id` label): an 8-digit domain, upper-case hex, `00000000:3B:00.0`,
    so gpulib's series join with a GPU's telemetry on it."""
    return address.bus_id


class _GpuFamilies:
    """The per-GPU families of one exposition, made once for every GPU."""

    def __init__(self, exp: Exposition, per_parent: bool) -> None:
        gpu = ("pci_bus_id",)
        self.info = exp.family(
            "gpulib_gpu_info", "gauge",
            "A GPU (physical function) of the host; pci_bus_id as NVIDIA's tools write it "
            "(join label), address as gpulib's commands take it.",
            "pci_bus_id", "address", "vendor_id", "device_id", "vendor", "device", "driver",
            "mode", "numa_node")
        self.managed = exp.family(
            "gpulib_gpu_managed", "gauge",
            "1 when gpulib manages the GPU, 0 when it is unmanaged (gpulib device "
            "unmanage): gpulib then creates, types and allocates nothing of it.", *gpu)
        self.unmanaged_vfs = exp.family(
            "gpulib_gpu_unmanaged_vfs", "gauge",
            "VFs of the GPU gpulib leaves alone (unmanaged, or of an unmanaged GPU).", *gpu)
        self.in_use = exp.family("gpulib_gpu_in_use", "gauge",
                                 "1 when a VM holds the GPU whole, else 0.", *gpu)
        self.offered = exp.family(
            "gpulib_gpu_whole_offered", "gauge",
            "1 when the GPU may be given whole (no vGPU use declared, no VFs).", *gpu)
        self.unavailable = exp.family(
            "gpulib_gpu_unavailable_instances", "gauge",
            "vGPUs and VFs of the GPU that no VM holds and that cannot be given now "
            "(the CloudStack report's gpulib:unavailable: the management server marks "
            "them Error): no capacity, and never silent.", "pci_bus_id", "kind")
        self.errors = exp.family(
            "gpulib_gpu_read_errors", "gauge",
            "Files of the GPU that could not be read (gpulib discover --format json lists "
            "them): what they hold is missing from the other series.", *gpu)
        # Per GPU and type: a large host's VFs each offer every type, with
        # room for one vGPU or none; the per-parent detail is a setting.
        self.per_parent = per_parent
        labels = ("pci_bus_id", "parent", "type", "profile") if per_parent else \
            ("pci_bus_id", "type", "profile")
        where = "parent" if per_parent else "GPU (all its parents)"
        self.creatable = exp.family(
            "gpulib_vgpu_creatable_instances", "gauge",
            f"vGPUs of the type the {where} could still create (available_instances): "
            "each type's count assumes no other is made, so sum by type, never across "
            "types; 0 on an unmanaged parent (not gpulib's to give).", *labels)
        self.live = exp.family("gpulib_vgpu_live_instances", "gauge",
                               f"Live vGPUs of the type on the {where} (absent: 0).", *labels)
        self.held = exp.family("gpulib_vgpu_held_instances", "gauge",
                               f"vGPUs of the type on the {where} held by a VM (absent: 0).",
                               *labels)
        self.pooled = exp.family(
            "gpulib_vgpu_pool_instances", "gauge",
            f"vGPUs of the type on the {where} that are pool members, live or to be "
            "recreated (absent: 0).", *labels)
        self.nv_vfs = exp.family("gpulib_nvidia_vfs", "gauge",
                                 "NVIDIA vendor-specific vGPU VFs of the GPU.", *gpu)
        self.nv_typed = exp.family("gpulib_nvidia_vfs_typed", "gauge",
                                   "NVIDIA vendor VFs of the GPU with a vGPU type set.", *gpu)
        self.nv_held = exp.family("gpulib_nvidia_vfs_held", "gauge",
                                  "NVIDIA vendor VFs of the GPU held by a VM.", *gpu)
        vf_labels = ("pci_bus_id", "type", "profile")
        self.nv_type_typed = exp.family(
            "gpulib_nvidia_vf_type_typed_vfs", "gauge",
            "NVIDIA vendor VFs of the GPU that have this vGPU type (absent: 0).", *vf_labels)
        self.nv_type_held = exp.family(
            "gpulib_nvidia_vf_type_held_vfs", "gauge",
            "NVIDIA vendor VFs of the GPU with this vGPU type held by a VM (absent: 0).",
            *vf_labels)
        self.nv_type_creatable = exp.family(
            "gpulib_nvidia_vf_type_creatable_vfs", "gauge",
            "Idle NVIDIA vendor VFs of the GPU that could be given this vGPU type now: an "
            "idle VF counts for every type it could take, so sum by type, never across "
            "types. Unmanaged VFs count in no per-type series.", *vf_labels)


def _gpus(exp: Exposition, inventory: Inventory, state: State, per_parent: bool,
          records_known: bool = True) -> None:
    fams = _GpuFamilies(exp, per_parent)
    records = state.vgpus
    unmanaged = state.unmanaged
    occ = inventory.occupancy
    for gpu in inventory.gpus:
        fn = gpu.fn
        address = str(gpu.address)
        bus_id = pci_bus_id(gpu.address)
        gpu_set = label_set(("pci_bus_id",), (bus_id,))
        fams.info.add(1, bus_id, address, f"{fn.vendor_id:04x}", f"{fn.device_id:04x}",
                      gpu.vendor_name, gpu.device_name, fn.driver or "", gpu.mode,
                      str(fn.numa_node))
        whole_unmanaged = address in unmanaged
        fams.managed.add_set(0 if whole_unmanaged else 1, gpu_set)
        fams.unmanaged_vfs.add_set(
            len(gpu.vfs) if whole_unmanaged else
            sum(1 for vf in gpu.vfs if str(vf.address) in unmanaged) if unmanaged else 0,
            gpu_set)
        # Discovery's `used_by` of a GPU names whoever keeps it from being
        # given whole (a VM of one of its vGPUs too): held whole is a hold
        # on the GPU's own node.
        fams.in_use.add_set(
            1 if any(h.device == address for h in occ.conflicts(address)) else 0, gpu_set)
        fams.offered.add_set(1 if gpu.passthrough_enabled else 0, gpu_set)
        # The administrator's (unmanaged: the GPU, or its VFs one by one) is
        # no capacity of gpulib's: its instances left count 0, so an alert on
        # running out sees only what gpulib may give (`Occupancy.hands_off`).
        hands_off = frozenset(
            str(p) for p in [gpu.address, *(vf.address for vf in gpu.vfs)]
            if occ.hands_off(str(p)) is not None) if unmanaged else frozenset()
        if per_parent:
            _vgpus_per_parent(fams, gpu, bus_id, records, hands_off)
        else:
            _vgpus_per_gpu(fams, gpu, gpu_set, records, hands_off)
        vgpus_off, vfs_off = unavailable_instances(gpu)
        fams.unavailable.add(vgpus_off, bus_id, "vgpu")
        fams.unavailable.add(vfs_off, bus_id, "vf")
        # After the counts: one that cannot be read is one of the GPU's errors.
        fams.errors.add_set(len(gpu.errors), gpu_set)
        _nvidia_vfs(fams, gpu, bus_id, gpu_set, hands_off)
    if not records_known:
        fams.pooled.samples.clear()  # pool membership is gpulib's record: unknown


def _held_counts(gpu: Gpu, records: dict[str, VgpuRecord], per_parent: bool
                 ) -> dict[tuple[str, str], list[Any]]:
    """(parent or "", type id) -> [live, held, pool members, profile] of the
    GPU's vGPUs (most of a large host's parents have none)."""
    counts: dict[tuple[str, str], list[Any]] = {}
    for v in gpu.vgpus:
        key = (str(v.parent) if per_parent else "", v.mdev_type.type_id)
        c = counts.get(key)
        if c is None:
            c = counts[key] = [0, 0, 0, v.mdev_type.profile_name]
        c[0] += v.live
        c[1] += v.used_by is not None
        rec = records.get(v.uuid)
        c[2] += rec is not None and rec.pool is not None and not is_handmade(rec)
    return counts


def _vgpus_per_gpu(fams: _GpuFamilies, gpu: Gpu, gpu_set: str,
                   records: dict[str, VgpuRecord], hands_off: frozenset[str] = frozenset()
                   ) -> None:
    """The GPU's vGPU series per type: its parents' counts summed (a VF's
    count is of the vGPUs it can take, so the sum is what the GPU can make)."""
    # type id -> [its profile, instances left on every parent that could be read]
    totals: dict[str, list[Any]] = {}
    for parent, pairs, available in gpu.mdev_offers():
        off = bool(hands_off) and str(parent) in hands_off
        for (type_id, t), n in zip(pairs, available):
            if n is None:  # unreadable: the GPU's read errors say so
                continue
            if off:
                n = 0
            found = totals.get(type_id)
            if found is None:
                totals[type_id] = [t.profile_name, n]
            else:
                found[1] += n
    prefix = gpu_set[:-1] + ","
    sets: dict[str, str] = {}

    def labels(type_id: str, profile: str) -> str:
        made = sets.get(type_id)
        if made is None:
            made = sets[type_id] = prefix + label_set(("type", "profile"),
                                                      (type_id, profile))[1:]
        return made

    creatable = fams.creatable.samples
    for type_id, (profile, n) in totals.items():
        creatable.append((labels(type_id, profile), n))
    for (_, type_id), (live, held, pooled, profile) in _held_counts(gpu, records,
                                                                     False).items():
        values = labels(type_id, profile)
        fams.live.add_set(live, values)
        fams.held.add_set(held, values)
        fams.pooled.add_set(pooled, values)


def _vgpus_per_parent(fams: _GpuFamilies, gpu: Gpu, bus_id: str,
                      records: dict[str, VgpuRecord], hands_off: frozenset[str] = frozenset()
                      ) -> None:
    """The GPU's vGPU series per parent and type (`[metrics] parent_series`):
    the instances left of every type of every parent, the live, held and
    pooled vGPUs where the parent has some."""
    counts = _held_counts(gpu, records, True)
    # The label set of a parent's type, from parts made once: a large host
    # has 16 VFs x 24 types a GPU, and every VF offers the same types,
    # answered for by the same type objects. (type id, type) -> its part.
    type_parts: dict[tuple[str, MdevType], str] = {}
    gpu_part = label_set(("pci_bus_id",), (bus_id,))[:-1]
    creatable_samples = fams.creatable.samples
    for parent_address, parent_types, available in gpu.mdev_offers():
        parent = str(parent_address)
        prefix = f"{gpu_part},{label_set(('parent',), (parent,))[1:-1]},"
        for pair, n in zip(parent_types, available):
            type_part = type_parts.get(pair)
            if type_part is None:
                type_part = type_parts[pair] = \
                    label_set(("type", "profile"), (pair[0], pair[1].profile_name))[1:]
            values = prefix + type_part
            if n is not None:
                creatable_samples.append((values, 0 if parent in hands_off else n))
            found = counts.pop((parent, pair[0]), None) if counts else None
            if found:
                fams.live.add_set(found[0], values)
                fams.held.add_set(found[1], values)
                fams.pooled.add_set(found[2], values)
    # vGPUs of a type their parent no longer lists (unreadable files).
    for (parent, type_id), (live, held, pooled, profile) in sorted(counts.items()):
        fams.live.add(live, bus_id, parent, type_id, profile)
        fams.held.add(held, bus_id, parent, type_id, profile)
        fams.pooled.add(pooled, bus_id, parent, type_id, profile)


def _nvidia_vfs(fams: _GpuFamilies, gpu: Gpu, bus_id: str, gpu_set: str,
                hands_off: frozenset[str] = frozenset()) -> None:
    vendor = [vf for vf in gpu.vfs if vf.nvidia is not None]
    if not vendor:
        return
    fams.nv_vfs.add_set(len(vendor), gpu_set)
    fams.nv_typed.add_set(sum(1 for vf in vendor if vf.nvidia and vf.nvidia.current_type),
                          gpu_set)
    fams.nv_held.add_set(sum(1 for vf in vendor if vf.used_by), gpu_set)
    # Every type an idle VF could take or a VF has; typed and held VFs only
    # of the types some VF has (absent: 0).
    for tid, (name, typed, held, free) in gpu.vendor_vf_types(hands_off).items():
        vf_set = label_set(("pci_bus_id", "type", "profile"), (bus_id, str(tid), name))
        fams.nv_type_creatable.add_set(free, vf_set)
        if typed:
            fams.nv_type_typed.add_set(typed, vf_set)
            fams.nv_type_held.add_set(held, vf_set)


# -- gpulib's own records ---------------------------------------------------------------


def _allocations(exp: Exposition, ctx: Context, state: State, inventory: Inventory,
                 config: Config) -> None:
    from gpulib import mdev
    from gpulib.lifecycle import PENDING_GRACE_SECONDS, age_seconds, boot_clock

    allocs = exp.family("gpulib_allocations", "gauge",
                        "VMs holding devices, by the state of their allocation.", "state")
    statuses = [a.status for a in state.allocations.values()]
    for status in ("active", "pending"):
        allocs.add(statuses.count(status), status)
    boot_id, uptime = boot_clock(ctx)
    ages = []
    for a in state.allocations.values():
        if a.status != "pending":
            continue
        if a.uptime is not None and a.boot_id is not None and a.boot_id == boot_id:
            ages.append(max(uptime - a.uptime, 0.0))
        else:
            age = age_seconds(a.since)
            ages.append(age if age != float("inf") else 0.0)
    exp.family("gpulib_allocation_pending_oldest_age_seconds", "gauge",
               "Age of the oldest pending allocation (0: none is pending)."
               ).add(round(max(ages, default=0.0), 3))
    exp.family("gpulib_allocation_pending_grace_seconds", "gauge",
               "How long a pending allocation of a VM that does not run is kept."
               ).add(PENDING_GRACE_SECONDS)
    # The mdevs live when discovery read the host: the stray ones are counted
    # against the same listing as the inventory's vGPUs.
    live = inventory.live if inventory.live is not None else mdev.live_mdevs(ctx.sysfs)
    exp.family("gpulib_stray_vgpus", "gauge",
               "Live vGPUs gpulib has no record of and no VM holds."
               ).add(len(inventory.occupancy.stray_mdevs(live, state.vgpus)))
    members = exp.family("gpulib_pool_members", "gauge",
                         "Members of the pool (vGPUs, or VFs given its type).", "pool")
    held = exp.family("gpulib_pool_held_members", "gauge",
                      "Members of the pool held by a VM.", "pool")
    target = exp.family("gpulib_pool_target_members", "gauge",
                        "Members the pool declares (gpulib.conf) on the parents it finds.",
                        "pool")
    holding = {d.id for a in state.allocations.values() for d in a.devices}
    unmanaged = frozenset(state.unmanaged)
    # Hand-made devices are in no pool: their marker is not a pool's name.
    names = set(config.pools) | {r.pool for r in state.vgpus.values() if r.pool} | \
        {r.pool for r in state.vf_types.values() if r.pool}
    names.discard(HANDMADE)
    handmade = exp.family("gpulib_handmade_devices", "gauge",
                          "Devices an administrator made by hand (gpulib mdev create: "
                          "mdev; gpulib vf set-type: vf), in no pool.", "kind")
    handmade.add(sum(1 for r in state.vgpus.values() if is_handmade(r)), "mdev")
    handmade.add(sum(1 for r in state.vf_types.values() if is_handmade(r)), "vf")
    for name in sorted(n for n in names if n):
        ids = [u for u, r in state.vgpus.items() if r.pool == name] + \
            [a for a, vr in state.vf_types.items() if vr.pool == name]
        members.add(len(ids), name)
        held.add(sum(1 for i in ids if i in holding), name)
        pool = config.pools.get(name)
        if pool is None:
            target.add(0, name)
            continue
        from gpulib import pools  # only for a declared pool (and mdevctl with it)

        planned = pools.plan(pool, inventory, unmanaged)
        found = {str(t.parent) for _, t in planned.mdev_parents} if planned.mdev_parents \
            else {str(a) for _, a, _, _ in planned.vf_parents}
        if pool.per_parent is not None:
            target.add(pool.per_parent * len(found), name)
        else:
            target.add((pool.count or 0) if found else 0, name)


def _state(exp: Exposition, ctx: Context, config: Config) -> tuple[State, bool]:
    """The state file's health and age; the state as read, and whether gpulib's
    records are known. A damaged file is read as the copy gpulib keeps beside
    it (what the next hook rebuilds it from: a series does not jump while the
    file waits for that); with the copy unusable too, they are not."""
    from gpulib.errors import GpulibError
    from gpulib.lifecycle import open_store
    from gpulib.records import UNRECOVERED_KEY
    from gpulib.state import State

    store = open_store(ctx, config)
    known = True
    try:
        state = store.load()
        healthy = store.corrupt_reason is None
        if not healthy:
            copy = store.backup_state()
            if copy is not None:
                state = copy
            else:
                known = False
    except GpulibError:
        state, healthy, known = State(), False, False
    exp.family("gpulib_state_healthy", "gauge",
               "1 when gpulib's state file is readable and valid (or missing with no copy: "
               "a new host), 0 when it is corrupt, missing beside its copy, unreadable or "
               "from a newer gpulib.").add(1 if healthy else 0)
    try:
        mtime: Optional[float] = os.stat(ctx.state_path).st_mtime
    except OSError:
        mtime = None
    last = exp.family("gpulib_state_last_write_timestamp_seconds", "gauge",
                      "When gpulib's state file was last written (absent: no file yet).")
    if mtime is not None:
        last.add(round(mtime, 3))
    intents = exp.family("gpulib_state_intents", "gauge",
                         "Write-ahead intents in the state: sysfs changes of starts not yet "
                         "settled (absent: the state cannot be read).")
    lost = state.extra.get(UNRECOVERED_KEY)
    unrecovered = exp.family(
        "gpulib_state_unrecovered", "gauge",
        "What the last rebuild of the state from the host alone (no usable copy) could "
        "not recover, in kinds of record (gpulib status lists them; 0: none; absent: the "
        "state cannot be read).")
    if known:
        intents.add(len(state.intents))
        unrecovered.add(len(lost) if isinstance(lost, list) else 0)
    return state, known


def _mig(exp: Exposition, ctx: Context, config: Config, inventory: Inventory) -> None:
    """The MIG series: each NVIDIA GPU with vendor VFs whose tool reports a
    MIG mode (`gpulib.migtool`, cached: asked again only when the GPU's VFs
    show a change, or after two minutes), its GPU instances per profile free
    or held (a VM holds the VF whose vGPU runs on it), and how many more of
    each profile fit. A host without such GPUs asks nothing."""
    from gpulib import migtool

    migtool.attach(inventory, ctx.root, config.get_float("discovery", "nvidia_smi_timeout"))
    gpus = [g for g in inventory.gpus if g.mig is not None]
    if not gpus:
        return
    enabled = exp.family("gpulib_mig_mode_enabled", "gauge",
                         "1 when the GPU is in MIG mode (NVIDIA's tool), else 0.", "pci_bus_id")
    pending = exp.family("gpulib_mig_mode_pending_reset", "gauge",
                         "1 when the GPU's MIG mode changes at its next reset.", "pci_bus_id")
    instances = exp.family("gpulib_mig_gpu_instances", "gauge",
                           "MIG GPU instances of the profile: free, or held (a VM holds the VF "
                           "whose vGPU runs on it).", "pci_bus_id", "profile", "state")
    creatable = exp.family("gpulib_mig_profile_creatable_instances", "gauge",
                           "More GPU instances of the profile that fit on the GPU now.",
                           "pci_bus_id", "profile")
    for gpu in gpus:
        layout = gpu.mig
        assert layout is not None
        address = pci_bus_id(gpu.address)
        enabled.add(1 if layout.enabled else 0, address)
        pending.add(1 if layout.reset_pending else 0, address)
        if not layout.enabled:
            continue
        held_by = {vf.nvidia.gpu_instance: vf.used_by for vf in gpu.vfs
                   if vf.nvidia is not None and vf.nvidia.gpu_instance is not None}
        by_profile: dict[str, list[int]] = {}
        for gi in layout.instances:
            c = by_profile.setdefault(gi.profile_name, [0, 0])
            c[1 if held_by.get(gi.id) else 0] += 1
        for name, (free, held) in sorted(by_profile.items()):
            instances.add(free, address, name, "free")
            instances.add(held, address, name, "held")
        for p in sorted(layout.profiles.values(), key=lambda p: p.id):
            creatable.add(p.free, address, p.name)


def _readiness(exp: Exposition, ctx: Context, config: Config, inventory: Inventory) -> None:
    from gpulib.doctor import CHECK_IDS, Doctor, worst

    # The doctor reads the state file itself (its `state` check says what is
    # wrong with it); the host's GPUs it is given, not read again.
    report = Doctor(ctx, config, inventory=inventory).run()
    fam = exp.family("gpulib_readiness_check_status", "gauge",
                     "The worst status of a gpulib doctor check: 0 ok, 1 warn, 2 fail.",
                     "check")
    by_check: dict[str, list[str]] = {}
    for r in report.results:
        by_check.setdefault(r.check, []).append(r.status)
    for check in CHECK_IDS:
        if check in by_check:
            fam.add(STATUS_VALUES[worst(by_check[check])], check)


def _counters(exp: Exposition, totals: dict[str, int]) -> None:
    helps = {
        "starts_prepared": "VM starts whose GPU devices a hook made ready.",
        "starts_refused": "VM starts a hook refused, by the kind of reason.",
        "vgpus_created": "vGPUs created (mdevs, and types set on NVIDIA vendor VFs).",
        "vgpus_destroyed": "vGPUs destroyed (mdevs removed, NVIDIA vendor VF types cleared).",
        "releases": "Allocations released: at a VM's stop, by gpulib reconcile, or by "
                    "gpulib release.",
    }
    for name, spec in counters.COUNTERS.items():
        fam = exp.family(f"gpulib_{name}_total", "counter", helps[name],
                         *(label for label, _ in spec))
        combos: list[tuple[str, ...]] = [()]
        for _label, allowed in spec:
            combos = [(*c, v) for c in combos for v in allowed]
        for combo in combos:
            key = " ".join([name, *(f"{label}={v}" for (label, _), v in zip(spec, combo))])
            fam.add(totals.get(key, 0), *combo)


def collect(ctx: Context, config: Config, fold: bool = True) -> Exposition:
    """Every gpulib metric of the host below ctx's root. `fold`: move the
    hooks' counted events into the counters' totals file (else only read)."""
    from gpulib.hostview import attach_type_numbers, discover_host

    exp = Exposition()
    state, known = _state(exp, ctx, config)
    inventory = discover_host(ctx, config, state=state, learn=False, keep_domains=True)
    # What each vendor-VF type can still be given is bounded by how many the
    # GPU runs: NVIDIA's numbers (cached per driver), as `mdev types` has them.
    attach_type_numbers(inventory, ctx.root,
                        config.get_float("discovery", "nvidia_smi_timeout"))
    _gpus(exp, inventory, state, config.get_bool("metrics", "parent_series"), known)
    if known:
        # Without gpulib's records (the file and its copy unusable) strays,
        # pools and allocations are unknown, not 0: absent, so no series
        # reads as a change while the state is broken (its health says so).
        _allocations(exp, ctx, state, inventory, config)
    _mig(exp, ctx, config, inventory)
    _readiness(exp, ctx, config, inventory)
    _counters(exp, counters.fold(ctx.root) if fold else counters.read(ctx.root))
    return exp


def render(ctx: Context, config: Config, fold: bool = True) -> str:
    return collect(ctx, config, fold).text()


def write(path: str, text: str) -> None:
    """Replace `path` with `text` atomically (temp file, fsync, rename): the
    textfile collector reads the old file or the new one, never a part. A
    symlink is followed: the file it names is replaced, beside itself (a
    rename is atomic only within its directory), and the link stays."""
    import os

    from gpulib import atomicfile
    from gpulib.errors import GpulibError

    try:
        target = os.path.realpath(path) if os.path.islink(path) else path
        atomicfile.write_atomic(target, text.encode("utf-8"), mode=0o644)
    except OSError as exc:
        raise GpulibError(f"cannot write {path}: {exc.strerror or exc}") from None
