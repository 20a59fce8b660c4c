"""Whole-or-nothing file replacement: the one writer of gpulib's own files.

A reader (another hook, mdevctl, an administrator's editor) must see either
the old file or the new one, never a torn mix, and a crash at any instant
must leave one of the two on disk. The recipe: an exclusively created temp
file in the target's directory (O_EXCL, so a link planted under the temp
name is never followed), write, fsync, rename over the target, fsync the
directory so the rename itself survives a power cut.

Temp files are named `.<target>.<pid>.<random>.tmp`, so a writer that died
can be recognised and its leftover removed (`remove_stale_temp_files`).
"""

from __future__ import annotations

import os
import time

from gpulib import logger
from gpulib.validate import decimal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

log = logger.get(__name__)

# A temp file older than this is a dead writer's leftover, whatever its pid.
STALE_TEMP_AGE = 60.0


class AtomicWriteError(OSError):
    """Writing failed; the target is unchanged. `strerror` says why."""


def temp_prefix(path: str) -> str:
    return "." + os.path.basename(path) + "."


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: str) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.join(directory, f"{temp_prefix(path)}{os.getpid()}.{os.urandom(4).hex()}.tmp")


def _create(tmp: str, mode: int) -> int:
    """The new temp file, open for writing (never a link planted under its name)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not loosen or tighten what we ask for
    except OSError:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd


def write_atomic(path: str, data: bytes, mode: int = 0o644, sync_dir: bool = True,
                 durable: bool = True, prepared: Optional[PreparedFile] = None,
                 owner: Optional[tuple[int, int]] = None) -> None:
    """Replace `path` with `data` atomically and durably.

    Raises AtomicWriteError (with errno and strerror of the failing call) and
    leaves no temp file behind. A failure to sync the directory after the
    rename is only logged: the new file is already in place and visible.
    `sync_dir=False` leaves the directory's fsync (the rename's durability) to
    the caller, who may do it after releasing a lock: other processes see the
    new file as soon as it is renamed. `durable=False` (a cache) skips the
    file's fsync too: still atomic, not kept across a power cut. `prepared`:
    a PreparedFile for `path` to use when `data` fits in it (the quick way).
    `owner` (uid, gid): the new file's, set before it replaces the old one
    (an edited /etc file keeps its group, e.g. root:adm).
    """
    if prepared is not None and prepared.replace(data):
        if sync_dir:
            sync_dir_of(path)
        return
    tmp = _temp_name(path)
    try:
        fd = _create(tmp, mode)
        try:
            if owner is not None:
                os.fchown(fd, *owner)
                os.fchmod(fd, mode)  # chown clears set-id bits
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise AtomicWriteError(e.errno, e.strerror or str(e), path) from None
    if sync_dir:
        sync_dir_of(path)


def sync_dir_of(path: str) -> None:
    """Make the rename that put `path` in place durable (fsync its directory).
    A failure is only logged: the new file is already in place and visible."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fsync_dir(directory)
    except OSError as e:
        log.warning("%s written, but syncing %s failed: %s", path, directory,
                    e.strerror or e)


class PreparedFile:
    """A temp file made and synced ahead of a replacement that must be quick.

    `write_atomic` pays for a journal commit while its caller (a hook holding
    the state lock) waits: the new file's size and blocks are metadata, and in
    a boot storm the filesystem's commit thread shares the cores with dozens of
    starting hooks. This file is made first, outside the lock: `capacity`
    bytes of spaces, fsynced, so its size and blocks are already on disk.
    `replace()` then overwrites its start with the new text (JSON allows the
    trailing whitespace), needs only `fdatasync` (data, no metadata) and the
    rename. The guarantees are write_atomic's: a crash leaves the old file or
    the new one, each whole; the caller fsyncs the directory afterwards.
    """

    def __init__(self, path: str, capacity: int, mode: int = 0o600) -> None:
        self.path = path
        self.capacity = capacity
        self.tmp = _temp_name(path)
        self.staged = False
        self.fd: Optional[int] = _create(self.tmp, mode)
        try:
            _write_all(self.fd, b" " * self.capacity)
            os.fsync(self.fd)
        except OSError:
            self.discard()
            raise

    def replace(self, data: bytes) -> bool:
        """Put `data` in place of `path`; False (nothing done) when it does not
        fit or the temp file is gone (removed as stale while its writer waited)."""
        return self.stage(data) and self.commit()

    def stage(self, data: bytes) -> bool:
        """Write `data` over the file's start and sync it, not yet in place."""
        fd = self.fd
        if fd is None or len(data) > self.capacity:
            return False
        try:
            if not self._still_ours(fd):
                return False
            os.lseek(fd, 0, os.SEEK_SET)
            _write_all(fd, data)
            os.fdatasync(fd)
        except OSError as e:
            raise AtomicWriteError(e.errno, e.strerror or str(e), self.path) from None
        self.staged = True
        return True

    def commit(self) -> bool:
        """Rename the staged file over `path`; False (nothing done) when nothing
        is staged or the temp file is gone."""
        fd = self.fd
        if fd is None or not self.staged:
            return False
        try:
            if not self._still_ours(fd):
                return False
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise AtomicWriteError(e.errno, e.strerror or str(e), self.path) from None
        self.fd = None
        os.close(fd)
        return True

    def discard(self) -> None:
        """Remove the temp file (when it was not used)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self._still_ours(fd):
                os.unlink(self.tmp)
        except OSError:
            pass
        os.close(fd)

    def _still_ours(self, fd: int) -> bool:
        """The temp name is still this file (not removed as a dead writer's)."""
        st = os.fstat(fd)
        return st.st_nlink > 0 and os.lstat(self.tmp).st_ino == st.st_ino


def hold_open(path: str) -> Optional[int]:
    """A read-only descriptor of `path` (None if it cannot be opened), to close
    once a lock is released.

    Renaming over a file frees its blocks at once when nothing else has it
    open, and on a filesystem mounted with `discard` that may include
    discarding them on the disk, right in the rename: milliseconds in a busy
    boot storm. Holding the old file open moves that cost to the close."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


def remove_stale_temp_files(path: str) -> None:
    """Remove temp files of `path` left by writers that died.

    Safe without the writers' lock: a live writer's temp file is younger than
    STALE_TEMP_AGE (write_atomic holds it for milliseconds), except a
    PreparedFile whose owner waits that long for a lock, and that one notices
    its file is gone and falls back to write_atomic's own.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = temp_prefix(path)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    now = time.time()
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        temp = os.path.join(directory, name)
        pid_text = name[len(prefix):].split(".", 1)[0]
        pid = decimal(pid_text, 10) or 0
        try:
            age = now - os.lstat(temp).st_mtime
            if age > STALE_TEMP_AGE or not _pid_alive(pid):
                os.unlink(temp)
                log.info("removed stale temp file %s", temp)
        except OSError:
            continue
