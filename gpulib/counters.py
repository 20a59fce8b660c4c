"""Counters of what the hooks did, for `gpulib metrics`.

A hook notes an event (a start prepared or refused, a vGPU created or
destroyed, a release) with one `note` call: one O_APPEND write of one short
line to `var/lib/gpulib/counters.log`, no fsync, no lock. Appends of a line
this short are never torn or interleaved on a local file system, and a start
pays microseconds for it. Nothing here touches gpulib's state file, and a hook
imports this module only where an event happens (never on the no-GPU path).

`gpulib metrics` reads the totals: `counters.json` (what was folded so far,
with how far into each event file) plus the lines appended since. `fold`
moves the lines into `counters.json` (written atomically, under the
counters' own lock, never the state lock: a hook never waits for it) and
rotates a long event file to `counters.log.1`, which it removes once every
line of it is folded and no writer can still hold it open.

Losing a counter's events (a power cut before the page cache was written, a
file removed by hand) resets it: Prometheus' rate() takes a counter reset in
its stride. A line that does not parse (a hand edit, a disk error) is skipped.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Protocol, TypeVar

    from gpulib.state import Device

    class _Start(Protocol):
        """What `counted_start` needs of the preparer it wraps."""

        @property
        def hook(self) -> str: ...

        @property
        def sysfs(self) -> Any: ...

    S = TypeVar("S", bound=_Start)

EVENTS_FILE = "var/lib/gpulib/counters.log"
ROTATED_FILE = EVENTS_FILE + ".1"
TOTALS_FILE = "var/lib/gpulib/counters.json"
LOCK_FILE = "var/lib/gpulib/counters.lock"
TOTALS_VERSION = 1
# Rotated when longer than this at a fold (a line is 30 to 60 bytes).
ROTATE_BYTES = 256 * 1024
# A rotated file is removed this long after its last write: a hook writes
# right after opening the file, so none can still hold it then.
ROTATED_KEEP_SECONDS = 60.0
# Never read more than this of one event file (a file grown by something else).
READ_MAX = 16 * 1024 * 1024

# Every counter, its labels and the values each label may take: a bounded
# set of series, whatever the hooks meet.
HOOKS = ("transformer", "qemu")
REASONS = ("bad_input", "unavailable", "device", "busy", "state", "internal")
KINDS = ("mdev", "vf")
RELEASED_BY = ("stop", "reconcile", "command")
COUNTERS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "starts_prepared": (("hook", HOOKS),),
    "starts_refused": (("hook", HOOKS), ("reason", REASONS)),
    "vgpus_created": (("kind", KINDS),),
    "vgpus_destroyed": (("kind", KINDS),),
    "releases": (("by", RELEASED_BY),),
}


def event_line(name: str, **labels: str) -> str:
    """The event file's line for one event: `name label=value...`; raises
    ValueError for a counter, label or value not in COUNTERS."""
    spec = COUNTERS.get(name)
    if spec is None:
        raise ValueError(f"no counter {name!r}")
    if set(labels) != {label for label, _ in spec}:
        raise ValueError(f"counter {name} takes the labels {[label for label, _ in spec]}")
    parts = [name]
    for label, allowed in spec:
        value = labels[label]
        if value not in allowed:
            raise ValueError(f"counter {name}: {label} may not be {value!r}")
        parts.append(f"{label}={value}")
    return " ".join(parts) + "\n"


def note(root: str, name: str, times: int = 1, **labels: str) -> None:
    """Count an event (`times` times) below `root`. Never raises for an I/O
    problem: a counter must not fail the start or stop it counts."""
    if times <= 0:
        return
    line = event_line(name, **labels).encode("ascii") * times
    path = os.path.join(root, EVENTS_FILE)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | \
        os.O_NONBLOCK | os.O_NOCTTY
    try:
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        from gpulib import logger

        logger.get(__name__).debug("counter %s not counted: %s", name, exc)


def refusal_reason(exc: BaseException) -> str:
    """The `reason` label of a refused start, from the kind of its error."""
    from gpulib import errors

    if isinstance(exc, errors.InputError):
        return "bad_input"
    if isinstance(exc, errors.NotAvailableError):
        return "unavailable"
    if isinstance(exc, errors.DeviceError):
        return "device"
    if isinstance(exc, errors.LockTimeout):
        return "busy"
    if isinstance(exc, errors.StateError):
        return "state"
    return "internal"


def counted_start(run: Callable[[S], list[Device]]) -> Callable[[S], list[Device]]:
    """Wraps a preparer's `run`: a start that made devices ready counts as
    prepared, one that raised counts as refused (by its error's kind), a
    domain none of whose devices are gpulib's counts as neither. Counted
    after the state change is done, so a run thrown away is never counted."""
    def counted(self: S) -> list[Device]:
        hook = self.hook
        try:
            devices = run(self)
        except Exception as exc:
            note(self.sysfs.root, "starts_refused", hook=hook, reason=refusal_reason(exc))
            raise
        if devices:
            note(self.sysfs.root, "starts_prepared", hook=hook)
        return devices

    counted.__doc__ = run.__doc__
    return counted


# -- reading and folding (gpulib metrics) ------------------------------------------------


def parse_line(line: str) -> Optional[str]:
    """The counter key (`name label=value...`) of one event line, or None
    when it is not one (`event_line`'s output, without its newline)."""
    parts = line.split(" ")
    spec = COUNTERS.get(parts[0])
    if spec is None or len(parts) != len(spec) + 1:
        return None
    for part, (label, allowed) in zip(parts[1:], spec):
        key, sep, value = part.partition("=")
        if not sep or key != label or value not in allowed:
            return None
    return line


def count_lines(data: bytes, counts: dict[str, int]) -> int:
    """Add the events of `data`'s complete lines to `counts`; the number of
    bytes those lines take (a last line without its newline is left)."""
    end = data.rfind(b"\n") + 1
    for raw in data[:end].split(b"\n")[:-1]:
        try:
            key = parse_line(raw.decode("ascii"))
        except UnicodeDecodeError:
            key = None
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    return end


def labels_of(key: str) -> tuple[str, dict[str, str]]:
    """A counter key's name and labels."""
    name, *parts = key.split(" ")
    return name, dict(p.partition("=")[::2] for p in parts)


class Totals:
    """What `counters.json` holds: the counts folded so far and, per event
    file, its inode and how many bytes of it are in the counts."""

    def __init__(self, counts: Optional[dict[str, int]] = None,
                 files: Optional[dict[str, tuple[int, int]]] = None) -> None:
        self.counts: dict[str, int] = counts or {}
        self.files: dict[str, tuple[int, int]] = files or {}

    @classmethod
    def load(cls, root: str) -> Totals:
        """The folded totals; empty when the file is missing or unusable
        (its counters then start again: a reset, not an error)."""
        import json

        try:
            with open(os.path.join(root, TOTALS_FILE), "rb") as fh:
                doc = json.loads(fh.read(READ_MAX).decode("utf-8"))
        except (OSError, ValueError):
            return cls()
        if not isinstance(doc, dict) or doc.get("version") != TOTALS_VERSION:
            return cls()
        counts = {k: v for k, v in (doc.get("counts") or {}).items()
                  if isinstance(v, int) and not isinstance(v, bool) and v >= 0
                  and parse_line(k) is not None} if isinstance(doc.get("counts"), dict) else {}
        files: dict[str, tuple[int, int]] = {}
        raw_files = doc.get("files")
        if isinstance(raw_files, dict):
            for name, pos in raw_files.items():
                if name in (EVENTS_FILE, ROTATED_FILE) and isinstance(pos, list) and \
                        len(pos) == 2 and all(isinstance(n, int) and n >= 0 for n in pos):
                    files[name] = (pos[0], pos[1])
        return cls(counts, files)

    def to_bytes(self) -> bytes:
        import json

        doc = {"version": TOTALS_VERSION, "counts": dict(sorted(self.counts.items())),
               "files": {name: list(pos) for name, pos in sorted(self.files.items())}}
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode("ascii")


def _read_new(root: str, rel: str, totals: Totals, counts: dict[str, int]
              ) -> Optional[tuple[int, int, float, int]]:
    """Count the lines of one event file past what `totals` folded of it;
    (inode, offset reached, mtime, size), or None when there is no file."""
    try:
        fd = os.open(os.path.join(root, rel), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW |
                     os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        import stat

        if not stat.S_ISREG(st.st_mode):
            return None
        # Found by inode, whatever its name now (a fold renamed it, or failed
        # to record that it did); a file not folded yet, or cut short by
        # hand, is read from its start.
        start = next((done for ino, done in totals.files.values()
                      if ino == st.st_ino and done <= st.st_size), 0)
        os.lseek(fd, start, os.SEEK_SET)
        data = os.read(fd, min(st.st_size - start, READ_MAX)) if st.st_size > start else b""
        return st.st_ino, start + count_lines(data, counts), st.st_mtime, st.st_size
    finally:
        os.close(fd)


def read(root: str, totals: Optional[Totals] = None) -> dict[str, int]:
    """Every counter's total (key -> count), changing nothing."""
    totals = totals if totals is not None else Totals.load(root)
    counts = dict(totals.counts)
    for rel in (ROTATED_FILE, EVENTS_FILE):
        _read_new(root, rel, totals, counts)
    return counts


def fold(root: str, now: Optional[float] = None,
         lock_wait: float = 1.0) -> dict[str, int]:
    """Move the appended events into the totals file and rotate a long event
    file; every counter's total. Without the right to write (or with the
    counters' lock busy past `lock_wait`) the totals are read, not folded."""
    import fcntl
    import time

    from gpulib import atomicfile

    try:
        lock = os.open(os.path.join(root, LOCK_FILE),
                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError:
        return read(root)
    try:
        deadline = time.monotonic() + lock_wait
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    return read(root)
                time.sleep(0.02)
        totals = Totals.load(root)
        counts = dict(totals.counts)
        files: dict[str, tuple[int, int]] = {}
        now = time.time() if now is None else now
        rotated = _read_new(root, ROTATED_FILE, totals, counts)
        if rotated is not None:
            ino, offset, mtime, size = rotated
            if offset >= size and now - mtime >= ROTATED_KEEP_SECONDS:
                os.unlink(os.path.join(root, ROTATED_FILE))
                rotated = None
            else:
                files[ROTATED_FILE] = (ino, offset)
        current = _read_new(root, EVENTS_FILE, totals, counts)
        if current is not None:
            ino, offset, _mtime, size = current
            if rotated is None and size > ROTATE_BYTES:
                # New appends go to a new file; a late one into this file is
                # still read at the next fold, from where this one stopped.
                os.rename(os.path.join(root, EVENTS_FILE), os.path.join(root, ROTATED_FILE))
                files[ROTATED_FILE] = (ino, offset)
            else:
                files[EVENTS_FILE] = (ino, offset)
        if counts != totals.counts or files != totals.files:
            # Only when something moved: the timer folds every minute.
            folded = Totals(counts, files)
            atomicfile.write_atomic(os.path.join(root, TOTALS_FILE), folded.to_bytes())
        return counts
    except OSError:
        return read(root)
    finally:
        os.close(lock)
