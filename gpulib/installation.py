"""The installed release as one whole: no gpulib process runs with modules of two versions.

A package upgrade replaces gpulib's modules one file at a time, and gpulib
imports most of them only when a run needs them. So every hook and command
takes, as its first act, a shared lock on the installation that it keeps
until it exits (`hold`); the package's maintainer scripts take it exclusively
for the unpack. A run that starts during an upgrade waits for it to end and
then starts again from the new files (it has read nothing yet), or gives up
with exit 3 (run again) after `HOLD_WAIT` seconds.

Whether the files changed meanwhile is told by the build's version file,
`gpulib/_version.py` (`stamp`): every installation of a build writes it
anew (dpkg and rpm rename it into place, pip writes it) and nothing else
touches it, so Python writing byte code beside the modules (`__pycache__`)
is no upgrade. A removal (dpkg's and rpm's scripts hold the lock for it too)
leaves no such file: a run that waited for one says so and exits 3.

The lock is two flocks on the package's own directories, a turnstile:
`gpulib/` is the gate, taken exclusively for an instant by each run and for
the whole upgrade by the package; `gpulib/hooks/` is the hall, shared by the
runs, exclusive for the upgrade. A stream of runs can therefore never keep an
upgrade waiting (flock has no queue: a waiting exclusive lock does not stop
new shared ones). The package scripts use flock(1) on the same directories.

Only os, sys, fcntl and time are imported: this runs before anything else
on every hook start, the no-GPU path included.
"""

from __future__ import annotations

import os
import sys

# typing costs every hook start milliseconds: names for type checkers only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn, Optional

# The hooks answer the CloudStack agent within its 30 s: waiting longer for
# an upgrade would only turn exit 3 into the agent's timeout.
HOLD_WAIT = 20.0

# Written by the build (packaging/version), replaced by every installation.
VERSION_FILE = "_version.py"

_held: list[int] = []          # the hall's descriptor, open until the process exits
_stamp_at_start: list[tuple[int, ...]] = []


def package_dir() -> str:
    """The directory of the gpulib package these modules were loaded from."""
    return os.path.dirname(os.path.abspath(__file__))


def stamp() -> tuple[int, ...]:
    """The identity of the installed build: device, inode, mtime and size of
    its version file, which an installation replaces (a new inode) and nothing
    else changes (not byte code being written, not a relabel: no ctime, no
    directory). () when there is none: the package was removed, or this is a
    source tree never built."""
    try:
        st = os.stat(os.path.join(package_dir(), VERSION_FILE))
    except OSError:
        return ()
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def started_with() -> tuple[int, ...]:
    """The stamp when this process took hold of the installation, or, in a
    process that never did (a test, a library user), when it first asked."""
    if not _stamp_at_start:
        _stamp_at_start.append(stamp())
    return _stamp_at_start[0]


def hold(program: str, wait: float = HOLD_WAIT) -> None:
    """Hold the installation (shared) until the process exits.

    During an upgrade: wait for it, then run this process again from the
    start (os.execv of the same command line) when the files changed, or exit
    3 with one line on stderr when it did not end within `wait` seconds. Where
    nothing can be locked (a directory that cannot be opened, a file system
    without flock) it goes on unguarded: there is no package manager at work.
    """
    if _held:
        return
    import fcntl

    before = stamp()
    base = package_dir()
    flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0)
    try:
        gate = os.open(base, flags)
    except FileNotFoundError:
        _gone(program)  # removed since this module was read
    except OSError:
        _stamp_at_start.append(before)
        return
    try:
        hall = os.open(os.path.join(base, "hooks"), flags)
    except OSError:
        os.close(gate)
        _stamp_at_start.append(before)
        return
    deadline: Optional[float] = None
    try:
        deadline = _lock(gate, fcntl.LOCK_EX, deadline, wait, program)
        deadline = _lock(hall, fcntl.LOCK_SH, deadline, wait, program)
        fcntl.flock(gate, fcntl.LOCK_UN)
    except OSError:  # no flock here (ENOLCK): nothing to coordinate with
        os.close(hall)
        hall = -1
    finally:
        os.close(gate)
    if deadline is not None and stamp() != before:
        if before and not stamp():
            _gone(program)  # it waited for a removal
        # It waited for an upgrade that replaced the files: what this process
        # imported so far is the old release. Start over from the new one.
        if hall >= 0:
            os.close(hall)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if hall >= 0:
        _held.append(hall)
    _stamp_at_start.append(stamp())


def _lock(fd: int, how: int, deadline: Optional[float], wait: float, program: str
          ) -> Optional[float]:
    """flock(fd, how) by the deadline (set now if None and it has to wait):
    the deadline, None when the lock was free at once; exit 3 once it passed."""
    import fcntl

    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return deadline
    except BlockingIOError:
        if not _held_by_trusted(fd):
            return deadline
    import time

    # Another run holds the gate for microseconds; an upgrade for seconds.
    if deadline is None:
        deadline = time.monotonic() + wait
    pause = 0.001
    while True:
        time.sleep(pause)
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return deadline
        except BlockingIOError:
            if time.monotonic() >= deadline:
                _busy(program, wait)
            pause = min(pause * 2, 0.05)


def _held_by_trusted(fd: int) -> bool:
    """Whether the lock on fd's file that stops this process is one to wait
    for: held by root (the package's scripts) or by this process's own user.

    Any user may flock a directory they can read: a lock taken by another
    user must not keep the hooks waiting and exiting 3 (a VM could not start).
    Only asked when the lock is busy; where the holder cannot be told (its pid
    is not visible here), it is waited for.
    """
    try:
        st = os.fstat(fd)
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return True
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = []
    for line in lines:
        parts = line.split()
        # `1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF`; waiters have `->`.
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == where:
            holders.append(parts[4])
    if not holders:
        return True
    trusted = {0, os.getuid()}
    for pid in holders:
        try:
            if os.stat(f"/proc/{pid}").st_uid in trusted:
                return True
        except (OSError, ValueError):
            return True
    return False


# What every executable says when the installed package is incomplete: dpkg or rpm
# between one file and the next (an install, an upgrade's old executable meeting new
# modules, a removal), whichever of gpulib's modules a run reaches for.
INCOMPLETE = "gpulib is being installed or removed: nothing was done"


def incomplete_line(program: str, exc: BaseException) -> Optional[str]:
    """The one line for an ImportError of gpulib's own modules (a module missing, or a
    name an older or newer module lacks); None for any other error (a bug, a missing
    dependency), which keeps its own report."""
    name = getattr(exc, "name", None)
    if isinstance(exc, ImportError) and isinstance(name, str) and \
            (name == "gpulib" or name.startswith("gpulib.")):
        return f"{program}: {INCOMPLETE}"
    return None


def incomplete(program: str, exc: BaseException) -> NoReturn:
    """Exit 3 with one line when `exc` says the installation is incomplete; else raise
    it again."""
    line = incomplete_line(program, exc)
    if line is None:
        raise exc
    _exit_3(line)


def _busy(program: str, wait: float) -> NoReturn:
    _exit_3(f"{program}: gpulib is being upgraded and the upgrade did not end within "
            f"{wait:g} s: nothing was done; run it again")


def _gone(program: str) -> NoReturn:
    _exit_3(f"{program}: gpulib was removed while this run waited for it: nothing was done")


def _exit_3(line: str) -> NoReturn:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    raise SystemExit(3)
