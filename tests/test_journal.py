"""The journal on its own: write-ahead removals, settling what died, and the
one notion of a running VM (`gpulib.liveness`) every removal asks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import mdev
from gpulib.domstatus import status_uuid
from gpulib.errors import DeviceError
from gpulib.journal import Journal, release_devices, settle
from gpulib.liveness import Liveness, boot_clock_of
from gpulib.sim.fakehost import FakeHost
from gpulib.state import Allocation, Device, Intent, State, VgpuRecord
from tests.hosts import simulated, t4_host

T4 = "0000:3b:00.0"
U1 = "11111111-2222-4333-8444-555555555555"
U2 = "21111111-2222-4333-8444-555555555555"
DOM = "9b4c2e17-3a6f-4d8b-a5e1-7c0f3d9b2a46"


def on_demand_state(*uuids: str) -> State:
    return State(vgpus={u: VgpuRecord(T4, "nvidia-232", on_demand=True) for u in uuids})


def live(host: FakeHost) -> set[str]:
    return set(os.listdir(host.p("sys/bus/mdev/devices")))


def test_removals_are_announced_before_the_first_removal(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(U1, U2))
    ctx = simulated(host)
    state = on_demand_state(U1, U2)
    seen: list[tuple[list[str], set[str]]] = []

    def checkpoint(s: State) -> None:
        seen.append(([i.id for i in s.intents], live(host)))

    lines = release_devices(ctx.sysfs, state, "vm", [Device("mdev", U1, True),
                                                     Device("mdev", U2, True)],
                            Liveness(ctx.sysfs), checkpoint, 0)
    assert seen == [([U1, U2], {U1, U2})], "one write-ahead record, before any removal"
    assert lines == [f"destroyed mdev {U1}", f"destroyed mdev {U2}"]
    assert live(host) == set() and state.intents == [] and state.vgpus == {}


def test_a_removal_the_kernel_refuses_keeps_its_intent_for_the_next_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = t4_host(str(tmp_path), live=(U1,))
    ctx = simulated(host)
    state = on_demand_state(U1)
    real = mdev.remove

    def busy(*a: Any, **k: Any) -> bool:
        raise DeviceError("mdev busy: the guest's QEMU has not exited yet")

    monkeypatch.setattr(mdev, "remove", busy)
    lines = release_devices(ctx.sysfs, state, "vm", [Device("mdev", U1, True)],
                            Liveness(ctx.sysfs), None, 0)
    assert lines[0].startswith("FAILED") and [i.action for i in state.intents] == ["remove-mdev"]
    assert U1 in state.vgpus, "the record stays while its intent explains it"
    monkeypatch.setattr(mdev, "remove", real)
    out = settle(ctx.sysfs, state, Liveness(ctx.sysfs))
    assert out == [f"remove-mdev {U1} of vm: destroyed mdev {U1}"]
    assert state.intents == [] and U1 not in state.vgpus and live(host) == set()


def test_a_removal_is_void_once_a_vm_holds_the_device_again(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(U1, U2))
    ctx = simulated(host)
    state = on_demand_state(U1, U2)
    state.intents = [Intent("remove-mdev", U1, "old"), Intent("remove-mdev", U2, "old")]
    state.allocations["new"] = Allocation("new", devices=[Device("mdev", U1, True)])
    host.add_running_domain("other", DOM, mdevs=(U2,))
    out = settle(ctx.sysfs, state, Liveness(ctx.sysfs))
    assert out == [f"remove-mdev {U1} of old: kept mdev {U1}: new holds it",
                   f"remove-mdev {U2} of old: kept mdev {U2}: other holds it"]
    assert live(host) == {U1, U2} and state.intents == []


def test_a_removal_the_starting_vm_names_again_is_void(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(U1,))
    ctx = simulated(host)
    state = on_demand_state(U1)
    state.intents = [Intent("remove-mdev", U1, "vm")]
    settle(ctx.sysfs, state, Liveness(ctx.sysfs), keep="vm", reuse=[U1])
    assert live(host) == {U1} and state.intents == [] and U1 in state.vgpus


def test_a_dead_starts_vgpu_is_undone_unless_a_running_domain_names_it(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(U1, U2))
    ctx = simulated(host)
    state = on_demand_state(U1, U2)
    state.intents = [Intent("create-mdev", U1, "dead", T4, "nvidia-232", True),
                     Intent("create-mdev", U2, "dead", T4, "nvidia-232", True)]
    host.add_running_domain("runs", DOM, mdevs=(U2,))
    settle(ctx.sysfs, state, Liveness(ctx.sysfs))
    assert live(host) == {U2}, "nothing a running domain names is removed"
    assert state.intents == [] and set(state.vgpus) == {U2}


def test_a_start_that_released_devices_cannot_be_put_back(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(U1,))
    ctx = simulated(host)
    state = on_demand_state(U1)
    journal = Journal(ctx.sysfs, state, "vm", Liveness(ctx.sysfs))
    journal.release([Device("mdev", U1, True)], retry_seconds=0)
    assert journal.rollback() is False, "a removal is not undone: its intents stand"


# -- liveness -------------------------------------------------------------------------------

def test_a_vm_runs_when_its_status_file_names_it_with_its_uuid(tmp_path: Path) -> None:
    host = FakeHost(str(tmp_path / "h"))
    host.add_running_domain("vm", DOM, mdevs=(U1,))
    host.write_file("run/libvirt/qemu/garbled.xml", "<domstatus><domain><name>garbled")
    lv = Liveness(simulated(host).sysfs)
    assert lv.is_running("vm") and lv.is_running("vm", DOM) and lv.is_running("vm", DOM.upper())
    assert not lv.is_running("vm", U2), "another domain under its name"
    assert not lv.is_running("stopped")
    assert lv.is_running("garbled", U2), "a status file whose UUID cannot be read: running"
    assert lv.user_of(U1) == "vm" and lv.user_of(U2) is None


@settings(max_examples=50, deadline=None)
@given(meta=st.text(alphabet="<>/ abcdef0123456789-uid", max_size=60))
def test_the_status_uuid_is_the_domains_own(meta: str) -> None:
    """Whatever a tenant puts in <metadata> (after <uuid>), the UUID read is the domain's."""
    doc = (f"<domstatus state='running'><domain type='kvm' id='3'><name>vm</name>"
           f"<uuid>{DOM}</uuid><metadata><uuid>{U1}</uuid>{meta}</metadata></domain>"
           "</domstatus>").encode()
    assert status_uuid(doc) == DOM


def test_an_allocation_of_an_earlier_boot_holds_nothing_unless_its_vm_runs(
        tmp_path: Path) -> None:
    from gpulib.occupancy import Occupancy

    host = t4_host(str(tmp_path))
    host.write_file("proc/sys/kernel/random/boot_id", "boot-2\n")
    ctx = simulated(host)
    now = boot_clock_of(ctx.sysfs)[1]  # a start of now: within its grace
    state = State(allocations={
        "old": Allocation("old", DOM, "active", devices=[Device("pci", T4)], boot_id="boot-1",
                          uptime=10.0),
        "new": Allocation("new", devices=[Device("pci", "0000:3a:00.0")], boot_id="boot-2",
                          uptime=now)})
    occ = Occupancy.build(ctx.sysfs, state, [])
    assert occ.user("pci", T4) is None and occ.user("pci", "0000:3a:00.0") == "new"
    host.add_running_domain("old", DOM)
    occ = Occupancy.build(ctx.sysfs, state, Liveness(ctx.sysfs).domains())
    assert occ.user("pci", T4) == "old"
