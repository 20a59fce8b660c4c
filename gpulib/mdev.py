"""Mediated devices (kernel ABI: Documentation/driver-api/vfio-mediated-device).

Parents appear as `sys/class/mdev_bus/<parent>`; their types as
`<parent>/mdev_supported_types/<type>/{name,description,available_instances,
device_api,create,devices/}`; live mdevs as `sys/bus/mdev/devices/<uuid>`
with an `mdev_type` link and a `remove` file.

Outside discovery, reading is lazy per type: a large host has thousands of
type directories and most callers need only the few types that have live
devices. Discovery reads each listed type's `name` and `description` at once
(`MdevType.load`), inside its per-device guard: once per GPU, on the VF that
lists the type first (the same type on the other VFs shares them, `same_as`).
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Sequence

from gpulib import logger
from gpulib.errors import DeviceError, InputError, NotAvailableError
from gpulib.lazyre import lazy
from gpulib.pci import PCI_DEVICES, PciAddress
from gpulib.sysfs import ReadFailure, Sysfs

# The one rule each (gpulib.validate); check_* stay importable from here.
from gpulib.validate import check_type_id, check_uuid, is_type_id, is_uuid

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

log = logger.get(__name__)

MDEV_DEVICES = "sys/bus/mdev/devices"
MDEV_BUS = "sys/class/mdev_bus"
TYPES_DIR = "mdev_supported_types"
# The most `available_instances` taken as a number (more is a broken file).
INSTANCES_MAX = 1 << 20

# At most 7 digits per number: no real value is larger, and a garbage
# description must not put a thousand-digit number in a report.
_NUM = {
    "max_instance": lazy(r"max_instance=(\d{1,7})(?!\d)"),
    "framebuffer": lazy(r"framebuffer=(\d{1,7})(?!\d)\s*([MG])?"),
    "num_heads": lazy(r"num_heads=(\d{1,7})(?!\d)"),
    "max_resolution": lazy(r"max_resolution=(\d{1,7})x(\d{1,7})(?!\d)"),
}
# Intel GVT-g writes "resolution: 1920x1200" lines instead.
_GVT_RES = lazy(r"^resolution:\s*(\d{1,7})x(\d{1,7})(?!\d)", re.M)
# A type's name as shown in reports: one line, bounded.
NAME_MAX = 256


def new_uuid() -> str:
    import uuid  # imported here: hashlib and platform cost the hooks milliseconds

    return str(uuid.uuid4())


class Description:
    """The numbers CloudStack wants, parsed from a type's `description`."""

    __slots__ = ("framebuffer_mb", "max_instance", "max_resolution", "num_heads")

    def __init__(self, text: Optional[str]) -> None:
        self.max_instance: Optional[int] = None
        self.framebuffer_mb: Optional[int] = None
        self.num_heads: Optional[int] = None
        self.max_resolution: Optional[tuple[int, int]] = None
        if not text:
            return
        m = _NUM["max_instance"].search(text)
        if m:
            self.max_instance = int(m.group(1))
        m = _NUM["framebuffer"].search(text)
        if m:
            self.framebuffer_mb = int(m.group(1)) * (1024 if m.group(2) == "G" else 1)
        m = _NUM["num_heads"].search(text)
        if m:
            self.num_heads = int(m.group(1))
        m = _NUM["max_resolution"].search(text) or _GVT_RES.search(text)
        if m:
            self.max_resolution = (int(m.group(1)), int(m.group(2)))


class MdevType:
    """One directory under a parent's mdev_supported_types."""

    __slots__ = ("_available", "_available_kept", "_description", "_description_read",
                 "_description_text", "_device_api", "_name", "_name_read", "_same_as",
                 "_sysfs", "failures", "parent", "rel", "type_id")

    def __init__(self, sysfs: Sysfs, parent: PciAddress, type_id: str,
                 same_as: Optional[MdevType] = None, rel: Optional[str] = None) -> None:
        """`same_as`: the same type on a sibling parent (another VF of the same
        GPU), whose name, description and device API this one shares: one
        driver and one card print them alike, and a large host has thousands
        of such files. `rel`: the type's directory, when the caller has it."""
        self._sysfs = sysfs
        self.parent = parent
        self.type_id = type_id
        self.rel = rel or f"{PCI_DEVICES}{parent}/{TYPES_DIR}/{type_id}"
        self._same_as = same_as
        self._device_api: Optional[str] = None
        self._name: Optional[str] = None
        self._name_read = False
        # The text is read by `load` (or when first asked for); the numbers
        # are parsed from it when first asked for (a report needs few of them).
        self._description: Optional[Description] = None
        self._description_read = False
        self._description_text: Optional[str] = None
        # What `load` could not read (paths and reasons).
        self.failures: list[str] = []
        # Kept by `available_once`: answered from then on without a read.
        self._available: Optional[int] = None
        self._available_kept = False

    @property
    def same_as(self) -> Optional[MdevType]:
        return self._same_as

    def __repr__(self) -> str:
        return f"MdevType({self.parent}, {self.type_id!r})"

    def load(self) -> list[str]:
        """Read `name` and `description` now; the reasons they could not be
        read (empty when both were read or are simply absent).

        Discovery calls this inside its per-device guard, so nothing is read
        lazily while a report is rendered."""
        if self._same_as is not None:
            return self._same_as.load()
        failures = self.failures
        if not self._name_read:
            self._name_read = True
            data = self._sysfs.read_result(self.rel + "/name")
            if isinstance(data, ReadFailure):
                if not data.missing:
                    failures.append(f"{self.rel}/name: {data.reason}")
                    self._sysfs.failed(self.rel + "/name", data.reason)
            else:
                self._name = _one_line(data.decode("utf-8", "replace")) or None
        if not self._description_read:
            self._description_read = True
            data = self._sysfs.read_result(self.rel + "/description")
            if isinstance(data, ReadFailure):
                if not data.missing:
                    failures.append(f"{self.rel}/description: {data.reason}")
                    self._sysfs.failed(self.rel + "/description", data.reason)
                self._description_text = None
            else:
                self._description_text = data.decode("utf-8", "replace").strip()
        return failures

    @property
    def name(self) -> Optional[str]:
        """The `name` file (kernels before 6.1 may lack it)."""
        if self._same_as is not None:
            return self._same_as.name
        if not self._name_read:
            self._name_read = True
            self._name = _one_line(self._sysfs.read(self.rel + "/name") or "") or None
        return self._name

    @property
    def profile_name(self) -> str:
        """What the stock discovery script calls the profile: name, else the id."""
        return self.name or self.type_id

    @property
    def description_text(self) -> Optional[str]:
        self._load_description()
        return self._description_text

    @property
    def description(self) -> Description:
        self._load_description()
        assert self._description is not None
        return self._description

    def _load_description(self) -> None:
        if self._description is not None:
            return
        if self._same_as is not None:
            self._same_as._load_description()
            self._description_text = self._same_as._description_text
            self._description = self._same_as._description
            return
        if not self._description_read:
            self._description_read = True
            self._description_text = self._sysfs.read(self.rel + "/description")
        self._description = Description(self._description_text)

    @property
    def available_instances(self) -> Optional[int]:
        """Read afresh each time (a start's own creations change it), unless
        `available_once` was asked."""
        if self._available_kept:
            return self._available
        return self._sysfs.read_int(self.rel + "/available_instances", low=0,
                                    high=INSTANCES_MAX)

    def available_once(self) -> Optional[int]:
        """`available_instances`, read now and answered from then on without
        a read: for a report of one instant (`gpulib metrics`, whose doctor
        asks every type again), never for what a start allocates from."""
        if not self._available_kept:
            self._available = self.available_instances
            self._available_kept = True
        return self._available

    def keep_available(self, value: Optional[int]) -> None:
        """Keep `value`, read now by `available_all`, as `available_once` would."""
        self._available = value
        self._available_kept = True

    @property
    def device_api(self) -> Optional[str]:
        if self._same_as is not None:
            return self._same_as.device_api
        if self._device_api is None:
            self._device_api = self._sysfs.read(self.rel + "/device_api")
        return self._device_api

    def live_uuids(self) -> list[str]:
        return sorted(self._sysfs.listdir(self.rel + "/devices"))


def available_all(types: Sequence[MdevType]) -> list[Optional[int]]:
    """`available_once` of every type in `types`, in order, read a parent's
    types at a time (`Sysfs.read_counts`): a large host's report reads thousands."""
    # type directory's parent -> (its types, their files below it)
    by_dir: dict[str, tuple[list[MdevType], list[str]]] = {}
    for t in types:
        if t._available_kept:
            continue
        rel_dir, _, name = t.rel.rpartition("/")
        group = by_dir.get(rel_dir)
        if group is None:
            group = by_dir[rel_dir] = ([], [])
        group[0].append(t)
        group[1].append(name + "/available_instances")
    for rel_dir, (kept, names) in by_dir.items():
        counts = kept[0]._sysfs.read_counts(rel_dir, names, high=INSTANCES_MAX)
        for t, n in zip(kept, counts):
            t.keep_available(n)
    return [t.available_once() for t in types]


def _one_line(text: str) -> str:
    """The first line of `text`, without control characters, at most NAME_MAX long."""
    line = text.strip().split("\n", 1)[0]
    if not line.isprintable():
        line = "".join(c for c in line if c.isprintable())
    return line[:NAME_MAX].strip()


class Mdev:
    """A mediated device; `live` is False for one known only to gpulib's registry."""

    __slots__ = ("already_live", "live", "parent", "type_id", "uuid")

    def __init__(self, uuid: str, parent: PciAddress, type_id: str, live: bool = True) -> None:
        self.uuid = uuid
        self.parent = parent
        self.type_id = type_id
        self.live = live
        # create() found it live already (another tool made it): nothing was written.
        self.already_live = False

    def __repr__(self) -> str:
        return f"Mdev({self.uuid}, {self.parent}, {self.type_id!r})"


def is_parent(sysfs: Sysfs, address: PciAddress) -> bool:
    return sysfs.isdir(f"{PCI_DEVICES}{address}/{TYPES_DIR}")


def valid_type_id(name: str) -> bool:
    """`name` can be a type id (gpulib.validate's rule: a directory name safe in
    paths, `<driver>-<name>`)."""
    return is_type_id(name)


def list_types(sysfs: Sysfs, parent: PciAddress,
               siblings: Optional[dict[str, MdevType]] = None) -> list[MdevType]:
    """A parent's types. `siblings` (type id -> type on another VF of the same
    GPU) lets them share names and descriptions; it is filled as it goes."""
    base = f"{PCI_DEVICES}{parent}/{TYPES_DIR}/"
    names = sysfs.listdir(base[:-1])
    out = []
    for n in sorted(names):
        sibling = siblings.get(n) if siblings is not None else None
        # A sibling's id was checked already (16 VFs x 24 types on a large host).
        if sibling is None and not valid_type_id(n):
            sysfs.failed(base + n, "not a type id")
            continue
        t = MdevType(sysfs, parent, n, same_as=sibling, rel=base + n)
        if siblings is not None and sibling is None:
            siblings[n] = t
        out.append(t)
    return out


def list_parents(sysfs: Sysfs) -> list[PciAddress]:
    out = []
    for name in sysfs.listdir(MDEV_BUS):
        try:
            out.append(PciAddress.parse(name))
        except InputError:
            continue
    return sorted(out)


def live_mdevs(sysfs: Sysfs) -> dict[str, Mdev]:
    """Every live mdev by UUID, from `sys/bus/mdev/devices` and its links."""
    out: dict[str, Mdev] = {}
    for name in sysfs.listdir(MDEV_DEVICES):
        found = read_mdev(sysfs, name)
        if found is not None:
            out[found.uuid] = found
    return out


def read_mdev(sysfs: Sysfs, uuid: str) -> Optional[Mdev]:
    """A live mdev, or None if no such device exists."""
    if not is_uuid(uuid):
        return None  # a stray entry: only UUIDs name mdevs
    rel = f"{MDEV_DEVICES}/{uuid}"
    # <parent dir>/<uuid>: the parent is the directory holding the device.
    # The bus entry is a link whose own target names it ("../../../devices/
    # pci0000:10/0000:10:01.0/0000:11:00.4/<uuid>"): one readlink, not a
    # resolution of every component (a large host has hundreds of vGPUs).
    try:
        target: Optional[str] = os.readlink(sysfs.path(rel))
    except FileNotFoundError:
        return None
    except OSError:
        target = None  # not a link (or unreadable): resolved the long way
    try:
        if target is None or not target.endswith("/" + uuid):
            if not sysfs.exists(rel):
                return None
            target = sysfs.resolve(rel)
        parent = PciAddress.parse(target.rstrip("/").split("/")[-2])
    except (ValueError, InputError, IndexError):
        return None
    type_id = sysfs.link_name(rel + "/mdev_type")
    if not type_id:
        return None
    return Mdev(uuid.lower(), parent, type_id)


# -- lifecycle ---------------------------------------------------------------------

_CREATE_ERRORS = {
    errno.EEXIST: "an mdev with UUID {uuid} already exists",
    errno.ENOSPC: "no available instances of {type} on {parent}",
    errno.EDQUOT: "no available instances of {type} on {parent}",
    errno.EUSERS: "no available instances of {type} on {parent}",
    errno.EINVAL: "the kernel rejected UUID {uuid} for {type} on {parent} (invalid argument)",
    errno.ENODEV: "parent {parent} or type {type} disappeared",
    errno.EBUSY: "{parent} is busy; try again",
}


def _type_label(t: MdevType) -> str:
    return f"{t.type_id} ({t.name})" if t.name else t.type_id


def find_type(sysfs: Sysfs, parent: PciAddress, type_id: str) -> MdevType:
    check_type_id(type_id)
    if not sysfs.exists(f"{PCI_DEVICES}{parent}"):
        raise DeviceError(f"no PCI device {parent}")
    if not is_parent(sysfs, parent):
        raise DeviceError(f"{parent} offers no mdev types (is the vendor vGPU driver loaded?)")
    t = MdevType(sysfs, parent, type_id)
    if not sysfs.isdir(t.rel):
        offered = ", ".join(x.type_id for x in list_types(sysfs, parent)) or "none"
        raise DeviceError(f"{parent} does not offer mdev type {type_id} (offered: {offered})")
    return t


def _conflict(uuid: str, existing: Mdev, parent: PciAddress, type_id: str) -> str:
    return (f"mdev {uuid} already exists: live on {existing.parent} as {existing.type_id}, "
            f"not on {parent} as {type_id}")


def _await(sysfs: Sysfs, uuid: str, seconds: float) -> Optional[Mdev]:
    """The device once it shows up with its links (the kernel adds them in steps)."""
    deadline = time.monotonic() + seconds
    while True:
        found = read_mdev(sysfs, uuid)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def create(sysfs: Sysfs, parent: PciAddress, type_id: str, uuid: Optional[str] = None,
           settle_seconds: float = 2.0, attrs: Sequence[tuple[str, str]] = ()) -> Mdev:
    """Create an mdev, confirm it appeared and write its attributes in order.

    A device already live with this UUID, parent and type is success (another
    tool, mdevctl's udev autostart say, made it first): the result says
    `already_live` and nothing is written. With another parent or type it is
    an error naming both. A device that comes up wrong, or whose attribute
    cannot be written, is removed again.
    """
    t = find_type(sysfs, parent, type_id)
    value = check_uuid(uuid) if uuid else new_uuid()
    existing = read_mdev(sysfs, value)
    if existing is not None:
        if existing.parent == parent and existing.type_id == type_id:
            existing.already_live = True
            return existing
        raise DeviceError(_conflict(value, existing, parent, type_id))
    available = t.available_instances
    if available is not None and available <= 0:
        raise NotAvailableError(f"No available instances of {_type_label(t)} on {parent}")
    try:
        sysfs.write(t.rel + "/create", value, expected=(errno.EEXIST,))
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            # Made by another tool between our look and our write.
            existing = _await(sysfs, value, settle_seconds)
            if existing is not None and existing.parent == parent and \
                    existing.type_id == type_id:
                log.info("mdev %s (%s on %s) is already live: created by another tool",
                         value, type_id, parent)
                existing.already_live = True
                return existing
            if existing is not None:
                raise DeviceError(_conflict(value, existing, parent, type_id)) from None
        template = _CREATE_ERRORS.get(exc.errno or 0)
        if template is None:
            raise DeviceError(f"creating mdev {value} of {_type_label(t)} on {parent} failed: "
                              f"{exc.strerror}") from None
        msg = template.format(uuid=value, type=_type_label(t), parent=parent)
        cls = NotAvailableError if exc.errno in (errno.ENOSPC, errno.EDQUOT,
                                                 errno.EUSERS) else DeviceError
        raise cls(msg[0].upper() + msg[1:]) from None
    made = _await(sysfs, value, settle_seconds)
    if made is None:
        raise DeviceError(f"mdev {value} did not appear after writing to {t.rel}/create")
    if made.parent != parent or made.type_id != type_id:
        # Roll back: never leave a device that is not what was asked for.
        remove(sysfs, value)
        raise DeviceError(f"mdev {value} appeared on {made.parent} as {made.type_id}, "
                          f"not {parent} {type_id}; removed it")
    write_attrs(sysfs, value, attrs)
    log.info("created mdev %s type %s on %s", value, type_id, parent)
    from gpulib import counters
    counters.note(sysfs.root, "vgpus_created", kind="mdev")
    return made


def write_attrs(sysfs: Sysfs, uuid: str, attrs: Sequence[tuple[str, str]]) -> None:
    """Write a new device's attributes in order, as mdevctl does; on a failure
    remove the device (a vGPU without its settings is not the one defined)."""
    for name, text in attrs:
        if not name or name.startswith("/") or ".." in name.split("/"):
            remove(sysfs, uuid)
            raise InputError(f"mdev {uuid}: not an attribute name: {name!r}; removed the device")
        try:
            sysfs.write(f"{MDEV_DEVICES}/{uuid}/{name}", text)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            try:
                remove(sysfs, uuid)
                undone = "removed the device"
            except DeviceError as again:
                undone = f"removing the device failed too: {again.message}"
            raise DeviceError(f"mdev {uuid}: writing attribute {name} = {text!r} failed "
                              f"({reason}); {undone}") from None


def remove(sysfs: Sysfs, uuid: str, retry_seconds: float = 0.0) -> bool:
    """Remove a live mdev; False if it was not live. EBUSY retried while in use."""
    value = check_uuid(uuid)
    rel = f"{MDEV_DEVICES}/{value}"
    if not sysfs.exists(rel):
        return False
    deadline = time.monotonic() + retry_seconds
    while True:
        try:
            sysfs.write(rel + "/remove", "1")
            break
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            reason = "still in use by a VM" if exc.errno == errno.EBUSY else exc.strerror
            raise DeviceError(f"removing mdev {value} failed: {reason}") from None
    log.info("removed mdev %s", value)
    from gpulib import counters
    counters.note(sysfs.root, "vgpus_destroyed", kind="mdev")
    return True
