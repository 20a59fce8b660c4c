"""A hook acts on its own run, and "is this run over?" has one answer
(ARCHITECTURE.md, Liveness).

Through the executables, on the demo host and on a host written with plain
os calls (tests/handmade.py, libvirt's status files written here by hand):

* a late onStart of a VM's previous run never makes its newer, pending start
  active (libvirt has not launched it); its own onStart does;
* a late `release end` of the previous run never frees the newer start the
  transformer recorded, nor destroys the vGPUs made for it; the `release
  end` of a run libvirt prepared ends it;
* `reconnect begin` under another domain UUID replaces the old allocation
  even when the running domain has no GPU;
* the report never calls a device used by a run the hooks would release (a
  start past its grace, an abandoned arrival), and the next start takes it;
* under plain libvirt, `prepare begin` refuses a domain whose gpulib metadata
  asks for vGPUs it has no hostdev for, naming `gpulib attach`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from gpulib.context import Context
from gpulib.liveness import Liveness
from gpulib.records import Allocation, utc_now
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import build_demo
from tests import handmade
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
GPULIB = str(Path(sys.executable).parent / "gpulib")

RTX = "0000:3b:00.0"  # demo: a GeForce with its HDMI audio in one IOMMU group
MI300X = "0001:e6:00.0"  # handmade: a processing accelerator alone in its group
U_PA = "4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
U_PB = "5d8f6b02-9e3a-4c75-b2fa-7a1c5e9d3f86"
U_OTHER = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
META = ("<metadata><gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
        "<gpulib:vgpu profile='GRID A100-8C' count='{count}'/></gpulib:gpus></metadata>")


def xml(name: str, uuid: str, devices: str = "", vgpus: int = 0) -> str:
    meta = META.format(count=vgpus) if vgpus else ""
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid>{meta}<devices>"
            f"<emulator>/usr/bin/qemu-system-x86_64</emulator>{devices}</devices></domain>")


def state_of(root: str) -> dict[str, Any]:
    return json.loads(Path(root, STATE).read_text())  # type: ignore[no-any-return]


def write_state(root: str, doc: dict[str, Any]) -> None:
    Path(root, STATE).write_text(json.dumps(doc, indent=1, sort_keys=True))


def live_mdevs(root: str) -> set[str]:
    return set(os.listdir(os.path.join(root, "sys/bus/mdev/devices")))


def log_of(root: str) -> str:
    path = Path(root, LOG)
    return path.read_text() if path.exists() else ""


def cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULIB, *args], capture_output=True, text=True,
                          env=hook_env(root), timeout=60)


def transform_ok(root: str, text: str) -> etree._Element:
    res = as_agent(root, text)
    assert res.returncode == 0, res.stdout
    return etree.fromstring(res.stdout)


def report(root: str) -> list[dict[str, Any]]:
    res = cli(root, "discover", "--format", "cloudstack")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["gpus"]  # type: ignore[no-any-return]


def whole_used_by(root: str, address: str) -> Any:
    short = address[5:] if address.startswith("0000:") else address
    gpu = next(g for g in report(root) if g["pci_address"] == short)
    return gpu["full_passthrough"]["used_by_vm"]


def vgpu_users(root: str) -> dict[str, Any]:
    return {v["mdev_uuid"]: v["used_by_vm"] for g in report(root)
            for v in g["vgpu_instances"]}


@pytest.fixture
def demo(tmp_path: Path) -> FakeHost:
    h = build_demo(str(tmp_path / "demo"))
    h.write_file("proc/sys/kernel/random/boot_id", "boot-1\n", 0o444)
    return h


# -- a host gpulib's builder did not write -------------------------------------------------------

def _w(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


@pytest.fixture
def hand(tmp_path: Path) -> str:
    root = str(tmp_path / "hand") + "/"
    handmade.build(root)
    _w(os.path.join(root, "proc/sys/kernel/random/boot_id"), "boot-h\n")
    return root


def libvirt_launches(root: str, name: str, uuid: str, pci: str) -> None:
    """libvirtd's status file for a run, written by hand as libvirt writes it."""
    d, rest = pci.split(":", 1)
    b, sf = rest.split(":")
    s, f = sf.split(".")
    _w(os.path.join(root, f"run/libvirt/qemu/{name}.xml"),
       f"<domstatus state='running' reason='booted' pid='{os.getpid()}'>\n"
       f"<domain type='kvm' id='7'>\n<name>{name}</name>\n<uuid>{uuid}</uuid>\n<devices>\n"
       "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
       f"<address domain='0x{d}' bus='0x{b}' slot='0x{s}' function='0x{f}'/></source>"
       "</hostdev>\n</devices>\n</domain>\n</domstatus>\n")


def libvirt_stops(root: str, name: str) -> None:
    os.unlink(os.path.join(root, f"run/libvirt/qemu/{name}.xml"))


# -- 1. a late onStart of the previous run ---------------------------------------------------------

def test_a_late_onstart_never_activates_a_newer_start(demo: FakeHost) -> None:
    root = demo.root
    first = transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))
    libvirt_runs(demo, first)
    demo.stop_domain("pa")  # run 1 ends before its onStart came
    assert run([STATE_CHANGE, "onStop", "pa"], root).returncode == 0
    transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))  # run 2, not launched yet
    # Run 1's onStart, at last: run 2 is not launched, it stays pending.
    assert run([STATE_CHANGE, "onStart", "pa"], root).returncode == 0
    assert state_of(root)["allocations"]["pa"]["status"] == "pending"
    assert "late onStart of pa" in log_of(root)
    # So the next hook does not end it as a stop that did not complete, and
    # the GPU is nobody else's.
    assert run([STATE_CHANGE, "onStart", "pz"], root).returncode == 0
    assert state_of(root)["allocations"]["pa"]["status"] == "pending"
    res = as_agent(root, xml("pb", U_PB, pci_hostdev(RTX)))
    assert res.returncode == 1 and b"in use by starting VM pa" in res.stdout, res.stdout
    assert whole_used_by(root, RTX) == "pa"
    # libvirt launches run 2; its own onStart makes it active.
    libvirt_runs(demo, etree.fromstring(xml("pa", U_PA, pci_hostdev(RTX)).encode()))
    assert run([STATE_CHANGE, "onStart", "pa"], root).returncode == 0
    assert state_of(root)["allocations"]["pa"]["status"] == "active"


def test_a_status_file_older_than_the_start_is_of_another_run(demo: FakeHost) -> None:
    """Liveness.launched: the status file must name the domain and be no older
    than the allocation."""
    demo.add_running_domain("pa", U_PA)
    live = Liveness(Context.for_root(demo.root).sysfs)
    now = Allocation("pa", U_PA, since=utc_now())
    assert live.launched(now)
    assert not live.launched(Allocation("pa", U_OTHER, since=utc_now())), "another domain"
    later = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
    assert not live.launched(Allocation("pa", U_PA, since=later)), "written before the start"
    assert not live.launched(Allocation("pz", U_PA, since=utc_now())), "no status file"


def test_a_late_onstart_on_a_handmade_host(hand: str) -> None:
    transform_ok(hand, xml("pa", U_PA, pci_hostdev(MI300X)))
    libvirt_launches(hand, "pa", U_PA, MI300X)
    libvirt_stops(hand, "pa")
    transform_ok(hand, xml("pa", U_PA, pci_hostdev(MI300X)))
    assert run([STATE_CHANGE, "onStart", "pa"], hand).returncode == 0
    assert state_of(hand)["allocations"]["pa"]["status"] == "pending"
    assert run([STATE_CHANGE, "onStart", "pz"], hand).returncode == 0
    res = as_agent(hand, xml("pb", U_PB, pci_hostdev(MI300X)))
    assert res.returncode == 1 and b"starting VM pa" in res.stdout, res.stdout
    libvirt_launches(hand, "pa", U_PA, MI300X)
    assert run([QEMU_HOOK, "pa", "started", "begin", "-"], hand).returncode == 0
    assert state_of(hand)["allocations"]["pa"]["status"] == "active"


# -- 2. a late release end of the previous run -----------------------------------------------------

def test_a_late_release_end_never_frees_a_newer_start(demo: FakeHost) -> None:
    root = demo.root
    first = transform_ok(root, xml("pa", U_PA, vgpus=2))
    made = hostdev_uuids(first)
    libvirt_runs(demo, first)
    assert run([STATE_CHANGE, "onStart", "pa"], root).returncode == 0
    demo.stop_domain("pa")  # run 1 stops; libvirt's release end is still to come
    again = transform_ok(root, xml("pa", U_PA, vgpus=2))  # run 2: the same vGPUs, made again
    assert hostdev_uuids(again) == made and set(made) <= live_mdevs(root)
    assert run([QEMU_HOOK, "pa", "release", "end", "-"], root).returncode == 0
    alloc = state_of(root)["allocations"]["pa"]
    assert alloc["status"] == "pending"
    assert sorted(d["id"] for d in alloc["devices"]) == sorted(made)
    assert set(made) <= live_mdevs(root), "the newer start's vGPUs were destroyed"
    assert "late release end of pa" in log_of(root)
    # libvirt prepares and launches run 2: it runs with its vGPUs.
    res = run([QEMU_HOOK, "pa", "prepare", "begin", "-"], root, stdin=etree.tostring(again))
    assert res.returncode == 0, res.stderr
    libvirt_runs(demo, again)
    assert run([QEMU_HOOK, "pa", "started", "begin", "-"], root).returncode == 0
    assert state_of(root)["allocations"]["pa"]["status"] == "active"
    assert set(made) <= live_mdevs(root)
    # Its own release end ends it.
    demo.stop_domain("pa")
    assert run([QEMU_HOOK, "pa", "release", "end", "-"], root).returncode == 0
    assert "pa" not in state_of(root)["allocations"] and not set(made) & live_mdevs(root)


def test_the_release_end_of_a_failed_prepared_start_ends_it(demo: FakeHost) -> None:
    root = demo.root
    text = xml("pa", U_PA, pci_hostdev(RTX))
    res = run([QEMU_HOOK, "pa", "prepare", "begin", "-"], root, stdin=text.encode())
    assert res.returncode == 0, res.stderr
    assert state_of(root)["allocations"]["pa"]["prepared"] is True
    # QEMU never came up: libvirt's release end.
    assert run([QEMU_HOOK, "pa", "release", "end", "-"], root).returncode == 0
    assert "pa" not in state_of(root)["allocations"]
    assert whole_used_by(root, RTX) is None


def test_a_late_release_end_on_a_handmade_host(hand: str) -> None:
    transform_ok(hand, xml("pa", U_PA, pci_hostdev(MI300X)))
    libvirt_launches(hand, "pa", U_PA, MI300X)
    assert run([STATE_CHANGE, "onStart", "pa"], hand).returncode == 0
    libvirt_stops(hand, "pa")
    transform_ok(hand, xml("pa", U_PA, pci_hostdev(MI300X)))
    assert run([QEMU_HOOK, "pa", "release", "end", "-"], hand).returncode == 0
    assert state_of(hand)["allocations"]["pa"]["status"] == "pending"
    assert whole_used_by(hand, MI300X) == "pa"


# -- 3. reconnect under another domain UUID, without a GPU -----------------------------------------

def test_reconnect_of_a_gpu_less_domain_replaces_the_old_allocation(demo: FakeHost) -> None:
    root = demo.root
    first = transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))
    libvirt_runs(demo, first)
    assert run([STATE_CHANGE, "onStart", "pa"], root).returncode == 0
    # libvirtd restarts; meanwhile pa was redefined as another domain, no GPU.
    demo.stop_domain("pa")
    demo.add_running_domain("pa", U_OTHER)
    res = run([QEMU_HOOK, "pa", "reconnect", "begin", "-"], root,
              stdin=xml("pa", U_OTHER).encode())
    assert res.returncode == 0
    assert "pa" not in state_of(root)["allocations"]
    assert whole_used_by(root, RTX) is None
    assert transform_ok(root, xml("pb", U_PB, pci_hostdev(RTX))) is not None
    # Reconnect of the same domain changes nothing.
    before = Path(root, STATE).read_bytes()
    res = run([QEMU_HOOK, "pb", "reconnect", "begin", "-"], root,
              stdin=xml("pb", U_PB).encode())
    assert res.returncode == 0 and Path(root, STATE).read_bytes() == before


# -- 4. one answer to "is this run over?" ----------------------------------------------------------

def _age(root: str, vm: str, seconds: float) -> None:
    """Make vm's allocation `seconds` older on the boot clock."""
    doc = state_of(root)
    doc["allocations"][vm]["uptime"] -= seconds
    write_state(root, doc)


def test_the_report_never_shows_a_start_past_its_grace(demo: FakeHost) -> None:
    root = demo.root
    made = hostdev_uuids(transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX), vgpus=1)))
    assert whole_used_by(root, RTX) == "pa" and vgpu_users(root)[made[0]] == "pa"
    _age(root, "pa", 121)  # libvirt never launched it: dead past its grace
    users = vgpu_users(root)
    assert whole_used_by(root, RTX) is None
    assert made[0] not in users, "an on-demand vGPU about to go is not offered"
    # The hooks agree: the next start takes the GPU.
    transform_ok(root, xml("pb", U_PB, pci_hostdev(RTX)))
    st = state_of(root)
    assert "pa" not in st["allocations"] and "pb" in st["allocations"]
    assert made[0] not in live_mdevs(root)


def test_the_report_never_shows_a_start_past_its_grace_on_a_handmade_host(hand: str) -> None:
    transform_ok(hand, xml("pa", U_PA, pci_hostdev(MI300X)))
    assert whole_used_by(hand, MI300X) == "pa"
    _age(hand, "pa", 121)
    assert whole_used_by(hand, MI300X) is None
    transform_ok(hand, xml("pb", U_PB, pci_hostdev(MI300X)))
    assert set(state_of(hand)["allocations"]) == {"pb"}
    assert whole_used_by(hand, MI300X) == "pb"


def test_a_running_vm_past_the_grace_stays_used(demo: FakeHost) -> None:
    root = demo.root
    dom = transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))
    libvirt_runs(demo, dom)  # launched, its onStart not come yet
    _age(root, "pa", 500)
    assert whole_used_by(root, RTX) == "pa"
    res = as_agent(root, xml("pb", U_PB, pci_hostdev(RTX)))
    assert res.returncode == 1, res.stdout


# -- 5. a request plain libvirt cannot meet --------------------------------------------------------

def test_prepare_begin_refuses_a_request_without_hostdevs(demo: FakeHost) -> None:
    root = demo.root
    before = Path(root, STATE).read_bytes() if Path(root, STATE).exists() else None
    mdevs = live_mdevs(root)
    res = run([QEMU_HOOK, "web1", "prepare", "begin", "-"], root,
              stdin=xml("web1", U_PA, vgpus=2).encode())
    assert res.returncode == 1, res.stderr
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "gpulib attach web1" in lines[0], lines
    assert "2 x GRID A100-8C" in lines[0]
    assert live_mdevs(root) == mdevs
    after = Path(root, STATE).read_bytes() if Path(root, STATE).exists() else None
    assert after is None or "web1" not in json.loads(after)["allocations"]
    assert before is None or json.loads(before)["allocations"] == json.loads(
        after or b"{}").get("allocations")


def test_prepare_begin_accepts_a_request_its_hostdevs_meet(demo: FakeHost) -> None:
    root = demo.root
    # The transformer (the pipe workflow) inserts the hostdevs; libvirt then starts that.
    dom = transform_ok(root, xml("web1", U_PA, vgpus=1))
    res = run([QEMU_HOOK, "web1", "prepare", "begin", "-"], root, stdin=etree.tostring(dom))
    assert res.returncode == 0, res.stderr


# -- 6. a host gpulib did not set up ---------------------------------------------------------------

U_FOREIGN = "7e2d4c1a-3b5f-4e6d-8a9b-0c1d2e3f4a5b"
U_FOREIGN2 = "8f3e5d2b-4c6a-4f7e-9b0c-1d2e3f4a5b6c"
DEMO_T4 = "0000:af:00.0"


@pytest.mark.parametrize("learnt_by", ["reconnect", "another start"])
def test_a_vgpu_gpulib_did_not_make_is_made_again_after_a_reboot(demo: FakeHost,
                                                                 learnt_by: str) -> None:
    from tests.hosts import reboot

    root = demo.root
    # Made before gpulib was installed (straight through sysfs), used by a running VM.
    demo.add_mdev(U_FOREIGN, DEMO_T4, "nvidia-232")
    demo.add_running_domain("busy", U_PA, mdevs=(U_FOREIGN,))
    if learnt_by == "reconnect":
        res = run([QEMU_HOOK, "busy", "reconnect", "begin", "-"], root,
                  stdin=xml("busy", U_PA, _mdev(U_FOREIGN)).encode())
        assert res.returncode == 0
    else:
        transform_ok(root, xml("other", U_PB, pci_hostdev(RTX)))
    rec = state_of(root)["vgpus"][U_FOREIGN]
    assert (rec["parent"], rec["type_id"], rec["remembered"]) == (DEMO_T4, "nvidia-232", True)
    assert rec["pool"] == "manual", "remembered, not owned: the administrator's"
    # Its VM stops: the vGPU stays (gpulib did not make it).
    demo.stop_domain("busy")
    assert run([QEMU_HOOK, "busy", "release", "end", "-"], root).returncode == 0
    assert U_FOREIGN in live_mdevs(root)
    # A reboot, and the boot unit: not gpulib's to make, and not forgotten either.
    host = reboot(demo, build_demo)
    host.write_file("proc/sys/kernel/random/boot_id", "boot-2\n", 0o444)
    root = host.root
    assert cli(root, "restore").returncode in (0, 1)
    assert U_FOREIGN not in live_mdevs(root)
    assert state_of(root)["vgpus"][U_FOREIGN]["remembered"] is True
    # The VM's next start makes it again on its parent, as its type.
    res = as_agent(root, xml("busy", U_PA, _mdev(U_FOREIGN)))
    assert res.returncode == 0, res.stdout
    assert U_FOREIGN in live_mdevs(root)
    link = Path(root, "sys/bus/mdev/devices", U_FOREIGN)
    assert os.path.basename(os.readlink(link / "mdev_type")) == "nvidia-232"
    assert os.path.basename(os.path.dirname(os.path.realpath(link))) == DEMO_T4


def _mdev(uuid: str) -> str:
    return ("<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'>"
            f"<source><address uuid='{uuid}'/></source></hostdev>")


# -- 7. state lost entirely ------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_state_lost_with_its_copy_is_rebuilt_from_the_host(demo: FakeHost,
                                                             damage: str) -> None:
    root = demo.root
    assert cli(root, "restore").returncode == 0  # the boot unit: the pool's vGPUs are live
    dom = transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX)))
    libvirt_runs(demo, dom)
    assert run([STATE_CHANGE, "onStart", "pa"], root).returncode == 0
    transform_ok(root, xml("pc", U_OTHER, vgpus=1))  # pending: its claim cannot be recovered
    report_before = {g["pci_address"]: (sorted(v["mdev_uuid"] for v in g["vgpu_instances"]),
                                        sorted(v["vf_pci_address"] for v in g["vf_instances"]))
                     for g in report(root)}
    state = Path(root, STATE)
    if damage == "missing":
        state.unlink()
    else:
        state.write_text("{not json")
    Path(root, STATE + ".bak").write_text("{not json either")
    res = cli(root, "status", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    lost = doc["state_unrecovered"]
    assert any(line.startswith("pending starts") for line in lost), lost
    st = state_of(root)
    assert st["allocations"]["pa"]["status"] == "active", "the running VM's devices"
    assert RTX in [d["id"] for d in st["allocations"]["pa"]["devices"]]
    assert "pc" not in st["allocations"]
    assert "not recovered: pending starts" in log_of(root)
    text = cli(root, "status")
    assert "State rebuilt from the host; not recovered:" in text.stdout, text.stdout
    metrics = cli(root, "metrics").stdout
    line = next(x for x in metrics.splitlines() if x.startswith("gpulib_state_unrecovered "))
    assert float(line.split()[1]) == len(lost)
    # The report keeps listing the pool's vGPUs and the recorded VFs.
    assert whole_used_by(root, RTX) == "pa"
    after = {g["pci_address"]: (sorted(v["mdev_uuid"] for v in g["vgpu_instances"]),
                                sorted(v["vf_pci_address"] for v in g["vf_instances"]))
             for g in report(root)}
    pool = {u for u, r in st["vgpus"].items() if r["pool"] == "t4-desktops"}
    assert pool, "the pool's members are known again"
    for address, (vgpus, vfs) in report_before.items():
        assert after[address][1] == vfs, address
        assert set(vgpus) & pool <= set(after[address][0]), address


def test_the_release_end_after_a_failed_prepare_begin_ends_the_start(demo: FakeHost) -> None:
    """The transformer recorded the start; libvirt's prepare begin of it fails
    (here: libvirt was given the XML without the devices the transformer
    added), and its release end follows: that run is over, not a newer one."""
    root = demo.root
    transform_ok(root, xml("pa", U_PA, pci_hostdev(RTX), vgpus=1))
    res = run([QEMU_HOOK, "pa", "prepare", "begin", "-"], root,
              stdin=xml("pa", U_PA, pci_hostdev(RTX), vgpus=1).encode())
    assert res.returncode == 1 and b"gpulib attach pa" in res.stderr, res.stderr
    assert state_of(root)["allocations"]["pa"]["prepared"] is True
    assert run([QEMU_HOOK, "pa", "release", "end", "-"], root).returncode == 0
    assert "pa" not in state_of(root)["allocations"]
    assert whole_used_by(root, RTX) is None


HAND_MDEV = "0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"  # handmade: live on 0000:ca:00.5, vm-running's


def test_a_handmade_hosts_running_vgpu_is_remembered_by_the_next_start(hand: str) -> None:
    transform_ok(hand, xml("pa", U_PA, pci_hostdev(MI300X)))
    rec = state_of(hand)["vgpus"][HAND_MDEV]
    assert (rec["parent"], rec["type_id"], rec["pool"], rec["remembered"]) == \
        ("0000:ca:00.5", "nvidia-470", "manual", True)


def test_prepare_begin_refuses_a_request_without_hostdevs_on_a_handmade_host(hand: str) -> None:
    res = run([QEMU_HOOK, "web1", "prepare", "begin", "-"], hand,
              stdin=xml("web1", U_PA, vgpus=1).encode())
    assert res.returncode == 1, res.stderr
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "gpulib attach web1" in lines[0], lines


def test_the_occupancy_holds_exactly_the_runs_that_are_not_over(demo: FakeHost) -> None:
    """One answer: each kind of allocation is held by the occupancy model (the
    report's used, the hooks' refuse) exactly when liveness.run_over says its
    run is not over."""
    from gpulib.liveness import boot_clock_of, run_is_over, running_domains
    from gpulib.occupancy import Occupancy
    from gpulib.state import Device, State

    ctx = Context.for_root(demo.root)
    boot, up = boot_clock_of(ctx.sysfs)
    demo.add_running_domain("runs-active", U_PA)
    demo.add_running_domain("runs-pending", U_PB)
    kinds = {
        "runs-active": Allocation("runs-active", U_PA, "active", boot_id=boot, uptime=up),
        "runs-pending": Allocation("runs-pending", U_PB, "pending", boot_id=boot, uptime=up - 500),
        "fresh-start": Allocation("fresh-start", U_OTHER, "pending", boot_id=boot, uptime=up),
        "expired-start": Allocation("expired-start", None, "pending", boot_id=boot,
                                    uptime=up - 121),
        "lost-stop": Allocation("lost-stop", None, "active", boot_id=boot, uptime=up),
        "earlier-boot": Allocation("earlier-boot", None, "pending", boot_id="boot-0",
                                   uptime=1.0),
        "abandoned": Allocation("abandoned", None, "pending", boot_id=boot, uptime=up - 11,
                                arriving=True),
        "arriving": Allocation("arriving", None, "pending", boot_id=boot, uptime=up,
                               arriving=True),
    }
    state = State()
    devices = [RTX, "0000:65:00.0", "0000:af:00.0", "0000:ca:00.0", "0000:41:00.0",
               "0000:82:00.0", "0000:c1:00.0", "0000:17:00.0"]
    for (vm, alloc), address in zip(sorted(kinds.items()), devices):
        alloc.devices = [Device("pci", address)]
        state.allocations[vm] = alloc
    running = running_domains(ctx.sysfs)
    occ = Occupancy.build(ctx.sysfs, state, running)
    liveness = Liveness(ctx.sysfs, running)
    clock = boot_clock_of(ctx.sysfs)
    verdicts = {}
    for vm, alloc in state.allocations.items():
        held = any(h.vm == vm for h in occ.conflicts(alloc.devices[0].id))
        assert held != run_is_over(alloc, liveness, clock), vm
        verdicts[vm] = held
    assert verdicts == {"runs-active": True, "runs-pending": True, "fresh-start": True,
                        "arriving": True, "expired-start": False, "lost-stop": False,
                        "earlier-boot": False, "abandoned": False}
