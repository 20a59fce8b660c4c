"""A VM's whole life and the host's, through the executables as the agent and
libvirt run them: reboots, late and repeated stops, retries, reused names,
stops that crash or meet a full disk, a damaged state file, unmanaged
devices, VFs carrying vGPUs, UUID spellings.

Each test starts from a fresh simulated demo host; libvirt running a domain
is its status file (`FakeHost.add_running_domain`), a stop is its removal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import build_demo
from tests.conftest import DATA
from tests.hookrun import (
    QEMU_HOOK,
    STATE_CHANGE,
    as_agent,
    hook_env,
    hostdev_uuids,
    libvirt_runs,
    run,
)
from tests.hosts import reboot

STATE = "var/lib/gpulib/state.json"
BOOT_ID = "proc/sys/kernel/random/boot_id"
XMLS = DATA / "cloudstack-xml"
REPO = Path(__file__).resolve().parents[1]
GPULIB = str(Path(sys.executable).parent / "gpulib")

RTX = "0000:3b:00.0"  # GeForce with its HDMI audio (3b:00.1) in one IOMMU group
T4_WHOLE = "0000:65:00.0"  # a T4 on vfio-pci
A100 = "0000:ca:00.0"  # SR-IOV, mdev types on each VF
U_VM = "4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
U_OTHER = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"


def meta_xml(name: str = "plain-1", uuid: str = U_VM, count: int = 2) -> str:
    """A plain-libvirt domain asking gpulib for on-demand vGPUs (metadata)."""
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid><metadata>"
            "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
            f"<gpulib:vgpu profile='GRID A100-8C' count='{count}'/></gpulib:gpus></metadata>"
            "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>")


def pci_xml(name: str, uuid: str, address: str) -> str:
    d, rest = address.split(":", 1)
    b, sf = rest.split(":")
    s, f = sf.split(".")
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid><devices>"
            "<hostdev mode='subsystem' type='pci' managed='yes'><driver name='vfio'/>"
            f"<source><address domain='0x{d}' bus='0x{b}' slot='0x{s}' function='0x{f}'/>"
            "</source></hostdev></devices></domain>")


def mdev_xml(name: str, uuid: str, mdev: str) -> str:
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid><devices>"
            "<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'>"
            f"<source><address uuid='{mdev}'/></source></hostdev></devices></domain>")


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    h = build_demo(str(tmp_path / "demo"))
    h.write_file(BOOT_ID, "boot-1\n", 0o444)
    return h


def state_of(root: str) -> dict[str, Any]:
    return json.loads(Path(root, STATE).read_text())  # type: ignore[no-any-return]


def live_mdevs(root: str) -> set[str]:
    return set(os.listdir(os.path.join(root, "sys/bus/mdev/devices")))


def transform_ok(root: str, xml: str) -> etree._Element:
    res = as_agent(root, xml)
    assert res.returncode == 0, res.stdout
    return etree.fromstring(res.stdout)


def started_with_vgpus(host: FakeHost, count: int = 2) -> list[str]:
    """plain-1 started (transformer, libvirt, onStart) with on-demand vGPUs; their UUIDs."""
    dom = transform_ok(host.root, meta_xml(count=count))
    libvirt_runs(host, dom)
    assert run([STATE_CHANGE, "onStart", "plain-1"], host.root).returncode == 0
    return hostdev_uuids(dom)


def cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULIB, *args], capture_output=True, text=True,
                          env=hook_env(root), timeout=60)


def used_by(root: str, address: str) -> Any:
    res = cli(root, "discover", "--format", "cloudstack")
    assert res.returncode == 0, res.stderr
    short = address[5:] if address.startswith("0000:") else address
    gpu = next(g for g in json.loads(res.stdout)["gpus"] if g["pci_address"] == short)
    return gpu["full_passthrough"]["used_by_vm"]


# -- 1. a host crash and reboot ------------------------------------------------------------------

def test_a_reboot_frees_what_vms_of_the_last_boot_held(host: FakeHost) -> None:
    root = host.root
    passthrough = pci_xml("i-2-40-VM", U_OTHER, RTX)
    libvirt_runs(host, transform_ok(root, passthrough))
    assert run([STATE_CHANGE, "onStart", "i-2-40-VM"], root).returncode == 0
    vgpus = transform_ok(root, meta_xml())
    made = hostdev_uuids(vgpus)
    libvirt_runs(host, vgpus)
    assert run([STATE_CHANGE, "onStart", "plain-1"], root).returncode == 0
    assert used_by(root, RTX) == "i-2-40-VM"
    # Power cut: sysfs and /run are new, /etc and /var/lib survive; a new boot id.
    host = reboot(host, build_demo)
    host.write_file(BOOT_ID, "boot-2\n", 0o444)
    status = cli(root, "status")
    assert "an earlier boot (boot-1)" in status.stdout, status.stdout
    res = cli(root, "restore")  # what the boot unit runs
    assert res.returncode == 0, res.stderr
    st = state_of(root)
    assert st["allocations"] == {}
    assert not set(made) & set(st["vgpus"]), "on-demand vGPUs of the last boot are forgotten"
    assert not set(made) & live_mdevs(root), "and not made again"
    assert used_by(root, RTX) is None
    # The GPU goes to the next VM that asks.
    transform_ok(root, pci_xml("i-2-41-VM", U_VM, RTX))


# -- 2. onStop for a VM libvirt still runs ------------------------------------------------------

@pytest.mark.parametrize("stop", [
    [STATE_CHANGE, "onStop", "plain-1"],
    [STATE_CHANGE, "stop", "plain-1"],
    [QEMU_HOOK, "plain-1", "release", "end", "-"],
])
def test_a_stop_while_the_vm_runs_changes_nothing(host: FakeHost, stop: list[str]) -> None:
    root = host.root
    made = started_with_vgpus(host)
    before = state_of(root)
    for _ in range(2):  # late, then repeated
        res = run(stop, root)
        assert res.returncode == 0, res.stderr
        assert state_of(root)["allocations"] == before["allocations"]
        assert set(made) <= live_mdevs(root), "no vGPU removed under a running guest"
    log = Path(root, "var/log/gpulib/gpulib.log")
    assert "plain-1 is running" in log.read_text()
    # libvirt stops it: the status file goes, then the stop releases.
    host.stop_domain("plain-1")
    assert run(stop, root).returncode == 0
    assert state_of(root)["allocations"] == {}
    assert not set(made) & live_mdevs(root)


# -- 3. a start under a running VM's name with another domain UUID ---------------------------------

def test_a_start_under_a_running_vms_name_is_refused(host: FakeHost) -> None:
    root = host.root
    made = started_with_vgpus(host)
    before = state_of(root)
    impostor = meta_xml(uuid=U_OTHER)
    res = as_agent(root, impostor)
    assert res.returncode == 1
    assert b"plain-1 is already running as domain " + U_VM.encode() in res.stdout
    res = run([QEMU_HOOK, "plain-1", "prepare", "begin", "-"], root, stdin=impostor.encode())
    assert res.returncode == 1 and b"already running" in res.stderr
    assert state_of(root)["allocations"] == before["allocations"]
    assert set(made) <= live_mdevs(root)


# -- 4. a retried start replaces the earlier attempt -----------------------------------------------

def test_a_retried_start_holds_only_what_it_planned(host: FakeHost) -> None:
    root = host.root
    transform_ok(root, pci_xml("i-2-50-VM", U_VM, RTX))  # attempt 1 fails in libvirt
    first = state_of(root)["allocations"]["i-2-50-VM"]
    assert {d["id"] for d in first["devices"]} == {RTX, "0000:3b:00.1"}
    os.utime(Path(root, STATE), None)
    dom = transform_ok(root, pci_xml("i-2-50-VM", U_VM, T4_WHOLE))  # attempt 2 runs
    second = state_of(root)["allocations"]["i-2-50-VM"]
    assert {d["id"] for d in second["devices"]} == {T4_WHOLE}
    assert second["status"] == "pending" and second["uptime"] > first["uptime"], \
        "the clock of the retry starts again"
    libvirt_runs(host, dom)
    assert run([STATE_CHANGE, "onStart", "i-2-50-VM"], root).returncode == 0
    assert used_by(root, RTX) is None
    transform_ok(root, pci_xml("i-2-51-VM", U_OTHER, RTX))


def test_a_retry_destroys_the_on_demand_vgpus_only_its_earlier_attempt_made(
        host: FakeHost) -> None:
    root = host.root
    made = hostdev_uuids(transform_ok(root, meta_xml()))  # plain libvirt: never started
    assert set(made) <= live_mdevs(root)
    # The same VM now names a whole GPU instead (its definition was edited).
    transform_ok(root, pci_xml("plain-1", U_VM, T4_WHOLE))
    st = state_of(root)
    assert {d["id"] for d in st["allocations"]["plain-1"]["devices"]} == {T4_WHOLE}
    assert not set(made) & live_mdevs(root) and not set(made) & set(st["vgpus"])
    assert st["intents"] == []


# -- 5. stops are journaled: a full disk and a kill at every write ---------------------------------

def _worker(root: str, n: int, argv: list[str], mode: str = "kill"
            ) -> subprocess.CompletedProcess[bytes]:
    env = hook_env(root)
    if mode == "enospc":
        env["CRASH_WORKER_MODE"] = "enospc"
    return subprocess.run([sys.executable, "-m", "tests.helpers.crash_worker", str(n),
                           *argv], capture_output=True, env=env, cwd=str(REPO), timeout=60)


def _stopped_vm_with_vgpus(tmp: Path, tag: str, count: int = 3) -> tuple[FakeHost, list[str]]:
    host = build_demo(str(tmp / tag))
    host.write_file(BOOT_ID, "boot-1\n", 0o444)
    made = started_with_vgpus(host, count)
    host.stop_domain("plain-1")
    return host, made


def _explained(root: str, made: list[str]) -> None:
    """The state never names a vGPU that is gone without an intent explaining it."""
    st = state_of(root)
    live = live_mdevs(root)
    removing = {i["id"] for i in st["intents"] if i["action"] == "remove-mdev"}
    for alloc in st["allocations"].values():
        for d in alloc["devices"]:
            if d["kind"] == "mdev":
                assert d["id"] in live or d["id"] in removing, (d, st)
    for u in made:
        if u in st["vgpus"]:
            assert u in live or u in removing, (u, st)


@pytest.mark.slow
def test_kill_an_onstop_at_every_write_then_the_next_run_settles(tmp_path: Path) -> None:
    stop = ["gpulib.hooks.statechange", "onStop", "plain-1"]
    n = 1
    while True:
        host, made = _stopped_vm_with_vgpus(tmp_path, f"k{n}")
        res = _worker(host.root, n, stop)
        if res.returncode == 0:
            break
        assert res.returncode == 137, res.stderr
        _explained(host.root, made)
        # The next run of any hook (here another VM's onStart) settles what the
        # killed stop left; reconcile releases what it never got to.
        assert run([STATE_CHANGE, "onStart", "i-9-9-VM"], host.root).returncode == 0
        assert state_of(host.root)["intents"] == []
        _explained(host.root, made)
        cli(host.root, "reconcile")  # it also reports the demo's stray vGPU (not an error)
        st = state_of(host.root)
        assert st["allocations"] == {} and st["intents"] == []
        assert not set(made) & live_mdevs(host.root) and not set(made) & set(st["vgpus"])
        n += 1
    assert n > 3, "the stop made a write per vGPU to kill"


def test_a_full_state_directory_at_a_stop_loses_nothing(tmp_path: Path) -> None:
    stop = ["gpulib.hooks.statechange", "onStop", "plain-1"]
    for n in (1, 3, 6):
        host, made = _stopped_vm_with_vgpus(tmp_path, f"full{n}")
        before = state_of(host.root)
        res = _worker(host.root, n, stop, mode="enospc")
        assert res.returncode == 4, res.stderr
        assert b"No space left" in res.stderr and len(res.stderr.splitlines()) == 1
        _explained(host.root, made)
        if n == 1:  # the first write is the write-ahead record: nothing destroyed yet
            assert state_of(host.root) == before and set(made) <= live_mdevs(host.root)
        # Room again: the next stop (or any hook) finishes the release.
        assert run([STATE_CHANGE, "onStop", "plain-1"], host.root).returncode == 0
        st = state_of(host.root)
        assert st["allocations"] == {} and st["intents"] == []
        assert not set(made) & live_mdevs(host.root)


# -- 6. a damaged state file -----------------------------------------------------------------------

@pytest.mark.parametrize("damage", [b"", b"{\"version\": 3, \"allocations\": [", b"\x00" * 64])
def test_a_damaged_state_file_costs_no_ownership(host: FakeHost, damage: bytes) -> None:
    root = host.root
    assert cli(root, "pool", "apply").returncode == 0
    pool = sorted(u for u, r in state_of(root)["vgpus"].items() if r["pool"])
    assert len(pool) == 2
    transform_ok(root, pci_xml("i-2-60-VM", U_VM, RTX))  # pending: libvirt not yet running it
    Path(root, STATE).write_bytes(damage)
    res = as_agent(root, pci_xml("i-2-61-VM", U_OTHER, RTX))
    assert res.returncode == 1 and b"in use by starting VM i-2-60-VM" in res.stdout, res.stdout
    st = state_of(root)
    assert st["allocations"]["i-2-60-VM"]["status"] == "pending"
    assert sorted(u for u, r in st["vgpus"].items() if r["pool"]) == pool
    assert cli(root, "pool", "apply").returncode == 0
    assert sorted(u for u, r in state_of(root)["vgpus"].items() if r["pool"]) == pool, \
        "no second set of pool members"
    log = Path(root, "var/log/gpulib/gpulib.log").read_text()
    assert "from its copy and the host" in log


@pytest.mark.parametrize("named_by", ["type", "profile"])
def test_a_damaged_state_and_copy_relearn_pools_from_the_configuration(
        host: FakeHost, named_by: str) -> None:
    root = host.root
    if named_by == "profile":
        # The same pool named as CloudStack names it: the rebuild reads each
        # kept vGPU's type name on its parent to tell.
        host.write_file("etc/gpulib/gpulib.conf",
                        "[pool t4-desktops]\nparents = 10de:1eb8\nprofile = grid t4-4q\n"
                        "count = 2\n")
    assert cli(root, "pool", "apply").returncode == 0
    pool = sorted(u for u, r in state_of(root)["vgpus"].items() if r["pool"])
    Path(root, STATE).write_bytes(b"garbage")
    Path(root, STATE + ".bak").write_bytes(b"garbage")
    res = cli(root, "status", "--json")
    assert res.returncode == 0 and "rebuilt" in res.stderr
    assert sorted(u for u, r in state_of(root)["vgpus"].items() if r["pool"]) == pool
    assert not any("named by profile" in line
                   for line in json.loads(res.stdout)["state_unrecovered"])
    res = cli(root, "pool", "apply")
    assert res.returncode == 0
    assert sorted(u for u, r in state_of(root)["vgpus"].items() if r["pool"]) == pool, \
        "no second set of pool members"


def test_state_and_copy_lost_after_a_reboot_keep_the_report_whole(host: FakeHost) -> None:
    """A host gpulib ran on (the boot unit defined its pool vGPUs for mdevctl)
    reboots, and both state.json and its copy are lost before the boot unit
    runs: the rebuild from the host takes the kept vGPUs back from mdevctl's
    definitions (not live now) and their pool from gpulib.conf, so the
    CloudStack report lists every one (the management server would mark a
    missing one Error) and pool apply makes no second set."""
    def report(root: str) -> dict[str, Any]:
        res = cli(root, "discover", "--format", "cloudstack")
        assert res.returncode == 0, res.stderr
        doc: dict[str, Any] = json.loads(res.stdout)
        return doc

    assert cli(host.root, "restore").returncode == 0
    pool = sorted(u for u, r in state_of(host.root)["vgpus"].items() if r["pool"])
    assert len(pool) == 2
    host = reboot(host, build_demo)
    host.write_file(BOOT_ID, "boot-2\n", 0o444)
    root = host.root
    uuids = {v["mdev_uuid"] for g in report(root)["gpus"] for v in g["vgpu_instances"]}
    assert set(pool) <= uuids
    Path(root, STATE).write_bytes(b"garbage")
    Path(root, STATE + ".bak").write_bytes(b"garbage")
    res = cli(root, "status", "--json")
    assert res.returncode == 0 and "rebuilt" in res.stderr
    assert {v["mdev_uuid"] for g in report(root)["gpus"] for v in g["vgpu_instances"]} == uuids
    assert sorted(u for u, r in state_of(root)["vgpus"].items() if r["pool"]) == pool
    assert cli(root, "pool", "apply").returncode == 0
    assert sorted(u for u, r in state_of(root)["vgpus"].items() if r["pool"]) == pool


# -- 7. unmanaged is hands-off, not blind ----------------------------------------------------------

def test_unmanage_is_refused_while_a_vm_holds_part_of_the_gpu(host: FakeHost) -> None:
    root = host.root
    dom = transform_ok(root, meta_xml(count=1))
    libvirt_runs(host, dom)
    res = cli(root, "device", "unmanage", A100)
    assert res.returncode == 1 and "held by running VM plain-1" in res.stderr, res.stderr
    assert state_of(root)["unmanaged"] == []
    res = cli(root, "device", "unmanage", "--force", A100)
    assert res.returncode == 0 and "warning" in res.stderr
    # Whole, the GPU still conflicts with the vGPU the running VM holds.
    res = as_agent(root, pci_xml("i-2-70-VM", U_OTHER, A100))
    assert res.returncode == 1 and b"in use by running VM plain-1" in res.stdout, res.stdout
    res = run([QEMU_HOOK, "i-2-70-VM", "prepare", "begin", "-"], root,
              stdin=pci_xml("i-2-70-VM", U_OTHER, A100).encode())
    assert res.returncode == 1 and b"plain-1" in res.stderr


# -- 8. a VF carrying a kept vGPU is not given whole -----------------------------------------------

def test_a_vf_with_a_live_vgpu_is_not_given_whole(host: FakeHost) -> None:
    root = host.root
    vf0 = os.path.basename(os.path.realpath(os.path.join(host.device_dir(A100), "virtfn0")))
    # The demo's A100 VF 0 carries a live vGPU only a stopped, defined VM names.
    res = as_agent(root, pci_xml("i-2-80-VM", U_VM, vf0))
    assert res.returncode == 1
    assert f"VF {vf0} cannot be given whole: it carries 1 vGPU(s)".encode() in res.stdout
    res = run([QEMU_HOOK, "i-2-80-VM", "prepare", "begin", "-"], root,
              stdin=pci_xml("i-2-80-VM", U_VM, vf0).encode())
    assert res.returncode == 1 and b"cannot be given whole" in res.stderr


# -- 9. UUID spellings -----------------------------------------------------------------------------

@pytest.mark.parametrize("spell", [str.upper, lambda u: u.replace("-", ""),
                                   lambda u: " " + u.replace("-", "").upper() + " "])
def test_an_mdev_uuid_is_read_as_libvirt_reads_it(host: FakeHost, spell: Any) -> None:
    root = host.root
    uuid = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d"  # a demo pool vGPU, known, not live
    res = as_agent(root, mdev_xml("i-2-90-VM", U_VM, spell(uuid)))
    assert res.returncode == 0, res.stdout
    assert uuid in live_mdevs(root)
    assert [d["id"] for d in state_of(root)["allocations"]["i-2-90-VM"]["devices"]] == [uuid]
    res = as_agent(root, mdev_xml("i-2-91-VM", U_OTHER, uuid))
    assert res.returncode == 1 and b"in use by starting VM i-2-90-VM" in res.stdout
