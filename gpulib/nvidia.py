"""NVIDIA's vendor-specific vGPU framework on SR-IOV VFs (vGPU 17+, kernel >= 6.8).

Each VF carries `nvidia/creatable_vgpu_types` (a header line `ID    : vGPU Name`
then `ID : name` lines, shrinking as the card fills up) and
`nvidia/current_vgpu_type` (`0` = none; writing an id creates the vGPU,
writing 0 destroys it). Such VFs go to guests as PCI hostdevs with
`managed='no'`.
"""

from __future__ import annotations

import errno
import time

from gpulib import logger, profiles
from gpulib.errors import DeviceError, InputError, NotAvailableError
from gpulib.lazyre import lazy
from gpulib.pci import PCI_DEVICES, PciAddress
from gpulib.sysfs import Sysfs
from gpulib.validate import decimal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

log = logger.get(__name__)

NVIDIA_VENDOR = 0x10DE
# Type ids are small numbers (the driver's are below 10**4); 9 digits is the bound.
TYPE_ID_DIGITS = 9
_LINE = lazy(r"^\s*(\d{1,9})\s*:\s*(.{1,256}?)\s*$")
# "NVIDIA A10-6Q", "GRID T4-2Q", "NVIDIA H200X-1-18C": the last number before
# the series letter(s) is the frame buffer in GB.
_PROFILE_FB = lazy(r"-(\d+)([A-Z]{1,3})$")


def parse_creatable(text: Optional[str]) -> dict[int, str]:
    """`creatable_vgpu_types` as {id: name}; the header and junk lines are skipped."""
    out: dict[int, str] = {}
    for line in (text or "").splitlines():
        m = _LINE.match(line)
        if m:
            out[int(m.group(1))] = m.group(2)
    return out


def framebuffer_mb_from_name(name: Optional[str]) -> Optional[int]:
    m = _PROFILE_FB.search(name or "")
    return int(m.group(1)) * 1024 if m else None


def vf_rel(vf: PciAddress) -> str:
    return f"{PCI_DEVICES}{vf}/nvidia"


def is_vendor_vf(sysfs: Sysfs, vf: PciAddress) -> bool:
    return sysfs.exists(vf_rel(vf) + "/current_vgpu_type")


def current_type(sysfs: Sysfs, vf: PciAddress) -> Optional[int]:
    return sysfs.read_int(vf_rel(vf) + "/current_vgpu_type", low=0,
                          high=10 ** TYPE_ID_DIGITS - 1)


def gpu_instance(sysfs: Sysfs, vf: PciAddress) -> Optional[int]:
    """The MIG GPU instance a typed VF's vGPU runs on (`nvidia/gpu_instance_id`,
    which newer drivers have); None without the file or for any other value
    (an idle VF's, a time-sliced vGPU's)."""
    # Not read_int: another value is no fault of the VF's to report.
    text = sysfs.read(vf_rel(vf) + "/gpu_instance_id")
    return decimal(text.strip(), 4) if text is not None else None


def creatable_types(sysfs: Sysfs, vf: PciAddress) -> dict[int, str]:
    return parse_creatable(sysfs.read(vf_rel(vf) + "/creatable_vgpu_types"))


def check_type(text: object) -> int:
    """A numeric vGPU type id (what current_vgpu_type takes)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str) and decimal(text.strip(), 9) is not None:
        value = int(text.strip())
    else:
        raise InputError(f"not an NVIDIA vGPU type id: {text!r} (expected a number)")
    return value


def resolve_type(sysfs: Sysfs, vf: PciAddress, text: str) -> int:
    """A type as an administrator names it: the numeric id (`594`, `nvidia-594`)
    or the name as `creatable_vgpu_types` lists it (`NVIDIA A10-6Q`, compared
    as `profiles` compares names: case and blanks aside). Unknown or ambiguous
    names are refused with the list of creatable types."""
    number = profiles.vendor_number(text)
    if number is not None:
        return number
    bare = text.strip()
    if bare[:len(profiles.VENDOR_PREFIX)].lower() == profiles.VENDOR_PREFIX:
        bare = bare[len(profiles.VENDOR_PREFIX):]
    if bare.isascii() and bare.isdigit():  # a number, too long
        return check_type(bare)
    creatable = creatable_types(sysfs, vf)
    hits = sorted(i for i, name in creatable.items() if profiles.same_name(text, name))
    listing = ", ".join(f"{k} ({v})" for k, v in sorted(creatable.items())) or "none"
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise InputError(f"vGPU type name {text!r} is ambiguous on {vf}: ids "
                         f"{', '.join(map(str, hits))} (creatable: {listing}); give the id")
    raise InputError(f"no creatable vGPU type named {text!r} on {vf} (creatable: {listing})")


def set_type(sysfs: Sysfs, vf: PciAddress, type_id: int,
             names: Optional[dict[int, str]] = None) -> None:
    """Give an idle VF a vGPU type, checking the creatable list first, then read back."""
    if not is_vendor_vf(sysfs, vf):
        raise DeviceError(f"{vf} is not an NVIDIA vGPU VF (no nvidia/current_vgpu_type)")
    if type_id <= 0:
        raise InputError(f"vGPU type id must be positive, not {type_id}")
    current = current_type(sysfs, vf)
    creatable = creatable_types(sysfs, vf)
    label = creatable.get(type_id) or (names or {}).get(type_id) or str(type_id)
    if current == type_id:
        return
    if current:
        raise DeviceError(f"{vf} already has vGPU type {current}; clear it first")
    if type_id not in creatable:
        what = ", ".join(f"{k} ({v})" for k, v in sorted(creatable.items())) or "none left"
        raise NotAvailableError(f"vGPU type {label} is not creatable on {vf} now "
                                f"(creatable: {what})")
    try:
        sysfs.write(vf_rel(vf) + "/current_vgpu_type", str(type_id))
    except OSError as exc:
        raise DeviceError(f"setting vGPU type {label} on {vf} failed: {exc.strerror}") from None
    after = current_type(sysfs, vf)
    if after != type_id:
        raise DeviceError(f"{vf} reads vGPU type {after} after writing {type_id}")
    log.info("set vGPU type %s (%s) on %s", type_id, label, vf)
    from gpulib import counters
    counters.note(sysfs.root, "vgpus_created", kind="vf")


def clear_type(sysfs: Sysfs, vf: PciAddress, retry_seconds: float = 5.0) -> bool:
    """Write 0; retried because the driver refuses for a moment after QEMU exits."""
    current = current_type(sysfs, vf)
    if current is None:
        raise DeviceError(f"{vf} is not an NVIDIA vGPU VF (no nvidia/current_vgpu_type)")
    if current == 0:
        return False
    deadline = time.monotonic() + retry_seconds
    while True:
        try:
            sysfs.write(vf_rel(vf) + "/current_vgpu_type", "0")
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.EAGAIN, errno.EPERM) and \
                    time.monotonic() < deadline:
                time.sleep(0.25)
                continue
            raise DeviceError(f"clearing the vGPU type of {vf} failed: {exc.strerror}") from None
        if current_type(sysfs, vf) == 0:
            log.info("cleared vGPU type %s on %s", current, vf)
            from gpulib import counters
            counters.note(sysfs.root, "vgpus_destroyed", kind="vf")
            return True
        if time.monotonic() >= deadline:
            raise DeviceError(f"{vf} still reads vGPU type {current_type(sysfs, vf)} "
                              "after writing 0")
        time.sleep(0.25)
