"""`logging`: no hook or command lost log records since boot.

The hooks drop a record they cannot write (their stderr belongs to the
agent's XML) and note it in `run/gpulib/log-failures`; this check reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpulib.context import LOG_DIR
from gpulib.doctor.core import OK, WARN, Result, host_path

if TYPE_CHECKING:
    from gpulib.doctor.facts import Doctor


def check(d: Doctor) -> list[Result]:
    from gpulib.logs import LOG_FAILURES_FILE, read_failures

    shown = host_path(LOG_FAILURES_FILE)
    notes = read_failures(d.ctx)
    if not notes:
        return [Result("logging", OK, "log", "no log record lost since boot")]
    return [Result("logging", WARN, shown,
                   f"{len(notes)} gpulib run(s) since boot could not write their log; the "
                   f"last: {notes[-1]}",
                   f"free space under {host_path(LOG_DIR)} or repair syslog (/dev/log), then "
                   f"rm {shown}")]
