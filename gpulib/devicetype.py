"""What a vGPU is, read from this host: its type, the type's name, the GPU model.

gpulib records this in the domain's metadata (`<gpulib:device>`, see
`domain.DeviceType`) when it gives a VM a vGPU, so the record travels with
the live XML when the VM migrates: the destination gives the VM an
equivalent vGPU (same type on a GPU of the same vendor:device) without ever
asking the source. Sysfs is read, never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gpulib import mdev, nvidia
from gpulib.domain import DeviceType, Domain, DomainXmlError, MdevHostdev
from gpulib.errors import InputError
from gpulib.pci import PciAddress, physical_function

if TYPE_CHECKING:
    from gpulib.state import State
    from gpulib.sysfs import Sysfs


def gpu_model(sysfs: Sysfs, address: PciAddress) -> Optional[str]:
    """`vvvv:dddd` of the physical GPU `address` is (or is a VF of); None when
    it cannot be read."""
    pf = physical_function(sysfs, address) or address
    rel = f"sys/bus/pci/devices/{pf}"
    vendor, device = sysfs.read_id(rel + "/vendor"), sysfs.read_id(rel + "/device")
    if vendor is None or device is None:
        return None
    return f"{vendor:04x}:{device:04x}"


def mdev_type(sysfs: Sysfs, state: Optional[State], uuid: str) -> Optional[DeviceType]:
    """The live mdev's type (or, when it is not live, its registry record's)."""
    live = mdev.read_mdev(sysfs, uuid)
    if live is not None:
        parent, type_id = live.parent, live.type_id
    else:
        rec = state.vgpus.get(uuid) if state is not None else None
        if rec is None:
            return None
        try:
            parent, type_id = PciAddress.parse(rec.parent), rec.type_id
        except InputError:
            return None
    name = mdev.MdevType(sysfs, parent, type_id).name
    return DeviceType("mdev", uuid, type_id, name, gpu_model(sysfs, parent))


def vf_type(sysfs: Sysfs, state: Optional[State], address: PciAddress) -> Optional[DeviceType]:
    """An NVIDIA vendor VF's vGPU type (its current one, else the one recorded
    for it); None when it has none or is no such VF."""
    if not nvidia.is_vendor_vf(sysfs, address):
        return None
    rec = state.vf_types.get(str(address)) if state is not None else None
    tid = nvidia.current_type(sysfs, address) or (rec.type_id if rec is not None else 0)
    if not tid:
        return None
    model = gpu_model(sysfs, address)
    return DeviceType("vf", str(address), str(tid), vf_type_name(sysfs, state, address, tid, model),
                      model)


def vf_type_name(sysfs: Sysfs, state: Optional[State], address: PciAddress, type_id: int,
                 model: Optional[str] = None) -> Optional[str]:
    """The name of an NVIDIA vendor VF type: as gpulib recorded it for the VF,
    as the VF lists it creatable, or as learned for the GPU model (a typed
    VF's list no longer shows its own type); None when nothing says."""
    rec = state.vf_types.get(str(address)) if state is not None else None
    if rec is not None and rec.type_id == type_id and rec.name:
        return rec.name
    name = nvidia.creatable_types(sysfs, address).get(type_id)
    if name is None and state is not None:
        model = model or gpu_model(sysfs, address)
        if model is not None:
            name = state.type_names.get(model, {}).get(str(type_id))
    return name


def record_types(sysfs: Sysfs, state: Optional[State], dom: Domain) -> None:
    """Record in `dom`'s metadata what each of its vGPUs is (mdev hostdevs, NVIDIA
    vendor VFs), in document order. A vGPU this host cannot tell keeps the
    record it has; records of devices the XML no longer names go."""
    old = {(r.kind, r.id): r for r in dom.device_types()}
    out: list[DeviceType] = []
    for h in dom.hostdevs():
        found: Optional[DeviceType]
        try:
            if isinstance(h, MdevHostdev):
                ident = ("mdev", h.uuid_checked())
                found = mdev_type(sysfs, state, ident[1])
            else:
                addr = h.address
                ident = ("vf", str(addr))
                found = vf_type(sysfs, state, addr)
        except DomainXmlError:
            continue
        rec = found if found is not None else old.get(ident)
        if rec is not None and rec not in out:
            out.append(rec)
    dom.set_device_types(out)
