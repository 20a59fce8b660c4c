"""Every file gpulib reads or writes on a host, under one injected root.

`Sysfs` is the only object that writes to sysfs. Which kernel carries out a
write (the real one, or the simulator in `gpulib.sim`) is chosen at the entry
point (`gpulib.context`), so no other module knows whether the host is real.

Paths given to this module are relative to the root ("sys/bus/pci/devices").
Reads use os.open/os.read: discovery reads thousands of tiny attribute files
and the buffered `open()` machinery costs several times more per file.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import stat
from typing import Callable, Optional

log = logging.getLogger(__name__)

# A kernel carries out a write to an attribute file: (absolute path, data).
KernelWrite = Callable[[str, str], None]


def real_kernel_write(path: str, data: str) -> None:
    """Write an attribute the way `echo data > path` does, in one write(2)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


class Sysfs:
    """Reads and writes below one root directory (`/` on a real host)."""

    def __init__(self, root: str = "/", kernel_write: Optional[KernelWrite] = None,
                 simulated: bool = False) -> None:
        self.root = os.path.join(os.path.abspath(root), "")
        self._kernel_write = kernel_write or real_kernel_write
        self.simulated = simulated

    def __repr__(self) -> str:
        return f"Sysfs(root={self.root!r}, simulated={self.simulated})"

    # -- paths ---------------------------------------------------------------
    def path(self, rel: str) -> str:
        """Absolute path of `rel` below the root."""
        return self.root + rel.lstrip("/")

    def relative(self, abspath: str) -> str:
        """Inverse of `path` for a path inside the root."""
        if abspath.startswith(self.root):
            return abspath[len(self.root):]
        if abspath + "/" == self.root:
            return ""
        raise ValueError(f"{abspath} is outside {self.root}")

    # -- reads ---------------------------------------------------------------
    def read_bytes(self, rel: str) -> Optional[bytes]:
        """Raw content, or None if the file does not exist."""
        try:
            fd = os.open(self.root + rel, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            chunks = []
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def read(self, rel: str) -> Optional[str]:
        """Attribute text without the trailing newline, or None if absent."""
        data = self.read_bytes(rel)
        if data is None:
            return None
        return data.decode("utf-8", "replace").strip()

    def read_int(self, rel: str, base: int = 10) -> Optional[int]:
        """An integer attribute; None if absent or not a number."""
        text = self.read(rel)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            return None

    def listdir(self, rel: str) -> list[str]:
        """Entries of a directory, [] if it does not exist."""
        try:
            return os.listdir(self.root + rel)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.root + rel)

    def isdir(self, rel: str) -> bool:
        return os.path.isdir(self.root + rel)

    def link_name(self, rel: str) -> Optional[str]:
        """Last component of a symlink's target (`driver` -> "nvidia")."""
        try:
            return os.path.basename(os.readlink(self.root + rel))
        except (FileNotFoundError, NotADirectoryError, OSError):
            return None

    def resolve(self, rel: str) -> str:
        """Root-relative canonical path of `rel` (links followed)."""
        real = os.path.realpath(self.root + rel)
        return self.relative(real)

    def resolve_in_root(self, rel: str) -> Optional[str]:
        """`rel` with symlinks followed, staying inside the root.

        Absolute link targets are taken as below the root (a snapshot or a
        test tree holds links like /usr/bin/gpulib); None for a broken link,
        a loop, or a path that would leave the root.
        """
        path = posixpath.normpath(rel.lstrip("/"))
        for _ in range(16):
            try:
                st = os.lstat(self.root + path)
            except OSError:
                return None
            if not stat.S_ISLNK(st.st_mode):
                return path
            try:
                target = os.readlink(self.root + path)
            except OSError:
                return None
            if target.startswith("/"):
                path = posixpath.normpath(target.lstrip("/"))
            else:
                path = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
            if path == ".." or path.startswith("../"):
                return None
        return None

    # -- the one writer --------------------------------------------------------
    def write(self, rel: str, data: str, expected: tuple[int, ...] = ()) -> None:
        """Write an attribute; OSError carries the kernel's errno.

        A failure with an errno in `expected` is one the caller handles as a
        normal outcome (EEXIST of a vGPU another tool created): logged at
        info, not as a warning.
        """
        path = self.root + rel
        log.info("write %r to %s", data, path)
        try:
            self._kernel_write(path, data)
        except OSError as exc:
            log.log(logging.INFO if exc.errno in expected else logging.WARNING,
                    "write %r to %s failed: %s", data, path,
                    os.strerror(exc.errno or errno.EIO))
            raise
