"""The real mdevctl over a fake host, for tests/test_mdevctl_real.py.

mdevctl reads and writes fixed paths (`/sys/class/mdev_bus`,
`/sys/bus/mdev/devices`, `/etc/mdevctl.d`), so each run happens in its own
mount namespace (`unshare --mount`, private propagation) where the fake
host's `sys/` and `etc/mdevctl.d` are bind-mounted over the real ones. The
namespace ends with the mdevctl process: nothing on the machine changes.

The fake `sys/` is plain files, so what mdevctl writes to a type's `create`
file or a device's `remove` file is carried out afterwards by the simulated
kernel (`SimulatedKernel.settle`), as the kernel would have done at once.
mdevctl writes a device's attrs right after `create`, before the simulated
kernel can make the device: definitions with attrs are therefore started by
gpulib in these tests, never by mdevctl.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Optional

from gpulib.sim.kernel import SimulatedKernel

MDEVCTL = "/usr/bin/mdevctl"
REAL_DIR = "/etc/mdevctl.d"

NAMESPACE_SCRIPT = """\
set -eu
r=$1
shift
mount --no-mtab --bind "$r/sys" /sys
mount --no-mtab --bind "$r/etc/mdevctl.d" /etc/mdevctl.d
exec "$@"
"""

_reason: Optional[str] = None
_checked = False


def skip_reason() -> Optional[str]:
    """Why the real-mdevctl tests cannot run here, or None."""
    global _reason, _checked
    if _checked:
        return _reason
    _checked = True
    if os.environ.get("GPULIB_SKIP_MDEVCTL") == "1":
        _reason = "GPULIB_SKIP_MDEVCTL=1"
    elif not os.access(MDEVCTL, os.X_OK):
        _reason = f"mdevctl is not installed ({MDEVCTL}; Debian package mdevctl)"
    elif shutil.which("unshare") is None:
        _reason = "unshare (util-linux) is not installed"
    elif os.geteuid() != 0:
        _reason = "a mount namespace needs root"
    elif not os.path.isdir(REAL_DIR):
        # The bind mount needs a mount point; creating one would change the host.
        _reason = f"{REAL_DIR} does not exist (the mdevctl package ships it)"
    else:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                               capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            _reason = f"unshare --mount fails here: {probe.stderr.strip()}"
    return _reason


class Mdevctl:
    """mdevctl run against one fake host."""

    def __init__(self, root: str) -> None:
        self.root = root

    def prepare(self) -> None:
        # mdevctl refuses to run without its callout and notifier directories.
        for sub in ("callouts", "notifiers"):
            os.makedirs(os.path.join(self.root, "etc/mdevctl.d/scripts.d", sub), exist_ok=True)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.prepare()
        res = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", NAMESPACE_SCRIPT,
             "sh", self.root, MDEVCTL, *args],
            capture_output=True, text=True, check=False, timeout=60)
        errors = SimulatedKernel(self.root).settle()
        if check and (res.returncode != 0 or errors):
            raise AssertionError(f"mdevctl {' '.join(args)}: exit {res.returncode}: "
                                 f"{res.stderr.strip()} {errors}")
        return res

    def defined(self) -> dict[str, dict[str, Any]]:
        """`mdevctl list -d --dumpjson` as uuid -> {parent, type_id, start, attrs}."""
        out = self.run("list", "-d", "--dumpjson").stdout.strip()
        found: dict[str, dict[str, Any]] = {}
        for entry in json.loads(out) if out else []:
            for parent, devices in entry.items():
                for device in devices:
                    for uuid, d in device.items():
                        found[uuid] = {"parent": parent, "type_id": d["mdev_type"],
                                       "start": d["start"], "attrs": d.get("attrs", [])}
        return found

    def active(self) -> dict[str, tuple[str, str]]:
        """`mdevctl list --dumpjson` (live devices) as uuid -> (parent, type)."""
        out = self.run("list", "--dumpjson").stdout.strip()
        found: dict[str, tuple[str, str]] = {}
        for entry in json.loads(out) if out else []:
            for parent, devices in entry.items():
                for device in devices:
                    for uuid, d in device.items():
                        found[uuid] = (parent, d["mdev_type"])
        return found
