"""`logging`: no hook or command lost log records since boot.

The hooks drop a record they cannot write (their stderr belongs to the
agent's XML) and note it in `run/gpulib/log-failures`; this check reads it.
"""

from __future__ import annotations

from gpulib.context import LOG_DIR, LOG_FAILURES_FILE
from gpulib.doctor.core import OK, WARN, Result, host_path
from gpulib.sysfs import ReadFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.context import Context
    from gpulib.doctor.facts import Facts


def check(d: Facts) -> list[Result]:
    shown = host_path(LOG_FAILURES_FILE)
    notes = read_failures(d.ctx)
    if not notes:
        return [Result("logging", OK, "log", "no log record lost since boot")]
    return [Result("logging", WARN, shown,
                   f"{len(notes)} gpulib run(s) since boot could not write their log; the "
                   f"last: {notes[-1]}",
                   f"free space under {host_path(LOG_DIR)} or repair syslog (/dev/log), then "
                   f"rm {shown}")]


def read_failures(ctx: Context) -> list[str]:
    """The lines of the failure note (one per process that lost a record)."""
    text = ctx.sysfs.read_result(LOG_FAILURES_FILE)
    if isinstance(text, ReadFailure):
        return []
    return [line for line in text.decode("utf-8", "replace").splitlines() if line.strip()]
