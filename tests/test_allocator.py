"""Property: no sequence of allocate/release/restore/reconcile ever gives a
device twice or exceeds what a type offers, on a simulated T4 (time-sliced
mdev on the PF) and A10 (vendor-specific vGPU VFs). And the allocator's
choices, made before anything is written, never take what another VM holds."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpulib import mdev, nvidia
from gpulib.allocator import (
    AllocatePci,
    AllocateVf,
    AllocateVgpu,
    Allocator,
    apply_allocation,
    record,
    release,
)
from gpulib.config import Config
from gpulib.context import Context
from gpulib.domain import PassthroughRequest, VgpuRequest
from gpulib.domstatus import DomainDevices
from gpulib.entry import context_for_root
from gpulib.errors import NotAvailableError
from gpulib.hostview import discover_host
from gpulib.lifecycle import open_store, reconcile, restore
from gpulib.liveness import Liveness, boot_clock_of
from gpulib.occupancy import Occupancy
from gpulib.pci import PciAddress, virtfn_links
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import models
from gpulib.state import Allocation, Device, State, VgpuRecord

PROFILES = ["GRID T4-1B", "GRID T4-4Q", "NVIDIA A10-6Q", "NVIDIA A10-24Q"]
VMS = [f"vm-{i}" for i in range(6)]
T4 = PciAddress.parse("0000:3b:00.0")
A10 = PciAddress.parse("0000:41:00.0")


def build(root: str) -> FakeHost:
    host = FakeHost(root)
    m = models()
    host.add_function(str(T4), 0x10DE, 0x1EB8, 0x030200, driver="nvidia",
                      iommu_group=host.new_iommu_group())
    host.populate_mdev_parent(str(T4), m["t4"]["mdev_types"])
    host.add_function(str(A10), 0x10DE, 0x2236, 0x030200, driver="nvidia",
                      iommu_group=host.new_iommu_group())
    host.set_sriov_capability(str(A10), 32, 0x2236, offset=4)
    types = {int(k): v for k, v in m["a10"]["nvidia_vf_types"].items()}
    for vf in host.enable_sriov(str(A10), 4, vf_driver="nvidia"):
        host.add_nvidia_vf_types(vf, types)
    return host


class Allocations(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.host = build(os.path.join(self.tmp.name, "h"))
        self.ctx = context_for_root(self.host.root, simulate=True)
        self.config = Config()
        self.store = open_store(self.ctx, self.config)
        self.counter = 0

    def teardown(self) -> None:
        self.tmp.cleanup()

    def _uuid(self) -> str:
        self.counter += 1
        return f"{self.counter:08x}-0000-4000-8000-000000000000"

    @rule(vm=st.sampled_from(VMS), profile=st.sampled_from(PROFILES),
          count=st.integers(1, 3), policy=st.sampled_from(["spread", "pack"]))
    def allocate(self, vm: str, profile: str, count: int, policy: str) -> None:
        with self.store.transaction() as state:
            if vm in state.allocations:
                return
            inv = discover_host(self.ctx, self.config, state=state, learn=False)
            alloc = Allocator(self.ctx.sysfs, state, inv, policy=policy)
            try:
                devices = alloc.allocate_vgpus(vm, VgpuRequest(profile, None, count),
                                               self._uuid)
            except NotAvailableError:
                return
            record(state, vm, None, devices, status="active")

    @rule(vm=st.sampled_from(VMS))
    def release_vm(self, vm: str) -> None:
        with self.store.transaction() as state:
            release(self.ctx.sysfs, state, vm, Liveness(self.ctx.sysfs), retry_seconds=0)

    @rule(vm=st.sampled_from(VMS))
    def vm_runs(self, vm: str) -> None:
        self.host.add_running_domain(vm, "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53")

    @rule(vm=st.sampled_from(VMS))
    def vm_stops(self, vm: str) -> None:
        self.host.stop_domain(vm)

    @rule()
    def do_restore(self) -> None:
        with self.store.transaction() as state:
            restore(self.ctx, state, adopt_mdevctl=False)

    @rule()
    def do_reconcile(self) -> None:
        with self.store.transaction() as state:
            reconcile(self.ctx, state, grace=0)

    @invariant()
    def nothing_given_twice(self) -> None:
        state = self.store.load()
        seen: dict[str, str] = {}
        for vm, alloc in state.allocations.items():
            for d in alloc.devices:
                assert d.id not in seen, f"{d.id} held by {seen.get(d.id)} and {vm}"
                seen[d.id] = vm
        # Tree-aware: no node is held by two VMs, nor a node and its ancestor.
        sysfs = self.ctx.sysfs
        live = mdev.live_mdevs(sysfs)
        for ident, vm in seen.items():
            parent = str(live[ident].parent) if ident in live else None
            if parent is not None and parent in seen:
                assert seen[parent] == vm, f"{ident} of {vm} under {parent} of {seen[parent]}"

    @invariant()
    def within_what_types_offer(self) -> None:
        sysfs = self.ctx.sysfs
        live = mdev.live_mdevs(sysfs)
        by_type: dict[str, int] = {}
        for m in live.values():
            by_type[m.type_id] = by_type.get(m.type_id, 0) + 1
        maxima = {t["type_id"]: t["available_instances"] for t in models()["t4"]["mdev_types"]}
        for type_id, n in by_type.items():
            assert n <= maxima[type_id]
            assert (mdev.MdevType(sysfs, T4, type_id).available_instances or 0) >= 0
        assert len(by_type) <= 1, "a time-sliced T4 runs one type at a time"
        types = [nvidia.current_type(sysfs, vf) for _, vf in virtfn_links(sysfs, A10)]
        active = [t for t in types if t]
        assert len(set(active)) <= 1
        if active:
            size_gb = 6 if active[0] == 594 else 24
            assert len(active) <= 24 // size_gb

    @invariant()
    def held_devices_exist(self) -> None:
        state = self.store.load()
        live = mdev.live_mdevs(self.ctx.sysfs)
        for alloc in state.allocations.values():
            for d in alloc.devices:
                if d.kind == "mdev":
                    assert d.id in live
                elif d.kind == "vf":
                    assert nvidia.current_type(self.ctx.sysfs, PciAddress.parse(d.id))


Allocations.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestAllocations = Allocations.TestCase


# -- choices, before anything is written -------------------------------------------------------

OTHER = "vm-other"
ITS_VGPU = "0000000a-0000-4000-8000-000000000000"  # another VM's vGPU on the T4


@pytest.fixture(scope="module")
def chooser_host(tmp_path_factory: Any) -> Iterator[tuple[Context, list[str]]]:
    host = build(str(tmp_path_factory.mktemp("choices") / "h"))
    ctx = context_for_root(host.root, simulate=True)
    vfs = [str(vf) for _, vf in virtfn_links(ctx.sysfs, A10)]
    yield ctx, vfs


def _up(node: str, parents: dict[str, str]) -> list[str]:
    """The node and what it sits on: an mdev's parent, a VF's PF."""
    out = [node]
    while out[-1] in parents:
        out.append(parents[out[-1]])
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_choices_write_nothing_and_skip_what_another_vm_holds(
        chooser_host: tuple[Context, list[str]], data: Any) -> None:
    ctx, vfs = chooser_host
    state = State()
    state.vgpus[ITS_VGPU] = VgpuRecord(str(T4), "nvidia-222", None, True, "x")
    nodes = [str(T4), str(A10), ITS_VGPU, *vfs]
    held = data.draw(st.lists(st.sampled_from(nodes), unique=True, max_size=3))
    kinds = {ITS_VGPU: "mdev", **{vf: "vf" for vf in vfs}}
    status = data.draw(st.sampled_from(["pending", "active"]))
    # A run that is not over: a start of now, or a VM that runs.
    boot, now = boot_clock_of(ctx.sysfs)
    state.allocations[OTHER] = Allocation(
        OTHER, None, status, "x", [Device(kinds.get(n, "pci"), n) for n in held],
        boot_id=boot, uptime=now)
    occ = Occupancy.build(ctx.sysfs, state, [DomainDevices(OTHER)] if status == "active" else [])
    inv = discover_host(ctx, Config(), state=state, learn=False, occupancy=occ)
    allocator = Allocator(ctx.sysfs, state, inv,
                          policy=data.draw(st.sampled_from(["spread", "pack"])), occupancy=occ)

    def no_write(rel: str, value: str, expected: tuple[int, ...] = ()) -> None:
        raise AssertionError(f"a choice wrote {rel}")

    ctx.sysfs.write = no_write  # type: ignore[method-assign]
    try:
        count = data.draw(st.integers(1, 3))
        chosen: list[Union[AllocateVgpu, AllocateVf, AllocatePci]] = []
        try:
            if data.draw(st.booleans()):
                chosen += allocator.choose_passthrough(
                    "vm-a", PassthroughRequest(data.draw(st.sampled_from(["10de:1eb8",
                                                                          "10de:2236"])),
                                               count))
            else:
                req = VgpuRequest(data.draw(st.sampled_from(PROFILES)), None, count)
                uuids = iter(f"{n:08x}-0000-4000-8000-00000000000b" for n in range(1, 9))
                for k in range(count):
                    chosen.append(allocator.choose_vgpu("vm-a", req, lambda: next(uuids),
                                                        found=k))
        except NotAvailableError:
            pass
    finally:
        del ctx.sysfs.write
    parents = {vf: str(A10) for vf in vfs}
    parents[ITS_VGPU] = str(T4)
    ids = []
    for action in chosen:
        if isinstance(action, AllocateVgpu):
            assert action.on_demand and action.parent == str(T4)  # no pool on this host
            node, parents[action.uuid] = action.uuid, action.parent
        else:
            node = action.address
        ids.append(node)
        # Nothing it sits on is held, and nothing held sits on it.
        for h in held:
            assert h not in _up(node, parents) and node not in _up(h, parents), (action, held)
    assert len(set(ids)) == len(ids)
    # A choice, applied, is the device it names.
    if chosen and isinstance(chosen[0], AllocatePci):
        assert apply_allocation(ctx.sysfs, state, None, chosen[0]) == \
            Device("pci", chosen[0].address)


def test_a_request_for_two_gets_two_pool_members(chooser_host: tuple[Context, list[str]]
                                                 ) -> None:
    """The VM's own hold does not keep a device from it: what one request chose
    is still never chosen again for its next instance."""
    ctx, _ = chooser_host
    state = State()
    members = [f"0000000{n}-0000-4000-8000-00000000000c" for n in (1, 2)]
    for uuid in members:
        state.vgpus[uuid] = VgpuRecord(str(T4), "nvidia-222", "small", False, "x")
    occ = Occupancy.build(ctx.sysfs, state, [])
    inv = discover_host(ctx, Config(), state=state, learn=False, occupancy=occ)
    allocator = Allocator(ctx.sysfs, state, inv, occupancy=occ)
    req = VgpuRequest("GRID T4-1B", None, 2)
    chosen = [allocator.choose_vgpu("vm-a", req, lambda: "unused", found=k) for k in range(2)]
    assert sorted(a.uuid for a in chosen if isinstance(a, AllocateVgpu)) == members
    assert all(isinstance(a, AllocateVgpu) and a.pool == "small" and not a.on_demand
               for a in chosen)
