"""A stop belongs to the run it ends (ARCHITECTURE.md, Liveness).

Through the executables on the demo host: a late onStop of a VM's previous
run never frees its newer start; a stop that never completed is finished by
the next hook (and reconcile) before a start is judged, and is not reported
as a running VM's; a migration libvirt abandons after `migrate begin` is
released after `[release] arrival_timeout`; a missing state file beside its
copy is recovered like a damaged one; reconnect under another domain UUID
replaces the allocation; an on-demand vGPU whose owner stopped while another
VM used it goes when its last user stops; `gpulib release` of a starting VM
needs --force. And a stop killed at every write: the next start of another
VM naming the device is admitted with no command between.
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
from tests.hookrun import (
    QEMU_HOOK,
    STATE_CHANGE,
    as_agent,
    hook_env,
    hostdev_uuids,
    libvirt_runs,
    pci_hostdev,
    run,
)

STATE = "var/lib/gpulib/state.json"
LOG = "var/log/gpulib/gpulib.log"
BOOT_ID = "proc/sys/kernel/random/boot_id"
REPO = Path(__file__).resolve().parents[1]
GPULIB = str(Path(sys.executable).parent / "gpulib")

RTX = "0000:3b:00.0"  # GeForce with its HDMI audio in one IOMMU group
A100 = "0000:ca:00.0"
POOL_MDEV = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d"  # a T4 pool member of the demo
U_PA = "4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
U_PB = "5d8f6b02-9e3a-4c75-b2fa-7a1c5e9d3f86"
U_OTHER = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
META = ("<metadata><gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
        "<gpulib:vgpu profile='GRID A100-8C' count='{count}'/></gpulib:gpus></metadata>")


def _mdev(uuid: str) -> str:
    return ("<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'>"
            f"<source><address uuid='{uuid}'/></source></hostdev>")


def xml(name: str, uuid: str, devices: str = "", vgpus: int = 0) -> str:
    meta = META.format(count=vgpus) if vgpus else ""
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid>{meta}<devices>"
            f"<emulator>/usr/bin/qemu-system-x86_64</emulator>{devices}</devices></domain>")


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return demo(tmp_path, "demo")


def demo(tmp: Path, tag: str, conf: str = "") -> FakeHost:
    h = build_demo(str(tmp / tag))
    h.write_file(BOOT_ID, "boot-1\n", 0o444)
    if conf:
        path = Path(h.root, "etc/gpulib/gpulib.conf")
        path.write_text(path.read_text() + "\n" + conf)
    return h


def state_of(root: str) -> dict[str, Any]:
    return json.loads(Path(root, STATE).read_text())  # type: ignore[no-any-return]


def live_mdevs(root: str) -> set[str]:
    return set(os.listdir(os.path.join(root, "sys/bus/mdev/devices")))


def log_of(root: str) -> str:
    path = Path(root, LOG)
    return path.read_text() if path.exists() else ""


def cli(root: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULIB, *args], capture_output=True, text=True, input=stdin,
                          env=hook_env(root), timeout=60)


def transform_ok(root: str, text: str) -> etree._Element:
    res = as_agent(root, text)
    assert res.returncode == 0, res.stdout
    return etree.fromstring(res.stdout)


def started(host: FakeHost, text: str) -> etree._Element:
    """The agent's start: transformer, libvirt runs it, onStart."""
    dom = transform_ok(host.root, text)
    libvirt_runs(host, dom)
    name = dom.findtext("name")
    assert name
    assert run([STATE_CHANGE, "onStart", name], host.root).returncode == 0
    return dom


def whole_used_by(root: str, address: str) -> Any:
    res = cli(root, "discover", "--format", "cloudstack")
    assert res.returncode == 0, res.stderr
    short = address[5:]
    gpu = next(g for g in json.loads(res.stdout)["gpus"] if g["pci_address"] == short)
    return gpu["full_passthrough"]["used_by_vm"]


# -- 1. a late onStop of the previous run --------------------------------------------------------

def test_a_late_onstop_never_frees_a_newer_start(host: FakeHost) -> None:
    root = host.root
    made = hostdev_uuids(started(host, xml("pa", U_PA, vgpus=2)))
    host.stop_domain("pa")  # the run ends; the agent's onStop is late
    again = transform_ok(root, xml("pa", U_PA, vgpus=2))  # the agent starts pa again
    assert hostdev_uuids(again) == made
    assert state_of(root)["allocations"]["pa"]["status"] == "pending"
    res = run([STATE_CHANGE, "onStop", "pa"], root)  # the old run's onStop, at last
    assert res.returncode == 0
    alloc = state_of(root)["allocations"]["pa"]
    assert alloc["status"] == "pending" and sorted(d["id"] for d in alloc["devices"]) == \
        sorted(made)
    assert set(made) <= live_mdevs(root), "the new start's vGPUs were destroyed"
    assert "late onStop of pa" in log_of(root)
    # Its devices stay pa's: another VM naming one is refused as a starting VM's.
    res = as_agent(root, xml("pb", U_PB, _mdev(made[0])))
    assert res.returncode == 1 and b"starting VM pa" in res.stdout, res.stdout
    # libvirt prepares the new run, which fails: its release end ends it.
    res = run([QEMU_HOOK, "pa", "prepare", "begin", "-"], root, stdin=etree.tostring(again))
    assert res.returncode == 0, res.stderr
    assert state_of(root)["allocations"]["pa"]["prepared"] is True
    assert run([QEMU_HOOK, "pa", "release", "end", "-"], root).returncode == 0
    st = state_of(root)
    assert "pa" not in st["allocations"] and not set(made) & live_mdevs(root)


def test_a_late_onstop_of_a_whole_gpu_keeps_the_newer_start(host: FakeHost) -> None:
    root = host.root
    started(host, xml("pa", U_PA, pci_hostdev(RTX)))
    host.stop_domain("pa")
    transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))
    assert run([STATE_CHANGE, "onStop", "pa"], root).returncode == 0
    assert state_of(root)["allocations"]["pa"]["status"] == "pending"
    res = as_agent(root, xml("pb", U_PB, pci_hostdev(RTX)))
    assert res.returncode == 1 and b"in use by starting VM pa" in res.stdout, res.stdout


# -- 2. a stop that never completed ---------------------------------------------------------------

def test_a_lost_stop_is_finished_by_the_next_start(host: FakeHost) -> None:
    root = host.root
    started(host, xml("pa", U_PA, pci_hostdev(RTX)))
    assert whole_used_by(root, RTX) == "pa"
    host.stop_domain("pa")  # no onStop, no release end (lost, killed, ENOSPC)
    # Not reported as held meanwhile: the agent sees the GPU free.
    assert whole_used_by(root, RTX) is None
    res = as_agent(root, xml("pb", U_PB, pci_hostdev(RTX)))
    assert res.returncode == 0, res.stdout
    st = state_of(root)
    assert "pa" not in st["allocations"] and st["allocations"]["pb"]["status"] == "pending"
    log = log_of(root)
    assert f"pci {RTX}, pci 0000:3b:00.1: held by stopped VM pa, released now" in log
    assert "running VM pa" not in log


def test_a_lost_stop_of_on_demand_vgpus_destroys_them_at_the_next_hook(host: FakeHost) -> None:
    root = host.root
    made = hostdev_uuids(started(host, xml("pa", U_PA, vgpus=2)))
    host.stop_domain("pa")
    # Any hook: here another VM's onStart, which holds nothing.
    assert run([STATE_CHANGE, "onStart", "pz"], root).returncode == 0
    st = state_of(root)
    assert st["allocations"] == {} and st["intents"] == []
    assert not set(made) & live_mdevs(root) and not set(made) & set(st["vgpus"])


def test_reconcile_names_a_lost_stop_as_what_it_is(host: FakeHost) -> None:
    root = host.root
    started(host, xml("pa", U_PA, pci_hostdev(RTX)))
    host.stop_domain("pa")
    res = cli(root, "reconcile")
    assert "held by stopped VM pa, released now" in res.stdout, res.stdout
    assert "pa" not in state_of(root)["allocations"]


# -- 7. an abandoned migration ---------------------------------------------------------------------

def _arrive(tmp: Path, root: str) -> str:
    """migrate begin of mig-1, running on another demo host with an A100 vGPU; the
    XML libvirt starts here."""
    src = demo(tmp, "source")
    live = etree.tostring(started(src, xml("mig-1", U_PA, vgpus=1))).decode()
    res = run([QEMU_HOOK, "mig-1", "migrate", "begin", "-"], root, stdin=live.encode())
    assert res.returncode == 0, res.stderr
    alloc = state_of(root)["allocations"]["mig-1"]
    assert alloc["status"] == "pending" and alloc["arriving"] is True
    return res.stdout.decode()


def test_an_abandoned_migration_is_released_after_the_arrival_timeout(tmp_path: Path) -> None:
    host = demo(tmp_path, "quick", "[release]\narrival_timeout = 0\n")
    root = host.root
    incoming = _arrive(tmp_path, root)
    made = hostdev_uuids(etree.fromstring(incoming.encode()))
    assert made and set(made) <= live_mdevs(root)
    # libvirt abandoned it: no prepare begin, no release end. Any hook frees it.
    assert run([STATE_CHANGE, "onStart", "pz"], root).returncode == 0
    st = state_of(root)
    assert "mig-1" not in st["allocations"] and not set(made) & live_mdevs(root)
    assert "incoming migration of mig-1 that libvirt abandoned" in log_of(root)


def test_an_arrival_whose_prepare_begin_follows_is_a_start(tmp_path: Path) -> None:
    host = demo(tmp_path, "quick", "[release]\narrival_timeout = 0\n")
    root = host.root
    incoming = _arrive(tmp_path, root)
    made = hostdev_uuids(etree.fromstring(incoming.encode()))
    res = run([QEMU_HOOK, "mig-1", "prepare", "begin", "-"], root, stdin=incoming.encode())
    assert res.returncode == 0, res.stderr
    alloc = state_of(root)["allocations"]["mig-1"]
    assert alloc["status"] == "pending" and "arriving" not in alloc
    assert run([STATE_CHANGE, "onStart", "pz"], root).returncode == 0
    assert "mig-1" in state_of(root)["allocations"] and set(made) <= live_mdevs(root)


def test_an_arrival_within_its_timeout_is_kept(tmp_path: Path, host: FakeHost) -> None:
    root = host.root
    _arrive(tmp_path, root)  # the default: 10 s
    assert run([STATE_CHANGE, "onStart", "pz"], root).returncode == 0
    assert state_of(root)["allocations"]["mig-1"]["arriving"] is True


# -- 3. a missing state file -----------------------------------------------------------------------

def test_a_missing_state_file_is_recovered_from_its_copy(host: FakeHost) -> None:
    root = host.root
    transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))  # pending: libvirt not running it yet
    made = hostdev_uuids(transform_ok(root, xml("pc", U_OTHER, vgpus=1)))
    assert Path(root, STATE + ".bak").exists()
    Path(root, STATE).unlink()
    res = cli(root, "status", "--json")
    assert res.returncode == 0, res.stderr
    assert "missing" in res.stderr, res.stderr
    st = state_of(root)
    assert st["allocations"]["pa"]["status"] == "pending"
    assert st["vgpus"][made[0]]["on_demand"] is True
    assert "was missing" in log_of(root)
    # Removed again, the next start recovers it before judging.
    Path(root, STATE).unlink()
    res = as_agent(root, xml("pb", U_PB, pci_hostdev(RTX)))
    assert res.returncode == 1 and b"in use by starting VM pa" in res.stdout, res.stdout
    st = state_of(root)
    assert st["allocations"]["pa"]["status"] == "pending"
    assert st["vgpus"][made[0]]["on_demand"] is True


def test_without_any_copy_gpulib_starts_empty(host: FakeHost) -> None:
    root = host.root
    transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))
    Path(root, STATE).unlink()
    Path(root, STATE + ".bak").unlink()
    res = cli(root, "status", "--json")
    assert res.returncode == 0 and "missing" not in res.stderr, res.stderr
    assert json.loads(res.stdout)["allocations"] == {}


# -- 4. reconnect under another domain UUID --------------------------------------------------------

def test_reconnect_under_another_uuid_replaces_the_allocation(host: FakeHost) -> None:
    root = host.root
    made = hostdev_uuids(started(host, xml("pa", U_PA, pci_hostdev(RTX), vgpus=1)))
    # pa is now another domain (redefined and started outside the hooks) with a pool vGPU.
    host.stop_domain("pa")
    host.add_running_domain("pa", U_OTHER, mdevs=(made[0],))
    res = run([QEMU_HOOK, "pa", "reconnect", "begin", "-"], root,
              stdin=xml("pa", U_OTHER, _mdev(made[0])).encode())
    assert res.returncode == 0
    alloc = state_of(root)["allocations"]["pa"]
    assert alloc["domain_uuid"] == U_OTHER and alloc["status"] == "active"
    assert [d["id"] for d in alloc["devices"]] == [made[0]], "the old plan's GPU is not held"
    assert whole_used_by(root, RTX) is None
    assert made[0] in live_mdevs(root), "the running domain's vGPU stays"


# -- 5. an on-demand vGPU whose owner stopped while another VM used it -----------------------------

def test_an_ownerless_on_demand_vgpu_goes_when_its_last_user_stops(host: FakeHost) -> None:
    root = host.root
    made = hostdev_uuids(started(host, xml("pa", U_PA, vgpus=2)))
    # pb runs with pa's first vGPU, started without gpulib's hooks.
    host.add_running_domain("pb", U_PB, mdevs=(made[0],))
    host.stop_domain("pa")
    assert run([STATE_CHANGE, "onStop", "pa"], root).returncode == 0
    st = state_of(root)
    assert made[0] in live_mdevs(root) and made[1] not in live_mdevs(root)
    assert st["vgpus"][made[0]]["on_demand"] and st["allocations"] == {}
    # pb stops: its last user. Its release end (pb holds nothing of gpulib's).
    host.stop_domain("pb")
    assert run([QEMU_HOOK, "pb", "release", "end", "-"], root).returncode == 0
    st = state_of(root)
    assert made[0] not in live_mdevs(root) and made[0] not in st["vgpus"]
    assert st["intents"] == []
    # pa's next start makes its vGPUs again under the same UUIDs.
    assert hostdev_uuids(started(host, xml("pa", U_PA, vgpus=2))) == made


def test_reconcile_reports_and_removes_an_ownerless_on_demand_vgpu(host: FakeHost) -> None:
    root = host.root
    made = hostdev_uuids(started(host, xml("pa", U_PA, vgpus=1)))
    host.add_running_domain("pb", U_PB, mdevs=(made[0],))
    host.stop_domain("pa")
    assert run([STATE_CHANGE, "onStop", "pa"], root).returncode == 0
    res = cli(root, "reconcile")
    assert made[0] not in res.stdout or "released ownerless" not in res.stdout
    assert made[0] in live_mdevs(root), "pb still uses it"
    host.stop_domain("pb")  # no hook at all for pb
    res = cli(root, "reconcile")
    assert f"released ownerless on-demand device mdev {made[0]}" in res.stdout, res.stdout
    assert made[0] not in live_mdevs(root) and made[0] not in state_of(root)["vgpus"]


# -- 6. gpulib release of a starting VM ------------------------------------------------------------

def test_release_of_a_starting_vm_needs_force(host: FakeHost) -> None:
    root = host.root
    transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))
    res = cli(root, "release", "pa")
    assert res.returncode != 0 and "pa is starting" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert state_of(root)["allocations"]["pa"]["status"] == "pending"
    # mdev remove and device unmanage say the same of its devices.
    res = cli(root, "device", "unmanage", RTX)
    assert res.returncode != 0 and "starting VM pa" in res.stderr, res.stderr
    res = cli(root, "release", "pa", "--force")
    assert res.returncode == 0 and "warning" in res.stderr, res.stderr
    assert "pa" not in state_of(root)["allocations"]


# -- a stop killed at every write, then another VM's start -----------------------------------------

def _worker(root: str, n: int, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "tests.helpers.crash_worker", str(n), *argv],
                          capture_output=True, env=hook_env(root), cwd=str(REPO), timeout=60)


@pytest.mark.slow
def test_a_stop_killed_at_every_write_then_another_start_is_admitted(tmp_path: Path) -> None:
    stop = ["gpulib.hooks.statechange", "onStop", "pa"]
    n = 1
    while True:
        host = demo(tmp_path, f"k{n}")
        root = host.root
        made = hostdev_uuids(started(host, xml("pa", U_PA, _mdev(POOL_MDEV), vgpus=2)))
        assert POOL_MDEV in made and len(made) == 3
        host.stop_domain("pa")
        res = _worker(root, n, stop)
        if res.returncode == 0:
            break
        assert res.returncode == 137, res.stderr
        # No command between: another VM naming pa's pool vGPU is admitted.
        res = as_agent(root, xml("pb", U_PB, _mdev(POOL_MDEV)))
        assert res.returncode == 0, (n, res.stdout)
        st = state_of(root)
        assert "pa" not in st["allocations"] and st["intents"] == []
        assert [d["id"] for d in st["allocations"]["pb"]["devices"]] == [POOL_MDEV]
        on_demand = [u for u in made if u != POOL_MDEV]
        assert not set(on_demand) & live_mdevs(root)
        assert not set(on_demand) & set(st["vgpus"])
        n += 1
    assert n > 3, "the stop made a write per vGPU to kill"
