"""The edges: what gpulib prints can never corrupt the agent's XML, a failing
hook never kills a running VM, hooks never wait past the agent's patience.

The hook tests run the installed executables as their callers do: the agent
passes the XML as argv, merges stderr into stdout, gives 30 s and reads the
output after the process exited.
"""

from __future__ import annotations

import gc
import io
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lxml import etree

from gpulib import cli
from gpulib import doctor as dr
from gpulib import snapshot as snap
from gpulib.context import LOG_FAILURES_FILE, Context
from gpulib.errors import InputError
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_POOL_MDEVS, DEMO_T4
from gpulib.state import HOOK_LOCK_TIMEOUT_CAP, StateStore
from tests.conftest import DATA, SharedHost, shared
from tests.hookrun import BIN, QEMU_HOOK, TRANSFORMER, as_agent, as_the_agent_runs, hook_env
from tests.hosts import tree_contents

VGPU_XML = DATA / "cloudstack-xml" / "vgpu-mdev.xml"


@pytest.fixture
def demo(shared_demo: SharedHost, request: pytest.FixtureRequest) -> Iterator[str]:
    for host in shared(shared_demo, request):
        yield host.root


def write_config(root: str, text: str) -> None:
    path = Path(root, "etc/gpulib/gpulib.conf")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


# -- 3. a full log disk ------------------------------------------------------------------

def test_a_full_log_disk_never_reaches_the_agents_xml(demo: str) -> None:
    """Reproduction: `syslog = no` (or no /dev/log) and a full disk under
    /var/log/gpulib; the agent runs `libvirt-vm-xml-transformer.sh transform
    '<domain>...'` on a vGPU domain. Python printed `--- Logging error ---`
    and a traceback to stderr, which the agent merged into the domain XML it
    then used (exit 0). Here the log file is /dev/full (every write: ENOSPC)."""
    write_config(demo, "[log]\nsyslog = no\nlevel = debug\n")
    log_dir = Path(demo, "var/log/gpulib")
    log_dir.mkdir(parents=True, exist_ok=True)
    os.symlink("/dev/full", log_dir / "gpulib.log")
    xml = VGPU_XML.read_text(encoding="utf-8")
    res = as_agent(demo, xml)
    out = res.stdout.decode()
    assert res.returncode == 0, out
    assert "Logging error" not in out and "Traceback" not in out, out
    root = etree.fromstring(res.stdout)  # the whole output is the domain, nothing else
    assert root.tag == "domain" and root.findall("devices/hostdev")
    # The loss is noted where doctor finds it, once for the run.
    notes = Path(demo, LOG_FAILURES_FILE).read_text(encoding="utf-8").splitlines()
    assert len(notes) == 1 and "libvirt-vm-xml-transformer" in notes[0], notes
    assert "No space left on device" in notes[0] or "OSError" in notes[0], notes
    report = dr.run(Context.for_root(demo), only=["logging"])
    (result,) = report.results_for("logging")
    assert result.status == dr.WARN and "1 " in result.message and result.fix


def test_doctor_logging_check_is_ok_without_failures(demo: str) -> None:
    report = dr.run(Context.for_root(demo), only=["logging"])
    (result,) = report.results_for("logging")
    assert result.status == dr.OK


# -- 4. reconnect with stderr closed --------------------------------------------------

@pytest.mark.parametrize("stdin", [b"\x00garbage<", b"<domain><name>vm-r</name></domain>"])
def test_reconnect_exits_0_with_stderr_closed(demo: str, stdin: bytes) -> None:
    """Reproduction: libvirtd restarts and runs `50-gpulib vm-r reconnect begin -`
    with fd 2 closed (sys.stderr is None) and an XML gpulib cannot use: the
    one-line error raised AttributeError and the hook exited 1, and libvirt
    kills a running VM whose reconnect hook fails. It must exit 0."""
    res = subprocess.run(["sh", "-c", 'exec "$@" 2>&-', "sh", QEMU_HOOK, "vm-r", "reconnect",
                          "begin", "-"], input=stdin, stdout=subprocess.PIPE,
                         env=hook_env(demo), timeout=30)
    assert res.returncode == 0
    assert res.stdout == b""
    # With stdin closed as well.
    res = subprocess.run(["sh", "-c", 'exec "$@" 2>&- <&-', "sh", QEMU_HOOK, "vm-r",
                          "reconnect", "begin", "-"], stdout=subprocess.PIPE,
                         env=hook_env(demo), timeout=30)
    assert res.returncode == 0


# -- 6. the hooks' lock wait is capped -----------------------------------------------

def test_hook_context_caps_the_lock_wait(demo: str) -> None:
    ctx = Context.for_root(demo)
    assert StateStore.for_context(ctx, timeout=3600.0).timeout == 3600.0  # the CLI
    ctx.lock_wait_cap = HOOK_LOCK_TIMEOUT_CAP
    assert StateStore.for_context(ctx, timeout=3600.0).timeout == HOOK_LOCK_TIMEOUT_CAP
    assert StateStore.for_context(ctx, timeout=2.0).timeout == 2.0
    assert StateStore.for_context(ctx).timeout <= HOOK_LOCK_TIMEOUT_CAP
    assert HOOK_LOCK_TIMEOUT_CAP + 5 < 30  # time left to answer inside the agent's 30 s


@pytest.mark.slow
def test_a_huge_lock_timeout_never_makes_a_hook_wait_past_the_agent(demo: str) -> None:
    """Reproduction: `[state] lock_timeout = 3600` in gpulib.conf and the state
    lock held by another process; the agent runs the transformer on a vGPU
    domain with its 30 s timeout: the hook waited 3600 s and the agent killed
    it. It must give up at HOOK_LOCK_TIMEOUT_CAP with exit 3 and one line."""
    import filelock

    write_config(demo, "[state]\nlock_timeout = 3600\n")
    ctx = Context.for_root(demo)
    os.makedirs(os.path.dirname(ctx.lock_path), exist_ok=True)
    lock = filelock.FileLock(ctx.lock_path)
    lock.acquire()
    try:
        began = time.monotonic()
        res = as_agent(demo, VGPU_XML.read_text(encoding="utf-8"), timeout=30)
        took = time.monotonic() - began
    finally:
        lock.release()
    out = res.stdout.decode()
    assert res.returncode == 3, out
    assert took < 27, took
    assert len(out.splitlines()) == 1 and "lock" in out, out
    # doctor says the configured value is above what the hooks use.
    (result,) = dr.run(ctx, only=["config"]).results_for("config")
    assert result.status == dr.WARN and "lock_timeout" in result.message, result.to_json()
    assert f"{HOOK_LOCK_TIMEOUT_CAP:g}" in (result.fix or "")


def test_doctor_accepts_a_lock_timeout_within_the_cap(demo: str) -> None:
    write_config(demo, f"[state]\nlock_timeout = {HOOK_LOCK_TIMEOUT_CAP:g}\n")
    (result,) = dr.run(Context.for_root(demo), only=["config"]).results_for("config")
    assert result.status == dr.OK, result.to_json()


# -- 8. status on a corrupt state file ---------------------------------------------------

def gpulib_cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = hook_env(root, simulate=False)
    return subprocess.run([str(BIN / "gpulib"), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_status_says_the_state_was_corrupt_and_what_was_rebuilt(demo: str) -> None:
    """Reproduction: `echo garbage > /var/lib/gpulib/state.json; gpulib status`
    showed an empty state (no allocations, no vGPUs) without a word. It must
    say the file was corrupt, where the old one went and what was rebuilt."""
    host = FakeHost(demo)
    host.add_mdev(DEMO_POOL_MDEVS[1], DEMO_T4, "nvidia-232")
    host.add_running_domain("vm-r", "2f0c8e0a-6a55-4b1e-9d35-7a3c1f0e9b21",
                            mdevs=(DEMO_POOL_MDEVS[1],))
    state = Path(demo, "var/lib/gpulib/state.json")
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_bytes(b"{garbage")
    res = gpulib_cli(demo, "status", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == 1  # a consumer can tell the document's version
    repair = doc["state_repair"]
    assert repair["corrupt"].startswith("not JSON")
    aside = Path(repair["moved_to"])
    assert aside.parent == state.parent and aside.read_bytes() == b"{garbage"
    assert "vm-r" in repair["rebuilt"]["allocations"]
    assert DEMO_POOL_MDEVS[1] in repair["rebuilt"]["vgpus"]
    assert "vm-r" in doc["allocations"]
    (line,) = res.stderr.splitlines()
    assert "was corrupt" in line and str(aside) in line and "vm-r" in line, line
    # The file is whole again: the next status says nothing.
    assert json.loads(state.read_text())["allocations"]["vm-r"]["status"] == "active"
    again = gpulib_cli(demo, "status")
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert "vm-r" in again.stdout


# -- 9. vf set-type by name ------------------------------------------------------------------

A10_VF = "0000:41:00.5"


def _simulated_cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "gpulib"), *args], capture_output=True, text=True,
                          env=hook_env(root), timeout=60)


def test_vf_set_type_takes_the_name_creatable_vgpu_types_lists(demo: str) -> None:
    """Reproduction: `gpulib vf set-type 0000:41:00.5 "NVIDIA A10-6Q"` failed with
    "not an NVIDIA vGPU type id" although pools accept names. The name as
    creatable_vgpu_types lists it, any case, gives type 594."""
    current = Path(demo, f"sys/bus/pci/devices/{A10_VF}/nvidia/current_vgpu_type")
    res = _simulated_cli(demo, "vf", "set-type", A10_VF, "nvidia a10-6Q")
    assert res.returncode == 0, res.stderr
    assert current.read_text().strip() == "594"
    assert "594" in res.stdout and "NVIDIA A10-6Q" in res.stdout
    state = json.loads(Path(demo, "var/lib/gpulib/state.json").read_text())
    assert state["vf_types"][A10_VF]["type_id"] == 594
    # Numeric ids keep working.
    other = "0000:41:00.6"
    assert _simulated_cli(demo, "vf", "set-type", other, "nvidia-594").returncode == 0
    assert Path(demo, f"sys/bus/pci/devices/{other}/nvidia/current_vgpu_type") \
        .read_text().strip() == "594"


# Digits str.isdigit() knows but a type id is not written in: "\u00b2" (int()
# refuses it: this was a traceback), Arabic-Indic 594 (int() reads it: this
# was type 594).
@pytest.mark.parametrize("name", ["NVIDIA A10-6", "A10-6Q", "NVIDIA A10-6Q ", "../594",
                                  "\u00b2", "nvidia-\u0665\u0669\u0664"])
def test_vf_set_type_refuses_unknown_names_with_the_list(demo: str, name: str) -> None:
    current = Path(demo, f"sys/bus/pci/devices/{A10_VF}/nvidia/current_vgpu_type")
    before = current.read_text()
    res = _simulated_cli(demo, "vf", "set-type", A10_VF, name)
    if name == "NVIDIA A10-6Q ":  # surrounding blanks are not part of a name
        assert res.returncode == 0, res.stderr
        return
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.splitlines()
    assert "no creatable vGPU type named" in line and "594 (NVIDIA A10-6Q)" in line, line
    assert current.read_text() == before
    assert not Path(demo, "var/lib/gpulib/state.json").exists() or \
        A10_VF not in json.loads(Path(demo, "var/lib/gpulib/state.json").read_text())["vf_types"]


def test_vf_set_type_refuses_an_ambiguous_name(demo: str) -> None:
    creatable = Path(demo, f"sys/bus/pci/devices/{A10_VF}/nvidia/creatable_vgpu_types")
    creatable.write_text("ID    : vGPU Name\n594   : NVIDIA A10-6Q\n606   : nvidia a10-6q\n")
    res = _simulated_cli(demo, "vf", "set-type", A10_VF, "NVIDIA A10-6Q")
    assert res.returncode == 2
    assert "ambiguous" in res.stderr and "594, 606" in res.stderr, res.stderr
    assert Path(demo, f"sys/bus/pci/devices/{A10_VF}/nvidia/current_vgpu_type") \
        .read_text().strip() == "0"


# -- 2. snapshot -o PATH -----------------------------------------------------------------------

def _snapshot(root: str, output: str) -> tuple[str, snap.Summary]:
    return snap.create(Context.for_root(root), output)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a character device needs root")
def test_snapshot_into_a_character_device_writes_through_it(demo: str, tmp_path: Path) -> None:
    """Reproduction: `gpulib snapshot -o /dev/null` as root wrote
    /dev/null.<pid>.tmp and renamed it over /dev/null, which became a regular
    file. Here a private copy of /dev/null (same device numbers): it stays the
    character device, and a link to it is written through as well."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.symlink(null, tmp_path / "stdout-like")
    for target in (null, tmp_path / "stdout-like"):
        _, summary = _snapshot(demo, str(target))
        assert summary.files > 0
        assert stat.S_ISCHR(os.stat(null).st_mode)
        assert os.stat(null).st_rdev == os.makedev(1, 3)
    assert os.path.islink(tmp_path / "stdout-like")
    assert sorted(os.listdir(tmp_path)) == ["null", "stdout-like"]


def test_snapshot_into_a_fifo_streams_the_tarball(demo: str, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    # A daemon: if the FIFO were replaced, the reader would wait for ever.
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    _snapshot(demo, str(fifo))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    reader.join(30)
    assert got, "nothing was written into the FIFO"
    with tarfile.open(fileobj=io.BytesIO(got[0]), mode="r:gz") as tf:
        assert "proc/cmdline" in tf.getnames()


def test_snapshot_refuses_a_link_to_a_file_and_other_special_files(demo: str,
                                                                   tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    link = tmp_path / "out.tar.gz"
    os.symlink(victim, link)
    sock = socket.socket(socket.AF_UNIX)
    sock_path = tmp_path / "sock"
    sock.bind(str(sock_path))
    try:
        for target in (link, sock_path):
            with pytest.raises(InputError, match="refusing to write the snapshot"):
                _snapshot(demo, str(target))
        res = gpulib_cli(demo, "snapshot", "-o", str(link))
        assert res.returncode == 2 and "is a symbolic link" in res.stderr, res.stderr
    finally:
        sock.close()
    assert victim.read_text() == "keep me\n" and os.path.islink(link)
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["out.tar.gz", "sock", "victim"]


def test_snapshot_temp_file_never_follows_a_planted_link(demo: str, tmp_path: Path) -> None:
    """The old temp name `<path>.<pid>.tmp` was predictable and opened without
    O_EXCL: a link planted there made the snapshot overwrite its target."""
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    out = tmp_path / "snap.tar.gz"
    out.write_text("old\n")
    os.symlink(victim, f"{out}.{os.getpid()}.tmp")
    path, _ = _snapshot(demo, str(out))
    assert path == str(out) and tarfile.is_tarfile(out) and not os.path.islink(out)
    assert victim.read_text() == "keep me\n"
    assert sorted(os.listdir(tmp_path)) == ["snap.tar.gz", f"snap.tar.gz.{os.getpid()}.tmp",
                                            "victim"]


# -- 10. outputs larger than the pipe buffer -------------------------------------------------

def _large(xml: str, size: int) -> str:
    """`xml` with serial consoles added until it is `size` bytes (a domain with
    many disks or NICs is as large)."""
    one = ("<serial type='pty'><target type='isa-serial' port='0'><model name='isa-serial'/>"
           "</target></serial>\n    ")
    n = (size - len(xml)) // len(one) + 1
    return xml.replace("</devices>", one * n + "</devices>", 1)


@pytest.mark.parametrize("fixture", ["no-gpu.xml", "vgpu-mdev.xml"])
def test_an_output_larger_than_the_pipe_never_delays_the_exit(demo: str, fixture: str) -> None:
    """Reproduction: a domain of 100 KiB (many devices) passed as argv to the
    transformer by the agent, which reads the output only after the exit: the
    hook blocked writing its 100 KiB into the 64 KiB pipe until the agent's
    30 s timeout killed it, and the agent started the VM with its own XML."""
    xml = _large((DATA / "cloudstack-xml" / fixture).read_text(encoding="utf-8"), 100 * 1024)
    assert 64 * 1024 < len(xml.encode()) < 128 * 1024  # above the pipe, below argv's limit
    code, took, out = as_the_agent_runs([TRANSFORMER, "transform", xml], demo)
    assert code == 0, out[-300:]
    assert took < 10, took
    if fixture == "no-gpu.xml":
        assert out == xml.encode()
    else:
        dom = etree.fromstring(out)
        assert len(dom.findall("devices/serial")) == xml.count("<serial ")
        assert dom.findall("devices/hostdev")


# -- 12. doctor: when the qemu hook appeared ---------------------------------------------------

def test_doctor_uses_the_hook_links_ctime_not_dpkgs_mtime(tmp_path: Path) -> None:
    """Reproduction: install the package (dpkg gives the link
    /etc/libvirt/hooks/qemu.d/50-gpulib the build time as mtime) on a host whose
    libvirtd runs since before the installation: `gpulib doctor` said ok
    ("libvirtd started after the qemu hook appeared") while libvirtd does not
    run the hook until restarted. The packaging check repeats this with the
    real package (scripts/packaging-check, step 5)."""
    from tests.hosts import HOOKS_AT, healthy_host, start_libvirtd

    host = healthy_host(str(tmp_path))
    link = host.p(dr.LIBVIRT_HOOK)
    os.unlink(link)
    before_install = time.time() - 60
    start_libvirtd(host, started=before_install)  # running for a minute
    os.symlink("/usr/libexec/gpulib/gpulib-qemu-hook", link)
    os.utime(link, (HOOKS_AT, HOOKS_AT), follow_symlinks=False)  # the build time
    assert os.lstat(link).st_mtime < before_install < os.lstat(link).st_ctime
    (result,) = dr.run(Context.for_root(host.root), only=["libvirt"]).results_for("libvirt")
    assert result.status == dr.FAIL, result.to_json()
    assert (result.fix or "").startswith("systemctl restart libvirtd")
    start_libvirtd(host)  # restarted after the installation
    (result,) = dr.run(Context.for_root(host.root), only=["libvirt"]).results_for("libvirt")
    assert result.status == dr.OK, result.to_json()


# -- 14. an upgrade while a hook waits for the lock --------------------------------------------

def test_a_hook_never_runs_with_modules_of_two_versions(demo: str, tmp_path: Path) -> None:
    """Reproduction: a VM starts while `apt-get upgrade` unpacks a new gpulib:
    the hook, started with the old modules, lazily imported a new module
    whose functions the old callers call differently (TypeError). The
    maintainer scripts hold the state lock across the unpack; a hook that
    waited for it sees that gpulib changed under it and stops with one line
    and exit 3, having done nothing. The lock is held by this test, so the
    order is fixed: hook started, "unpack", lock released."""
    import filelock

    import gpulib

    site = tmp_path / "site"
    shutil.copytree(os.path.dirname(gpulib.__file__), site / "gpulib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = hook_env(demo)
    env["PYTHONPATH"] = str(site)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    ctx = Context.for_root(demo)
    os.makedirs(os.path.dirname(ctx.lock_path), exist_ok=True)
    before = tree_contents(demo)
    lock = filelock.FileLock(ctx.lock_path)
    lock.acquire()
    ready_r, ready_w = os.pipe()
    try:
        # The hook as its executable runs it, plus one byte on a side pipe
        # once it started (its modules so far are the old ones).
        proc = subprocess.Popen(
            [sys.executable, "-c", "import os, sys; from gpulib.hooks.transformer import main; "
             "import gpulib.hooks.common; os.write(int(os.environ['READY_FD']), b'r'); "
             "sys.exit(main(sys.argv))", "transform", VGPU_XML.read_text(encoding="utf-8")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
            env=dict(env, READY_FD=str(ready_w)), pass_fds=(ready_w,))
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"r", "the hook did not start"
        # The unpack: every module renamed into place, as dpkg does, and an
        # incompatible new one among them.
        for module in sorted((site / "gpulib").rglob("*.py")):
            new = module.with_name(module.name + ".dpkg-new")
            text = module.read_text(encoding="utf-8")
            if module.name == "allocator.py":
                text += "\ndef allocate(*args, **kwargs):\n    raise TypeError('new API')\n"
            new.write_text(text, encoding="utf-8")
            os.replace(new, module)
    finally:
        lock.release()
        os.close(ready_r)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3, out
    (line,) = out.decode().splitlines()
    assert "upgraded while this hook waited" in line and "TypeError" not in line
    assert tree_contents(demo) == before  # nothing written: sysfs, state


# -- 16. a GPU behind Intel VMD (PCI domain 10000) --------------------------------------------

def test_a_gpu_in_a_five_digit_pci_domain_is_discovered(demo: str) -> None:
    """Reproduction: a GPU behind an Intel VMD controller, which Linux names
    `10000:01:00.0`: PciAddress.parse refused it as "out of range" and the GPU
    vanished from discovery without a word. It is listed, with libvirt's
    address `domain='0x10000'`."""
    from gpulib.hostview import discover_host
    from gpulib.sim.hosts import add_model, models

    host = FakeHost(demo)
    host.add_bridge("10000:00:02.0")
    t4 = models()["t4"]
    add_model(host, t4, "10000:01:00.0", 0, parent="10000:00:02.0")
    res = gpulib_cli(demo, "discover", "--format", "cloudstack")
    assert res.returncode == 0, res.stderr
    gpus = {g["pci_address"]: g for g in json.loads(res.stdout)["gpus"]}
    assert "10000:01:00.0" in gpus, sorted(gpus)
    assert gpus["10000:01:00.0"]["full_passthrough"]["libvirt_address"]["domain"] == "0x10000"
    inv = discover_host(Context.for_root(demo), learn=False)
    assert any(str(g.address) == "10000:01:00.0" for g in inv.gpus)


def test_a_python_warning_goes_to_the_log_not_stderr(demo: str) -> None:
    """A warning raised while a hook runs (here every warning made visible by
    PYTHONWARNINGS=always, as an administrator's environment might) never
    reaches the agent's XML: captured into gpulib's log."""
    env = hook_env(demo)
    env["PYTHONWARNINGS"] = "always"
    xml = VGPU_XML.read_text(encoding="utf-8")
    code = ("import sys, warnings; from gpulib.hooks import transformer, common\n"
            "real = common.start\n"
            "def start(program):\n"
            "    out = real(program)\n"
            "    warnings.warn('something odd', UserWarning)\n"
            "    return out\n"
            "common.start = start\n"
            "sys.exit(transformer.main(sys.argv))\n")
    res = subprocess.run([sys.executable, "-c", code, "transform", xml], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env, timeout=30)
    assert res.returncode == 0, res.stdout[-500:]
    assert b"something odd" not in res.stdout
    etree.fromstring(res.stdout)
    assert "something odd" in Path(demo, "var/log/gpulib/gpulib.log").read_text()


def test_guest_slots_in_use_are_read_as_libvirt_reads_them(demo: str) -> None:
    """A device of the domain at guest address bus='00' slot='0x10' (bus 0 for
    libvirt): the slot gpulib picks for a passed-through GPU with its audio
    function must not be 0x10 (libvirt would refuse the double use)."""
    xml = (DATA / "cloudstack-xml" / "passthrough-1gpu.xml").read_text(encoding="utf-8")
    taken = ("<controller type='usb' index='1' model='ich9-ehci1'><address type='pci' "
             "domain='0x0000' bus='00' slot='0x10' function='0x0'/></controller>")
    xml = xml.replace("</devices>", taken + "</devices>", 1)
    res = as_agent(demo, xml)
    assert res.returncode == 0, res.stdout.decode()[-300:]
    dom = etree.fromstring(res.stdout)
    slots = [a.get("slot") for a in dom.iterfind("devices/hostdev/address")]
    assert slots and "0x10" not in slots, slots


# -- 10. a bug in a command ------------------------------------------------------------------

@pytest.mark.parametrize("args,target", [
    (["mdev", "list"], "gpulib.mdev.live_mdevs"),  # a click command
    (["metrics"], "gpulib.metrics.render"),  # a command served without click
])
def test_a_bug_in_a_command_is_one_line_and_its_traceback_is_logged(
        demo: str, args: list[str], target: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(target, broken)
    monkeypatch.setenv("GPULIB_ROOT", demo)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    capsys.readouterr()
    with caplog.at_level("ERROR", logger="gpulib.cli"):
        code = cli.main(args)
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.splitlines() == ["gpulib: internal error: RuntimeError: a bug over two lines "
                                "(a bug: the traceback is in gpulib's log)"]
    [record] = [r for r in caplog.records if r.name == "gpulib.cli"]
    assert record.exc_info is not None and "broken" in caplog.text


@pytest.mark.parametrize("args,target,result", [
    (["mdev", "list"], "gpulib.mdev.live_mdevs", {}),
    (["metrics"], "gpulib.metrics.render", ""),
])
def test_a_command_runs_without_the_cyclic_collector_and_gives_it_back(
        demo: str, args: list[str], target: str, result: object,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A command is short-lived: the collector stays off while it runs (its
    passes cost a large host's metrics milliseconds) and is on again after,
    for whoever called main() in-process."""
    seen: list[bool] = []

    def recording(*_args: object, **_kwargs: object) -> object:
        seen.append(gc.isenabled())
        return result

    monkeypatch.setattr(target, recording)
    monkeypatch.setenv("GPULIB_ROOT", demo)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    assert gc.isenabled()
    assert cli.main(args) == 0, capsys.readouterr().err
    assert seen == [False] and gc.isenabled()


# -- a full stdout -----------------------------------------------------------------------

FULL_STDOUT_RUNS = {
    "discover cloudstack": [str(BIN / "gpulib"), "discover", "--format", "cloudstack"],
    "discover json": [str(BIN / "gpulib"), "discover", "--format", "json"],
    "discover table": [str(BIN / "gpulib"), "discover", "--format", "table"],
    "metrics": [str(BIN / "gpulib"), "metrics"],
    "status": [str(BIN / "gpulib"), "status"],
    "status json": [str(BIN / "gpulib"), "status", "--json"],
    "mdev list": [str(BIN / "gpulib"), "mdev", "list"],
    "doctor": [str(BIN / "gpulib"), "doctor"],
    "transformer, no GPU": [TRANSFORMER, "transform", "<domain><name>x</name></domain>"],
    "transformer, a vGPU": [TRANSFORMER, "transform", VGPU_XML.read_text()],
}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("name", sorted(FULL_STDOUT_RUNS))
def test_a_full_stdout_is_one_line_not_a_bug(demo: str, name: str) -> None:
    """stdout on a full disk (/dev/full): every executable that answers there
    says so in one line and exits 1; no traceback, no "internal error"."""
    with open("/dev/full", "w") as full:
        r = subprocess.run(FULL_STDOUT_RUNS[name], stdout=full, stderr=subprocess.PIPE,
                           text=True, env=hook_env(demo), timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and "cannot write the output: No space left on device" \
        in r.stderr and "internal error" not in r.stderr, r.stderr
