"""Whose a device is, and whether gpulib may give it or change it: one answer.

Every node of the device tree (a PF, a VF, an mdev, a GPU instance, a
passthrough GPU's IOMMU-group companion) belongs to exactly one of:

* the **host** (`HOST`): the boot VGA device kept for the console; a GPU
  whose IOMMU group holds another endpoint a host driver uses (a NIC, a disk
  controller behind the same switch without ACS), and that endpoint;
* the **administrator** (`ADMIN`): an unmanaged device and everything below
  it (hands-off: never offered, given, made, typed or pooled); and whatever
  gpulib did not make: vGPUs made with `gpulib mdev create`, mdevctl or
  straight through sysfs, VF types set by hand or outside gpulib, GPU
  instances gpulib has no record of. Those are still the administrator's to
  hand to CloudStack (the report lists them, a start naming them keeps them
  as they are), never gpulib's to give, pool, retype or destroy;
* a **pool** (`POOL`): a member gpulib made for a pool of gpulib.conf;
* a **run** (`RUN`): a VM holding it, pending, arriving or running (the
  occupancy's holds, `occupancy.Occupancy.owner`);
* **nobody** (`NOBODY`).

gpulib gives only what is a pool's or nobody's (`Owner.may_give`) and
changes only what it made (`Owner.may_change`). The rules here read only
their arguments and the host's IOMMU groups; the occupancy composes them
with the runs (`Occupancy.owner`), and every path asks one or the other
(ARCHITECTURE.md, Whose a device is).
"""

from __future__ import annotations

from gpulib.pci import BRIDGE_BASE_CLASS, PciAddress, has_gpu_class, iommu_group_members
from gpulib.records import is_handmade, pool_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Collection, Iterable
    from typing import Optional

    from gpulib.records import State, VfRecord, VgpuRecord
    from gpulib.sysfs import Sysfs

HOST = "host"
ADMIN = "administrator"
POOL = "pool"
RUN = "run"
NOBODY = "nobody"
KINDS = (HOST, ADMIN, POOL, RUN, NOBODY)

# Drivers that hold no host function of a device: vfio gives the group to a guest.
GUEST_DRIVERS = frozenset({"vfio-pci", "pci-stub"})


class Owner:
    """Whose a node is. `name`: the VM, the pool, the endpoint or the
    unmanaged device that decides it; `reason`: one line saying so;
    `offered`: whether the CloudStack report may offer it (an unmanaged
    device and the host's are not; what an administrator made is theirs to
    hand to CloudStack)."""

    __slots__ = ("kind", "name", "offered", "reason")

    def __init__(self, kind: str, reason: str = "", name: Optional[str] = None,
                 offered: bool = True) -> None:
        assert kind in KINDS, kind
        self.kind = kind
        self.reason = reason
        self.name = name
        self.offered = offered and kind not in (HOST, RUN)

    @property
    def may_give(self) -> bool:
        """gpulib may give it to a VM (a metadata request, a pool's VM, attach)."""
        return self.kind in (POOL, NOBODY)

    @property
    def may_change(self) -> bool:
        """gpulib may make, type, clear, retype or destroy it (a run's only
        through the run's own start and stop)."""
        return self.kind in (POOL, NOBODY, RUN)

    def __repr__(self) -> str:
        return f"Owner({self.kind!r}, {self.name!r}, {self.reason!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Owner) and (self.kind, self.name) == (other.kind, other.name)

    def __hash__(self) -> int:
        return hash((self.kind, self.name))


NOBODYS = Owner(NOBODY)


# -- the administrator's ------------------------------------------------------------


def unmanaged_reason(unmanaged: Collection[str], chain: Iterable[str]) -> Optional[str]:
    """Why a node is hands-off (None: it is not): `chain` is the node, then
    its ancestors (its parent, that VF's PF); the first named unmanaged decides."""
    if not unmanaged:
        return None
    nodes = list(chain)
    for i, n in enumerate(nodes):
        if n in unmanaged:
            if i == 0:
                return f"{n} is unmanaged (gpulib device manage gives it back)"
            return f"{nodes[0]} is below the unmanaged {n} (gpulib device manage gives it back)"
    return None


def unmanaged_owner(unmanaged: Collection[str], chain: Iterable[str]) -> Optional[Owner]:
    why = unmanaged_reason(unmanaged, chain)
    if why is None:
        return None
    return Owner(ADMIN, why, name=why.split(" ", 1)[0], offered=False)


def vgpu_owner(rec: Optional[VgpuRecord], uuid: str, live: bool,
               defined: bool = False) -> Owner:
    """Whose a vGPU is by how it came to be (not who runs it): gpulib's
    record names a pool, a hand-made one, or nothing (gpulib's own, nobody's);
    a live vGPU without a record was made outside gpulib (mdevctl, sysfs)."""
    if rec is None:
        if live or defined:
            how = "mdevctl" if defined else "mdevctl or sysfs"
            return Owner(ADMIN, f"mdev {uuid} was made outside gpulib ({how})", name=uuid)
        return NOBODYS
    if is_handmade(rec):
        return Owner(ADMIN, f"mdev {uuid} was made by hand (gpulib mdev create)", name=uuid)
    if rec.remembered:
        # A running VM's vGPU gpulib did not make, recorded only so that VM
        # can start again after a reboot: remembered, not owned.
        return Owner(ADMIN, f"mdev {uuid} was made outside gpulib (remembered for its VM)",
                     name=uuid)
    pool = pool_of(rec)
    if pool is not None:
        return Owner(POOL, f"mdev {uuid} is a member of pool {pool}", name=pool)
    return NOBODYS


def vf_owner(rec: Optional[VfRecord], address: str, current_type: Optional[int]) -> Owner:
    """Whose an NVIDIA vendor VF's type is: a type gpulib set (a pool's or a
    run's, on demand), one set by hand (`gpulib vf set-type`), or one set
    outside gpulib (a type but no record)."""
    if rec is None:
        if current_type:
            return Owner(ADMIN, f"VF {address} was given vGPU type {current_type} outside "
                         "gpulib", name=address)
        return NOBODYS
    if is_handmade(rec):
        return Owner(ADMIN, f"VF {address} was typed by hand (gpulib vf set-type)",
                     name=address)
    pool = pool_of(rec)
    if pool is not None:
        return Owner(POOL, f"VF {address} is a member of pool {pool}", name=pool)
    return NOBODYS


# The boot whose GPU instance ids `gpu_instances` records (state.extra): after
# a reboot every instance is gone, so one found at a recorded placement before
# gpulib made it again was made by hand, the administrator's.
GI_BOOT = "gpu_instances_boot"


def made_by_gpulib(marker: Optional[str], recorded_gi: Optional[int], found_gi: int,
                   boot: Optional[str]) -> bool:
    """Whether the instance found (id `found_gi`) at a recorded placement is the
    one gpulib made: its id is the recorded one, recorded in this boot
    (`marker`: the boot of the records' ids; a record from before the marker
    counts as it was)."""
    if marker is not None and boot is not None and marker != boot:
        return False
    if recorded_gi is None:
        return marker is None
    return found_gi == recorded_gi


def gpu_instance_owner(state: State, gpu: str, profile: int, start: int,
                       gi: Optional[int] = None, boot: Optional[str] = None) -> Owner:
    """A MIG GPU instance is a pool's when gpulib recorded making it for one and
    the instance there (`gi`, its id now, when known) is the one it made (in
    this `boot`); else the administrator's (made by hand, beside the pool's or
    in its place after a reboot, or before gpulib knew it)."""
    for r in state.gpu_instances:
        if r.gpu == gpu and r.profile == profile and r.start == start:
            if gi is None or made_by_gpulib(state.extra.get(GI_BOOT), r.gi, gi, boot):
                return Owner(POOL, f"GPU instance {profile}@{start} of {gpu} is pool "
                                   f"{r.pool}'s", name=r.pool)
            break
    return Owner(ADMIN, f"GPU instance {profile}@{start} of {gpu} was not made by gpulib",
                 name=f"{gpu}/{profile}@{start}")


def device_owner(state: State, kind: str, ident: str, chain: Iterable[str],
                 live: bool = True, current_type: Optional[int] = None) -> Owner:
    """Whose a vGPU or a VF is, runs aside (`Occupancy.owner` adds them)."""
    found = unmanaged_owner(state.unmanaged, chain)
    if found is not None:
        return found
    if kind == "mdev":
        return vgpu_owner(state.vgpus.get(ident.lower()), ident.lower(), live)
    rec = state.vf_types.get(ident)
    if rec is not None or current_type:
        return vf_owner(rec, ident, current_type)
    return NOBODYS


# -- the host's -------------------------------------------------------------------


def is_own_function(gpu: PciAddress, gpu_vendor: Optional[int], other: PciAddress,
                    vendor: Optional[int]) -> bool:
    """The GPU's own function (HDMI audio, USB-C, UCSI): same slot, same vendor."""
    return (other.domain, other.bus, other.slot) == (gpu.domain, gpu.bus, gpu.slot) and \
        vendor is not None and vendor == gpu_vendor


def _hex(sysfs: Sysfs, address: PciAddress, name: str) -> Optional[int]:
    text = sysfs.read(f"sys/bus/pci/devices/{address}/{name}")
    if text is None:
        return None
    try:
        return int(text.strip(), 16)
    except ValueError:
        return None


def host_endpoints(sysfs: Sysfs, gpu: PciAddress, group: Optional[int],
                   members: Optional[Iterable[PciAddress]] = None) -> list[tuple[str, str]]:
    """The endpoints of `gpu`'s IOMMU group that a host driver uses and that
    are not the GPU's own: (address, driver), in address order. Bridges stay
    with the host anyway; another GPU (or a GPU's VF) is a device of its own
    the occupancy tracks; an endpoint unbound or on vfio-pci is nobody's and
    may go along. A non-empty answer keeps the GPU from being given whole:
    vfio would take the endpoint from its driver."""
    if group is None:
        return []
    if members is None:
        members = iommu_group_members(sysfs, group)
    vendor = _hex(sysfs, gpu, "vendor")
    out = []
    for m in members:
        if m == gpu:
            continue
        klass = _hex(sysfs, m, "class")
        if klass is not None and (klass >> 16 == BRIDGE_BASE_CLASS or has_gpu_class(klass >> 8)):
            continue
        if is_own_function(gpu, vendor, m, _hex(sysfs, m, "vendor")):
            continue
        driver = sysfs.link_name(f"sys/bus/pci/devices/{m}/driver")
        if driver and driver not in GUEST_DRIVERS:
            out.append((str(m), driver))
    return sorted(out)


def host_endpoint_reason(found: list[tuple[str, str]]) -> Optional[str]:
    """The one line that refuses a GPU whose group holds a host endpoint."""
    if not found:
        return None
    addr, driver = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return (f"its IOMMU group holds {addr}, which the host's {driver} driver uses{more}: "
            "giving the GPU whole would take it from the host")


BOOT_VGA_REFUSAL = ("it is the host's boot VGA device (its console): gpulib gives it whole "
                    "only with [discovery] allow_boot_vga = yes in gpulib.conf")


def whole_gpu_refusal(numvfs: int, vgpus: int, typed_vfs: int = 0,
                      pools: Iterable[str] = (), console: bool = False,
                      host_endpoint: Optional[str] = None,
                      unmanaged: Optional[str] = None) -> Optional[str]:
    """Why a GPU cannot be given whole (None: it can).

    The host's (its console: the boot VGA device unless `[discovery]
    allow_boot_vga` gives it up, whose vGPUs may still be offered; a group
    with an endpoint a host driver uses, `host_endpoint_reason`) and the
    administrator's (`unmanaged`) are never offered or given whole. Nor is a
    GPU whose vGPU use is declared (live or registered vGPUs, typed VFs, a
    pool of gpulib.conf) or whose SR-IOV VFs are enabled. The CloudStack
    report's `enabled` and the hooks' accept ask this one rule.
    """
    if unmanaged is not None:
        return unmanaged
    if console:
        return BOOT_VGA_REFUSAL
    if host_endpoint is not None:
        return host_endpoint
    declared = list(pools)
    if vgpus:
        return f"it carries {vgpus} vGPU(s)"
    if declared:
        return f"pool {declared[0]} declares vGPUs on it"
    if typed_vfs:
        return f"{typed_vfs} of its VFs carry a vGPU type"
    if numvfs:
        return f"its SR-IOV VFs are enabled ({numvfs})"
    return None

