"""One odd file degrades only its own device (issue: readers survive real hosts).

Every test works on a copy of the demo host and runs the real executables
with a time limit: a hang fails the test instead of stalling the suite. Each
checks that the healthy GPUs are all still reported and that every command
ends with a clear exit (0, or non-zero with one `gpulib: error:` line).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulib import cloudstack as cloudstack_mod
from gpulib import domstatus
from gpulib.config import Config
from gpulib.context import LOG_FAILURES_FILE, Context
from gpulib.domstatus import running_domains
from gpulib.entry import context_for_root
from gpulib.errors import ConfigError, DeviceError
from gpulib.hostview import discover_host
from gpulib.logs import FailureNote, LazyFileHandler
from gpulib.pci import PciAddress, list_addresses
from gpulib.sim import faults
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import add_model, add_sriov_gpu, build_demo, models
from gpulib.sysfs import ATTRIBUTE_MAX, ReadFailure, Sysfs, read_file, read_file_unless
from tests import hookrun
from tests.hookrun import BIN, QEMU_HOOK, STATE_CHANGE, as_agent, hook_env
from tests.hosts import scratch

GPULIB = str(BIN / "gpulib")
# Far above what any of these commands takes on the demo host (well under a
# second), far below "hangs until killed".
LIMIT = 30.0
RTX, A10, T4, A100, MI300X = ("0000:3b:00.0", "0000:41:00.0", "0000:af:00.0", "0000:ca:00.0",
                              "0001:d6:00.0")
DEV = "sys/bus/pci/devices"
HEX4 = re.compile(r"^[0-9a-f]{4}$")

# -- hosts and commands --------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_tree(module_tmp: Path) -> str:
    return build_demo(str(module_tmp / "demo")).root


def copy_host(demo_tree: str, dest: Path) -> str:
    root = str(dest / "host")
    shutil.copytree(demo_tree, root, symlinks=True)
    return root


@pytest.fixture
def host(demo_tree: str, tmp_path: Path) -> str:
    return copy_host(demo_tree, tmp_path)


def gpulib(root: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI on `root`; raises TimeoutExpired (fails the test) if it hangs."""
    proc = subprocess.run([GPULIB, *args], capture_output=True, env=hook_env(root),
                          stdin=subprocess.DEVNULL, timeout=LIMIT)
    # doctor and restore print a report; their exit status is its verdict
    assert_clear_exit(proc, report=args[0] in ("doctor", "restore"))
    return proc


def assert_clear_exit(proc: subprocess.CompletedProcess[bytes], report: bool = False) -> None:
    """Exit 0, or one `gpulib: error:` line (or, for a report, its verdict)."""
    err = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and "internal error" not in err, err
    if proc.returncode != 0 and not report:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpulib: error: "), err


def cloudstack(root: str) -> dict[str, Any]:
    proc = gpulib(root, "discover", "--format", "cloudstack")
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    for g in doc["gpus"]:
        assert HEX4.match(g["vendor_id"]) and HEX4.match(g["device_id"]), g
        assert isinstance(g["numa_node"], int) and -1 <= g["numa_node"] <= 1024
        assert g["full_passthrough"]["enabled"] in (0, 1)
        for v in g["vgpu_instances"]:
            for key in ("max_instances", "video_ram", "max_heads", "max_resolution_x"):
                assert v[key] is None or 0 <= v[key] < 10 ** 7
    return doc


def listed(root: str) -> set[str]:
    return {g["pci_address"] for g in cloudstack(root)["gpus"]}


def lspci(address: str) -> str:
    return address[5:] if address.startswith("0000:") else address


def doctor_finishes(root: str) -> dict[str, Any]:
    proc = gpulib(root, "doctor", "--json")
    assert proc.returncode in (0, 1, 2), proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def doctor_check(doc: dict[str, Any], cid: str) -> list[dict[str, Any]]:
    return [r for r in doc["checks"] if r["id"] == cid]


def transformer_finishes(root: str, pci: tuple[str, ...] = (MI300X,)
                         ) -> subprocess.CompletedProcess[bytes]:
    xml = FakeHost.domain_xml("i-2-99-VM", "0b6b3a8e-2f3c-4a55-9d1e-4f0c1c2d3e4f", pci=pci)
    proc = as_agent(root, xml, timeout=LIMIT)
    out = proc.stdout.decode("utf-8", "replace")
    assert "Traceback" not in out and "internal error" not in out, out
    if proc.returncode == 0:
        assert out.lstrip().startswith("<domain")
    else:
        assert len(out.strip().splitlines()) == 1, out
    return proc


@pytest.fixture(scope="module")
def baseline(demo_tree: str, module_tmp: Path) -> set[str]:
    root = copy_host(demo_tree, module_tmp / "baseline")
    found = listed(root)
    assert len(found) == 10
    return found


# -- the reading layer itself ----------------------------------------------------------------

def test_read_file_refuses_what_is_not_a_bounded_regular_file(tmp_path: Path) -> None:
    (tmp_path / "ok").write_bytes(b"0x10de\n")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_bytes(b"1" * (ATTRIBUTE_MAX + 1))
    os.symlink("loop", tmp_path / "loop")
    assert read_file(str(tmp_path / "ok"), ATTRIBUTE_MAX) == b"0x10de\n"
    reasons = {}
    for name in ("fifo", "dir", "big", "loop", "missing"):
        got = read_file(str(tmp_path / name), ATTRIBUTE_MAX)
        assert isinstance(got, ReadFailure), name
        reasons[name] = got
    assert "FIFO" in reasons["fifo"].reason and "directory" in reasons["dir"].reason
    assert "larger than" in reasons["big"].reason
    assert reasons["missing"].missing and not reasons["fifo"].missing


def test_sysfs_attributes_are_never_followed_and_failures_logged_once(tmp_path: Path) -> None:
    d = tmp_path / "sys" / "x"
    d.mkdir(parents=True)
    (tmp_path / "outside").write_text("0x10de\n")
    os.symlink("../../outside", d / "vendor")
    sysfs = Sysfs(str(tmp_path))
    assert sysfs.read("sys/x/vendor") is None
    assert sysfs.read("outside") == "0x10de"   # outside sys/, links are followed
    sysfs.read("sys/x/vendor")
    assert [rel for rel, _ in sysfs.failures] == ["sys/x/vendor"]


def test_links_outside_sys_are_followed_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "usr" / "lib" / "os-release").write_text("ID=inroot\n")
    (tmp_path / "etc").mkdir()
    os.symlink("/usr/lib/os-release", tmp_path / "etc" / "os-release")
    os.symlink("/etc/hostname", tmp_path / "etc" / "hostname")  # the real host's: not read
    sysfs = Sysfs(str(tmp_path))
    assert sysfs.read("etc/os-release") == "ID=inroot"
    got = sysfs.read_result("etc/hostname")
    assert isinstance(got, ReadFailure) and got.missing


def test_read_file_unless_skips_what_the_caller_holds(tmp_path: Path) -> None:
    path = tmp_path / "f.xml"
    path.write_bytes(b"<domain/>")
    got = read_file_unless(str(path), lambda st: False)
    assert not isinstance(got, ReadFailure) and got[1] == b"<domain/>"
    st = got[0]
    same = read_file_unless(str(path), lambda s: (s.st_ino, s.st_size) == (st.st_ino, st.st_size))
    assert not isinstance(same, ReadFailure) and same[1] is None
    os.mkfifo(tmp_path / "fifo.xml")
    # a FIFO is refused even by a caller that would take any file as known
    fifo = read_file_unless(str(tmp_path / "fifo.xml"), lambda s: True)
    assert isinstance(fifo, ReadFailure) and "FIFO" in fifo.reason
    big = read_file_unless(str(path), lambda s: False, limit=4)
    assert isinstance(big, ReadFailure) and "larger than" in big.reason


def test_unreadable_status_files_cost_only_their_domain(host: str) -> None:
    """A FIFO, a directory and an oversized file in place of status files:
    those domains hold nothing known, the others are still read (twice: the
    second time from the cache), and nothing waits."""
    qemu = Path(host, "run/libvirt/qemu")
    sysfs = Context.for_root(host).sysfs
    before = {d.name: d for d in running_domains(sysfs)}
    held = {n for n, d in before.items() if d.pci or d.mdevs}
    assert held
    os.mkfifo(qemu / "i-9-1-VM.xml")
    (qemu / "i-9-2-VM.xml").mkdir()
    (qemu / "i-9-3-VM.xml").write_bytes(b"<domstatus>" + b" " * (domstatus.MAX_STATUS_BYTES + 1))
    for _ in range(2):
        after = {d.name: d for d in running_domains(Context.for_root(host).sysfs)}
        assert set(after) == set(before) | {"i-9-1-VM", "i-9-2-VM", "i-9-3-VM"}
        for name in ("i-9-1-VM", "i-9-2-VM", "i-9-3-VM"):
            assert after[name].pci == [] and after[name].mdevs == []
        for name in held:
            assert (after[name].pci, after[name].mdevs) == (before[name].pci, before[name].mdevs)


def test_a_fifo_as_the_log_file_is_never_written(tmp_path: Path) -> None:
    """A FIFO that some process reads, in place of the log file or of the
    note of lost records: nothing is written into it; the record is lost and
    noted (never on stderr). Without a reader, no open waits for one (the
    commands' case below, under a time limit)."""
    fifo = tmp_path / "gpulib.log"
    os.mkfifo(fifo)
    # opened first, non-blocking: the writer's open never waits, even if it blocks
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        note = FailureNote(str(tmp_path / "note"), "gpulib")
        handler = LazyFileHandler(str(fifo), note)
        record = logging.makeLogRecord({"msg": "restored"})
        handler.emit(record)
        handler.emit(record)
        handler.close()
        assert os.read(reader, 4096) == b""   # end of file: nothing written, no writer left
        assert note.count == 2
        [line] = (tmp_path / "note").read_text().splitlines()
        assert "gpulib[" in line and "a FIFO, not a log file" in line
        FailureNote(str(fifo), "gpulib")(None)
        assert os.read(reader, 4096) == b""
    finally:
        os.close(reader)


def test_a_fifo_as_the_log_file_is_noted_for_doctor(host: str) -> None:
    log_file = Path(host, "var/log/gpulib/gpulib.log")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(log_file)
    proc = gpulib(host, "restore")
    assert proc.stderr == b""
    [note] = Path(host, LOG_FAILURES_FILE).read_text().splitlines()
    assert "gpulib[" in note and "gpulib.log" in note
    [result] = doctor_check(doctor_finishes(host), "logging")
    assert result["status"] == "warn"


@pytest.mark.parametrize("content", ["0x" + "1" * 9000, "0x1ffff", "garbage", "-1"])
def test_ids_are_shape_checked(tmp_path: Path, content: str) -> None:
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys" / "vendor").write_text(content + "\n")
    assert Sysfs(str(tmp_path)).read_id("sys/vendor") is None


# -- the fault mode ---------------------------------------------------------------------------

def test_fault_table_fails_reads_through_any_path(host: str) -> None:
    faults.inject(host, f"{DEV}/{RTX}", "eio")
    faults.inject(host, f"{DEV}/{T4}/vendor", "ebusy")
    sysfs = context_for_root(host, simulate=True).sysfs
    canonical = sysfs.resolve(f"{DEV}/{RTX}")
    for rel in (f"{DEV}/{RTX}/vendor", f"{canonical}/vendor"):
        got = sysfs.read_result(rel)
        assert isinstance(got, ReadFailure) and got.errno == 5, rel
    got = sysfs.read_result(f"{DEV}/{T4}/vendor")
    assert isinstance(got, ReadFailure) and "busy" in got.reason
    assert sysfs.read(f"{DEV}/{T4}/device") is not None
    # without GPULIB_SIMULATE the table is never looked at
    assert Context.for_root(host).sysfs.read(f"{DEV}/{T4}/vendor") == "0x10de"


def test_vf_vanishing_mid_walk_costs_only_that_vf(host: str) -> None:
    before = next(g for g in cloudstack(host)["gpus"] if g["pci_address"] == lspci(A10))
    faults.inject(host, f"{DEV}/0000:41:00.5", "vanish")
    after = next(g for g in cloudstack(host)["gpus"] if g["pci_address"] == lspci(A10))
    vfs = [v["vf_pci_address"] for v in before["vf_instances"]]
    assert [v["vf_pci_address"] for v in after["vf_instances"]] == \
        [v for v in vfs if v != "41:00.5"]


# -- item 1: a read never blocks ---------------------------------------------------------------

FIFO_CASES = [
    (f"{DEV}/{RTX}/vendor", set()),
    (f"{DEV}/{RTX}/class", {RTX}),  # its class unknown: not a GPU any more
    (f"{DEV}/{T4}/mdev_supported_types/nvidia-232/available_instances", set()),
    (f"{DEV}/0000:41:00.4/nvidia/current_vgpu_type", set()),
    ("usr/share/misc/pci.ids", set()),
    (f"run/udev/data/+pci:{RTX}", set()),
    ("run/libvirt/qemu/i-4-20-VM.xml", set()),
    ("run/gpulib/domains.json", set()),
    ("run/gpulib/log-failures", set()),
    ("var/log/gpulib/gpulib.log", set()),
    ("etc/gpulib/gpulib.conf", set()),
    ("proc/cmdline", set()),
    ("etc/os-release", set()),
    ("var/lib/gpulib/state.json", set()),
    ("var/lib/gpulib/state.lock", set()),
    (f"etc/mdevctl.d/{T4}/6a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", set()),
]


@pytest.mark.parametrize("rel,lost", FIFO_CASES, ids=[c[0].split("/")[-1] for c in FIFO_CASES])
def test_fifo_in_place_of_a_file_never_hangs(host: str, baseline: set[str], rel: str,
                                             lost: set[str]) -> None:
    os.makedirs(os.path.dirname(os.path.join(host, rel)), exist_ok=True)
    faults.inject(host, rel, "block")
    assert listed(host) == baseline - {lspci(a) for a in lost}
    doctor_finishes(host)
    gpulib(host, "status", "--json")
    gpulib(host, "mdev", "list", "--json")
    gpulib(host, "restore")
    out = os.path.join(os.path.dirname(host), "s.tar.gz")
    assert gpulib(host, "snapshot", "-o", out).returncode == 0
    transformer_finishes(host)
    xml = FakeHost.domain_xml("i-2-99-VM", "0b6b3a8e-2f3c-4a55-9d1e-4f0c1c2d3e4f").encode()
    for argv, stdin in (([STATE_CHANGE, "onStart", "i-2-99-VM"], b""),
                        ([STATE_CHANGE, "onStop", "i-2-99-VM"], b""),
                        ([QEMU_HOOK, "i-2-99-VM", "prepare", "begin", "-"], xml),
                        ([QEMU_HOOK, "i-2-99-VM", "release", "end", "-"], xml)):
        proc = hookrun.run(argv, host, stdin=stdin, timeout=LIMIT)
        assert b"Traceback" not in proc.stderr and b"internal error" not in proc.stderr
        assert proc.returncode == 0 or len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# -- item 2: one unreadable mdev type file ------------------------------------------------------

@pytest.mark.parametrize("kind", ["eio", "directory", "loop"])
def test_unreadable_type_file_keeps_the_report(host: str, baseline: set[str], kind: str) -> None:
    gpu = next(g for g in cloudstack(host)["gpus"] if g["pci_address"] == lspci(A100))
    [vgpu] = gpu["vgpu_instances"]
    type_dir = f"{DEV}/0000:ca:00.4/mdev_supported_types/nvidia-470"  # the vGPU is on a VF
    for name in ("description", "name"):
        rel = f"{type_dir}/{name}"
        if kind == "eio":
            faults.inject(host, rel, "eio")
        else:
            os.unlink(os.path.join(host, rel))
            if kind == "directory":
                os.mkdir(os.path.join(host, rel))
            else:
                os.symlink(name, os.path.join(host, rel))
    doc = cloudstack(host)
    assert {g["pci_address"] for g in doc["gpus"]} == baseline
    after = next(g for g in doc["gpus"] if g["pci_address"] == lspci(A100))
    # the live vGPU is still an instance, with what could be read
    [still] = after["vgpu_instances"]
    assert still["mdev_uuid"] == vgpu["mdev_uuid"] and still["profile_name"] == "nvidia-470"
    assert still["max_instances"] is None
    native = json.loads(gpulib(host, "discover", "--format", "json").stdout)
    [a100] = [g for g in native["gpus"] if g["address"] == A100]
    assert any("nvidia-470" in e for e in a100["errors"])


# -- item 3: one bad VF --------------------------------------------------------------------------

A10_VFS = ("0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7", "0000:41:01.0",
           "0000:41:01.1", "0000:41:01.2", "0000:41:01.3")


def type_vfs(root: str, vfs: tuple[str, ...], type_id: int = 594) -> None:
    """Give NVIDIA vendor VFs a vGPU type (A10-6Q), as the driver shows one:
    only a typed VF is offered to CloudStack (an untyped one would be refused)."""
    for vf in vfs:
        Path(root, DEV, vf, "nvidia/current_vgpu_type").write_text(f"{type_id}\n")


@pytest.mark.parametrize("kind", ["eio", "ebusy", "garbage"])
def test_one_bad_vf_hides_no_other(host: str, baseline: set[str], kind: str) -> None:
    type_vfs(host, A10_VFS)
    # gpulib's record types the bad VF too: a VF whose vGPU state cannot be
    # read is not offered free on the strength of the record either, but it
    # is reported (with its recorded profile), not dropped.
    state = Path(host, "var/lib/gpulib/state.json")
    doc = json.loads(state.read_text())
    doc["vf_types"]["0000:41:00.5"] = dict(doc["vf_types"]["0000:41:00.4"])
    state.write_text(json.dumps(doc))
    rel = f"{DEV}/0000:41:00.5/nvidia/current_vgpu_type"
    if kind == "garbage":
        Path(host, rel).write_text("9" * 5000 + "\n")
    else:
        faults.inject(host, rel, kind)
    doc = cloudstack(host)
    assert {g["pci_address"] for g in doc["gpus"]} == baseline
    a10 = next(g for g in doc["gpus"] if g["pci_address"] == lspci(A10))
    vfs = {v["vf_pci_address"]: v for v in a10["vf_instances"]}
    assert list(vfs) == [lspci(a) for a in A10_VFS]
    bad = vfs[lspci("0000:41:00.5")]
    assert bad["used_by_vm"] == cloudstack_mod.UNAVAILABLE
    assert bad["vf_profile"] == vfs[lspci("0000:41:00.4")]["vf_profile"] == "NVIDIA A10-6Q"
    assert all(v["used_by_vm"] is None for a, v in vfs.items() if a != lspci("0000:41:00.5"))
    native = json.loads(gpulib(host, "discover", "--format", "json").stdout)
    [g] = [g for g in native["gpus"] if g["address"] == A10]
    assert any(e.startswith("VF 0000:41:00.5 not offered: ") for e in g["errors"])


# -- item 6: configuration ------------------------------------------------------------------------

CONF = "etc/gpulib/gpulib.conf"


def test_bom_is_not_an_error(host: str, baseline: set[str]) -> None:
    Path(host, CONF).write_bytes(b"\xef\xbb\xbf# comments only\n")
    assert listed(host) == baseline
    [result] = doctor_check(doctor_finishes(host), "config")
    assert result["status"] == "ok"
    Path(host, CONF).write_bytes(b"\xef\xbb\xbf[discovery]\nexclude = " + RTX.encode() + b"\n")
    assert listed(host) == baseline - {lspci(RTX)}
    assert gpulib(host, "pool", "list", "--json").returncode == 0


@pytest.mark.parametrize("text,needle", [
    (b"[discovery]\nexclude = 0000:3b:00.0\n[discovery]\nexclude = 0000:3b:00.0\n",
     "given twice"),
    (b"[log]\nlevel = info\nlevel = debug\n", "given twice"),
    (b"[log]\nlevel = in\x00fo\n", "NUL"),
])
def test_bad_config_degrades_discovery_and_doctor(host: str, baseline: set[str], text: bytes,
                                                  needle: str) -> None:
    Path(host, CONF).write_bytes(text)
    got = listed(host)
    assert got >= baseline - {lspci(RTX)}
    [result] = doctor_check(doctor_finishes(host), "config")
    assert result["status"] == "fail" and needle in result["message"]
    # commands that change the host refuse, with the file named
    proc = gpulib(host, "pool", "apply", "--dry-run")
    assert proc.returncode == 2 and b"gpulib.conf" in proc.stderr
    proc = transformer_finishes(host)
    assert proc.returncode != 0 and b"gpulib.conf" in proc.stdout


def test_config_warnings_never_reach_discovery_output(host: str, baseline: set[str]) -> None:
    for text in ("[log]\nlevle = info\n", "[log]\nlevel = info\nlevel = debug\n"):
        Path(host, CONF).write_text(text)
        proc = gpulib(host, "discover", "--format", "cloudstack")
        assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
        assert {g["pci_address"] for g in json.loads(proc.stdout)["gpus"]} == baseline


_CONF_LINES = st.sampled_from([
    "[log]", "[discovery]", "[allocator]", "[pool p]", "[DEFAULT]", "[", "level = info",
    "level = debug", "exclude = 0000:3b:00.0", "policy = pack", "policy = sideways",
    "type = nvidia-232", "count = 2", "per_parent = 9999", "x = y", "# c", "; c", "  cont",
    "\ufeff[log]", "lev\x00el = info", "=", "[pool ../x]"])


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(st.one_of(st.lists(_CONF_LINES, max_size=8).map("\n".join),
                                st.binary(max_size=64).map(lambda b: b.decode("latin-1"))),
                      min_size=1, max_size=3))
def test_config_lenient_never_raises_and_strict_only_config_errors(
        tmp_path: Path, files: list[str]) -> None:
    """Whatever the files hold: a lenient load gives a usable Config (problems
    listed), a strict one that Config or ConfigError; both agree when clean."""
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    (base / "gpulib.conf.d").mkdir()
    (base / "gpulib.conf").write_bytes(files[0].encode("utf-8", "surrogateescape"))
    for i, text in enumerate(files[1:]):
        (base / "gpulib.conf.d" / f"{i}.conf").write_bytes(text.encode("utf-8"))
    path = str(base / "gpulib.conf")
    lenient = Config.load(path, lenient=True)
    assert lenient.get("allocator", "policy") in ("spread", "pack")
    assert lenient.get("log", "level") in ("info", "debug")
    try:
        strict: Config | None = Config.load(path)
    except ConfigError as exc:
        assert exc.message
        strict = None
    if not lenient.problems:
        assert strict is not None
        assert strict._values == lenient._values and set(strict.pools) == set(lenient.pools)


def test_dropins_in_lexical_order(host: str, baseline: set[str]) -> None:
    d = Path(host, CONF + ".d")
    d.mkdir()
    (d / "20-b.conf").write_text(f"[discovery]\nexclude = {T4}\n")
    (d / "10-a.conf").write_text(f"[discovery]\nexclude = {RTX}\n")
    (d / "30-c.conf.dpkg-old").write_text(f"[discovery]\nexclude = {A10}\n")
    (d / ".hidden.conf").write_text(f"[discovery]\nexclude = {A10}\n")
    assert listed(host) == baseline - {lspci(T4)}
    cfg = Config.load(os.path.join(host, CONF))
    assert cfg.match("discovery", "exclude").addresses == {PciAddress.parse(T4)}
    (d / "40-bad.conf").write_text("[allocator]\npolicy = sideways\n")
    with pytest.raises(ConfigError, match=r"40-bad.conf: \[allocator\] policy"):
        Config.load(os.path.join(host, CONF))
    lenient = Config.load(os.path.join(host, CONF), lenient=True)
    assert lenient.get("allocator", "policy") == "spread" and len(lenient.problems) == 1


# -- item 7: odd host trees --------------------------------------------------------------------

def test_os_release_as_a_directory(host: str, baseline: set[str]) -> None:
    os.unlink(os.path.join(host, "etc/os-release"))
    os.mkdir(os.path.join(host, "etc/os-release"))
    doctor_finishes(host)
    assert listed(host) == baseline


def test_pci_devices_as_a_symlink_loop(host: str, tmp_path: Path) -> None:
    bus = os.path.join(host, DEV)
    shutil.rmtree(bus)
    os.symlink("devices", bus)
    proc = gpulib(host, "discover", "--format", "cloudstack")
    assert proc.returncode == 1 and b"cannot list the PCI devices" in proc.stderr
    doctor_finishes(host)
    proc = gpulib(host, "snapshot", "-o", str(tmp_path / "s.tar.gz"))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("where", ["device", "group", "fifo"])
def test_snapshot_survives_loops_and_fifos(host: str, baseline: set[str], tmp_path: Path,
                                           where: str) -> None:
    lost: set[str] = set()
    if where == "device":
        link = os.path.join(host, DEV, RTX)
        os.unlink(link)
        os.symlink(RTX, link)
        lost = {RTX}
    elif where == "group":
        devices = os.path.join(host, "sys/kernel/iommu_groups/9/devices")
        shutil.rmtree(devices)
        os.symlink("devices", devices)
    else:
        faults.inject(host, f"{DEV}/{RTX}/numa_node", "block")
    assert listed(host) == baseline - {lspci(a) for a in lost}
    out = tmp_path / "s.tar.gz"
    proc = gpulib(host, "snapshot", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    replay = tmp_path / "replay"
    with tarfile.open(out) as tf:
        tf.extractall(replay, filter="tar")
    assert listed(str(replay)) == baseline - {lspci(a) for a in lost}


# -- item 8: shapes, physfn loops, unreadable group peers --------------------------------------

def test_huge_vendor_file_gives_no_huge_id(host: str, baseline: set[str]) -> None:
    Path(host, DEV, RTX, "vendor").write_bytes(b"0x" + b"1" * (10 * 1024 * 1024) + b"\n")
    proc = gpulib(host, "discover", "--format", "cloudstack")
    assert proc.returncode == 0 and len(proc.stdout) < 64 * 1024
    assert listed(host) == baseline   # checks every id is four hex digits


def test_odd_names_never_reach_the_report(host: str, baseline: set[str]) -> None:
    live = os.path.join(host, "sys/bus/mdev/devices")
    [uuid] = os.listdir(live)
    os.symlink(os.readlink(os.path.join(live, uuid)), os.path.join(live, "not-a-uuid"))
    os.mkdir(os.path.join(host, DEV, T4, "mdev_supported_types", "odd type"))
    group = Path(host, DEV, RTX, "iommu_group")
    group.unlink()
    group.symlink_to("../../../kernel/iommu_groups/" + "9" * 200)
    doc = cloudstack(host)
    assert {g["pci_address"] for g in doc["gpus"]} == baseline
    uuids = [v["mdev_uuid"] for g in doc["gpus"] for v in g["vgpu_instances"]]
    assert "not-a-uuid" not in uuids and uuid in uuids
    rtx = next(g for g in doc["gpus"] if g["pci_address"] == lspci(RTX))
    assert rtx["iommu_group"] == "null"
    native = json.loads(gpulib(host, "discover", "--format", "json").stdout)
    types = [t["type_id"] for g in native["gpus"] for t in g["mdev_types"]]
    assert "odd type" not in types and "nvidia-232" in types


def test_vf_with_looping_physfn_is_not_a_gpu(host: str, baseline: set[str]) -> None:
    type_vfs(host, ("0000:41:00.5",))
    physfn = os.path.join(host, DEV, "0000:41:00.5", "physfn")
    os.unlink(physfn)
    os.symlink("physfn", physfn)
    doc = cloudstack(host)
    assert {g["pci_address"] for g in doc["gpus"]} == baseline
    a10 = next(g for g in doc["gpus"] if g["pci_address"] == lspci(A10))
    assert "41:00.5" in [v["vf_pci_address"] for v in a10["vf_instances"]]


@pytest.mark.parametrize("running,asked", [(A10, "0000:41:00.5"), ("0000:41:00.5", A10)])
def test_vf_with_looping_physfn_still_conflicts_with_its_pf(host: str, running: str,
                                                            asked: str) -> None:
    """The VF's PF is found from the PF's `virtfnN` links: a running VM holding
    one of the two makes a start naming the other refused."""
    physfn = os.path.join(host, DEV, "0000:41:00.5", "physfn")
    os.unlink(physfn)
    os.symlink("physfn", physfn)
    FakeHost(host).add_running_domain("i-7-70-VM", "7d1e0c52-55a5-4a37-9a1c-3b0d6f1f7a70",
                                      pci=(running,), domain_id=70)
    proc = transformer_finishes(host, pci=(asked,))
    assert proc.returncode != 0 and b"i-7-70-VM" in proc.stdout, proc.stdout


def test_unreadable_group_peer_class_is_a_clear_transformer_error(host: str) -> None:
    faults.inject(host, f"{DEV}/0000:3b:00.1/class", "eio")
    proc = transformer_finishes(host, pci=(RTX,))
    assert proc.returncode != 0
    assert b"cannot read the PCI class of 0000:3b:00.1" in proc.stdout


# -- item 9: the snapshot shows why a GPU was not found -------------------------------------------

def test_snapshot_of_a_host_whose_only_gpu_is_not_counted(tmp_path: Path) -> None:
    host = FakeHost(str(tmp_path / "host"))
    # A co-processor class (0x0b40) NVIDIA part: gpulib does not count it.
    host.add_function("0000:65:00.0", 0x10DE, 0x20B5, 0x0B4000, driver="nvidia",
                      iommu_group=host.new_iommu_group(), numa_node=0)
    host.add_function("0000:00:1f.0", 0x8086, 0xA1C1, 0x060100, driver=None)
    assert cloudstack(host.root)["gpus"] == []
    out = tmp_path / "s.tar.gz"
    assert gpulib(host.root, "snapshot", "-o", str(out)).returncode == 0
    replay = tmp_path / "replay"
    with tarfile.open(out) as tf:
        tf.extractall(replay, filter="tar")
        manifest = json.loads(tf.extractfile("gpulib-snapshot.json").read())  # type: ignore[union-attr]
    assert "0000:65:00.0" in manifest["identity_only"]
    dev = replay / DEV / "0000:65:00.0"
    assert (dev / "class").read_text().strip() == "0x0b4000"
    assert (dev / "vendor").read_text().strip() == "0x10de"
    assert (dev / "device").read_text().strip() == "0x20b5"
    assert os.readlink(dev / "driver").endswith("/nvidia")
    assert (dev / "iommu_group").is_dir()
    assert cloudstack(str(replay))["gpus"] == []
    # told to count it, both the host and its replay report it
    for root in (host.root, str(replay)):
        Path(root, CONF).parent.mkdir(parents=True, exist_ok=True)
        Path(root, CONF).write_text("[discovery]\ninclude = 10de:20b5\n")
    assert listed(host.root) == listed(str(replay)) == {"65:00.0"}


# -- the property: one random fault anywhere ---------------------------------------------------

FAULT_KINDS = ("eio", "ebusy", "eagain", "vanish", "block", "directory", "loop", "big")


def host_files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.startswith(".gpulib-sim"):
            continue
        for name in dirnames + filenames:
            out.append(os.path.normpath(os.path.join(rel, name)))
    return sorted(out)


def apply_fault(root: str, rel: str, kind: str) -> None:
    path = os.path.join(root, rel)
    if kind in ("block",) or kind in faults.ERRNO_FAULTS or kind == "vanish":
        faults.inject(root, rel, kind)
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "loop":
        os.symlink(os.path.basename(path), path)
    else:
        with open(path, "wb") as fh:
            fh.write(b"1" * (ATTRIBUTE_MAX * 2))


def touched(root: str, rel: str, baseline: set[str]) -> set[str]:
    """The GPUs (lspci form) a fault at `rel` may take out of the report."""
    ctx = Context.for_root(root)
    faulted = [rel]
    path = os.path.join(root, rel)
    if os.path.islink(path) and os.path.isdir(path):   # a device link: its directory too
        faulted.append(ctx.sysfs.resolve(rel))
    gpus: set[str] = set()
    for a in list_addresses(ctx.sysfs):
        if lspci(str(a)) not in baseline:
            continue
        dirs = [ctx.sysfs.resolve(f"{DEV}/{a}"), f"{DEV}/{a}"]
        vf_links = [n for n in ctx.sysfs.listdir(f"{DEV}/{a}") if n.startswith("virtfn")]
        dirs += [ctx.sysfs.resolve(f"{DEV}/{a}/{n}") for n in vf_links]
        if any(f == d or f.startswith(d + "/") or d.startswith(f + "/")
               for d in dirs for f in faulted):
            gpus.add(lspci(str(a)))
    if DEV.startswith(rel):   # sys, sys/bus, ...: every device is below
        return set(baseline)
    return gpus


class Files(list[str]):
    """The demo host's paths, with a short repr (hypothesis prints the arguments)."""

    def __repr__(self) -> str:
        return f"<{len(self)} paths of the demo host>"


@pytest.fixture(scope="module")
def candidate_files(demo_tree: str) -> list[str]:
    return Files(host_files(demo_tree))


def check_one_fault(root: str, baseline: set[str], rel: str, kind: str,
                    pci: tuple[str, ...] = ()) -> None:
    """Inject one fault; the report keeps every GPU it does not touch, nothing hangs."""
    spared = baseline - touched(root, rel, baseline)
    apply_fault(root, rel, kind)
    proc = gpulib(root, "discover", "--format", "cloudstack")
    if proc.returncode == 0:
        got = {g["pci_address"] for g in json.loads(proc.stdout)["gpus"]}
        assert got >= spared, (rel, kind)
    else:
        # only a fault on the PCI device listing itself may stop the report
        assert spared == set(), (rel, kind, proc.stderr)
    doctor_finishes(root)
    # a start that asks for a GPU: accepted, or refused in one clear line
    transformer_finishes(root, pci=pci)


EXAMPLES = int(os.environ.get("GPULIB_FAULT_EXAMPLES", "12"))


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_one_random_fault_costs_only_what_it_touches(
        demo_tree: str, baseline: set[str], candidate_files: list[str], tmp_path_factory: Any,
        data: Any) -> None:
    rel = data.draw(st.sampled_from(candidate_files), label="file")
    kind = data.draw(st.sampled_from(FAULT_KINDS), label="fault")
    with scratch(tmp_path_factory, "fault") as tmp:
        check_one_fault(copy_host(demo_tree, tmp), baseline, rel, kind, pci=(MI300X,))


MODELS = ("t4", "a10", "a100", "rtx3070", "mi300x", "v620")


def random_host(root: str, picks: list[tuple[str, int]]) -> FakeHost:
    """A host with one GPU per pick (model, VFs or live vGPUs), each behind its bridge."""
    m = models()
    host = FakeHost(root)
    for i, (kind, n) in enumerate(picks):
        model = m[kind]
        bridge, gpu = f"0000:{0x10 + 2 * i:02x}:00.0", f"0000:{0x11 + 2 * i:02x}:00.0"
        host.add_bridge(bridge, numa_node=i % 2, iommu_group=host.new_iommu_group())
        if kind in ("a10", "a100", "v620"):
            vfs = add_sriov_gpu(host, model, gpu, i % 2, bridge, max(n, 1))
            for vf in vfs:
                if kind == "a10":
                    host.add_nvidia_vf_types(vf, {int(k): v for k, v in
                                                  model["nvidia_vf_types"].items()})
                elif kind == "a100":
                    host.populate_mdev_parent(vf, model["vf_mdev_types"])
        else:
            add_model(host, model, gpu, i % 2, parent=bridge)
            if kind == "t4":
                host.populate_mdev_parent(gpu, model["mdev_types"])
                for j in range(n):
                    host.add_mdev(f"{i:08x}-{j:04x}-4000-8000-000000000000", gpu, "nvidia-232")
    return host


@settings(max_examples=max(EXAMPLES // 2, 4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(picks=st.lists(st.tuples(st.sampled_from(MODELS), st.integers(0, 3)),
                      min_size=1, max_size=4),
       data=st.data())
def test_one_random_fault_on_a_random_host(picks: list[tuple[str, int]], data: Any,
                                           tmp_path_factory: Any) -> None:
    with scratch(tmp_path_factory, "random") as tmp:
        root = str(tmp / "host")
        random_host(root, picks)
        baseline = listed(root)
        assert len(baseline) == len(picks)
        rel = data.draw(st.sampled_from(host_files(root)), label="file")
        kind = data.draw(st.sampled_from(FAULT_KINDS), label="fault")
        check_one_fault(root, baseline, rel, kind)


def test_discovery_in_process_reports_listing_failure(host: str) -> None:
    faults.inject(host, DEV, "eio")
    with pytest.raises(DeviceError, match="cannot list the PCI devices"):
        list_addresses(context_for_root(host, simulate=True).sysfs)
    with pytest.raises(DeviceError):
        discover_host(context_for_root(host, simulate=True))
