"""A private, throw-away libvirtd for tests/test_libvirtd.py.

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
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

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

# Run by `unshare --mount` as `sh -c SCRIPT sh <base>`; ends as virtlogd.
NAMESPACE_SCRIPT = """\
set -eu
b=$1
# /run first and --no-mtab: mount(8) must not create /run/mount on the host.
mount --no-mtab --bind "$b/run" /run
mount --no-mtab --bind "$b/etc" /etc/libvirt
mount --no-mtab --bind "$b/lib" /var/lib/libvirt
mount --no-mtab --bind "$b/cache" /var/cache/libvirt
mount --no-mtab --bind "$b/log" /var/log/libvirt
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

    def __init__(self, base: Path) -> None:
        self.base = base
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
        (base / "etc" / "libvirtd.conf").write_text(LIBVIRTD_CONF)
        (base / "etc" / "qemu.conf").write_text(QEMU_CONF)
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
            self.virtlogd = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 NAMESPACE_SCRIPT, "sh", str(self.base)],
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
                ["nsenter", f"--mount=/proc/{self.virtlogd.pid}/ns/mnt", "--", "libvirtd"],
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
