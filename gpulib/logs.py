"""Where gpulib's log goes: syslog on a real host, else `var/log/gpulib/gpulib.log`.

Never stdout or stderr by default: the CloudStack agent merges the hooks'
stderr into the XML it reads back, and libvirt shows a hook's stderr to the
user as an error. Under a test or simulated root the log file below that root
is used, so nothing reaches the real host's syslog.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from gpulib.context import LOG_DIR, Context

_FORMAT = "%(name)s: %(levelname)s %(message)s"
_configured = False


def setup(ctx: Context, program: str, level: str = "info", use_syslog: bool = True,
          stderr_level: Optional[str] = None) -> None:
    """Configure the root logger once per process."""
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger()
    root.setLevel(min(_level(level), _level(stderr_level) if stderr_level else logging.CRITICAL))
    handler: Optional[logging.Handler] = None
    if use_syslog and ctx.root == "/" and os.path.exists("/dev/log"):
        handler = SyslogHandler(program)
        handler.setFormatter(logging.Formatter(_FORMAT))
    if handler is None:
        handler = LazyFileHandler(ctx.path(LOG_DIR + "/gpulib.log"))
        handler.setFormatter(logging.Formatter(f"%(asctime)s {program}[%(process)d]: "
                                               + _FORMAT))
    handler.setLevel(_level(level))
    root.addHandler(handler)
    if stderr_level:
        err = logging.StreamHandler(sys.stderr)
        err.setLevel(_level(stderr_level))
        err.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(err)


class LazyFileHandler(logging.FileHandler):
    """A log file created on the first record only: a command that has nothing
    to log (discover, doctor, snapshot) leaves the root untouched."""

    def __init__(self, path: str) -> None:
        super().__init__(path, encoding="utf-8", delay=True)

    def _open(self):  # type: ignore[no-untyped-def]
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:
            pass  # a read-only root (a mounted snapshot) must not fail a command


class SyslogHandler(logging.Handler):
    """Through libc's syslog(3): logging.handlers costs a VM start milliseconds."""

    def __init__(self, program: str) -> None:
        super().__init__()
        import syslog

        self._syslog = syslog
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


def _level(name: Optional[str]) -> int:
    return {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
            "error": logging.ERROR}.get((name or "info").lower(), logging.INFO)
