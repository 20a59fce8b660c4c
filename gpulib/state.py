"""gpulib's own state: one versioned JSON file, changed only under one lock.

The file (`var/lib/gpulib/state.json` below the root, DESIGN sections 3 and
6.4) records what gpulib knows that the host cannot tell it again after a
reboot or a crash: the mdevs it created (uuid -> parent, type), the vGPU type
it gave NVIDIA VFs, the vGPU type names it learned, which VM holds which
devices, and the devices the operator took away from gpulib.

Rules this module keeps:

* Every change is made under one OS lock (flock(2) on `state.lock`, the
  lock filelock and flock(1) take too, so a process that dies releases it),
  waited for with a timeout well inside the CloudStack agent's 30 s hook
  timeout. Expiry raises `LockTimeout` (exit code 3).
* Two ways to change the state. `StateStore.transaction()` holds the lock
  while its block runs and while the file is written. `StateStore.update()`
  (the hooks' starts and stops) works the change out and writes the new file
  before taking the lock, then under it renames that file over the old one
  if the old one still holds the bytes the change was worked out from
  (compare-and-swap); otherwise, or when the change needs a sysfs write or a
  checkpoint, it runs again. In a boot storm the lock is then held for a
  read and a rename, not for a data sync every start queues behind.
* Writes are atomic: a temp file in the same directory (`.state.json.<pid>.
  <random>.tmp`), written, synced, renamed over the file with os.replace,
  then the directory is fsynced. A reader therefore sees the old or the new
  document, never a mix, and may read without the lock. The temp file is
  made before the lock is taken (filled with spaces and fsynced, so its size
  and blocks are on disk); under the lock the document overwrites its start
  and needs only fdatasync. The file may therefore end in spaces, which JSON
  allows; the directory's fsync comes after the lock is released, before the
  caller returns.
* Every write also leaves a second copy, `state.json.bak` (same bytes, its
  own file, written atomically after the state file, without a sync: it
  serves only when the state file itself is damaged, not after a power cut,
  which the state file survives). A damaged state file therefore never costs
  ownership: the rebuild starts from the copy (`backup_state`).
* A corrupt file (not JSON, not an object, wrong types, truncated) is moved
  aside to `state.json.corrupt-<UTC timestamp>` under the lock, logged at
  ERROR, and rebuilt with the caller's `rebuild` hook. A plain `load()` of a
  corrupt file logs and returns an empty state; it never moves anything.
* A file written by a newer gpulib (`version` above `SCHEMA_VERSION`) is
  refused with `StateVersionError` (a `StateError`, exit code 4) and never
  overwritten or moved.
* The output is deterministic (sorted keys, ASCII, indent 1): the same
  state always gives the same bytes, and diffs stay readable.

The lock is taken with fcntl directly: the filelock package costs a hook
more to import (tens of milliseconds in recent releases) than the whole
locked section takes, on every VM start.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from json.encoder import encode_basestring_ascii as _json_string
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, TypeVar

from gpulib import atomicfile
from gpulib.errors import InputError, LockTimeout, NeedsLock, StateError
from gpulib.sysfs import DOCUMENT_MAX, ReadFailure, read_file
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

if TYPE_CHECKING:
    from gpulib.context import Context
    from gpulib.sysfs import Sysfs

T = TypeVar("T")

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3
"""3: intents may also announce removals (`remove-mdev`, `clear-vf-type`: a
stop's or a retried start's write-ahead record before it destroys a device),
which an older gpulib would read as a corrupt file and rebuild; a version 2
file needs no change.
2: allocations are the only record of who holds a device (v1 also kept a
`vm` on vGPU and VF records; `_migrate_v1` folds those into allocations), an
allocation records the boot it was made in (`boot_id`, `uptime`: proof that
a pending start is dead, robust to wall-clock jumps), and `intents` hold the
write-ahead records of sysfs changes a start is making."""

DEFAULT_LOCK_TIMEOUT = 20.0
"""Seconds to wait for the state lock: well inside the agent's 30 s hook timeout."""

OPTIMISTIC_TRIES = 5
"""Runs of a change without the lock (`StateStore.update`) before it runs
under the lock: each lost race costs a few milliseconds of CPU, far less
than the queue that holding the lock through a data sync builds."""

HOOK_LOCK_TIMEOUT_CAP = 20.0
"""The longest a hook waits for the state lock, whatever `lock_timeout` says:
the agent kills a hook after 30 s, so a hook gives up in time to answer with
its one-line error. `gpulib doctor` flags a configured value above it."""

DEVICE_KINDS = ("mdev", "vf", "pci")
INTENT_ACTIONS = ("create-mdev", "set-vf-type", "remove-mdev", "clear-vf-type")
REMOVALS = ("remove-mdev", "clear-vf-type")
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

    __slots__ = ("created", "on_demand", "parent", "pool", "type_id")

    def __init__(self, parent: str, type_id: str, pool: Optional[str] = None,
                 on_demand: bool = False, created: Optional[str] = None) -> None:
        self.parent = parent  # the parent device's name, a PCI address for GPUs
        self.type_id = type_id  # the mdev type, e.g. 'nvidia-558'
        self.pool = pool  # the declared pool it belongs to, if any
        self.on_demand = on_demand  # created for one VM: destroyed when that VM stops
        # Who uses it is an allocation's business (schema 2), never the record's.
        self.created = created if created is not None else utc_now()  # ISO 8601 UTC


class VfRecord(_Record):
    """The NVIDIA vendor-specific vGPU type gpulib gave a VF."""

    __slots__ = ("name", "on_demand", "pool", "type_id")

    def __init__(self, type_id: int, name: Optional[str] = None, pool: Optional[str] = None,
                 on_demand: bool = False) -> None:
        self.type_id = type_id  # the numeric `current_vgpu_type`
        self.name = name  # its name, e.g. 'NVIDIA A10-4Q', when known
        self.pool = pool
        self.on_demand = on_demand


class Device(_Record):
    """One device an allocation holds."""

    __slots__ = ("id", "kind", "on_demand")

    def __init__(self, kind: str, id: str, on_demand: bool = False) -> None:
        self.kind = kind  # 'mdev' | 'vf' | 'pci'
        self.id = id  # mdev uuid, or PCI address 'dddd:bb:ss.f' for 'vf' and 'pci'
        self.on_demand = on_demand


class Allocation(_Record):
    """The devices one VM holds, pending until the VM has started."""

    __slots__ = ("boot_id", "devices", "domain_uuid", "since", "status", "uptime", "vm")

    def __init__(self, vm: str, domain_uuid: Optional[str] = None, status: str = "pending",
                 since: Optional[str] = None, devices: Optional[list[Device]] = None,
                 boot_id: Optional[str] = None, uptime: Optional[float] = None) -> None:
        self.vm = vm
        self.domain_uuid = domain_uuid
        self.status = status  # 'pending' | 'active'
        self.since = since if since is not None else utc_now()
        self.devices: list[Device] = devices if devices is not None else []
        # The boot (kernel boot_id) and the seconds since that boot (CLOCK_BOOTTIME,
        # which no clock change moves) when the allocation was made: how a pending
        # start is proven dead (lifecycle.pending_is_dead).
        self.boot_id = boot_id
        self.uptime = uptime


class Intent(_Record):
    """A sysfs change gpulib is about to make, written before the write.

    A start's (`create-mdev`, `set-vf-type`): the next run completes it (the
    allocation that names the device exists: the change is that allocation's)
    or undoes it. A release's (`remove-mdev`, `clear-vf-type`): the next run
    finishes it unless a VM holds the device again (journal.settle).
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
    if _is_component(parent) and is_type_id(type_id) and type(created) is str and \
            (pool is None or type(pool) is str) and (on_demand is True or on_demand is False):
        return VgpuRecord(parent, type_id, pool, on_demand, created)
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
    return Allocation(vm, domain_uuid, status, since, devices, boot_id, uptime)


def _vgpu_from_json(value: Any, path: str) -> VgpuRecord:
    d = _as_dict(value, path)
    return VgpuRecord(
        parent=_as_component(_get(d, "parent", path), _where(path, "parent")),
        type_id=_as_type_id(_get(d, "type_id", path), _where(path, "type_id")),
        pool=_as_opt_str(_get(d, "pool", path, None), _where(path, "pool")),
        on_demand=_as_bool(_get(d, "on_demand", path, False), _where(path, "on_demand")),
        created=_as_str(_get(d, "created", path), _where(path, "created")),
    )


def _vgpu_to_json(r: VgpuRecord) -> dict[str, Any]:
    return {"parent": r.parent, "type_id": r.type_id, "pool": r.pool,
            "on_demand": r.on_demand, "created": r.created}


def _vf_from_json(value: Any, path: str) -> VfRecord:
    d = _as_dict(value, path)
    type_id = _as_int(_get(d, "type_id", path), _where(path, "type_id"))
    if type_id < 0:
        raise CorruptStateError(f"{_where(path, 'type_id')}: negative vGPU type {type_id}")
    return VfRecord(
        type_id=type_id,
        name=_as_opt_str(_get(d, "name", path, None), _where(path, "name")),
        pool=_as_opt_str(_get(d, "pool", path, None), _where(path, "pool")),
        on_demand=_as_bool(_get(d, "on_demand", path, False), _where(path, "on_demand")),
    )


def _vf_to_json(r: VfRecord) -> dict[str, Any]:
    return {"type_id": r.type_id, "name": r.name, "pool": r.pool,
            "on_demand": r.on_demand}


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
    return Allocation(
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
    return {"vm": a.vm, "domain_uuid": a.domain_uuid, "status": a.status, "since": a.since,
            "boot_id": a.boot_id, "uptime": a.uptime,
            "devices": [{"kind": d.kind, "id": d.id, "on_demand": d.on_demand}
                        for d in a.devices]}


def _intent_from_json(value: Any, path: str) -> Intent:
    d = _as_dict(value, path)
    action, ident = _choice_and_id(d, path, "action", INTENT_ACTIONS, "intent",
                                   ("create-mdev", "remove-mdev"))
    parent = _get(d, "parent", path, None)
    type_id = _get(d, "type_id", path, None)
    return Intent(action, ident, _as_vm(_get(d, "vm", path), _where(path, "vm")),
                  parent=None if parent is None else _as_component(parent,
                                                                   _where(path, "parent")),
                  type_id=None if type_id is None else _as_component(type_id,
                                                                     _where(path, "type_id")),
                  on_demand=_as_bool(_get(d, "on_demand", path, False),
                                     _where(path, "on_demand")))


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


_KNOWN_KEYS = frozenset({"version", "vgpus", "vf_types", "type_names", "allocations",
                         "unmanaged", "intents"})


class State(_Record):
    """The typed state document.

    `extra` keeps top-level keys this version does not know (a hand edit, a
    tool that annotates the file) so that a rewrite does not drop them.
    """

    __slots__ = ("allocations", "extra", "intents", "type_names", "unmanaged", "vf_types",
                 "vgpus")

    def __init__(self, vgpus: Optional[dict[str, VgpuRecord]] = None,
                 vf_types: Optional[dict[str, VfRecord]] = None,
                 type_names: Optional[dict[str, dict[str, str]]] = None,
                 allocations: Optional[dict[str, Allocation]] = None,
                 unmanaged: Optional[set[str]] = None,
                 extra: Optional[dict[str, Any]] = None,
                 intents: Optional[list[Intent]] = None) -> None:
        self.vgpus: dict[str, VgpuRecord] = vgpus or {}  # mdev uuid -> record
        self.vf_types: dict[str, VfRecord] = vf_types or {}  # VF address -> record
        # 'vvvv:dddd' of the GPU model -> {numeric vGPU type id: name}
        self.type_names: dict[str, dict[str, str]] = type_names or {}
        self.allocations: dict[str, Allocation] = allocations or {}  # VM name -> allocation
        self.unmanaged: set[str] = unmanaged or set()  # PCI addresses the operator unmanaged
        self.extra: dict[str, Any] = extra or {}
        self.intents: list[Intent] = intents or []  # write-ahead records, oldest first

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
        })
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
            raise StateVersionError(
                f"state is version {version}, this gpulib understands up to "
                f"{SCHEMA_VERSION}: upgrade gpulib")
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


class _Unusual(Exception):
    """A value json.dumps renders in a way `_render` does not (a non-text key)."""


_INFINITY = float("inf")


_SCALARS = frozenset({str, int, float, bool, type(None)})
_FLAT_ENCODERS: dict[str, json.JSONEncoder] = {}


def _flat_encoder(inner: str) -> json.JSONEncoder:
    """json's C encoder (used when indent is None) rendering a flat container's
    items one per line at `inner`."""
    encoder = _FLAT_ENCODERS.get(inner)
    if encoder is None:
        encoder = json.JSONEncoder(sort_keys=True, ensure_ascii=True, allow_nan=False,
                                   separators=(",\n" + inner, ": "))
        _FLAT_ENCODERS[inner] = encoder
    return encoder


def _render(value: Any, indent: str) -> str:
    """`value` as json.dumps(sort_keys=True, indent=1, ensure_ascii=True,
    allow_nan=False) renders it, nested at `indent`. Python's json renders an
    indented document in pure Python, one generator per level: this does the
    same in a third of the time, and every VM start writes the state file."""
    if isinstance(value, str):
        return _json_string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value or value == _INFINITY or value == -_INFINITY:
            raise ValueError("Out of range float values are not JSON compliant: "
                             + repr(value))
        return float.__repr__(value)
    inner = indent + " "
    if isinstance(value, dict):
        if not value:
            return "{}"
        if not all(type(k) is str for k in value):
            raise _Unusual()
        if all(type(v) in _SCALARS for v in value.values()):
            # A record of plain values (most of the file): one call into the C
            # encoder, whose item separator carries the newline and indent.
            flat = _flat_encoder(inner).encode(value)
            return "{\n" + inner + flat[1:-1] + "\n" + indent + "}"
        return "{\n" + inner + (",\n" + inner).join(
            [_json_string(k) + ": " + _render(v, inner) for k, v in sorted(value.items())]
        ) + "\n" + indent + "}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        return "[\n" + inner + (",\n" + inner).join([_render(v, inner) for v in value]) \
            + "\n" + indent + "]"
    raise _Unusual()


def render_json(doc: Any) -> str:
    """The state file's text of a JSON document (sorted keys, ASCII, indent 1,
    a final newline): byte for byte what json.dumps gives."""
    try:
        return _render(doc, "") + "\n"
    except (_Unusual, RecursionError):
        # Whatever json.dumps does with it (converts, or raises TypeError).
        return json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True,
                          allow_nan=False) + "\n"


# --------------------------------------------------------------------------
# The file and its lock.


class _LockWaitExpired(Exception):
    """Raised by the SIGALRM handler that ends a blocking wait for the lock."""


def _expire(signum: int, frame: Any) -> None:
    raise _LockWaitExpired()


def _may_use_alarm(signal: Any) -> bool:
    """Whether the wait may block in flock(2) with SIGALRM as its timeout: only
    Python's main thread runs signal handlers, and a timer or SIGALRM handler
    someone else set (a test runner's timeout, say) must be left alone."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and \
            signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
    except (AttributeError, ValueError, OSError):
        return False


def _flock_wait(fd: int, timeout: float) -> bool:
    """Wait up to `timeout` seconds for an exclusive flock on `fd`; False on expiry.

    A blocking flock(2) is woken by the kernel as soon as the holder lets go,
    costs nothing while it waits, and queues dozens of starts in a boot storm
    without their polling taking CPU from the one holding the lock. Its timeout
    is SIGALRM; where that cannot be used, short polls do the same.
    """
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    if timeout <= 0:
        return False
    import signal

    if _may_use_alarm(signal):
        previous = signal.signal(signal.SIGALRM, _expire)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout)
                fcntl.flock(fd, fcntl.LOCK_EX)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _LockWaitExpired:
            # The timer may also fire right after flock succeeded: closing the
            # descriptor (the caller does) releases that lock again.
            return False
        finally:
            signal.signal(signal.SIGALRM, previous)
        return True
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)


class _Lock:
    """The state lock: flock(2) on an open descriptor of the lock file, released
    by closing it (or by the kernel when the process dies)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _Hold:
    """One hold of the lock: when it began, how long it lasted once released,
    and the replaced state file, kept open until then."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.cpu_since = time.process_time()
        self.seconds = 0.0
        self.cpu = 0.0
        self._old_fd: Optional[int] = None

    def keep_old(self, path: str) -> None:
        """Hold the file about to be replaced open (see atomicfile.hold_open)."""
        self._old_fd = atomicfile.hold_open(path)

    def ended(self) -> None:
        self.seconds = time.monotonic() - self.since
        if self._old_fd is not None:
            os.close(self._old_fd)
            self._old_fd = None
        self.cpu = time.process_time() - self.cpu_since

    def line(self, writing: float, how: str = "") -> str:
        """What scripts/bench reads to report the lock's hold time per start."""
        return (f"state lock held {self.seconds * 1000:.2f} ms ({self.cpu * 1000:.2f} ms of "
                f"CPU, {writing * 1000:.2f} ms writing the file)" + (f": {how}" if how else ""))


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


class Repair(NamedTuple):
    """A corrupt state file moved aside and rebuilt (from its copy and the host)."""

    reason: str
    moved_to: str
    rebuilt: State

    def summary(self) -> str:
        """What was rebuilt and from where, in words (`gpulib status`, the log)."""
        st = self.rebuilt
        vms = ", ".join(f"{vm} ({a.status})" for vm, a in sorted(st.allocations.items())) \
            or "none"
        pooled = sum(1 for r in st.vgpus.values() if r.pool) + \
            sum(1 for r in st.vf_types.values() if r.pool)
        source = st.extra.get(REBUILT_FROM_KEY) or "the host"
        return (f"from {source}: {len(st.vgpus)} vGPU(s), {len(st.vf_types)} VF type(s), "
                f"{pooled} pool member(s), {len(st.allocations)} allocation(s) ({vms}); "
                f"the damaged file is {self.moved_to}")


REBUILT_FROM_KEY = "rebuilt_from"
"""Top-level key of a rebuilt state: where what it knows came from."""
def _changed_part(doc: dict[str, Any], loaded: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The part of a state document that differs from `loaded` (the document
    of a state read and checked before; None: all of it): the records of each
    top-level mapping that are new or changed, and the other top-level values
    that changed. State.from_json checks each record on its own, so checking
    this part checks everything the whole document would."""
    if loaded is None:
        return doc
    part: dict[str, Any] = {"version": doc.get("version")}
    for key, value in doc.items():
        old = loaded.get(key)
        if value == old or key == "version":
            continue
        if isinstance(value, dict) and isinstance(old, dict):
            part[key] = {k: v for k, v in value.items() if k not in old or old[k] != v}
        else:
            part[key] = value
    return part


def _hurry() -> Optional[int]:
    """Run ahead of the processes waiting for the lock while holding it.

    In a boot storm dozens of hooks start at once on a few cores; the one
    holding the state lock would otherwise get a thin slice of CPU while all
    the others wait for it. Raising its priority to the highest for the
    lock's duration (a few milliseconds) is priority inheritance by hand.
    Needs CAP_SYS_NICE (the hooks run as root); without it nothing changes.
    Returns the niceness to restore, or None."""
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, -20)
    except (OSError, AttributeError):
        return None
    return before


def _relax(niceness: Optional[int]) -> None:
    if niceness is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
        except OSError:
            pass


class StateStore:
    """The state file and its lock.

    `load()` reads without the lock (every read sees a whole document);
    `transaction()` is the only way to change the file.
    """

    def __init__(self, state_path: str, lock_path: str, timeout: float = DEFAULT_LOCK_TIMEOUT,
                 rebuild: Optional[Callable[[], State]] = None) -> None:
        self.state_path = os.path.abspath(state_path)
        self.lock_path = os.path.abspath(lock_path)
        self.timeout = timeout
        self.rebuild: Callable[[], State] = rebuild or State
        self._in_transaction = False
        # What the last load() found wrong, and what the last repair did:
        # `gpulib status` says both instead of showing an empty state.
        self.corrupt_reason: Optional[str] = None
        self.last_repair: Optional[Repair] = None
        # Called with the lock held, before anything is read: a hook checks
        # there that gpulib was not upgraded while it waited (it may raise).
        self.on_lock: Optional[Callable[[], None]] = None
        # The file's bytes when the transaction took the lock (None: no file),
        # and whether a checkpoint has replaced them since.
        self._raw_before: Optional[bytes] = None
        self._raw_doc: Any = None  # the parsed document of the last file read
        # The document of the state as the transaction loaded it (when the file's
        # own text stands for it): equal at the end means unchanged.
        self._loaded_doc: Optional[dict[str, Any]] = None
        self._last_written: Optional[str] = None  # the last checkpoint's text
        self._before_is_raw = False
        self._bak_existed = False  # whether the copy existed when the transaction began
        self._checkpointed = False
        self._optimistic_run = False  # inside update()'s run without the lock
        self._wait_until: Optional[float] = None  # update()'s deadline for lock waits

    @classmethod
    def for_context(cls, ctx: Context, **kw: Any) -> StateStore:
        """The store below the context's root (`var/lib/gpulib/state.json`); a
        hook's context caps the lock wait (`Context.lock_wait_cap`)."""
        cap = ctx.lock_wait_cap
        if cap is not None:
            kw["timeout"] = min(float(kw.get("timeout", DEFAULT_LOCK_TIMEOUT)), cap)
        store = cls(ctx.state_path, ctx.lock_path, **kw)
        store.on_lock = ctx.on_lock
        return store

    # -- reading ---------------------------------------------------------

    def exists(self) -> bool:
        return os.path.exists(self.state_path)

    def _read(self) -> Optional[bytes]:
        """The file's bytes, or None when there is no file."""
        # Through the reading layer: a FIFO in its place must not hang a hook.
        raw = read_file(self.state_path, DOCUMENT_MAX)
        if isinstance(raw, ReadFailure):
            if raw.missing:
                return None
            raise StateError(f"cannot read state file {self.state_path}: {raw.reason}")
        return raw

    def _parse(self, raw: bytes) -> tuple[State, Any]:
        """The state and the file's version; raises StateVersionError (newer
        file) or CorruptStateError."""
        try:
            doc = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise CorruptStateError("not UTF-8 text") from None
        except RecursionError:
            raise CorruptStateError("nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, and the int digits limit
            raise CorruptStateError(f"not JSON ({e})") from None
        if isinstance(doc, dict):
            version = doc.get("version")
            if isinstance(version, int) and not isinstance(version, bool) \
                    and version > SCHEMA_VERSION:
                raise StateVersionError(
                    f"state file {self.state_path} is version {version}, this gpulib "
                    f"understands up to {SCHEMA_VERSION}: upgrade gpulib")
        try:
            self._raw_doc = doc
            return State.from_json(doc), doc.get("version") if isinstance(doc, dict) else None
        except RecursionError:
            raise CorruptStateError("nested too deeply") from None

    def load(self) -> State:
        """The current state, read without the lock.

        A missing file is an empty state. A corrupt file is logged and read as
        an empty state (the next transaction moves it aside and rebuilds). A
        file from a newer gpulib raises StateVersionError.
        """
        self.corrupt_reason = None
        raw = self._read()
        if raw is None:
            return State()
        try:
            return self._parse(raw)[0]
        except CorruptStateError as e:
            self.corrupt_reason = e.message
            log.error("state file %s is corrupt (%s): reading it as empty; the next "
                      "change will move it aside and rebuild it", self.state_path, e.message)
            return State()

    # -- writing ---------------------------------------------------------

    def _ensure_dirs(self) -> None:
        for directory in {os.path.dirname(self.state_path), os.path.dirname(self.lock_path)}:
            if os.path.isdir(directory):
                continue
            try:
                os.makedirs(directory, mode=0o700, exist_ok=True)
                os.chmod(directory, 0o700)
            except OSError as e:
                raise StateError(
                    f"cannot create state directory {directory}: {_reason(e)}") from None

    def _write(self, text: str, sync_dir: bool = True,
               prepared: Optional[atomicfile.PreparedFile] = None) -> None:
        """Replace the file atomically with `text` (the caller holds the lock)."""
        data = text.encode("ascii")
        try:
            atomicfile.write_atomic(self.state_path, data, 0o600,
                                    sync_dir=sync_dir, prepared=prepared)
        except OSError as e:
            raise StateError(
                f"cannot write state file {self.state_path}: {_reason(e)}") from None
        self._mirror(data)

    @property
    def backup_path(self) -> str:
        return self.state_path + ".bak"

    def _mirror(self, data: bytes) -> None:
        """The second copy of what the state file now holds (the caller holds the
        lock). Not synced, and a failure only logged: the state file is the record."""
        try:
            atomicfile.write_atomic(self.backup_path, data, 0o600, sync_dir=False,
                                    durable=False)
        except OSError as e:
            log.warning("cannot write the state's copy %s: %s", self.backup_path, _reason(e))

    def backup_state(self) -> Optional[State]:
        """The state the copy beside the file holds, when it is whole and of a
        version this gpulib reads (None otherwise)."""
        raw = read_file(self.backup_path, DOCUMENT_MAX)
        if isinstance(raw, ReadFailure):
            return None
        try:
            doc = json.loads(raw.decode("utf-8"))
            return State.from_json(doc)
        except (ValueError, UnicodeDecodeError, RecursionError, StateError) as e:
            log.error("the state's copy %s is unusable too: %s", self.backup_path, e)
            return None

    def _prepare(self) -> Optional[atomicfile.PreparedFile]:
        """The file the transaction will write, made before the lock is taken
        (see atomicfile.PreparedFile): the state's fsync, which in a boot storm
        waits for the filesystem's journal, is then not paid with the lock
        held. Dead writers' temp files are removed first, also outside the lock.
        None (write_atomic's own temp file, under the lock) when it cannot be
        made."""
        # Room for the state as it is now (without the padding of the last
        # prepared write) and what one start may add to it.
        raw = read_file(self.state_path, DOCUMENT_MAX)
        size = 0 if isinstance(raw, ReadFailure) else len(raw.rstrip(b" "))
        capacity = -(-(size + size // 4 + 8192) // 4096) * 4096
        try:
            return self._new_temp(capacity)
        except (OSError, StateError) as e:
            log.debug("cannot prepare a state file ahead of the lock: %s", e)
            return None

    def _new_temp(self, capacity: int, content: Optional[bytes] = None
                  ) -> atomicfile.PreparedFile:
        """A temp file for the state, made outside the lock (dead writers' temp
        files are removed first)."""
        atomicfile.remove_stale_temp_files(self.state_path)
        self._ensure_dirs()
        return atomicfile.PreparedFile(self.state_path, capacity, content=content)

    def _move_aside(self) -> str:
        """Rename the corrupt file out of the way; return its new name."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = f"{self.state_path}.corrupt-{stamp}"
        n = 1
        while os.path.lexists(aside):
            aside = f"{self.state_path}.corrupt-{stamp}-{n}"
            n += 1
        try:
            os.replace(self.state_path, aside)
            atomicfile.fsync_dir(os.path.dirname(self.state_path))
        except OSError as e:
            raise StateError(f"state file {self.state_path} is corrupt and cannot be moved "
                             f"aside: {_reason(e)}") from None
        return aside

    def _rebuilt(self, reason: str) -> State:
        """The state from the rebuild hook, checked; the corrupt file stays if it fails."""
        try:
            state = self.rebuild()
            if not isinstance(state, State):
                raise TypeError(f"rebuild returned {type(state).__name__}, not State")
            State.from_json(json.loads(dumps(state)))
        except Exception as e:
            log.error("state file %s is corrupt (%s) and rebuilding it failed: %s",
                      self.state_path, reason, e)
            raise StateError(f"state file {self.state_path} is corrupt ({reason}) and "
                             f"rebuilding it failed: {e}") from e
        return state

    def _acquire(self) -> _Lock:
        self._ensure_dirs()
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StateError(f"cannot take state lock {self.lock_path}: {_reason(e)}") from None
        wait = self.timeout
        if self._wait_until is not None:  # inside update(): what its earlier waits left
            wait = min(wait, max(0.0, self._wait_until - time.monotonic()))
        try:
            got = _flock_wait(fd, wait)
        except OSError as e:
            os.close(fd)
            raise StateError(f"cannot take state lock {self.lock_path}: {_reason(e)}") from None
        except BaseException:
            os.close(fd)
            raise
        if not got:
            os.close(fd)
            raise LockTimeout(f"state lock busy: {self.lock_path} held by another gpulib "
                              f"process for {self.timeout:g} s")
        return _Lock(fd)

    @contextmanager
    def _locked(self, hurry: bool = False) -> Iterator[_Hold]:
        """The lock, held while the block runs, with the `on_lock` check made
        first; `hurry`: at the highest priority meanwhile (see _hurry)."""
        lock = self._acquire()
        hold = _Hold()
        niceness = _hurry() if hurry else None
        try:
            if self.on_lock is not None:
                self.on_lock()
            yield hold
        finally:
            lock.release()
            _relax(niceness)
            hold.ended()

    @contextmanager
    def transaction(self) -> Iterator[State]:
        """Lock, load, yield the state to change, write it if it changed, unlock.

        An exception inside the block discards every change. A corrupt file
        is moved aside and replaced by the rebuild hook's state (written
        before the block runs, so a failing block does not lose it). A file
        from a newer gpulib raises StateVersionError and stays as it is.
        """
        if self._in_transaction:
            raise RuntimeError("StateStore.transaction() is not reentrant")
        self._in_transaction = True
        try:
            prepared = self._prepare()
            hold: Optional[_Hold] = None
            writing = 0.0
            written = False
            try:
                with self._locked(hurry=True) as hold:
                    state, before = self._load_locked()
                    yield state
                    after = self._final_text(state, before)
                    if after != before:
                        # The rename is visible at once; its directory fsync (durability
                        # across a power cut) need not keep other starts waiting.
                        write_since = time.monotonic()
                        hold.keep_old(self.state_path)
                        self._write(after, sync_dir=False, prepared=prepared)
                        writing = time.monotonic() - write_since
                        written = True
            finally:
                if prepared is not None:
                    prepared.discard()
                if hold is not None:
                    log.debug("%s", hold.line(writing))
            if written:
                atomicfile.sync_dir_of(self.state_path)
        finally:
            self._in_transaction = False

    def _final_text(self, state: State, before: str) -> str:
        """What the transaction leaves in the file: `before` when the state did
        not change (or is on disk already), else the new text, checked."""
        try:
            doc = state.to_json()
            after = render_json(doc)
            # What is written is checked (a final checkpoint was already);
            # the file as it was found needs no second look, nor do the
            # records it already held.
            if after != self._last_written and after != before:
                loaded = self._loaded_doc if self._before_is_raw else None
                State.from_json(json.loads(json.dumps(_changed_part(doc, loaded))))
        except (StateError, TypeError, ValueError) as e:
            raise StateError(f"refusing to write an invalid state to "
                             f"{self.state_path}: {e}") from e
        if after == self._last_written:
            return before  # already on disk (StateStore.checkpoint)
        if after != before and self._before_is_raw and not self._checkpointed \
                and doc == self._loaded_doc:
            # The same state in another layout (or without fields that have
            # their defaults): leave the file. Documents of two states are
            # equal when the states are, and far cheaper to compare.
            return before
        return after

    def update(self, change: Callable[[State], T], host: Optional[Sysfs] = None) -> T:
        """Run `change` on the state and write what it changed; its result.

        The hooks' transaction, which holds the lock only for its last instant
        when it can. `change` runs first on the state read without the lock,
        and the new file is written and synced outside it too; under the lock
        the file is read again and, when it holds the very bytes `change` saw,
        the new one is renamed over it (a compare-and-swap: the lock covers a
        read and a rename, the write order stays that of DESIGN 6.4). Equal
        bytes are an equal state, and the state is what `change` decides from:
        the host facts it also reads change only through a state change (a
        gpulib process announces a sysfs write in the state first).

        Otherwise everything is thrown away and `change` runs again inside
        `transaction()`: when another process wrote meanwhile; when `change`
        wanted to write to `host` (sysfs writes are made under the lock only)
        or to checkpoint; when it raised (the answer under the lock counts);
        when the file is missing, corrupt, or of another schema. `change` must
        be repeatable: it reads, changes the state it is given and returns.
        Its log records are held back until its run is the one that counts.
        """
        if self._in_transaction:
            raise RuntimeError("StateStore.update() inside a transaction")
        # However many times it waits for the lock, a hook waits `timeout` in all.
        self._wait_until = time.monotonic() + self.timeout
        try:
            # Each run is a race with the other writers: the sooner it is done,
            # the likelier it counts. In a boot storm dozens of hooks are still
            # starting up on a few cores; the one that has reached this point
            # goes first (milliseconds; needs CAP_SYS_NICE, as the lock's holder).
            niceness = _hurry()
            try:
                raw: Optional[bytes] = None
                for _ in range(OPTIMISTIC_TRIES):
                    done, raw = self._optimistic(change, host, raw)
                    if done is not None:
                        return done[0]
                    if raw is None:
                        break  # not a race lost: only the lock helps
            finally:
                _relax(niceness)
            with self.transaction() as state:
                return change(state)
        finally:
            self._wait_until = None

    def _optimistic(self, change: Callable[[State], T], host: Optional[Sysfs],
                    raw: Optional[bytes]) -> tuple[Optional[tuple[T]], Optional[bytes]]:
        """One run of `update` without the lock until the rename: its result (in
        a tuple), or None and, when another process wrote first, the file's
        bytes as that run found them under the lock (the next run's start).
        `raw`: the file's bytes already read, None to read them."""
        from gpulib.logs import HeldBack

        self._before_is_raw, self._checkpointed, self._last_written = False, False, None
        try:
            if raw is None:
                raw = self._read()
            if raw is None:
                return None, None
            state, version = self._parse(raw)
        except StateError:
            return None, None
        before = self._loaded_from(state, raw) if version == SCHEMA_VERSION else None
        if before is None:
            return None, None
        held_back = HeldBack()
        counted = False
        hold_line = ""
        fresh: Optional[bytes] = None
        why = ""
        try:
            self._in_transaction = self._optimistic_run = True
            if host is not None:
                host.barred = []
            try:
                result = change(state)
                after = self._final_text(state, before)
            except (Exception, NeedsLock) as e:
                why = f"it stopped: {e}"
                return None, None
            finally:
                self._in_transaction = self._optimistic_run = False
                barred = host.barred if host is not None else None
                if host is not None:
                    host.barred = None
            if barred:
                why = f"it would write to {barred[0]}"  # refused, whoever caught that
                return None, None
            why = "another process wrote the state since it was read"
            try:
                if after == before:
                    self._confirm()
                    counted = True
                else:
                    counted, hold_line, fresh = self._swap(raw, after)
            except BaseException as e:
                why = f"{type(e).__name__}: {e}"
                raise
            return ((result,) if counted else None), fresh
        finally:
            held_back.release(keep=counted)
            if hold_line:
                log.debug("%s", hold_line)
            if not counted:
                # What scripts/bench counts: work done without the lock and thrown away.
                log.debug("state change worked out without the lock does not count (%s)", why)

    def _confirm(self) -> None:
        """For a change that writes nothing: run the on_lock check (no upgrade
        happened since the hook started) with the lock held, as any change
        does. The package holds the lock across an upgrade, and `change` ran
        without it and may have imported modules meanwhile."""
        if self.on_lock is not None:
            with self._locked():
                pass

    def _swap(self, raw: bytes, text: str) -> tuple[bool, str, Optional[bytes]]:
        """Rename a synced file of `text` over the state file if it still holds
        `raw`; False (nothing changed) if another process wrote it meanwhile.
        Also the line to log once the records held back are settled, and the
        bytes found instead of `raw` (None: no file, or it was `raw`)."""
        try:
            staged = self._new_temp(0, content=text.encode("ascii"))
        except OSError as e:
            raise StateError(f"cannot write state file {self.state_path}: {_reason(e)}") from None
        swapped = False
        found: Optional[bytes] = None
        try:
            with self._locked() as hold:
                found = self._read()
                if found == raw:
                    hold.keep_old(self.state_path)
                    swapped = staged.commit()
                    if swapped:
                        self._mirror(text.encode("ascii"))
        except OSError as e:
            raise StateError(f"cannot write state file {self.state_path}: {_reason(e)}") from None
        finally:
            staged.discard()
        if swapped:
            atomicfile.sync_dir_of(self.state_path)
        how = "written before the lock" if swapped else "compared, not written"
        return swapped, hold.line(0.0, how), None if swapped else found

    def checkpoint(self, state: State) -> None:
        """Write `state` now, inside a transaction: a write-ahead intent must be
        on disk before the sysfs write it announces. The transaction still
        writes its final state at the end (or, on an exception, leaves this one,
        whose intents the next run settles)."""
        if not self._in_transaction:
            raise RuntimeError("StateStore.checkpoint() outside a transaction")
        if self._optimistic_run:
            raise NeedsLock("a write-ahead checkpoint")
        text = dumps(state)
        try:
            State.from_json(json.loads(text))
        except (StateError, TypeError, ValueError) as e:
            raise StateError(f"refusing to write an invalid state to {self.state_path}: "
                             f"{e}") from e
        self._write(text)
        self._checkpointed = True
        self._last_written = text

    def revert_checkpoints(self) -> None:
        """Put back the file as the transaction found it (the start that wrote
        intents failed and undid every sysfs change they announced)."""
        if not self._in_transaction or not self._checkpointed:
            return
        try:
            if self._raw_before is None:
                os.unlink(self.state_path)
                atomicfile.fsync_dir(os.path.dirname(self.state_path))
            else:
                atomicfile.write_atomic(self.state_path, self._raw_before, 0o600)
            # The copy as it was too: the file's mirror, or none.
            if self._raw_before is not None and self._bak_existed:
                self._mirror(self._raw_before)
            elif os.path.lexists(self.backup_path):
                os.unlink(self.backup_path)
        except OSError as e:
            log.error("cannot put back state file %s after a failed start: %s",
                      self.state_path, _reason(e))
            return
        self._checkpointed = False

    def _load_locked(self) -> tuple[State, str]:
        """The state and the text it serialises to (the caller holds the lock)."""
        raw = self._read()
        self._raw_before = raw
        self._bak_existed = os.path.lexists(self.backup_path)
        self._before_is_raw = False
        self._checkpointed = False
        self._last_written = None
        if raw is None:
            state = State()
            return state, dumps(state)
        try:
            state, version = self._parse(raw)
        except CorruptStateError as e:
            state = self._rebuilt(e.message)
            aside = self._move_aside()
            log.error("state file %s was corrupt (%s): moved it aside to %s and rebuilt it",
                      self.state_path, e.message, aside)
            text = dumps(state)
            self._write(text)
            self.last_repair = Repair(e.message, aside, State.from_json(json.loads(text)))
            log.error("state file %s rebuilt %s", self.state_path, self.last_repair.summary())
            return state, text
        if version != SCHEMA_VERSION:
            # An older schema, migrated in memory: the first transaction writes it.
            log.warning("state file %s: upgrading schema %s to %d", self.state_path, version,
                        SCHEMA_VERSION)
            return state, ""
        own = self._loaded_from(state, raw)
        return state, dumps(state) if own is None else own

    def _loaded_from(self, state: State, raw: bytes) -> Optional[str]:
        """The file's own text, standing for `state` as loaded (None: not ASCII,
        so not text gpulib wrote). The file is our own deterministic text: no
        need to serialise it again to know whether a change changed anything
        (another formatting just means one rewrite)."""
        try:
            text = raw.decode("ascii").rstrip(" ")
        except UnicodeDecodeError:
            return None
        self._before_is_raw = True
        self._loaded_doc = state.to_json()
        return text


__all__ = [
    "ALLOCATION_STATUSES",
    "DEFAULT_LOCK_TIMEOUT",
    "DEVICE_KINDS",
    "HOOK_LOCK_TIMEOUT_CAP",
    "SCHEMA_VERSION",
    "Allocation",
    "CorruptStateError",
    "Device",
    "Intent",
    "Repair",
    "State",
    "StateStore",
    "StateVersionError",
    "VfRecord",
    "VgpuRecord",
    "dumps",
    "utc_now",
]
