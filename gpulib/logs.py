"""Where gpulib's log goes: syslog on a real host, else `var/log/gpulib/gpulib.log`.

Never stdout or stderr by default: the CloudStack agent merges the hooks'
stderr into the XML it reads back, and libvirt shows a hook's stderr to the
user as an error. Under a test or simulated root the log file below that root
is used, so nothing reaches the real host's syslog.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import time
from typing import Optional

from gpulib.context import LOG_DIR, LOG_FAILURES_FILE, Context
from gpulib.logger import level_number
from gpulib.sysfs import file_kind

# The note file stays small whatever happens: a line per failing process.
_FAILURES_MAX_BYTES = 64 * 1024
_FORMAT = "%(name)s: %(levelname)s %(message)s"
_configured = False


def setup(ctx: Context, program: str, level: str = "info", use_syslog: bool = True,
          stderr_level: Optional[str] = None) -> None:
    """Configure the root logger once per process."""
    global _configured
    if _configured:
        return
    _configured = True
    # Whatever handler fails (ours or one added later), never a traceback on
    # stderr (logging.Handler.handleError prints only when this is set).
    logging.raiseExceptions = False
    # Python's warnings print to stderr too: into the log with them.
    logging.captureWarnings(True)
    failures = FailureNote(ctx.path(LOG_FAILURES_FILE), program)
    root = logging.getLogger()
    root.setLevel(min(level_number(level),
                      level_number(stderr_level) if stderr_level else logging.CRITICAL))
    handler: Optional[logging.Handler] = None
    if use_syslog and ctx.root == "/" and os.path.exists("/dev/log"):
        handler = SyslogHandler(program, failures)
        handler.setFormatter(logging.Formatter(_FORMAT))
    if handler is None:
        handler = LazyFileHandler(ctx.path(LOG_DIR + "/gpulib.log"), failures)
        handler.setFormatter(logging.Formatter(f"%(asctime)s {program}[%(process)d]: "
                                               + _FORMAT))
    handler.setLevel(level_number(level))
    root.addHandler(handler)
    if stderr_level:
        err = logging.StreamHandler(sys.stderr)
        err.setLevel(level_number(stderr_level))
        err.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(err)


class FailureNote:
    """Notes, once per process, that a log record was lost (for `gpulib doctor`)."""

    def __init__(self, path: str, program: str) -> None:
        self.path = path
        self.program = program
        self.count = 0

    def __call__(self, exc: Optional[BaseException]) -> None:
        self.count += 1
        if self.count > 1:
            return
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"{stamp} {self.program}[{os.getpid()}] {' '.join(reason.split())}\n"
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            # Non-blocking, regular files only: a FIFO here must not hang
            # the process whose log is already failing.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                         | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_size < _FAILURES_MAX_BYTES:
                    os.write(fd, line.encode("utf-8", "replace"))
            finally:
                os.close(fd)
        except OSError:
            pass  # nowhere left to say it: the record is lost, quietly


class LazyFileHandler(logging.FileHandler):
    """A log file created on the first record only: a command that has nothing
    to log (discover, doctor, snapshot) leaves the root untouched."""

    def __init__(self, path: str, failures: Optional[FailureNote] = None) -> None:
        super().__init__(path, encoding="utf-8", delay=True)
        self._failures = failures

    def _open(self):  # type: ignore[no-untyped-def]
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        # Non-blocking: opening a FIFO for writing waits for a reader forever,
        # and whatever logs (a hook, restore) would hang with it. Only a
        # regular file or a character device (/dev/null) is written to;
        # anything else is a lost record (OSError, handled by emit).
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK
                     | os.O_CLOEXEC | os.O_NOCTTY, 0o644)
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
                raise OSError(errno.EINVAL, f"{file_kind(mode)}, not a log file",
                              self.baseFilename)
            os.set_blocking(fd, True)
            return open(fd, "a", encoding=self.encoding, errors=self.errors)
        except BaseException:
            os.close(fd)
            raise

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:
            # Opening failed (a read-only root, a full disk): the record is lost.
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        # Never the default (a traceback on stderr, which the agent would read).
        if self._failures is not None:
            self._failures(sys.exc_info()[1])
        # A stream left half-written stays broken: reopen on the next record.
        stream, self.stream = self.stream, None  # type: ignore[assignment]
        if stream is not None:
            try:
                stream.close()
            except (OSError, ValueError):
                pass


class SyslogHandler(logging.Handler):
    """Through libc's syslog(3): logging.handlers costs a VM start milliseconds."""

    def __init__(self, program: str, failures: Optional[FailureNote] = None) -> None:
        super().__init__()
        import syslog

        self._syslog = syslog
        self._failures = failures
        syslog.openlog(program, syslog.LOG_PID, syslog.LOG_DAEMON)

    def emit(self, record: logging.LogRecord) -> None:
        s = self._syslog
        priority = {logging.DEBUG: s.LOG_DEBUG, logging.INFO: s.LOG_INFO,
                    logging.WARNING: s.LOG_WARNING, logging.ERROR: s.LOG_ERR}.get(
                        record.levelno, s.LOG_CRIT)
        try:
            s.syslog(priority, self.format(record))
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if self._failures is not None:
            self._failures(sys.exc_info()[1])
