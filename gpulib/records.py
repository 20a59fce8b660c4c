"""The state's schema and its records: what gpulib knows that the host cannot
tell it again after a reboot or a crash.

`State` is the typed document of `var/lib/gpulib/state.json`: the mdevs gpulib
created (uuid -> parent, type), the vGPU type it gave NVIDIA VFs, the vGPU type
names it learned, which VM holds which devices (allocations, pending or
active), the devices the operator took away from gpulib, and the write-ahead
intents of sysfs changes in flight. `State.from_json` checks every field and
raises `CorruptStateError` (or `StateVersionError` for a newer schema) on
anything else; `dumps` gives the file's deterministic text (`gpulib.statetext`).
The file itself, its lock and its writers are `gpulib.state`.
"""

from __future__ import annotations

import json
import time

import gpulib
from gpulib import logger
from gpulib.errors import InputError, StateError
from gpulib.statetext import render_json
from gpulib.validate import (
    check_pci_address,
    check_type_id,
    check_uuid,
    check_vm_name,
    is_canonical_pci_address,
    is_canonical_uuid,
    is_plain_vm_name,
    is_type_id,
    show,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Union

log = logger.get("gpulib.state")

SCHEMA_VERSION = 4
"""4: MIG GPU instances gpulib made for pools (`gpu_instances`), the GPU
instance profile of a VF's MIG-backed type (`gpu_instance_profile` of a
`vf_types` record), and intents that announce a GPU instance's creation or
destruction (`create-gi`, `destroy-gi`), which an older gpulib would read as
a corrupt file; a version 3 file needs no change.
3: intents may also announce removals (`remove-mdev`, `clear-vf-type`: a
stop's or a retried start's write-ahead record before it destroys a device),
which an older gpulib would read as a corrupt file and rebuild; a version 2
file needs no change.
2: allocations are the only record of who holds a device (v1 also kept a
`vm` on vGPU and VF records; `_migrate_v1` folds those into allocations), an
allocation records the boot it was made in (`boot_id`, `uptime`: proof that
a pending start is dead, robust to wall-clock jumps), and `intents` hold the
write-ahead records of sysfs changes a start is making."""


HANDMADE = "manual"
"""The `pool` of a record an administrator made by hand (`gpulib mdev create`,
`gpulib vf set-type`): gpulib keeps it (recreates or retypes it after a reboot)
but it is never a pool member. No pool may be named so (`gpulib.config`
refuses the section), `pool apply` never counts, removes or clears it, and
the allocator never hands it out for a metadata request. `is_handmade` and
`pool_of` are the one reading of the field."""

DEVICE_KINDS = ("mdev", "vf", "pci")
INTENT_ACTIONS = ("create-mdev", "set-vf-type", "remove-mdev", "clear-vf-type", "create-gi",
                  "destroy-gi")
REMOVALS = ("remove-mdev", "clear-vf-type")
# A GPU instance's creation or destruction: only commands that may run NVIDIA's
# tool settle them (never a hook: gpulib.migtool).
GPU_INSTANCE_ACTIONS = ("create-gi", "destroy-gi")
ALLOCATION_STATUSES = ("pending", "active")

_LOWER_HEX = frozenset("0123456789abcdef")
_DIGITS = frozenset("0123456789")


def _is_model(key: str) -> bool:
    """`vvvv:dddd`, lower-case hex (no regex: it would be compiled under the lock)."""
    return len(key) == 9 and key[4] == ":" and _LOWER_HEX.issuperset(key[:4] + key[5:])


def _is_type_number(text: str) -> bool:
    return bool(text) and _DIGITS.issuperset(text)


class StateVersionError(StateError):
    """The state file was written by a newer gpulib: refuse it, never touch it."""


class CorruptStateError(StateError):
    """The state document cannot be understood (bad JSON, bad shape, bad values)."""


def utc_now() -> str:
    """The current time as ISO 8601 UTC with second precision (`...T12:00:00Z`)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------
# The typed document.


class _Record:
    """A small mutable record: slots, equality and repr over its fields.

    Hand-written instead of dataclasses: the hooks import this module on
    every VM start, and generating dataclasses costs milliseconds there.
    """

    __slots__: tuple[str, ...] = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, f) == getattr(other, f) for f in self.__slots__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__slots__)
        return f"{type(self).__name__}({fields})"

    __hash__ = None  # type: ignore[assignment]  # mutable: unhashable, as dataclasses


class VgpuRecord(_Record):
    """An mdev gpulib created or adopted, so it can be recreated after a reboot."""

    __slots__ = ("created", "on_demand", "parent", "pool", "remembered", "type_id")

    def __init__(self, parent: str, type_id: str, pool: Optional[str] = None,
                 on_demand: bool = False, created: Optional[str] = None,
                 remembered: bool = False) -> None:
        self.parent = parent  # the parent device's name, a PCI address for GPUs
        self.type_id = type_id  # the mdev type, e.g. 'nvidia-558'
        self.pool = pool  # the declared pool it belongs to, if any
        self.on_demand = on_demand  # created for one VM: destroyed when that VM stops
        # Who uses it is an allocation's business (schema 2), never the record's.
        self.created = created if created is not None else utc_now()  # ISO 8601 UTC
        # Made outside gpulib (mdevctl, sysfs, another tool) and used by a
        # running VM: remembered (parent, type, UUID) so that VM's next start
        # after a reboot can make it again, never owned (its pool is
        # HANDMADE: the administrator's). Not defined for mdevctl, not made
        # by restore, never destroyed. Written only when true.
        self.remembered = remembered


class VfRecord(_Record):
    """The NVIDIA vendor-specific vGPU type gpulib gave a VF."""

    __slots__ = ("gi_profile", "name", "on_demand", "pool", "type_id")

    def __init__(self, type_id: int, name: Optional[str] = None, pool: Optional[str] = None,
                 on_demand: bool = False, gi_profile: Optional[int] = None) -> None:
        self.type_id = type_id  # the numeric `current_vgpu_type`
        self.name = name  # its name, e.g. 'NVIDIA A10-4Q', when known
        self.pool = pool
        self.on_demand = on_demand
        # The MIG GPU instance profile a MIG-backed type runs on (None: a
        # time-sliced type). Such a pool member gives its GPU instance back
        # when its VM stops: its type is cleared, the record stays.
        self.gi_profile = gi_profile


class GpuInstanceRecord(_Record):
    """A MIG GPU instance gpulib made (with its compute instance) for a pool,
    so it is made again at the same placement after a reboot."""

    __slots__ = ("gi", "gpu", "pool", "profile", "size", "start")

    def __init__(self, gpu: str, profile: int, start: int, size: int,
                 gi: Optional[int] = None, pool: Optional[str] = None) -> None:
        self.gpu = gpu  # the GPU's PCI address
        self.profile = profile  # the GPU instance profile id (19: MIG 1g.10gb on an H100)
        self.start = start  # its placement: the first memory slice ...
        self.size = size  # ... and how many it takes
        self.gi = gi  # the id the driver gave it when last made
        self.pool = pool

    @property
    def key(self) -> tuple[str, int]:
        """One instance per placement start on a GPU."""
        return (self.gpu, self.start)


class Device(_Record):
    """One device an allocation holds."""

    __slots__ = ("id", "kind", "on_demand")

    def __init__(self, kind: str, id: str, on_demand: bool = False) -> None:
        self.kind = kind  # 'mdev' | 'vf' | 'pci'
        self.id = id  # mdev uuid, or PCI address 'dddd:bb:ss.f' for 'vf' and 'pci'
        self.on_demand = on_demand


class Allocation(_Record):
    """The devices one VM holds, pending until the VM has started."""

    __slots__ = ("arriving", "boot_id", "devices", "domain_uuid", "prepared", "since", "status",
                 "uptime", "vm")

    def __init__(self, vm: str, domain_uuid: Optional[str] = None, status: str = "pending",
                 since: Optional[str] = None, devices: Optional[list[Device]] = None,
                 boot_id: Optional[str] = None, uptime: Optional[float] = None,
                 arriving: bool = False, prepared: bool = False) -> None:
        self.vm = vm
        self.domain_uuid = domain_uuid
        self.status = status  # 'pending' | 'active'
        self.since = since if since is not None else utc_now()
        self.devices: list[Device] = devices if devices is not None else []
        # The boot (kernel boot_id) and the seconds since that boot (CLOCK_BOOTTIME,
        # which no clock change moves) when the allocation was made: how a pending
        # start is proven dead (liveness.run_over).
        self.boot_id = boot_id
        self.uptime = uptime
        # Made by a live migration's `migrate begin`, whose `prepare begin` has
        # not come yet: libvirt calls it at once, so an arrival it never
        # follows was abandoned (liveness.run_over). Written only when
        # true: an older gpulib reads the key as unknown and ignores it.
        self.arriving = arriving
        # libvirt prepared this run: its `prepare begin` (or `restore begin`)
        # recorded or confirmed the allocation. `release end` ends only such
        # a run (or an active one): a pending allocation the transformer made
        # and libvirt has not prepared yet is a newer start, which a late
        # `release end` of the run before it must leave alone. Written only
        # when true, like `arriving`.
        self.prepared = prepared


class Intent(_Record):
    """A sysfs change gpulib is about to make, written before the write.

    A start's (`create-mdev`, `set-vf-type`): the next run completes it (the
    allocation that names the device exists: the change is that allocation's)
    or undoes it. A release's (`remove-mdev`, `clear-vf-type`): the next run
    finishes it unless a VM holds the device again (journal.settle); a
    `clear-vf-type` that is not on demand clears a MIG-backed pool member's
    type and keeps its record. A GPU instance's (`create-gi`, `destroy-gi`:
    `id` the GPU, `type_id` `<profile>@<start>`, `vm` `pool:<name>`): the
    next command that may run NVIDIA's tool completes or undoes it
    (`pools.settle_instances`).
    """

    __slots__ = ("action", "id", "on_demand", "parent", "type_id", "vm")

    def __init__(self, action: str, id: str, vm: str, parent: Optional[str] = None,
                 type_id: Optional[str] = None, on_demand: bool = False) -> None:
        self.action = action  # 'create-mdev' | 'set-vf-type'
        self.id = id  # the mdev uuid, or the VF's PCI address
        self.vm = vm
        self.parent = parent
        self.type_id = type_id  # mdev type id, or the VF's numeric type as text
        self.on_demand = on_demand


def is_handmade(record: Union[VgpuRecord, VfRecord]) -> bool:
    """An administrator made the device by hand: theirs, never a pool member."""
    return record.pool == HANDMADE


def pool_of(record: Union[VgpuRecord, VfRecord]) -> Optional[str]:
    """The declared pool the device is a member of (None: none, or hand-made)."""
    pool = record.pool
    return None if pool is None or pool == HANDMADE else pool


# Shape checks. Each raises CorruptStateError naming the place in the document.


def _where(path: str, key: str) -> str:
    return f"{path}[{key!r}]" if path else key


def _typename(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _get(obj: dict[str, Any], key: str, path: str, default: Any = ...) -> Any:
    if key in obj:
        return obj[key]
    if default is ...:
        raise CorruptStateError(f"{path}: missing {key!r}")
    return default


def _as_dict(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptStateError(f"{path}: expected an object, got {_typename(value)}")
    return value


def _as_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise CorruptStateError(f"{path}: expected a string, got {_typename(value)}")
    return value


def _as_opt_str(value: Any, path: str) -> Optional[str]:
    return None if value is None else _as_str(value, path)


def _as_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise CorruptStateError(f"{path}: expected true or false, got {_typename(value)}")
    return value


def _as_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptStateError(f"{path}: expected an integer, got {_typename(value)}")
    return value


def _as_component(value: Any, path: str) -> str:
    """A name that ends up as one sysfs path component: no '/', no '..'."""
    text = _as_str(value, path)
    if not text or "/" in text or "\x00" in text or text in (".", ".."):
        raise CorruptStateError(f"{path}: not a usable name: {show(text)}")
    return text


def _as_checked(value: Any, path: str, check: Callable[[str], str]) -> str:
    """Text that one of gpulib.validate's rules accepts (every entry point takes
    the same), in the form it keeps; the rule's message, placed, otherwise."""
    text = _as_str(value, path)
    try:
        return check(text)
    except InputError as e:
        raise CorruptStateError(f"{path}: {e.message}") from None


def _as_uuid(value: Any, path: str) -> str:
    """A UUID, kept lowercase."""
    return _as_checked(value, path, check_uuid)


def _as_pci(value: Any, path: str) -> str:
    """A PCI address, kept as sysfs names it."""
    return _as_checked(value, path, check_pci_address)


def _as_type_id(value: Any, path: str) -> str:
    return _as_checked(value, path, check_type_id)


def _as_vm(value: Any, path: str) -> str:
    return _as_checked(value, path, check_vm_name)


# Fast paths for the state's common shape. Each accepts only what the checked
# parser below it accepts and builds the same record; anything else (an error
# included) goes through the checked parser, whose messages name the place.
# A state of 64 allocations is parsed under the lock by every VM start.


def _is_component(text: Any) -> bool:
    return type(text) is str and text != "" and "/" not in text and "\x00" not in text \
        and text != "." and text != ".."


def _vgpu_fast(d: Any) -> Optional[VgpuRecord]:
    if type(d) is not dict:
        return None
    parent: Any = d.get("parent")
    type_id: Any = d.get("type_id")
    created, pool, on_demand = d.get("created"), d.get("pool"), d.get("on_demand", False)
    remembered = d.get("remembered", False)
    if _is_component(parent) and is_type_id(type_id) and type(created) is str and \
            (pool is None or type(pool) is str) and (on_demand is True or on_demand is False) \
            and (remembered is True or remembered is False):
        return VgpuRecord(parent, type_id, pool, on_demand, created, remembered)
    return None


def _device_fast(d: Any) -> Optional[Device]:
    if type(d) is not dict:
        return None
    ident: Any = d.get("id")
    kind, on_demand = d.get("kind"), d.get("on_demand", False)
    if not (on_demand is True or on_demand is False):
        return None
    if (kind == "mdev" and is_canonical_uuid(ident)) or \
            ((kind == "pci" or kind == "vf") and is_canonical_pci_address(ident)):
        return Device(kind, ident, on_demand)
    return None


def _allocation_fast(d: Any, key: str) -> Optional[Allocation]:
    if type(d) is not dict:
        return None
    vm, status, since = d.get("vm"), d.get("status"), d.get("since")
    if vm != key or not is_plain_vm_name(vm) or type(since) is not str or \
            not (status == "pending" or status == "active"):
        return None
    domain_uuid, boot_id, uptime = d.get("domain_uuid"), d.get("boot_id"), d.get("uptime")
    if (domain_uuid is not None and not is_canonical_uuid(domain_uuid)) or \
            (boot_id is not None and type(boot_id) is not str):
        return None
    if uptime is not None:
        if (type(uptime) is not float and type(uptime) is not int) or uptime != uptime:
            return None
        uptime = float(uptime)
    raw_devices = d.get("devices")
    if type(raw_devices) is not list:
        return None
    devices = []
    for raw in raw_devices:
        dev = _device_fast(raw)
        if dev is None:
            return None
        devices.append(dev)
    arriving = d.get("arriving", False)
    if arriving is not False and arriving is not True:
        return None
    prepared = d.get("prepared", False)
    if prepared is not False and prepared is not True:
        return None
    return Allocation(vm, domain_uuid, status, since, devices, boot_id, uptime, arriving,
                      prepared)


def _vgpu_from_json(value: Any, path: str) -> VgpuRecord:
    d = _as_dict(value, path)
    return VgpuRecord(
        parent=_as_component(_get(d, "parent", path), _where(path, "parent")),
        type_id=_as_type_id(_get(d, "type_id", path), _where(path, "type_id")),
        pool=_as_opt_str(_get(d, "pool", path, None), _where(path, "pool")),
        on_demand=_as_bool(_get(d, "on_demand", path, False), _where(path, "on_demand")),
        created=_as_str(_get(d, "created", path), _where(path, "created")),
        remembered=_as_bool(_get(d, "remembered", path, False), _where(path, "remembered")),
    )


def _vgpu_to_json(r: VgpuRecord) -> dict[str, Any]:
    doc: dict[str, Any] = {"parent": r.parent, "type_id": r.type_id, "pool": r.pool,
                           "on_demand": r.on_demand, "created": r.created}
    if r.remembered:
        doc["remembered"] = True
    return doc


def _vf_from_json(value: Any, path: str) -> VfRecord:
    d = _as_dict(value, path)
    type_id = _as_int(_get(d, "type_id", path), _where(path, "type_id"))
    if type_id < 0:
        raise CorruptStateError(f"{_where(path, 'type_id')}: negative vGPU type {type_id}")
    gi_profile = _get(d, "gpu_instance_profile", path, None)
    if gi_profile is not None:
        gi_profile = _as_int(gi_profile, _where(path, "gpu_instance_profile"))
        if not 0 <= gi_profile < 10 ** 4:
            raise CorruptStateError(f"{_where(path, 'gpu_instance_profile')}: not a GPU "
                                    f"instance profile: {gi_profile}")
    return VfRecord(
        type_id=type_id,
        name=_as_opt_str(_get(d, "name", path, None), _where(path, "name")),
        pool=_as_opt_str(_get(d, "pool", path, None), _where(path, "pool")),
        on_demand=_as_bool(_get(d, "on_demand", path, False), _where(path, "on_demand")),
        gi_profile=gi_profile,
    )


def _vf_to_json(r: VfRecord) -> dict[str, Any]:
    out = {"type_id": r.type_id, "name": r.name, "pool": r.pool, "on_demand": r.on_demand}
    if r.gi_profile is not None:  # only MIG-backed types have one
        out["gpu_instance_profile"] = r.gi_profile
    return out


def _gi_from_json(value: Any, path: str) -> GpuInstanceRecord:
    d = _as_dict(value, path)
    numbers = {}
    for key in ("profile", "start", "size"):
        n = _as_int(_get(d, key, path), _where(path, key))
        if not 0 <= n < 10 ** 4:
            raise CorruptStateError(f"{_where(path, key)}: out of range: {n}")
        numbers[key] = n
    gi = _get(d, "gi", path, None)
    if gi is not None:
        gi = _as_int(gi, _where(path, "gi"))
        if not 0 <= gi < 10 ** 4:
            raise CorruptStateError(f"{_where(path, 'gi')}: out of range: {gi}")
    return GpuInstanceRecord(_as_pci(_get(d, "gpu", path), _where(path, "gpu")),
                             numbers["profile"], numbers["start"], numbers["size"], gi,
                             _as_opt_str(_get(d, "pool", path, None), _where(path, "pool")))


def _gi_to_json(r: GpuInstanceRecord) -> dict[str, Any]:
    return {"gpu": r.gpu, "profile": r.profile, "start": r.start, "size": r.size, "gi": r.gi,
            "pool": r.pool}


def _choice_and_id(d: dict[str, Any], path: str, key: str, allowed: tuple[str, ...],
                   what: str, uuid_for: tuple[str, ...]) -> tuple[str, str]:
    """`d[key]`, one of `allowed`, and `d["id"]`: a UUID when `d[key]` is one
    of `uuid_for` (an mdev's), else a PCI address."""
    choice = _as_str(_get(d, key, path), _where(path, key))
    if choice not in allowed:
        raise CorruptStateError(f"{_where(path, key)}: unknown {what} {show(choice)}")
    raw_id, where = _get(d, "id", path), _where(path, "id")
    return choice, (_as_uuid(raw_id, where) if choice in uuid_for else _as_pci(raw_id, where))


def _device_from_json(value: Any, path: str) -> Device:
    d = _as_dict(value, path)
    kind, dev_id = _choice_and_id(d, path, "kind", DEVICE_KINDS, "device kind", ("mdev",))
    return Device(kind=kind, id=dev_id,
                  on_demand=_as_bool(_get(d, "on_demand", path, False),
                                     _where(path, "on_demand")))


def _allocation_from_json(value: Any, path: str, key: str) -> Allocation:
    d = _as_dict(value, path)
    vm = _as_vm(_get(d, "vm", path), _where(path, "vm"))
    if vm != key:
        raise CorruptStateError(f"{path}: records VM {show(vm)} under the key {show(key)}")
    domain_uuid = _get(d, "domain_uuid", path, None)
    status = _as_str(_get(d, "status", path), _where(path, "status"))
    if status not in ALLOCATION_STATUSES:
        raise CorruptStateError(f"{_where(path, 'status')}: unknown status {show(status)}")
    devices = _get(d, "devices", path)
    if not isinstance(devices, list):
        raise CorruptStateError(
            f"{_where(path, 'devices')}: expected a list, got {_typename(devices)}")
    boot_id = _as_opt_str(_get(d, "boot_id", path, None), _where(path, "boot_id"))
    uptime = _get(d, "uptime", path, None)
    if uptime is not None and (isinstance(uptime, bool) or not isinstance(uptime, (int, float))
                               or uptime != uptime):
        raise CorruptStateError(f"{_where(path, 'uptime')}: expected a number, got "
                                f"{_typename(uptime)}")
    arriving = _get(d, "arriving", path, False)
    if not isinstance(arriving, bool):
        raise CorruptStateError(f"{_where(path, 'arriving')}: expected true or false, got "
                                f"{_typename(arriving)}")
    prepared = _get(d, "prepared", path, False)
    if not isinstance(prepared, bool):
        raise CorruptStateError(f"{_where(path, 'prepared')}: expected true or false, got "
                                f"{_typename(prepared)}")
    return Allocation(
        arriving=arriving, prepared=prepared,
        boot_id=boot_id, uptime=None if uptime is None else float(uptime),
        vm=vm,
        domain_uuid=None if domain_uuid is None else _as_uuid(domain_uuid,
                                                              _where(path, "domain_uuid")),
        status=status,
        since=_as_str(_get(d, "since", path), _where(path, "since")),
        devices=[_device_from_json(dev, f"{_where(path, 'devices')}[{i}]")
                 for i, dev in enumerate(devices)],
    )


def _allocation_to_json(a: Allocation) -> dict[str, Any]:
    doc = {"vm": a.vm, "domain_uuid": a.domain_uuid, "status": a.status, "since": a.since,
           "boot_id": a.boot_id, "uptime": a.uptime,
           "devices": [{"kind": d.kind, "id": d.id, "on_demand": d.on_demand}
                       for d in a.devices]}
    if a.arriving:
        doc["arriving"] = True
    if a.prepared:
        doc["prepared"] = True
    return doc


def _intent_from_json(value: Any, path: str) -> Intent:
    d = _as_dict(value, path)
    action, ident = _choice_and_id(d, path, "action", INTENT_ACTIONS, "intent",
                                   ("create-mdev", "remove-mdev"))
    parent = _get(d, "parent", path, None)
    type_id = _get(d, "type_id", path, None)
    if action in GPU_INSTANCE_ACTIONS and placement_of(type_id) is None:
        raise CorruptStateError(f"{_where(path, 'type_id')}: not a GPU instance's "
                                f"<profile>@<start>: {show(type_id)}")
    return Intent(action, ident, _as_vm(_get(d, "vm", path), _where(path, "vm")),
                  parent=None if parent is None else _as_component(parent,
                                                                   _where(path, "parent")),
                  type_id=None if type_id is None else _as_component(type_id,
                                                                     _where(path, "type_id")),
                  on_demand=_as_bool(_get(d, "on_demand", path, False),
                                     _where(path, "on_demand")))


def placement_of(text: object) -> Optional[tuple[int, int]]:
    """(profile, start) of a GPU instance intent's `type_id` (`19@6`), else None."""
    if not isinstance(text, str):
        return None
    profile, sep, start = text.partition("@")
    if sep and 0 < len(profile) <= 4 and 0 < len(start) <= 2 and \
            _DIGITS.issuperset(profile) and _DIGITS.issuperset(start):
        return int(profile), int(start)
    return None


def _intent_to_json(i: Intent) -> dict[str, Any]:
    return {"action": i.action, "id": i.id, "vm": i.vm, "parent": i.parent,
            "type_id": i.type_id, "on_demand": i.on_demand}


def _migrate_v1(d: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 -> 2: the `vm` of vGPU and VF records becomes allocation entries.

    v1 kept who uses a device twice (the record's `vm` and the allocation). A
    record naming a VM whose allocation lacks the device gains it there; a VM
    with no allocation at all gets an active one (it held the device when the
    file was written: reconcile releases it if that VM no longer runs).
    """
    d = dict(d)
    allocations = dict(_as_dict(d.get("allocations", {}), "allocations"))
    for section, kind in (("vgpus", "mdev"), ("vf_types", "vf")):
        records = {}
        for key, value in _as_dict(d.get(section, {}), section).items():
            rec = dict(_as_dict(value, _where(section, key)))
            vm = rec.pop("vm", None)
            records[key] = rec
            if vm is None:
                continue
            vm = _as_vm(vm, _where(_where(section, key), "vm"))
            alloc = allocations.get(vm)
            device = {"kind": kind, "id": key, "on_demand": rec.get("on_demand", False)}
            if alloc is None:
                allocations[vm] = {"vm": vm, "domain_uuid": None, "status": "active",
                                   "since": utc_now(), "devices": [device]}
                log.warning("state upgrade: %s %s was recorded as used by %s, which had no "
                            "allocation: recorded an active one", kind, key, vm)
                continue
            alloc = dict(_as_dict(alloc, _where("allocations", vm)))
            devices = list(alloc.get("devices") or [])
            if not any(isinstance(x, dict) and x.get("id") == key for x in devices):
                devices.append(device)
            alloc["devices"] = devices
            allocations[vm] = alloc
        d[section] = records
    d["allocations"] = allocations
    d["version"] = 2
    return d


REBUILT_FROM_KEY = "rebuilt_from"
# What a rebuild from the host alone could not recover (a list of lines, in
# the state until the next rebuild): `gpulib status`, metrics and the log say it.
UNRECOVERED_KEY = "unrecovered"
"""Top-level key of a rebuilt state: where what it knows came from."""

WRITER_KEY = "writer"
"""Top-level key: the gpulib release that wrote the file last ("gpulib 0.1.0.433"),
for the administrator and for a refusal of a file a newer release wrote."""

_KNOWN_KEYS = frozenset({"version", "vgpus", "vf_types", "type_names", "allocations",
                         "unmanaged", "intents", WRITER_KEY, "gpu_instances"})


class State(_Record):
    """The typed state document.

    `extra` keeps top-level keys this version does not know (a hand edit, a
    tool that annotates the file) so that a rewrite does not drop them.
    """

    __slots__ = ("allocations", "extra", "gpu_instances", "intents", "type_names", "unmanaged",
                 "vf_types", "vgpus")

    def __init__(self, vgpus: Optional[dict[str, VgpuRecord]] = None,
                 vf_types: Optional[dict[str, VfRecord]] = None,
                 type_names: Optional[dict[str, dict[str, str]]] = None,
                 allocations: Optional[dict[str, Allocation]] = None,
                 unmanaged: Optional[set[str]] = None,
                 extra: Optional[dict[str, Any]] = None,
                 intents: Optional[list[Intent]] = None,
                 gpu_instances: Optional[list[GpuInstanceRecord]] = None) -> None:
        self.vgpus: dict[str, VgpuRecord] = vgpus or {}  # mdev uuid -> record
        self.vf_types: dict[str, VfRecord] = vf_types or {}  # VF address -> record
        # 'vvvv:dddd' of the GPU model -> {numeric vGPU type id: name}
        self.type_names: dict[str, dict[str, str]] = type_names or {}
        self.allocations: dict[str, Allocation] = allocations or {}  # VM name -> allocation
        self.unmanaged: set[str] = unmanaged or set()  # PCI addresses the operator unmanaged
        self.extra: dict[str, Any] = extra or {}
        self.intents: list[Intent] = intents or []  # write-ahead records, oldest first
        # MIG GPU instances gpulib made for pools, by GPU and placement.
        self.gpu_instances: list[GpuInstanceRecord] = gpu_instances or []

    def to_json(self) -> dict[str, Any]:
        """The JSON document (plain dicts, lists and scalars)."""
        doc: dict[str, Any] = dict(self.extra)
        doc.update({
            "version": SCHEMA_VERSION,
            "vgpus": {k: _vgpu_to_json(v) for k, v in self.vgpus.items()},
            "vf_types": {k: _vf_to_json(v) for k, v in self.vf_types.items()},
            "type_names": {k: dict(v) for k, v in self.type_names.items()},
            "allocations": {k: _allocation_to_json(v) for k, v in self.allocations.items()},
            "unmanaged": sorted(self.unmanaged),
            "intents": [_intent_to_json(i) for i in self.intents],
            WRITER_KEY: f"gpulib {gpulib.version()}",
        })
        if self.gpu_instances:  # a host without MIG keeps the file it had
            doc["gpu_instances"] = [_gi_to_json(r) for r in sorted(
                self.gpu_instances, key=lambda r: r.key)]
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> State:
        """Build a State from a parsed document.

        Raises StateVersionError for a document from a newer gpulib and
        CorruptStateError (both StateError) for anything malformed.
        """
        d = _as_dict(doc, "state")
        version = _get(d, "version", "state")
        if isinstance(version, bool) or not isinstance(version, int):
            raise CorruptStateError(f"version: expected an integer, got {_typename(version)}")
        if version > SCHEMA_VERSION:
            writer = d.get(WRITER_KEY)
            by = f" (written by {writer})" if isinstance(writer, str) and len(writer) < 80 \
                and writer.isprintable() else ""
            raise StateVersionError(
                f"state is version {version}{by}, this gpulib ({gpulib.version()}) understands "
                f"up to {SCHEMA_VERSION}: upgrade gpulib")
        if version < 1:
            raise CorruptStateError(f"version: {version} is not a state version")
        if version == 1:
            d = _migrate_v1(d)

        state = cls()
        for key, value in _as_dict(d.get("vgpus", {}), "vgpus").items():
            record = _vgpu_fast(value) if is_canonical_uuid(key) else None
            if record is None:
                path = _where("vgpus", key)
                record = _vgpu_from_json(value, path)
                key = _as_uuid(key, path)
            state.vgpus[key] = record
        for key, value in _as_dict(d.get("vf_types", {}), "vf_types").items():
            path = _where("vf_types", key)
            state.vf_types[_as_pci(key, path)] = _vf_from_json(value, path)
        for key, value in _as_dict(d.get("type_names", {}), "type_names").items():
            path = _where("type_names", key)
            if not _is_model(key):
                raise CorruptStateError(f"{path}: not a GPU model vvvv:dddd")
            names: dict[str, str] = {}
            for number, name in _as_dict(value, path).items():
                if not _is_type_number(number):
                    raise CorruptStateError(f"{_where(path, number)}: not a numeric type id")
                names[number] = _as_str(name, _where(path, number))
            state.type_names[key] = names
        for key, value in _as_dict(d.get("allocations", {}), "allocations").items():
            alloc = _allocation_fast(value, key)
            if alloc is None:
                path = _where("allocations", key)
                alloc = _allocation_from_json(value, path, key)
                key = _as_vm(key, path)
            state.allocations[key] = alloc
        unmanaged = d.get("unmanaged", [])
        if not isinstance(unmanaged, list):
            raise CorruptStateError(f"unmanaged: expected a list, got {_typename(unmanaged)}")
        state.unmanaged = {_as_pci(a, f"unmanaged[{i}]") for i, a in enumerate(unmanaged)}
        intents = d.get("intents", [])
        if not isinstance(intents, list):
            raise CorruptStateError(f"intents: expected a list, got {_typename(intents)}")
        state.intents = [_intent_from_json(x, f"intents[{i}]") for i, x in enumerate(intents)]
        gis = d.get("gpu_instances", [])
        if not isinstance(gis, list):
            raise CorruptStateError(f"gpu_instances: expected a list, got {_typename(gis)}")
        state.gpu_instances = [_gi_from_json(x, f"gpu_instances[{i}]") for i, x in enumerate(gis)]
        seen: set[tuple[str, int]] = set()
        for i, r in enumerate(state.gpu_instances):
            if r.key in seen:
                raise CorruptStateError(f"gpu_instances[{i}]: a second GPU instance at {r.gpu} "
                                        f"start {r.start}")
            seen.add(r.key)
        state.extra = {k: v for k, v in d.items() if k not in _KNOWN_KEYS}
        return state

    def assign(self, other: State) -> None:
        """Make this document equal to `other` (inside a transaction, say)."""
        for name in self.__slots__:
            setattr(self, name, getattr(other, name))

    def copy(self) -> State:
        """A deep copy (through the JSON text, so nothing is shared)."""
        return State.from_json(json.loads(dumps(self)))


def dumps(state: State) -> str:
    """The deterministic text of a state file: sorted keys, ASCII, indent 1."""
    return render_json(state.to_json())



__all__ = [
    "ALLOCATION_STATUSES",
    "DEVICE_KINDS",
    "GPU_INSTANCE_ACTIONS",
    "HANDMADE",
    "INTENT_ACTIONS",
    "REBUILT_FROM_KEY",
    "REMOVALS",
    "SCHEMA_VERSION",
    "UNRECOVERED_KEY",
    "Allocation",
    "CorruptStateError",
    "Device",
    "GpuInstanceRecord",
    "Intent",
    "State",
    "StateVersionError",
    "VfRecord",
    "VgpuRecord",
    "dumps",
    "is_handmade",
    "placement_of",
    "pool_of",
    "utc_now",
]
