"""A private, throw-away libvirtd running gpulib's qemu hook, for the real-libvirtd
tests (tests/test_libvirtd.py, tests/test_attach_libvirtd.py).

libvirtd reads its hook directory once, at start, from a fixed path
(`/etc/libvirt/hooks`), and a privileged libvirtd keeps its state in fixed
places (`/run/libvirt`, `/etc/libvirt/qemu`, `/var/lib/libvirt`, ...): a
`--config` with another `unix_sock_dir` would still share all of those with
the system's libvirtd. So the instance runs in its own mount namespace
(`unshare --mount`), where these directories are bind mounts of a temporary
directory:

    <base>/etc    -> /etc/libvirt         (private config, hooks/qemu.d/60-gpulib-test)
    <base>/run    -> /run                 (sockets, pid files, /run/libvirt/qemu)
    <base>/lib    -> /var/lib/libvirt
    <base>/cache  -> /var/cache/libvirt
    <base>/log    -> /var/log/libvirt     (libvirtd.log, qemu/<domain>.log)

Nothing on the host changes: the real `/etc/libvirt/hooks` is neither read
nor written (so a `50-gpulib` another test installs there does not run
here), and the system's libvirtd, if any, is left alone. The host's /run is
hidden too, D-Bus with it: no machined, polkit or firewalld calls. The
namespace goes away with the last process in it. Clients reach the daemon through the
socket's path on the host side: `qemu:///system?socket=<base>/run/libvirt/libvirt-sock`.

virtlogd and libvirtd run in the foreground as children of the test process
(not `-d`: a daemonised process is re-parented to init, which in some CI
containers never reaps it), with PR_SET_PDEATHSIG so they die with pytest
even when it is killed. `stop()` destroys the domains, kills any qemu left
behind (by the pid files libvirt wrote) and ends both daemons by pid.

`Env` is what both test modules start from: a simulated demo host
(`gpulib.sim.hosts.build_demo`) and, in the private `hooks/qemu.d`, a wrapper
(`60-gpulib-test`) that sets GPULIB_ROOT to that host and GPULIB_SIMULATE=1,
runs this checkout's `gpulib-qemu-hook`, and records each call (arguments,
exit code, gpulib's state and the live mdevs right after it) so the tests
see what libvirt did in which order. `serving` and `defining` are the bodies
of the modules' `libvirtd` and `define` fixtures.

Private settings (`qemu.conf`):
* `user`/`group` = root: where /dev/kvm exists but the `libvirt-qemu` user
  cannot open it (/dev/kvm with mode 0600 in some containers), libvirt 9.0 decides on every
  capabilities lookup that "KVM was enabled when probing ... but it is not
  available now" and probes QEMU again (~4 s per binary, on every call, 30 s
  for one `virsh define`). The test domains are `type='qemu'` (TCG) anyway.
* `cgroup_controllers = []`: the host's cgroup tree is shared with the
  system; libvirt would create `machine/` partitions there and leave them.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpulib.sim.hosts import build_demo

QEMU = "/usr/bin/qemu-system-x86_64"
PROGRAMS = ("libvirtd", "virtlogd", "virsh", "unshare", "nsenter", "mount")
# Host directories the private instance lays its own over (they must exist:
# a bind mount needs a mount point, and creating them would change the host).
MOUNTS = (("etc", "/etc/libvirt"), ("run", "/run"), ("lib", "/var/lib/libvirt"),
          ("cache", "/var/cache/libvirt"), ("log", "/var/log/libvirt"))
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

LIBVIRTD_CONF = """\
# Private libvirtd for gpulib's tests (tests/helpers/libvirtd_env.py).
log_filters = "1:util.hook 1:qemu.qemu_process 1:qemu.qemu_hostdev"
log_outputs = "1:file:/var/log/libvirt/libvirtd.log"
"""

QEMU_CONF = """\
# Private qemu driver config for gpulib's tests (see libvirtd_env.py).
user = "root"
group = "root"
cgroup_controllers = [ ]
"""

# Run by `unshare --mount` as `sh -c SCRIPT sh <base> [<hostname>]`; ends as virtlogd.
# With a hostname (and `--uts`) the instance also looks like another host.
NAMESPACE_SCRIPT = """\
set -eu
b=$1
# The UTS namespace's hostname, set through /proc (no hostname(1) needed).
if [ -n "${2-}" ]; then echo "$2" > /proc/sys/kernel/hostname; fi
# /run first and --no-mtab: mount(8) must not create /run/mount on the host.
mount --no-mtab --bind "$b/run" /run
mount --no-mtab --bind "$b/etc" /etc/libvirt
mount --no-mtab --bind "$b/lib" /var/lib/libvirt
mount --no-mtab --bind "$b/cache" /var/cache/libvirt
mount --no-mtab --bind "$b/log" /var/log/libvirt
# A fake mdev bus and VFIO for libvirt only (tests/helpers/mdev_fake.py), when laid out:
# its /sys/bus and /sys/kernel/iommu_groups, and the machine's /dev under an overlay
# that adds /dev/vfio/vfio (the submounts moved back on top of it).
if [ -d "$b/sysbus" ]; then
    mount --no-mtab --bind "$b/sysbus" /sys/bus
    mount --no-mtab --bind "$b/iommu_groups" /sys/kernel/iommu_groups
    mount --no-mtab --rbind /dev/pts "$b/dev/pts"
    mount --no-mtab --rbind /dev/shm "$b/dev/shm"
    mount --no-mtab -t overlay overlay \
        -o "lowerdir=/dev,upperdir=$b/dev/upper,workdir=$b/dev/work" /dev
    mount --no-mtab --move "$b/dev/pts" /dev/pts
    mount --no-mtab --move "$b/dev/shm" /dev/shm
fi
exec virtlogd
"""


def skip_reason() -> Optional[str]:
    """Why a private libvirtd cannot run here, or None."""
    if os.environ.get("GPULIB_SKIP_LIBVIRTD") == "1":
        return "GPULIB_SKIP_LIBVIRTD=1"
    if os.geteuid() != 0:
        return "needs root (starts a privileged libvirtd in a private mount namespace)"
    missing = [p for p in PROGRAMS if shutil.which(p, path=DAEMON_PATH) is None]
    if not os.access(QEMU, os.X_OK):
        missing.append(QEMU)
    if missing:
        return "missing " + ", ".join(missing) + " (libvirt-daemon-system, " \
            "libvirt-clients, qemu-system-x86, util-linux)"
    absent = [target for _, target in MOUNTS if not os.path.isdir(target)]
    if absent:
        return "missing directories " + ", ".join(absent) + " (libvirt-daemon-system)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return "cannot create a private mount namespace: unshare --mount: " + \
            (probe.stderr.strip() or f"exit {probe.returncode}")
    return None


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the test process dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_socket():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _end(proc: Optional[subprocess.Popen[bytes]], timeout: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class PrivateLibvirtd:
    """virtlogd + libvirtd in a private mount namespace rooted at `base`."""

    def __init__(self, base: Path, hostname: Optional[str] = None,
                 host_uuid: Optional[str] = None, qemu_conf: str = "") -> None:
        """`hostname`, `host_uuid`: look like another host (own UTS namespace and
        libvirtd.conf `host_uuid`), as a migration between two instances needs;
        `qemu_conf`: more lines for qemu.conf."""
        self.base = base
        self.hostname = hostname
        self.hooks_dir = base / "etc" / "hooks" / "qemu.d"
        self.socket = base / "run" / "libvirt" / "libvirt-sock"
        self.uri = f"qemu:///system?socket={self.socket}"
        self.log = base / "log" / "libvirtd.log"
        self.virtlogd: Optional[subprocess.Popen[bytes]] = None
        self.libvirtd: Optional[subprocess.Popen[bytes]] = None
        for sub, _ in MOUNTS:
            (base / sub).mkdir(parents=True, exist_ok=True)
        self.hooks_dir.mkdir(parents=True, exist_ok=True)
        (base / "etc" / "qemu").mkdir(exist_ok=True)
        (base / "etc" / "libvirtd.conf").write_text(
            LIBVIRTD_CONF + (f'host_uuid = "{host_uuid}"\n' if host_uuid else ""))
        (base / "etc" / "qemu.conf").write_text(QEMU_CONF + qemu_conf)
        os.chmod(base / "run", 0o755)
        (base / "run" / "lock").mkdir(exist_ok=True)
        os.chmod(base / "run" / "lock", 0o1777)

    def install_hook(self, name: str, text: str) -> Path:
        """Put an executable into the private /etc/libvirt/hooks/qemu.d (before start())."""
        path = self.hooks_dir / name
        path.write_text(text)
        path.chmod(0o755)
        return path

    def _env(self) -> dict[str, str]:
        # What an init system gives a daemon; nothing of the test's environment.
        return {"PATH": DAEMON_PATH, "HOME": "/root", "LANG": "C.UTF-8"}

    def start(self, timeout: float = 30.0) -> None:
        out = open(self.base / "log" / "virtlogd.out", "ab")  # noqa: SIM115
        try:
            uts = ["--uts"] if self.hostname else []
            self.virtlogd = subprocess.Popen(
                ["unshare", "--mount", *uts, "--propagation", "private", "sh", "-c",
                 NAMESPACE_SCRIPT, "sh", str(self.base), self.hostname or ""],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/", env=self._env(),
                preexec_fn=_die_with_parent)
        finally:
            out.close()
        if not _wait_socket(self.base / "run" / "libvirt" / "virtlogd-sock", self.virtlogd,
                            timeout):
            raise RuntimeError("virtlogd did not come up:\n" + self.tail("virtlogd.out"))
        self.start_libvirtd(timeout)

    def start_libvirtd(self, timeout: float = 30.0) -> None:
        assert self.virtlogd is not None and self.virtlogd.poll() is None
        out = open(self.base / "log" / "libvirtd.out", "ab")  # noqa: SIM115
        try:
            self.libvirtd = subprocess.Popen(
                ["nsenter", f"--mount=/proc/{self.virtlogd.pid}/ns/mnt",
                 *([f"--uts=/proc/{self.virtlogd.pid}/ns/uts"] if self.hostname else []),
                 "--", "libvirtd"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/", env=self._env(),
                preexec_fn=_die_with_parent)
        finally:
            out.close()
        deadline = time.monotonic() + timeout
        if _wait_socket(self.socket, self.libvirtd, timeout):
            while time.monotonic() < deadline and self.libvirtd.poll() is None:
                if self.virsh("uri", timeout=max(1.0, deadline - time.monotonic())).returncode \
                        == 0:
                    return
                time.sleep(0.1)
        raise RuntimeError("libvirtd did not come up:\n" + self.tail("libvirtd.out")
                           + self.tail("libvirtd.log"))

    def stop_libvirtd(self) -> None:
        """End libvirtd only (its domains keep running, as on a real host)."""
        _end(self.libvirtd)
        self.libvirtd = None
        try:
            self.socket.unlink()
        except FileNotFoundError:
            pass

    def virsh(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["virsh", "-c", self.uri, *args], capture_output=True, text=True,
                              timeout=timeout, check=False, env=self._env(), cwd="/")

    def domains(self) -> list[str]:
        res = self.virsh("list", "--all", "--name", timeout=30)
        return [n.strip() for n in res.stdout.splitlines() if n.strip()]

    def stop(self) -> None:
        """Destroy and undefine every domain, then end the daemons. Never raises."""
        try:
            if self.libvirtd is not None and self.libvirtd.poll() is None:
                for name in self.domains():
                    self.virsh("destroy", name, timeout=30)
                    self.virsh("undefine", name, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
        self._kill_leftover_qemu()
        _end(self.libvirtd)
        _end(self.virtlogd)
        self.libvirtd = self.virtlogd = None

    def _kill_leftover_qemu(self) -> None:
        """A qemu libvirt started and did not stop: its pid file says which one."""
        piddir = self.base / "run" / "libvirt" / "qemu"
        for pidfile in piddir.glob("*.pid") if piddir.is_dir() else ():
            try:
                pid = int(pidfile.read_text().strip())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if b"qemu-system" in cmdline:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.base / "log" / name
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"--- {path}\n" + "\n".join(text) + "\n"


def shell_quote(value: object) -> str:
    return shlex.quote(str(value))


# -- gpulib's qemu hook in the private libvirtd ------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
# The venv's console script, beside the interpreter running the tests (not resolved:
# sys.executable is usually a symlink into the base Python).
HOOK = Path(sys.executable).parent / "gpulib-qemu-hook"
HOOK_NAME = "60-gpulib-test"
# Every domain the tests define is named so.
PREFIX = "gpulib-test-"

# libvirt runs hooks with an almost empty environment (virCommandAddEnvPassCommon:
# LC_ALL=C, PATH, HOME, USER, LOGNAME, TMPDIR): the wrapper must set everything.
# It keeps `exec`'s contract: stdin goes to the hook, its stdout/stderr and exit
# code come back unchanged; the trace is written after the hook ended.
WRAPPER = """\
#!/bin/sh
# gpulib's qemu hook for gpulib's real-libvirtd tests (a private libvirtd only).
GPULIB_ROOT={root}
GPULIB_SIMULATE=1
PYTHONPATH={repo}
PYTHONDONTWRITEBYTECODE=1
export GPULIB_ROOT GPULIB_SIMULATE PYTHONPATH PYTHONDONTWRITEBYTECODE
{hook} "$@"
rc=$?
trace={trace}
n=$(( $(wc -l < "$trace/calls.log") + 1 ))
cp "$GPULIB_ROOT/var/lib/gpulib/state.json" "$trace/$n.state.json" 2>/dev/null
ls "$GPULIB_ROOT/sys/bus/mdev/devices" > "$trace/$n.mdevs" 2>/dev/null
printf '%s\\t%s\\t%s\\t%s\\t%s\\t%s\\n' "$n" "${{1-}}" "${{2-}}" "${{3-}}" "${{4-}}" "$rc" \\
    >> "$trace/calls.log"
exit $rc
"""


@functools.cache
def hook_skip_reason() -> Optional[str]:
    """Why the real-libvirtd tests cannot run here, or None."""
    reason = skip_reason()
    if reason is None and not os.access(HOOK, os.X_OK):
        reason = f"{HOOK} is not installed (pip install -e . in this venv)"
    return reason


def marks() -> list[pytest.MarkDecorator]:
    """A real-libvirtd test module's `pytestmark`."""
    reason = hook_skip_reason()
    return [pytest.mark.libvirtd,
            pytest.mark.skipif(reason is not None, reason=f"real libvirtd test: {reason}")]


class Env:
    """The fake host, the installed wrapper and its trace."""

    def __init__(self, base: Path, hostname: Optional[str] = None,
                 host_uuid: Optional[str] = None, qemu_conf: str = "") -> None:
        """`hostname`, `host_uuid`: look like another host (own UTS namespace and
        libvirtd.conf `host_uuid`), as a migration between two instances needs;
        `qemu_conf`: more lines for qemu.conf."""
        self.base = base
        self.hostname = hostname
        self.root = base / "root"
        self.trace = base / "trace"
        build_demo(str(self.root))
        self.trace.mkdir()
        (self.trace / "calls.log").write_text("")
        self.daemon = PrivateLibvirtd(base / "libvirt")
        self.wrapper = self.daemon.install_hook(HOOK_NAME, WRAPPER.format(
            root=shell_quote(self.root), repo=shell_quote(REPO), hook=shell_quote(HOOK),
            trace=shell_quote(self.trace)))

    def share_status_files(self) -> None:
        """Make the fake host's `run/libvirt/qemu` the private libvirtd's own, so
        gpulib reads the status files libvirt really writes (which VM runs)."""
        fake = self.root / "run" / "libvirt" / "qemu"
        shutil.rmtree(fake, ignore_errors=True)
        fake.parent.mkdir(parents=True, exist_ok=True)
        real = self.daemon.base / "run" / "libvirt" / "qemu"
        real.mkdir(parents=True, exist_ok=True)
        fake.symlink_to(real)

    # -- the fake host -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(
            (self.root / "var/lib/gpulib/state.json").read_text())
        return data

    def live_mdevs(self) -> list[str]:
        return sorted(os.listdir(self.root / "sys/bus/mdev/devices"))

    # -- what the wrapper recorded -------------------------------------------------------------
    def calls(self, vm: str) -> list[dict[str, Any]]:
        out = []
        for line in (self.trace / "calls.log").read_text().splitlines():
            n, name, op, sub, extra, rc = line.split("\t")
            if name == vm:
                out.append({"n": n, "op": f"{op} {sub}", "extra": extra, "rc": int(rc)})
        return out

    def state_after(self, call: dict[str, Any]) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.trace / f"{call['n']}.state.json").read_text())
        return data

    def mdevs_after(self, call: dict[str, Any]) -> list[str]:
        return sorted((self.trace / f"{call['n']}.mdevs").read_text().split())

    def libvirt_events(self, vm: str) -> list[str]:
        """What libvirtd logged (libvirtd.conf: util.hook, qemu_process at debug) from the
        VM's `prepare begin` to its `release end`: hook calls and host-device preparation."""
        lines = self.daemon.log.read_text(errors="replace").splitlines()
        hook = re.compile(r"Calling hook (\S+) id=(\S+) op=(\S+) subop=(\S+)")
        events: list[str] = []
        for line in lines:
            m = hook.search(line)
            if m and m.group(2) == vm:
                assert m.group(1) == f"/etc/libvirt/hooks/qemu.d/{HOOK_NAME}", line
                events.append(f"hook {m.group(3)} {m.group(4)}")
            elif events and events[-1] != "hook release end":
                if "Preparing host devices" in line:
                    events.append("prepare host devices")
                elif " error : " in line and events[-1] == "prepare host devices":
                    events.append("host device error")  # no VFIO, or no such mdev
        return events

    def gpulib_log(self) -> str:
        path = self.root / "var/log/gpulib/gpulib.log"
        return path.read_text(errors="replace") if path.exists() else "(no gpulib log)"

    def explain(self, res: subprocess.CompletedProcess[str]) -> str:
        """Everything needed to understand a failed assertion."""
        return (f"virsh rc={res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}\n"
                f"--- hook calls\n{(self.trace / 'calls.log').read_text()}"
                f"--- gpulib log (tail)\n{self.gpulib_log()[-3000:]}\n"
                + self.daemon.tail("libvirtd.log", 30))


def domain_xml(name: str, mdev: Optional[str] = None, pci: Optional[str] = None) -> str:
    """A TCG domain, with an mdev and/or a PCI hostdev."""
    hostdev = ""
    if mdev is not None:
        hostdev = f"""
    <hostdev mode='subsystem' type='mdev' model='vfio-pci'>
      <source><address uuid='{mdev}'/></source>
    </hostdev>"""
    if pci is not None:
        # As the CloudStack agent's LibvirtGpuDef renders a passthrough GPU.
        d, b, sf = pci.split(":")
        s, f = sf.split(".")
        hostdev += f"""
<hostdev mode='subsystem' type='pci' managed='yes' display='off'>
  <driver name='vfio'/>
  <source>
    <address domain='0x{d}' bus='0x{b}' slot='0x{s}' function='0x{f}'/>
  </source>
</hostdev>"""
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <devices>
    <emulator>{QEMU}</emulator>{hostdev}
  </devices>
</domain>
"""


def serving(env: Env) -> Iterator[PrivateLibvirtd]:
    """virtlogd + libvirtd, started after the wrapper is in place (hooks are read at
    start); stopped after (domains destroyed and undefined, daemons ended by pid)."""
    daemon = env.daemon
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()


def defining(env: Env, daemon: PrivateLibvirtd) -> Iterator[Callable[..., str]]:
    """define(suffix, mdev=None, pci=None, text=None) -> the domain's name (PREFIX +
    suffix; `text` instead of `domain_xml`); destroyed and undefined afterwards."""
    names: list[str] = []

    def _define(suffix: str, mdev: Optional[str] = None, pci: Optional[str] = None,
                text: Optional[str] = None) -> str:
        name = PREFIX + suffix
        xml = env.base / f"{name}.xml"
        xml.write_text(text if text is not None else domain_xml(name, mdev, pci))
        res = daemon.virsh("define", str(xml))
        assert res.returncode == 0, env.explain(res)
        names.append(name)
        return name

    yield _define
    for name in names:
        daemon.virsh("destroy", name)
        daemon.virsh("undefine", name)
