"""mdevctl's persistent mdev definitions: the record of which vGPUs exist across reboots.

On a host, the persistent definition of a mediated device belongs to mdevctl
(`etc/mdevctl.d/<parent>/<uuid>`, one JSON object per file), and libvirt (7.3
and later) reads and writes the same files through mdevctl. gpulib reads and
writes them in mdevctl's own format and layout whether or not mdevctl is
installed, so that one record serves all three tools:

    {
      "mdev_type": "nvidia-232",
      "start": "auto",
      "attrs": [
        {"name": "value"}
      ]
    }

`start` is `auto` (started when the parent appears, at boot) or `manual`;
`attrs` are written in order to the device's sysfs files after it is created.

Definitions are read fresh every time (the operator may change them with
mdevctl or an editor between two gpulib runs). What is not a definition is
skipped without a warning: mdevctl's own `scripts.d`, editor backups, temp
files, names that are not UUIDs, directories, parents that are not PCI
devices (gpulib manages GPUs only), and files whose JSON is not a definition.
"""

from __future__ import annotations

import json
import os

from gpulib import atomicfile, logger
from gpulib.context import Context
from gpulib.errors import InputError
from gpulib.lazyre import lazy
from gpulib.pci import PciAddress
from gpulib.sysfs import ReadFailure, read_file
from gpulib.validate import check_pci_address, check_type_id, check_uuid

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

log = logger.get(__name__)

MDEVCTL_DIR = "etc/mdevctl.d"
START_POLICIES = ("auto", "manual")
# mdevctl's udev rule: starts a parent's `auto` definitions when the parent appears.
UDEV_RULES = ("etc/udev/rules.d/60-mdevctl.rules", "usr/lib/udev/rules.d/60-mdevctl.rules",
              "lib/udev/rules.d/60-mdevctl.rules")
_RULE_COMMAND = lazy(r"(/[^\s'\"]*mdevctl)\s+start-parent-mdevs")
# A definition is a few hundred bytes; anything far larger is not one.
_MAX_SIZE = 1 << 20
# An attribute is a file below the mdev device's directory (mdevctl allows a
# sub-directory, e.g. NVIDIA's `nvidia/vgpu_params`).
_ATTR_NAME = lazy(r"^[A-Za-z0-9_.:+-]+(/[A-Za-z0-9_.:+-]+)*\Z")


class Definition:
    """One mdevctl definition; `extra` keeps keys this gpulib does not know."""

    __slots__ = ("attrs", "extra", "parent", "start", "type_id", "uuid")

    def __init__(self, uuid: str, parent: str, type_id: str, start: str = "auto",
                 attrs: Optional[list[tuple[str, str]]] = None,
                 extra: Optional[dict[str, Any]] = None) -> None:
        self.uuid = uuid
        self.parent = parent
        self.type_id = type_id
        self.start = start
        self.attrs: list[tuple[str, str]] = list(attrs or [])
        self.extra: dict[str, Any] = dict(extra or {})

    @property
    def auto(self) -> bool:
        return self.start == "auto"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Definition) and all(
            getattr(self, f) == getattr(other, f) for f in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (f"Definition({self.uuid}, {self.parent}, {self.type_id!r}, {self.start!r}, "
                f"{self.attrs!r})")

    def as_dict(self) -> dict[str, Any]:
        """The listing form (`gpulib mdev list --json`): attrs as mdevctl prints them."""
        return {"parent": self.parent, "type_id": self.type_id, "start": self.start,
                "attrs": [{k: v} for k, v in self.attrs]}

    def to_json(self) -> bytes:
        """The file's bytes, as mdevctl writes them (these three keys first, indent 2)."""
        doc: dict[str, Any] = {"mdev_type": self.type_id, "start": self.start,
                               "attrs": [{k: v} for k, v in self.attrs]}
        for k, v in self.extra.items():
            doc.setdefault(k, v)
        return json.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"


def check_attr(name: str, value: str) -> tuple[str, str]:
    """An attribute safe to write below the device's directory, else InputError."""
    if not isinstance(name, str) or not _ATTR_NAME.match(name) or \
            any(part in (".", "..") for part in name.split("/")):
        raise InputError(f"not an mdev attribute name: {name!r}")
    if not isinstance(value, str) or "\x00" in value:
        raise InputError(f"mdev attribute {name}: value must be text without NUL")
    return name, value


def parse_attr(text: str) -> tuple[str, str]:
    """`NAME=VALUE` from the command line."""
    name, sep, value = text.partition("=")
    if not sep:
        raise InputError(f"mdev attribute must be NAME=VALUE, not {text!r}")
    return check_attr(name, value)


def parse(uuid: str, parent: str, raw: bytes) -> Optional[Definition]:
    """The definition in a file's bytes, or None when they are not one."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    type_id = doc.get("mdev_type")
    start = doc.get("start", "manual")
    attrs = doc.get("attrs", [])
    if not isinstance(type_id, str) or start not in START_POLICIES or \
            not isinstance(attrs, list):
        return None
    try:
        check_type_id(type_id)
        pairs = []
        for item in attrs:
            if not isinstance(item, dict) or len(item) != 1:
                return None
            ((name, value),) = item.items()
            pairs.append(check_attr(name, value))
    except InputError:
        return None
    extra = {k: v for k, v in doc.items() if k not in ("mdev_type", "start", "attrs")}
    return Definition(uuid, parent, type_id, start, pairs, extra)


def _parent_dirs(base: str) -> list[str]:
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        try:
            canonical = check_pci_address(name)
        except InputError:
            continue  # scripts.d, non-PCI parents (ccw, ap matrix), stray files
        if canonical == name:  # mdevctl names the directory as sysfs names the parent
            out.append(name)
    return sorted(out)


def read_definitions(ctx: Context) -> dict[str, Definition]:
    """Every definition on the host by UUID, read now.

    A UUID defined on two parents (possible only by hand) is kept once, on the
    first parent in sorted order, and logged: mdevctl refuses to start it.
    """
    base = ctx.sysfs.path(MDEVCTL_DIR)
    out: dict[str, Definition] = {}
    for parent in _parent_dirs(base):
        directory = os.path.join(base, parent)
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            try:
                uuid = check_uuid(name)
            except InputError:
                continue  # editor backups (~, .swp), temp files, notes
            if uuid != name:
                continue  # mdevctl names files by the lowercase UUID
            # By the reading layer's rules, the name itself never followed.
            raw = read_file(os.path.join(directory, name), _MAX_SIZE, follow=False)
            if isinstance(raw, ReadFailure):
                log.debug("%s: skipped", raw)
                continue
            found = parse(uuid, parent, raw)
            if found is None:
                log.debug("%s/%s is not an mdevctl definition: skipped", directory, name)
                continue
            if uuid in out:
                log.warning("mdev %s is defined on both %s and %s: using %s", uuid,
                            out[uuid].parent, parent, out[uuid].parent)
                continue
            out[uuid] = found
    return out


def read_definition(ctx: Context, uuid: str) -> Optional[Definition]:
    return read_definitions(ctx).get(uuid)


def write_definition(ctx: Context, d: Definition) -> None:
    """Write (or replace) a definition atomically; OSError if it cannot be written."""
    check_uuid(d.uuid)
    PciAddress.parse(d.parent)
    check_type_id(d.type_id)
    if d.start not in START_POLICIES:
        raise InputError(f"start policy must be auto or manual, not {d.start!r}")
    directory = ctx.sysfs.path(f"{MDEVCTL_DIR}/{d.parent}")
    os.makedirs(directory, mode=0o755, exist_ok=True)
    atomicfile.write_atomic(os.path.join(directory, d.uuid), d.to_json(), 0o644)
    log.info("defined mdev %s (%s on %s, start %s) for mdevctl", d.uuid, d.type_id,
             d.parent, d.start)


def remove_definition(ctx: Context, uuid: str, parent: Optional[str] = None) -> bool:
    """Remove a definition (on `parent`, else wherever it is); False if there was none."""
    check_uuid(uuid)
    parents = [parent] if parent else _parent_dirs(ctx.sysfs.path(MDEVCTL_DIR))
    removed = False
    for p in parents:
        path = ctx.sysfs.path(f"{MDEVCTL_DIR}/{p}/{uuid}")
        try:
            os.unlink(path)
            removed = True
        except FileNotFoundError:
            continue
        try:
            atomicfile.fsync_dir(os.path.dirname(path))
        except OSError:
            pass
        log.info("undefined mdev %s on %s", uuid, p)
    return removed


def udev_autostart(ctx: Context) -> bool:
    """Whether mdevctl's udev rule starts `auto` definitions on this host.

    The rule runs when a parent appears; it only works where the mdevctl it
    names exists (Debian 12's rule names /usr/sbin/mdevctl, which its package
    does not ship) and where an administrator has not masked it with a link
    to /dev/null in /etc/udev/rules.d.
    """
    for rel in UDEV_RULES:
        path = ctx.sysfs.path(rel)
        if os.path.islink(path) and os.readlink(path) == "/dev/null":
            return False
        raw = read_file(path, _MAX_SIZE, follow=False)
        if isinstance(raw, ReadFailure):
            continue
        m = _RULE_COMMAND.search(raw.decode("utf-8", "replace"))
        if m is None:
            return False
        return os.access(ctx.sysfs.path(m.group(1).lstrip("/")), os.X_OK)
    return False


__all__ = ["MDEVCTL_DIR", "START_POLICIES", "Definition", "check_attr", "parse",
           "parse_attr", "read_definition", "read_definitions", "remove_definition",
           "udev_autostart", "write_definition"]
