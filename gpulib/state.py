"""gpulib's own state file, its lock and its writers.

The file (`var/lib/gpulib/state.json` below the root; ARCHITECTURE.md, "The
state file") records what gpulib knows that the host cannot tell it again
after a reboot or a crash; its schema and records are `gpulib.records`, its
text `gpulib.statetext`. Every name other modules import from here stays
importable here.

Rules this module keeps:

* Every change is made under one OS lock (flock(2) on `state.lock`, the
  lock filelock and flock(1) take too, so a process that dies releases it),
  waited for with a timeout well inside the CloudStack agent's 30 s hook
  timeout. Expiry raises `LockTimeout` (exit code 3).
* Changes go through `StateStore.transaction()` (and `update()`, the same
  for a function): lock, read, change, write, unlock. The lock's holder
  runs at the highest priority while it holds it, and only then.
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
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gpulib import atomicfile, logger
from gpulib.errors import LockTimeout, StateError
from gpulib.records import (
    ALLOCATION_STATUSES,
    DEVICE_KINDS,
    GPU_INSTANCE_ACTIONS,
    INTENT_ACTIONS,
    REBUILT_FROM_KEY,
    REMOVALS,
    SCHEMA_VERSION,
    Allocation,
    CorruptStateError,
    Device,
    GpuInstanceRecord,
    Intent,
    State,
    StateVersionError,
    VfRecord,
    VgpuRecord,
    dumps,
    placement_of,
    pool_of,
    utc_now,
)
from gpulib.statetext import render_json
from gpulib.sysfs import DOCUMENT_MAX, ReadFailure, read_file

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, TypeVar

    from gpulib.context import Context

    T = TypeVar("T")

log = logger.get(__name__)

DEFAULT_LOCK_TIMEOUT = 20.0
"""Seconds to wait for the state lock: well inside the agent's 30 s hook timeout."""

HOOK_LOCK_TIMEOUT_CAP = 20.0
"""The longest a hook waits for the state lock, whatever `lock_timeout` says:
the agent kills a hook after 30 s, so a hook gives up in time to answer with
its one-line error. `gpulib doctor` flags a configured value above it."""

# The reason given for a state file that is gone while its copy is not.
MISSING = "the file is missing, its copy is not"
MISSING_BOTH = "the file is missing and its copy is unusable"

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
    and the replaced files (the state and its copy), kept open until then."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.cpu_since = time.process_time()
        self.seconds = 0.0
        self.cpu = 0.0
        self._old_fds: list[int] = []

    def keep_old(self, path: str) -> None:
        """Hold the file about to be replaced open (see atomicfile.hold_open)."""
        fd = atomicfile.hold_open(path)
        if fd is not None:
            self._old_fds.append(fd)

    def ended(self) -> None:
        self.seconds = time.monotonic() - self.since
        fds, self._old_fds = self._old_fds, []
        for fd in fds:
            os.close(fd)
        self.cpu = time.process_time() - self.cpu_since

    def line(self, writing: float, how: str = "") -> str:
        """What scripts/bench reads to report the lock's hold time per start."""
        return (f"state lock held {self.seconds * 1000:.2f} ms ({self.cpu * 1000:.2f} ms of "
                f"CPU, {writing * 1000:.2f} ms writing the file)" + (f": {how}" if how else ""))


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


class Repair:
    """A corrupt state file moved aside and rebuilt (from its copy and the host).

    A plain class, not a NamedTuple: every hook imports this module, and
    creating a NamedTuple class costs a tenth of a millisecond."""

    __slots__ = ("moved_to", "reason", "rebuilt")

    def __init__(self, reason: str, moved_to: str, rebuilt: State) -> None:
        self.reason = reason
        self.moved_to = moved_to
        self.rebuilt = rebuilt

    def summary(self) -> str:
        """What was rebuilt and from where, in words (`gpulib status`, the log)."""
        st = self.rebuilt
        vms = ", ".join(f"{vm} ({a.status})" for vm, a in sorted(st.allocations.items())) \
            or "none"
        pooled = sum(1 for r in st.vgpus.values() if pool_of(r)) + \
            sum(1 for r in st.vf_types.values() if pool_of(r))
        source = st.extra.get(REBUILT_FROM_KEY) or "the host"
        where = f"the damaged file is {self.moved_to}" if self.moved_to else \
            "the file itself was missing"
        return (f"from {source}: {len(st.vgpus)} vGPU(s), {len(st.vf_types)} VF type(s), "
                f"{pooled} pool member(s), {len(st.allocations)} allocation(s) ({vms}); "
                f"{where}")


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
    lock's duration (a few milliseconds) is priority inheritance by hand:
    in the boot storm of scripts/bench the storm took a sixth less time with
    it than without (three interleaved runs each). Only the lock's holder is
    raised, never a whole hook run: the guests booting on the same cores
    come first otherwise. Needs CAP_SYS_NICE (the hooks run as root);
    without it nothing changes. Returns the niceness to restore, or None."""
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
    `transaction()` and `update()` change the file, under the lock.
    """

    def __init__(self, state_path: str, lock_path: str, timeout: float = DEFAULT_LOCK_TIMEOUT,
                 rebuild: Optional[Callable[[], State]] = None) -> None:
        self.state_path = os.path.abspath(state_path)
        self.lock_path = os.path.abspath(lock_path)
        self.timeout = timeout
        self.rebuild: Callable[[], State] = rebuild or State
        self._in_transaction = False
        self._hold: Optional[_Hold] = None  # the lock's hold, in a transaction
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
        # The document of the state as the transaction loaded it (when the file's
        # own text stands for it): equal at the end means unchanged.
        self._loaded_doc: Optional[dict[str, Any]] = None
        self._last_written: Optional[str] = None  # the last checkpoint's text
        self._before_is_raw = False
        self._bak_existed = False  # whether the copy existed when the transaction began
        self._checkpointed = False

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
            if not os.path.lexists(self.backup_path):
                return State()
            copy = self.backup_state()
            # Lost, not new: its copy is what gpulib knew (the next change
            # rebuilds the file from it and the host, as a damaged one; from
            # the host alone when the copy is unusable too).
            self.corrupt_reason = MISSING if copy is not None else MISSING_BOTH
            log.error("state file %s is missing beside its copy %s: %s; the next change "
                      "will rebuild it from %s", self.state_path, self.backup_path,
                      "reading the copy" if copy is not None else "the copy is unusable",
                      "the copy and the host" if copy is not None else "the host")
            return copy if copy is not None else State()
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
        lock). Not synced, and a failure only logged: the state file is the record.
        The copy it replaces is closed after the lock is released, like the
        state file (_Hold.keep_old): freeing its blocks cost a boot storm's
        holders 3 ms (median; 12 ms at the 90th percentile) in the rename."""
        if self._hold is not None:
            self._hold.keep_old(self.backup_path)
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

    def _new_temp(self, capacity: int) -> atomicfile.PreparedFile:
        """A temp file for the state, made outside the lock (dead writers' temp
        files are removed first)."""
        atomicfile.remove_stale_temp_files(self.state_path)
        self._ensure_dirs()
        return atomicfile.PreparedFile(self.state_path, capacity)

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
        try:
            got = _flock_wait(fd, self.timeout)
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
    def _locked(self) -> Iterator[_Hold]:
        """The lock, held while the block runs, with the `on_lock` check made
        first, at the highest priority meanwhile (see _hurry)."""
        lock = self._acquire()
        hold = _Hold()
        niceness = _hurry()
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
                with self._locked() as hold:
                    self._hold = hold
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
            self._hold = None

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

    def update(self, change: Callable[[State], T]) -> T:
        """Run `change` on the state under the lock and write what it changed;
        its result (the hooks' starts and stops).

        One locked read-change-write, as `transaction()`. Measured in a boot
        storm (64 starts at once on 2 cores), working the change out before the
        lock and renaming it in under the lock when no one wrote meanwhile lost:
        a third of those runs were thrown away because another start wrote
        first, and the storm took longer than with every change under the lock.
        """
        if self._in_transaction:
            raise RuntimeError("StateStore.update() inside a transaction")
        with self.transaction() as state:
            return change(state)

    def checkpoint(self, state: State) -> None:
        """Write `state` now, inside a transaction: a write-ahead intent must be
        on disk before the sysfs write it announces. The transaction still
        writes its final state at the end (or, on an exception, leaves this one,
        whose intents the next run settles)."""
        if not self._in_transaction:
            raise RuntimeError("StateStore.checkpoint() outside a transaction")
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
            if self._bak_existed:
                # Beside a copy, usable or not: lost, not new.
                return self._recover_missing()
            # No file and no copy: gpulib starts empty (a new host).
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

    def _recover_missing(self) -> tuple[State, str]:
        """A missing state file beside its copy: rebuilt exactly as a damaged one
        is (the copy when it is usable, and the host: `rebuild`), written at once and
        logged; `last_repair` says so (`gpulib status`). Read as empty, it
        would give a pending start's device again, lose on-demand flags, and
        the next write would overwrite the copy."""
        reason = MISSING if self.backup_state() is not None else MISSING_BOTH
        state = self._rebuilt(reason)
        text = dumps(state)
        self._write(text)
        # A failed start's revert_checkpoints puts back this, not nothing.
        self._raw_before = text.encode("ascii")
        self.last_repair = Repair(reason, "", State.from_json(json.loads(text)))
        log.error("state file %s was missing: rebuilt %s", self.state_path,
                  self.last_repair.summary())
        return state, text

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
    "GPU_INSTANCE_ACTIONS",
    "HOOK_LOCK_TIMEOUT_CAP",
    "INTENT_ACTIONS",
    "REBUILT_FROM_KEY",
    "REMOVALS",
    "SCHEMA_VERSION",
    "Allocation",
    "CorruptStateError",
    "Device",
    "GpuInstanceRecord",
    "Intent",
    "Repair",
    "State",
    "StateStore",
    "StateVersionError",
    "VfRecord",
    "VgpuRecord",
    "dumps",
    "placement_of",
    "render_json",
    "utc_now",
]
