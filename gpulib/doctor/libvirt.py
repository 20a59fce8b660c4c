"""`libvirt`: libvirtd was (re)started after the qemu hook appeared."""

from __future__ import annotations

import os
import time

from gpulib.doctor.actions import RestartService
from gpulib.doctor.core import (
    FAIL,
    LIBVIRT_DAEMONS,
    LIBVIRT_HOOK,
    OK,
    PROC_STAT,
    WARN,
    Result,
    host_path,
)
from gpulib.validate import decimal

# libvirtd's start time is known to a clock tick, the boot time to a second.
_START_SLACK = 1.0

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.facts import Facts


def _daemon_start(d: Facts) -> tuple[str, Optional[float], str]:
    """(daemon, start time or None, why unknown)."""
    for daemon, pidfile in LIBVIRT_DAEMONS:
        text = d.sysfs.read(pidfile)
        if text is None:
            continue
        if decimal(text, 10) is None:
            return daemon, None, f"{host_path(pidfile)} holds no pid"
        stat_text = d.sysfs.read(f"proc/{text}/stat")
        if stat_text is None:
            return daemon, None, (f"{daemon} is not running (no process {text} from "
                                  f"{host_path(pidfile)})")
        close = stat_text.rfind(")")
        comm = stat_text[stat_text.find("(") + 1:close]
        fields = stat_text[close + 2:].split()
        if daemon not in comm and comm not in ("libvirtd", "virtqemud"):
            return daemon, None, (f"process {text} from {host_path(pidfile)} is {comm}, "
                                  f"not {daemon}")
        started = decimal(fields[19], 20) if len(fields) >= 20 else None
        if started is None:
            return daemon, None, f"cannot read the start time of {daemon} (pid {text})"
        btime = None
        for line in (d.sysfs.read(PROC_STAT) or "").splitlines():
            if line.startswith("btime "):
                value = line.split()[1]
                btime = decimal(value, 20)
        if btime is None:
            return daemon, None, "cannot read the boot time (btime in /proc/stat)"
        ticks = d.clock_ticks or os.sysconf("SC_CLK_TCK")
        return daemon, btime + started / ticks, ""
    return "libvirtd", None, "cannot tell when libvirtd started (no /run/libvirtd.pid)"

def check(d: Facts) -> list[Result]:
    cid = "libvirt"
    hook = host_path(LIBVIRT_HOOK)
    st = d.stat_in_root(LIBVIRT_HOOK, follow=False)
    if st is None:
        return [Result(cid, WARN, hook,
                       "gpulib's qemu hook is not installed (see the hooks check): "
                       "libvirtd has nothing to load",
                       "install the hook (see the hooks check), then: "
                       "systemctl restart libvirtd")]
    daemon, started, why = _daemon_start(d)
    if started is None:
        return [d.result(cid, WARN, hook,
                         f"{why}: libvirtd reads its hooks only when it starts, so it may "
                         "not run gpulib's hook", [RestartService("libvirtd")])]
    # When the link appeared on this host: its ctime (set when it is made,
    # renamed into place or changed). Never the mtime: dpkg and rpm give it
    # the package's build time, long before libvirtd's start. A snapshot's
    # replay has the host's (unpacked, the file's ctime is that moment).
    appeared = d.snapshot_ctime(LIBVIRT_HOOK) or st.st_ctime
    if appeared > started + _START_SLACK:
        return [d.result(cid, FAIL, hook,
                         f"{daemon} started at {_when(started)}, before the qemu hook "
                         f"appeared ({_when(appeared)}): it reads its hooks only when it "
                         "starts, so it does not run gpulib's hook",
                         [RestartService(daemon, "(running VMs keep running)")])]
    return [Result(cid, OK, hook,
                   f"{daemon} started at {_when(started)}, after the qemu hook appeared "
                   f"({_when(appeared)})")]


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
