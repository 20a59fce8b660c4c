"""The simulated kernel's fault mode: files that fail the way real ones do.

On real GPU hosts a sysfs read can fail with EIO (a device in reset), EBUSY
or EAGAIN (a vendor driver in a bad state), a file can vanish between the
listing of its directory and its read (a VF going away), and a read can block.
Tests used to stand in for these with directories and dangling links; this
module makes the simulator produce the real errors instead.

A fault table `<root>/.gpulib-sim/faults.json` maps root-relative paths to a
fault; a fault on a directory applies to everything below it:

    {"sys/bus/pci/devices/0000:41:00.4/nvidia/current_vgpu_type": "eio",
     "sys/bus/pci/devices/0000:41:00.5": "vanish"}

* `eio`, `ebusy`, `eagain`, `enodev`, `eacces`: reads and listings fail with
  that errno;
* `vanish`: the entry is still listed by its directory (the walk saw it) but
  is gone when used: reads fail with ENOENT, links and directories are absent;
* `block`: not a table entry: `inject` replaces the file with a FIFO that
  nothing writes, the one kind of blocking read a tree can hold for real.

The table is read when the entry point builds its context with
`GPULIB_SIMULATE=1` (`gpulib.entry`); without a table the plain `Sysfs` is
used, so the production path never looks at faults.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
from collections.abc import Sequence

from gpulib.sysfs import DOCUMENT_MAX, ReadFailure, Sysfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Union

    from gpulib.sysfs import AlreadyRead, KernelWrite

FAULTS_FILE = ".gpulib-sim/faults.json"
ERRNO_FAULTS = {
    "eio": errno.EIO,
    "ebusy": errno.EBUSY,
    "eagain": errno.EAGAIN,
    "enodev": errno.ENODEV,
    "eacces": errno.EACCES,
}
KINDS = (*ERRNO_FAULTS, "vanish", "block")


def load_table(root: str) -> Optional[dict[str, str]]:
    """The fault table below `root`, None when there is none."""
    path = os.path.join(root, FAULTS_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {posixpath.normpath(str(k).lstrip("/")): str(v) for k, v in doc.items()}


def inject(root: str, rel: str, kind: str) -> None:
    """Add one fault for `rel` below `root` (a test's or the demo's tree)."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault {kind!r} (one of {', '.join(KINDS)})")
    rel = posixpath.normpath(rel.lstrip("/"))
    if kind == "block":
        path = os.path.join(root, rel)
        if os.path.isdir(path) and not os.path.islink(path):
            # Imported here: every simulated run loads this module, only
            # injecting a fault needs shutil (and the compressors it loads).
            import shutil

            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        os.mkfifo(path, 0o644)
        return
    table = load_table(root) or {}
    table[rel] = kind
    path = os.path.join(root, FAULTS_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(table, fh, indent=1, sort_keys=True)


class FaultySysfs(Sysfs):
    """A `Sysfs` whose reads consult a fault table first."""

    def __init__(self, root: str, faults: dict[str, str],
                 kernel_write: Optional[KernelWrite] = None, simulated: bool = True) -> None:
        super().__init__(root, kernel_write=kernel_write, simulated=simulated)
        # Keyed by canonical path: a fault on a device's directory hits it
        # whether it is reached through sys/bus/pci/devices or sys/devices.
        self._dirs: dict[str, str] = {}
        self.faults: dict[str, str] = {}
        for rel, kind in faults.items():
            self.faults[self._canonical(rel)] = kind
            # A link to a directory (a device in sys/bus/pci/devices): the
            # fault is also on the directory it names.
            if os.path.islink(self.root + rel) and os.path.isdir(self.root + rel):
                self.faults[self._canonical_dir(rel)] = kind

    def _canonical_dir(self, rel: str) -> str:
        """Root-relative realpath of a directory (`rel` itself when it leaves the root)."""
        cached = self._dirs.get(rel)
        if cached is None:
            real = os.path.realpath(self.root + rel)
            if real.startswith(self.root):
                cached = real[len(self.root):]
            else:
                cached = "" if real + "/" == self.root else rel
            self._dirs[rel] = cached
        return cached

    def _canonical(self, rel: str) -> str:
        """`rel` with the links above its last component resolved."""
        parent, name = posixpath.split(posixpath.normpath(rel.lstrip("/")))
        if not parent:
            return name
        canon = self._canonical_dir(parent)
        return posixpath.join(canon, name) if canon else name

    def fault(self, rel: str) -> Optional[str]:
        """The fault on `rel` or on a directory above it."""
        if not self.faults:
            return None
        path = posixpath.normpath(rel.lstrip("/"))
        for candidate in (path, self._canonical(path)):
            probe = candidate
            while probe and probe != ".":
                kind = self.faults.get(probe)
                if kind is not None:
                    return kind
                probe = posixpath.dirname(probe)
        return None

    def _failure(self, rel: str, kind: str) -> ReadFailure:
        code = errno.ENOENT if kind == "vanish" else ERRNO_FAULTS.get(kind, errno.EIO)
        return ReadFailure(self.root + rel, code, os.strerror(code))

    def read_result(self, rel: str, limit: Optional[int] = None) -> Union[bytes, ReadFailure]:
        kind = self.fault(rel)
        if kind is not None:
            return self._failure(rel, kind)
        return super().read_result(rel, limit)

    def read_counts(self, rel_dir: str, names: Sequence[str], high: int) -> list[Optional[int]]:
        # Each file through read_result, which consults the table.
        return [self.read_int(f"{rel_dir}/{n}", low=0, high=high) for n in names]

    def read_unless(self, rel: str, known: AlreadyRead, limit: int = DOCUMENT_MAX
                    ) -> Union[tuple[os.stat_result, Optional[bytes]], ReadFailure]:
        kind = self.fault(rel)
        if kind is not None:
            return self._failure(rel, kind)
        return super().read_unless(rel, known, limit)

    def listdir_result(self, rel: str) -> Union[list[str], ReadFailure]:
        kind = self.fault(rel)
        if kind is not None:
            return self._failure(rel, kind)
        return super().listdir_result(rel)

    def exists(self, rel: str) -> bool:
        return self.fault(rel) != "vanish" and super().exists(rel)

    def isdir(self, rel: str) -> bool:
        return self.fault(rel) != "vanish" and super().isdir(rel)

    def link_name(self, rel: str) -> Optional[str]:
        return None if self.fault(rel) is not None else super().link_name(rel)
