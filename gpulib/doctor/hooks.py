"""`hooks`: gpulib's hooks are installed and executable (libvirt's qemu.d, the
CloudStack agent's hook directory)."""

from __future__ import annotations

import os
import posixpath
import stat

from gpulib import cloudstack
from gpulib.context import CLOUDSTACK_AGENT_DIR
from gpulib.doctor.core import (
    AGENT_HOOK_EXECUTABLES,
    FAIL,
    LIBVIRT_HOOK,
    OK,
    QEMU_HOOK_EXECUTABLE,
    WARN,
    Result,
    agent_hooks_dir,
    host_path,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.facts import Facts


def _hook_problem(d: Facts, rel: str, executable: str, restart: str = "") -> Optional[Result]:
    path = host_path(rel)
    st = d.stat_in_root(rel)
    if st is None:
        if os.path.lexists(d.ctx.path(rel)):
            msg = f"{path} is a broken link"
        else:
            msg = f"{path} is missing"
        directory = posixpath.dirname(path)
        fix = (f"mkdir -p {directory} && ln -sf \"$(command -v {executable})\" {path}"
               + (f" && {restart}" if restart else ""))
        return Result("hooks", FAIL, path, msg, fix)
    if not stat.S_ISREG(st.st_mode):
        return Result("hooks", FAIL, path, f"{path} is not a regular file",
                      f"mv {path} {path}.bak && ln -s \"$(command -v {executable})\" {path}")
    if not st.st_mode & 0o111:
        return Result("hooks", FAIL, path, f"{path} is not executable", f"chmod 0755 {path}")
    return None

def check(d: Facts) -> list[Result]:
    cid = "hooks"
    problems: list[Result] = []
    ok: list[str] = []
    found = _hook_problem(d, LIBVIRT_HOOK, QEMU_HOOK_EXECUTABLE,
                               "systemctl restart libvirtd")
    if found:
        found.message += " (libvirt's qemu hook)"
        if d.sysfs.isdir(CLOUDSTACK_AGENT_DIR):
            # The agent starts a VM with its own XML when the transformer
            # refuses: only `prepare begin` can stop a start that would take
            # a device another VM holds.
            found.message += ("; the CloudStack agent is installed and ignores a "
                              "refusing transformer, so without this hook nothing "
                              "stops a VM from taking a GPU another VM holds")
        problems.append(found)
    else:
        ok.append(host_path(LIBVIRT_HOOK))
    if not d.sysfs.isdir(CLOUDSTACK_AGENT_DIR):
        problems.append(Result(
            cid, WARN, host_path(CLOUDSTACK_AGENT_DIR),
            "the CloudStack agent is not installed: its hooks were not checked",
            "on a CloudStack KVM host: install cloudstack-agent, then: " +
            _link_hooks_command(host_path(cloudstack.AGENT_HOOKS_DIR))))
    else:
        base = agent_hooks_dir(d.ctx)
        for name, executable in AGENT_HOOK_EXECUTABLES.items():
            found = _hook_problem(d, f"{base}/{name}", executable)
            if found:
                found.message += " (the CloudStack agent's hook)"
                problems.append(found)
            else:
                ok.append(host_path(f"{base}/{name}"))
    if problems:
        return problems
    return [Result(cid, OK, "hooks", f"installed and executable: {', '.join(ok)}")]


def _link_hooks_command(directory: str) -> str:
    links = " && ".join(f'ln -sf "$(command -v {exe})" {directory}/{name}'
                        for name, exe in AGENT_HOOK_EXECUTABLES.items())
    return f"mkdir -p {directory} && {links}"
