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


# -- libvirt's node device driver over the same fake host -------------------------------

# Run by `unshare --mount` as `sh -c SCRIPT sh <base> <root> <command>...`: a
# private libvirtd (its own /run, /etc/libvirt, /var/lib/libvirt, ... as in
# libvirtd_env.py) that sees the fake `sys/` and `etc/mdevctl.d`, then each
# command (a shell line, virsh against that libvirtd), then libvirtd ends.
# libudev refuses a /sys that is not sysfs unless SYSTEMD_DEVICE_VERIFY_SYSFS=0.
LIBVIRT_SCRIPT = """\
set -u
b=$1; r=$2; shift 2
mount --no-mtab --bind "$b/run" /run
mount --no-mtab --bind "$b/etc" /etc/libvirt
mount --no-mtab --bind "$b/lib" /var/lib/libvirt
mount --no-mtab --bind "$b/cache" /var/cache/libvirt
mount --no-mtab --bind "$b/log" /var/log/libvirt
mount --no-mtab --bind "$r/sys" /sys
mount --no-mtab --bind "$r/etc/mdevctl.d" /etc/mdevctl.d
mkdir -p /run/lock
SYSTEMD_DEVICE_VERIFY_SYSFS=0 libvirtd --timeout 60 >/var/log/libvirt/libvirtd.out 2>&1 &
pid=$!
i=0
until virsh -c qemu:///system nodedev-list --cap pci 2>/dev/null | grep -q pci_; do
    i=$((i + 1)); [ $i -gt 150 ] && break; sleep 0.2
done
for cmd in "$@"; do
    echo "@@@ $cmd"
    sh -c "$cmd" 2>&1
    echo "@@@ rc=$?"
done
kill $pid; wait $pid
"""
LIBVIRT_DIRS = ("/etc/libvirt", "/var/lib/libvirt", "/var/cache/libvirt", "/var/log/libvirt")


def libvirt_skip_reason() -> Optional[str]:
    reason = skip_reason()
    if reason:
        return reason
    missing = [p for p in ("libvirtd", "virsh") if shutil.which(p) is None]
    missing += [d for d in LIBVIRT_DIRS if not os.path.isdir(d)]
    if missing:
        return "missing " + ", ".join(missing) + " (libvirt-daemon-system, libvirt-clients)"
    return None


def add_pci_config(root: str) -> None:
    """A `config` file (the 256-byte header) for every PCI function of the fake
    host: libvirt reads it before it lists a PCI device as a node device."""
    import struct

    devices = os.path.join(root, "sys/bus/pci/devices")
    for name in os.listdir(devices):
        d = os.path.realpath(os.path.join(devices, name))

        def hexfile(attr: str, directory: str = d) -> int:
            with open(os.path.join(directory, attr), encoding="ascii") as fh:
                return int(fh.read().strip(), 16)

        header = bytearray(256)
        struct.pack_into("<HH", header, 0, hexfile("vendor"), hexfile("device"))
        klass = hexfile("class")
        header[9:12] = klass.to_bytes(3, "little")
        header[0x0E] = 1 if klass >> 8 == 0x0604 else 0  # a bridge's header type
        with open(os.path.join(d, "config"), "wb") as fh:
            fh.write(bytes(header))


def virsh_in_namespace(root: str, base: str, *commands: str) -> dict[str, tuple[int, str]]:
    """Run shell lines (virsh against a private libvirtd) over the fake host;
    returns command -> (exit code, output)."""
    for sub in ("etc", "run", "lib", "cache", "log"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    os.chmod(os.path.join(base, "run"), 0o755)
    with open(os.path.join(base, "etc", "libvirtd.conf"), "w", encoding="utf-8") as fh:
        fh.write('log_outputs = "1:file:/var/log/libvirt/libvirtd.log"\n'
                 'log_filters = "1:node_device"\n')
    res = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", LIBVIRT_SCRIPT, "sh",
         base, root, *commands],
        capture_output=True, text=True, check=False, timeout=120,
        env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "HOME": "/root", "LANG": "C.UTF-8", "LIBVIRT_DEFAULT_URI": "qemu:///system"})
    out: dict[str, tuple[int, str]] = {}
    blocks = res.stdout.split("@@@ ")[1:]
    for cmd_block, rc_block in zip(blocks[::2], blocks[1::2]):
        cmd, _, text = cmd_block.partition("\n")
        out[cmd] = (int(rc_block.split("=", 1)[1].split()[0]), text)
    return out
