"""`state`: the state file is readable and consistent, the lock works."""

from __future__ import annotations

import errno
import os
import time

from gpulib import mdev
from gpulib.context import LOCK_FILE, STATE_DIR, STATE_FILE
from gpulib.doctor.core import FAIL, OK, WARN, Result, host_path
from gpulib.pci import PCI_DEVICES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.facts import Facts


def _try_lock(d: Facts) -> Optional[Result]:
    import fcntl

    path, shown = d.ctx.lock_path, host_path(LOCK_FILE)
    if not os.path.exists(path):
        directory = os.path.dirname(path)
        if os.path.isdir(directory) and not os.access(directory, os.W_OK):
            return Result("state", WARN, host_path(STATE_DIR),
                          f"the lock {shown} does not exist and {host_path(STATE_DIR)} is "
                          "not writable by this user", "run gpulib doctor as root")
        return None
    try:
        # Non-blocking: a FIFO in place of the lock must not hang the doctor.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        return Result("state", WARN, shown, f"cannot open the lock {shown}: {exc.strerror}",
                      "run gpulib doctor as root")
    try:
        deadline = time.monotonic() + d.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return None
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return Result("state", FAIL, shown,
                                  f"cannot take the lock {shown}: {exc.strerror}",
                                  f"check the file system holding {host_path(STATE_DIR)}")
            if time.monotonic() >= deadline:
                return Result("state", FAIL, shown,
                              f"the state lock {shown} is held by another process for more "
                              f"than {d.lock_timeout:g} s: hooks and gpulib commands "
                              "will time out",
                              f"find the holder with `fuser -v {shown}` (a hung gpulib "
                              "process?) and stop it")
            time.sleep(0.05)
    finally:
        os.close(fd)

def check(d: Facts) -> list[Result]:
    cid, path = "state", host_path(STATE_FILE)
    state = d.state
    problems: list[Result] = []
    if d._state_error:
        status, msg, fix = d._state_error
        problems.append(Result(cid, status, path, msg, fix))
    locked = _try_lock(d)
    if locked:
        problems.append(locked)
    for uuid, rec in sorted(state.vgpus.items()):
        parent = f"{PCI_DEVICES}{rec.parent}"
        if not d.sysfs.exists(parent):
            problems.append(Result(
                cid, FAIL, uuid,
                f"the registry keeps vGPU {uuid} on {rec.parent}, which does not exist: "
                "it cannot be recreated", "gpulib reconcile"))
        elif not d.sysfs.isdir(f"{parent}/{mdev.TYPES_DIR}/{rec.type_id}"):
            problems.append(Result(
                cid, FAIL, uuid,
                f"the registry keeps vGPU {uuid} as {rec.type_id} on {rec.parent}, which "
                "does not offer that type (vGPU driver not loaded? VFs not enabled?)",
                "check the mdev and sriov checks, then gpulib reconcile"))
    for vf, vrec in sorted(state.vf_types.items()):
        if not d.sysfs.exists(f"{PCI_DEVICES}{vf}"):
            problems.append(Result(
                cid, WARN, vf,
                f"the registry gives VF {vf} vGPU type {vrec.type_id}, but the VF does not "
                "exist (VFs not enabled? see the sriov check)",
                "enable the VFs (see the sriov check); if the VF is gone for good: "
                "gpulib reconcile"))
    if problems:
        return problems
    if not os.path.exists(d.ctx.state_path):
        return [Result(cid, OK, path, "no state file yet (nothing recorded); the lock works")]
    return [Result(cid, OK, path,
                   f"readable and consistent: {len(state.vgpus)} registered vGPU(s), "
                   f"{len(state.vf_types)} VF type(s), {len(state.allocations)} "
                   "allocation(s); the lock works")]
