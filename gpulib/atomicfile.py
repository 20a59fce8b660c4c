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

import logging
import os
import time

log = logging.getLogger(__name__)

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


def write_atomic(path: str, data: bytes, mode: int = 0o644, sync_dir: bool = True,
                 durable: bool = True) -> None:
    """Replace `path` with `data` atomically and durably.

    Raises AtomicWriteError (with errno and strerror of the failing call) and
    leaves no temp file behind. A failure to sync the directory after the
    rename is only logged: the new file is already in place and visible.
    `sync_dir=False` leaves the directory's fsync (the rename's durability) to
    the caller, who may do it after releasing a lock: other processes see the
    new file as soon as it is renamed. `durable=False` (a cache) skips the
    file's fsync too: still atomic, not kept across a power cut.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f"{temp_prefix(path)}{os.getpid()}."
                                  f"{os.urandom(4).hex()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, mode)
        try:
            os.fchmod(fd, mode)  # the umask must not loosen or tighten what we ask for
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
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
    if not sync_dir:
        return
    try:
        fsync_dir(directory)
    except OSError as e:
        log.warning("%s written, but syncing %s failed: %s", path, directory,
                    e.strerror or e)


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

    Call it under whatever lock serialises the writers of `path`.
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
        pid = int(pid_text) if pid_text.isdigit() else 0
        try:
            age = now - os.lstat(temp).st_mtime
            if age > STALE_TEMP_AGE or not _pid_alive(pid):
                os.unlink(temp)
                log.info("removed stale temp file %s", temp)
        except OSError:
            continue
