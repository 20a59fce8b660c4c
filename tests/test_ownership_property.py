"""Property: on random hosts, random sequences of starts (named devices and
metadata requests), crashes at any write, retries, VM runs and stops and
reconciles never give a device twice (tree and IOMMU-group aware), a device
the CloudStack report offers free is accepted, one it reports used by another
VM is refused, and nothing leaks (no live vGPU or VF type gpulib does not
know, no on-demand record nobody holds)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpulib import atomicfile, cloudstack, report
from gpulib.config import Config
from gpulib.context import Context
from gpulib.domain import parse_domain
from gpulib.entry import context_for_root
from gpulib.errors import GpulibError
from gpulib.hooks import prepare as prepare_mod
from gpulib.hooks.vmstate import activate, deactivate
from gpulib.hostview import discover_host
from gpulib.journal import Journal
from gpulib.lifecycle import open_store, reconcile
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import add_model, add_sriov_gpu, models
from gpulib.sysfs import Sysfs

VMS = [f"vm-{i}" for i in range(4)]
UUIDS = {vm: f"00000000-0000-4000-8000-{i:012x}" for i, vm in enumerate(VMS)}
T4 = "0000:af:00.0"
# vGPUs no VM holds that keep the registry's T4-4Q from being recreated (a T4
# runs one vGPU type at a time): a stray T4-1B nobody knows, a T4-1B pool member.
STRAY_T4 = "5e1d2c3b-4a59-4687-9a5b-c4d3e2f1a000"
POOL_T4_1B = "5e1d2c3b-4a59-4687-9a5b-c4d3e2f1a001"
# Bits of `stray`: what else lives on the host when it is built.
STRAY_VGPU, STRAY_POOL_VGPU, STRAY_VF_TYPE = 1, 2, 4


class Crash(BaseException):
    """A kill: nothing after it runs (no rollback, no final write)."""


def build(root: str, rtx: int, t4: bool, a10_vfs: int, pool_live: int,
          typed_vfs: int, stray: int = 0) -> FakeHost:
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    m = models()
    for i in range(rtx):
        group = host.new_iommu_group()
        add_model(host, m["rtx3070"], f"0000:{0x3b + i:02x}:00.0", 0, group=group)
        audio = dict(m["rtx3070"], **m["rtx3070"]["audio"])
        add_model(host, audio, f"0000:{0x3b + i:02x}:00.1", 0, group=group)
    registry: dict[str, Any] = {}
    if t4:
        add_model(host, m["t4"], "0000:af:00.0", 1)
        host.populate_mdev_parent("0000:af:00.0", m["t4"]["mdev_types"])
        for k in range(2):
            u = f"6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c{k:02x}"
            registry[u] = {"parent": "0000:af:00.0", "type_id": "nvidia-232",
                           "pool": "desk", "on_demand": False, "created": "2026-01-01T00:00:00Z"}
            if k < pool_live:
                host.add_mdev(u, "0000:af:00.0", "nvidia-232")
        if stray & STRAY_POOL_VGPU:
            registry[POOL_T4_1B] = {"parent": T4, "type_id": "nvidia-222", "pool": "thin",
                                    "on_demand": False, "created": "2026-01-01T00:00:00Z"}
    vf_types: dict[str, Any] = {}
    if a10_vfs:
        vfs = add_sriov_gpu(host, m["a10"], "0000:41:00.0", 0, None, a10_vfs)
        types = {int(k): v for k, v in m["a10"]["nvidia_vf_types"].items()}
        for n, vf in enumerate(vfs):
            host.add_nvidia_vf_types(vf, types)
            if n < typed_vfs:
                vf_types[vf] = {"type_id": 594, "name": "NVIDIA A10-6Q", "pool": None,
                                "on_demand": False}
    host.write_file("var/lib/gpulib/state.json", json.dumps(
        {"version": 2, "vgpus": registry, "vf_types": vf_types, "allocations": {}}), 0o600)
    host.write_file("etc/gpulib/gpulib.conf",
                    "[transformer]\nallow_metadata_requests = yes\n")
    return host


def add_strays(ctx: Context, t4: bool, a10_vfs: int, typed_vfs: int, stray: int) -> None:
    """Through the simulated kernel (which keeps the one-type rule): live vGPUs
    and a VF type that no VM holds. One the GPU refuses now is left out."""
    create = f"sys/class/mdev_bus/{T4}/mdev_supported_types/nvidia-222/create"
    wanted = []
    if t4 and stray & STRAY_VGPU:
        wanted.append((create, STRAY_T4))
    if t4 and stray & STRAY_POOL_VGPU:
        wanted.append((create, POOL_T4_1B))
    if stray & STRAY_VF_TYPE and a10_vfs > typed_vfs:
        # The last VF, which gpulib never typed: an A10-8Q keeps the others'
        # recorded A10-6Q from being set.
        wanted.append((f"sys/bus/pci/devices/{_a10_vf(ctx, a10_vfs - 1)}"
                       "/nvidia/current_vgpu_type", "595"))
    for rel, value in wanted:
        try:
            ctx.sysfs.write(rel, value)
        except OSError:
            continue


def _a10_vf(ctx: Context, index: int) -> str:
    return os.path.basename(os.readlink(ctx.path(
        f"sys/bus/pci/devices/0000:41:00.0/virtfn{index}")))


def _hostdev(kind: str, ident: str) -> str:
    if kind == "mdev":
        return ("<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'>"
                f"<source><address uuid='{ident}'/></source></hostdev>")
    d, b, sf = ident.split(":")
    s, f = sf.split(".")
    managed = "no" if kind == "vf" else "yes"
    return (f"<hostdev mode='subsystem' type='pci' managed='{managed}'><driver name='vfio'/>"
            f"<source><address domain='0x{d}' bus='0x{b}' slot='0x{s}' function='0x{f}'/>"
            "</source></hostdev>")


def _xml(vm: str, body: str = "", meta: str = "") -> str:
    metadata = (f"<metadata><gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
                f"{meta}</gpulib:gpus></metadata>") if meta else ""
    return (f"<domain type='kvm'><name>{vm}</name><uuid>{UUIDS[vm]}</uuid>{metadata}"
            f"<devices>{body}</devices></domain>")


class Ownership(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.host: Optional[FakeHost] = None

    def teardown(self) -> None:
        self.tmp.cleanup()

    @initialize(rtx=st.integers(0, 2), t4=st.booleans(), a10_vfs=st.integers(0, 3),
                pool_live=st.integers(0, 2), typed_vfs=st.integers(0, 3),
                stray=st.integers(0, 7))
    def make_host(self, rtx: int, t4: bool, a10_vfs: int, pool_live: int,
                  typed_vfs: int, stray: int = 0) -> None:
        self.host = build(os.path.join(self.tmp.name, "h"), rtx, t4, a10_vfs, pool_live,
                          typed_vfs, stray)
        self.ctx = context_for_root(self.host.root, simulate=True)
        self.config = Config.load(self.ctx.config_path)
        add_strays(self.ctx, t4, a10_vfs, typed_vfs, stray)
        self.first_live = self._live()

    def _live(self) -> set[str]:
        path = self.ctx.path("sys/bus/mdev/devices")
        return set(os.listdir(path)) if os.path.isdir(path) else set()

    # -- what the report offers -------------------------------------------------------------
    def _offers(self) -> list[tuple[str, str, Optional[str]]]:
        """(kind, id, used_by) of every device the CloudStack report lists as offered."""
        doc = cloudstack.render(discover_host(self.ctx, self.config, learn=False))
        out: list[tuple[str, str, Optional[str]]] = []
        for g in doc["gpus"]:
            fp = g["full_passthrough"]
            if fp["enabled"] == 1:
                a = fp["libvirt_address"]
                out.append(("pci", f"{a['domain'][2:]}:{a['bus'][2:]}:{a['slot'][2:]}."
                                   f"{a['function'][2:]}", fp["used_by_vm"]))
            for v in g["vgpu_instances"]:
                out.append(("mdev", v["mdev_uuid"], v["used_by_vm"]))
            for vf in g["vf_instances"]:
                a = vf["libvirt_address"]
                out.append(("vf", f"{a['domain'][2:]}:{a['bus'][2:]}:{a['slot'][2:]}."
                                  f"{a['function'][2:]}", vf["used_by_vm"]))
        return out

    def _prepare(self, xml: str, crash_at: int = 0) -> Optional[GpulibError]:
        dom = parse_domain(xml)
        mode = prepare_mod.StartMode("transformer", edits_xml=True, requests=True)
        preparer = prepare_mod.Preparer(self.ctx, self.config, dom, mode)
        if not crash_at:
            try:
                preparer.run()
            except GpulibError as exc:
                return exc
            return None
        count = [0]
        real_write, real_atomic = Sysfs.write, atomicfile.write_atomic
        real_commit = atomicfile.PreparedFile.commit
        real_rollback = Journal.rollback

        def counting(real: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                count[0] += 1
                if count[0] == crash_at:
                    raise Crash()
                return real(*a, **k)
            return wrapper

        Sysfs.write = counting(real_write)  # type: ignore[method-assign]
        atomicfile.write_atomic = counting(real_atomic)
        # The rename of the state file prepared before the lock (StateStore.transaction).
        atomicfile.PreparedFile.commit = counting(real_commit)  # type: ignore[method-assign]
        Journal.rollback = lambda self: False  # type: ignore[method-assign,assignment]
        try:
            preparer.run()
        except (Crash, GpulibError):
            pass
        finally:
            Sysfs.write = real_write  # type: ignore[method-assign]
            atomicfile.write_atomic = real_atomic
            atomicfile.PreparedFile.commit = real_commit  # type: ignore[method-assign]
            Journal.rollback = real_rollback  # type: ignore[method-assign]
        return None

    # -- rules -----------------------------------------------------------------------------------
    @rule(vm=st.sampled_from(VMS), pick=st.integers(0, 50))
    def start_named(self, vm: str, pick: int) -> None:
        offers = self._offers()
        if not offers:
            return
        kind, ident, used_by = offers[pick % len(offers)]
        error = self._prepare(_xml(vm, _hostdev(kind, ident)))
        if os.path.exists(self.ctx.path(f"run/libvirt/qemu/{vm}.xml")):
            # A start under a running VM's name is refused, whatever it names.
            assert error is not None and "already running" in error.message, \
                f"{kind} {ident} accepted for {vm}, which is running"
            return
        if used_by is None:
            assert error is None, f"{kind} {ident} offered free, refused: {error}"
        elif used_by == cloudstack.UNAVAILABLE:
            # Reported so (not dropped) while its GPU cannot make it: refused.
            assert error is not None and "is not available" in error.message, \
                f"{kind} {ident} reported unavailable, start: {error}"
        elif used_by != vm:
            assert error is not None and "in use by" in error.message, \
                f"{kind} {ident} reported used by {used_by}, accepted for {vm}"

    @rule(vm=st.sampled_from(VMS), profile=st.sampled_from(["GRID T4-4Q", "NVIDIA A10-6Q",
                                                            "GRID T4-1B"]),
          crash_at=st.integers(0, 6))
    def start_requested(self, vm: str, profile: str, crash_at: int) -> None:
        self._prepare(_xml(vm, meta=f"<gpulib:vgpu profile='{profile}'/>"), crash_at)

    @rule(vm=st.sampled_from(VMS), pick=st.integers(0, 50), crash_at=st.integers(1, 4))
    def start_named_and_crash(self, vm: str, pick: int, crash_at: int) -> None:
        offers = self._offers()
        if offers:
            kind, ident, _ = offers[pick % len(offers)]
            self._prepare(_xml(vm, _hostdev(kind, ident)), crash_at)

    @rule(vm=st.sampled_from(VMS))
    def vm_runs(self, vm: str) -> None:
        assert self.host is not None
        state = open_store(self.ctx).load()
        alloc = state.allocations.get(vm)
        if alloc is None:
            return
        mdevs = tuple(d.id for d in alloc.devices if d.kind == "mdev")
        pci = tuple(d.id for d in alloc.devices if d.kind != "mdev")
        self.host.add_running_domain(vm, UUIDS[vm], pci=pci, mdevs=mdevs)
        activate(self.ctx, self.config, vm)

    @rule(vm=st.sampled_from(VMS))
    def vm_stops(self, vm: str) -> None:
        assert self.host is not None
        self.host.stop_domain(vm)
        deactivate(self.ctx, self.config, vm)

    @rule()
    def do_reconcile(self) -> None:
        with open_store(self.ctx).transaction() as state:
            reconcile(self.ctx, state, grace=0)

    # -- invariants ---------------------------------------------------------------------------
    def _ancestors(self, node: str) -> list[str]:
        """Written apart from gpulib: links in the fake sysfs."""
        out = []
        cur: Optional[str] = node
        while cur is not None:
            if cur.count(":") == 2:
                link = self.ctx.path(f"sys/bus/pci/devices/{cur}/physfn")
                cur = os.path.basename(os.readlink(link)) if os.path.islink(link) else None
            else:
                path = self.ctx.path(f"sys/bus/mdev/devices/{cur}")
                cur = os.path.basename(os.path.dirname(os.path.realpath(path))) \
                    if os.path.islink(path) else None
            if cur is not None:
                out.append(cur)
        return out

    def _group(self, node: str) -> Optional[str]:
        link = self.ctx.path(f"sys/bus/pci/devices/{node}/iommu_group")
        return os.path.basename(os.readlink(link)) if os.path.islink(link) else None

    @invariant()
    def no_device_owned_twice(self) -> None:
        if self.host is None:
            return
        state = open_store(self.ctx).load()
        holds = {(vm, d.id) for vm, a in state.allocations.items() for d in a.devices}
        items = sorted(holds)
        for i, (vm1, n1) in enumerate(items):
            for vm2, n2 in items[i + 1:]:
                if vm1 == vm2:
                    continue
                assert n1 != n2, f"{n1} held by {vm1} and {vm2}"
                assert n1 not in self._ancestors(n2) and n2 not in self._ancestors(n1), \
                    f"{n1} ({vm1}) and {n2} ({vm2}) are one tree"
                if n1.count(":") == 2 and n2.count(":") == 2:
                    g1 = self._group(n1)
                    assert g1 is None or g1 != self._group(n2), \
                        f"{n1} ({vm1}) and {n2} ({vm2}) share IOMMU group {g1}"

    @rule()
    def the_allocators_quick_question_agrees(self) -> None:
        """`takeable` (asked of every pool member, under the lock) answers
        `free_for`, also with the live mdevs listed once."""
        if self.host is None:
            return
        from gpulib.domstatus import running_domains
        from gpulib.occupancy import Occupancy

        state = open_store(self.ctx).load()
        occ = Occupancy.build(self.ctx.sysfs, state, running_domains(self.ctx.sysfs))
        nodes = set(state.vgpus) | set(state.vf_types) | self._live()
        nodes |= {d.id for a in state.allocations.values() for d in a.devices}
        for node in sorted(nodes):
            for vm in VMS:
                free = occ.free_for(node, vm)
                assert occ.takeable(node, vm) == free, (node, vm)
                with occ.tree.live_listed():
                    assert occ.takeable(node, vm) == free, (node, vm)

    @invariant()
    def nothing_leaks(self) -> None:
        if self.host is None:
            return
        state = open_store(self.ctx).load()
        live = self._live()
        held = {d.id for a in state.allocations.values() for d in a.devices}
        # A start killed half-way leaves intents: they are the record the next
        # run settles (tested: a retry after each kill succeeds, nothing leaks).
        intended = {i.id for i in state.intents}
        for u in live - self.first_live:
            assert u in state.vgpus or u in intended, f"live vGPU {u} unknown to gpulib"
        for u, rec in state.vgpus.items():
            if rec.on_demand:
                assert u in held or u in intended, f"on-demand {u} held by nobody"
        for a in held:
            if a in state.vgpus and not state.intents:
                assert a in live, f"an allocation names {a}, not live"


Ownership.TestCase.settings = settings(
    max_examples=60, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestOwnership = pytest.mark.slow(Ownership.TestCase)


def test_registry_vgpu_a_busy_gpu_cannot_recreate_is_reported_used(tmp_path: Any) -> None:
    """A T4 runs one vGPU type at a time: with vm-0's T4-1B live on it, the
    registry's T4-4Q (not live) cannot be recreated. It is reported used by
    vm-0, and another VM naming it is refused as in use, before any write."""
    machine = Ownership()
    try:
        machine.make_host(rtx=0, t4=True, a10_vfs=0, pool_live=0, typed_vfs=0)
        machine.start_requested(vm="vm-0", profile="GRID T4-1B", crash_at=0)
        registry = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c00"
        offered = {ident: used_by for kind, ident, used_by in machine._offers()
                   if kind == "mdev"}
        assert offered[registry] == "vm-0"
        live = machine._live()
        error = machine._prepare(_xml("vm-1", _hostdev("mdev", registry)))
        assert error is not None and "in use by" in error.message
        assert "vm-0" in error.message
        assert machine._live() == live
    finally:
        machine.teardown()


def _machine(**kw: Any) -> Ownership:
    machine = Ownership()
    machine.make_host(**{"rtx": 0, "t4": False, "a10_vfs": 0, "pool_live": 0, "typed_vfs": 0,
                         "stray": 0, **kw})
    return machine


def _offered(machine: Ownership, kind: str) -> dict[str, Optional[str]]:
    return {ident: used_by for k, ident, used_by in machine._offers() if k == kind}


REGISTRY_T4_4Q = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c00"


@pytest.mark.parametrize("keeper", [STRAY_T4, POOL_T4_1B])
def test_registry_vgpu_kept_by_vgpus_no_vm_holds_is_not_offered(keeper: str) -> None:
    """A T4-1B no VM holds (a stray nobody knows, or a pool member nobody was
    given) keeps the registry's T4-4Q from being recreated, and there is no VM
    to report it used by: it is reported used by `gpulib:unavailable` (the
    management server marks it Error, not free, and keeps it managed; dropped
    from the report it would stay unmanaged for good), and a VM naming it is
    refused before any write. The T4-1B itself is offered free. Once it is
    gone, the T4-4Q is offered free again and a start recreates it."""
    machine = _machine(t4=True, stray=STRAY_VGPU if keeper == STRAY_T4 else STRAY_POOL_VGPU)
    try:
        offered = _offered(machine, "mdev")
        assert offered[REGISTRY_T4_4Q] == cloudstack.UNAVAILABLE
        assert offered[keeper] is None
        # gpulib's own report keeps it, marked as what it is.
        inventory = discover_host(machine.ctx, machine.config, learn=False)
        [t4] = [g for g in report.document(inventory)["gpus"] if g["address"] == T4]
        marks = {v["uuid"]: (v["used_by"], v["available"]) for v in t4["vgpus"]}
        assert marks[REGISTRY_T4_4Q] == (None, False) and marks[keeper] == (None, True)
        blocked = sum(1 for used_by, available in marks.values() if not available)
        plural = "" if len(marks) == 1 else "s"
        assert f"{len(marks)} vGPU{plural} (0 used, {blocked} unavailable)" in \
            report.table(inventory)
        live = machine._live()
        error = machine._prepare(_xml("vm-1", _hostdev("mdev", REGISTRY_T4_4Q)))
        assert error is not None
        assert error.message.startswith(f"mdev {REGISTRY_T4_4Q} is not available: ")
        assert f"{T4} has no instance of nvidia-232 left" in error.message
        assert machine._live() == live
        assert machine._prepare(_xml("vm-2", _hostdev("mdev", keeper))) is None

        deactivate(machine.ctx, machine.config, "vm-2")
        machine.ctx.sysfs.write(f"sys/bus/mdev/devices/{keeper}/remove", "1")
        assert _offered(machine, "mdev")[REGISTRY_T4_4Q] is None
        assert machine._prepare(_xml("vm-1", _hostdev("mdev", REGISTRY_T4_4Q))) is None
        assert REGISTRY_T4_4Q in machine._live()
    finally:
        machine.teardown()


@pytest.mark.parametrize("parent,type_id,why", [
    (T4, "nvidia-999", f"{T4} does not offer mdev type nvidia-999"),
    ("0000:af:00.4", "nvidia-232", "no PCI device 0000:af:00.4"),
])
def test_registry_vgpu_its_parent_cannot_recreate_is_not_offered(parent: str, type_id: str,
                                                                 why: str) -> None:
    """A registry vGPU whose parent no longer offers its type (the driver
    changed, the record was edited): reported unavailable; whose parent is
    gone (its VFs were disabled): under no GPU, so in no report. Both are
    refused by name; the GPU's other vGPUs are still offered."""
    machine = _machine(t4=True)
    try:
        path = machine.ctx.path("var/lib/gpulib/state.json")
        with open(path) as fh:
            doc = json.load(fh)
        gone = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4cff"
        doc["vgpus"][gone] = {"parent": parent, "type_id": type_id, "pool": None,
                              "on_demand": False, "created": "2026-01-01T00:00:00Z"}
        with open(path, "w") as fh:
            json.dump(doc, fh)
        offered = _offered(machine, "mdev")
        if parent == T4:
            assert offered[gone] == cloudstack.UNAVAILABLE
        else:
            assert gone not in offered
        assert offered[REGISTRY_T4_4Q] is None
        error = machine._prepare(_xml("vm-1", _hostdev("mdev", gone)))
        assert error is not None
        assert error.message.startswith(f"mdev {gone} is not available: ")
        assert why in error.message
    finally:
        machine.teardown()


def test_recorded_vf_type_its_gpu_cannot_give_is_offered_only_as_used() -> None:
    """An A10 runs one vGPU type at a time. With an A10-8Q set on its third VF,
    the A10-6Q gpulib records for the first two cannot be set: with no VM on
    the A10-8Q they are reported unavailable and refused before any write;
    with a VM on it, they are reported used by that VM and refused naming
    it. Cleared, they are offered free and accepted."""
    machine = _machine(a10_vfs=3, typed_vfs=2, stray=STRAY_VF_TYPE)
    try:
        recorded, stray = _a10_vf(machine.ctx, 0), _a10_vf(machine.ctx, 2)
        current = machine.ctx.path(f"sys/bus/pci/devices/{recorded}/nvidia/current_vgpu_type")
        offered = _offered(machine, "vf")
        assert offered[recorded] == cloudstack.UNAVAILABLE and offered[stray] is None
        error = machine._prepare(_xml("vm-1", _hostdev("vf", recorded)))
        assert error is not None
        assert error.message.startswith(f"PCI device {recorded} is not available: ")
        assert "vGPU type 594" in error.message
        with open(current) as fh:
            assert fh.read().strip() == "0"

        assert machine._prepare(_xml("vm-0", _hostdev("vf", stray))) is None
        assert _offered(machine, "vf")[recorded] == "vm-0"
        error = machine._prepare(_xml("vm-1", _hostdev("vf", recorded)))
        assert error is not None and "in use by" in error.message and "vm-0" in error.message

        deactivate(machine.ctx, machine.config, "vm-0")
        machine.ctx.sysfs.write(f"sys/bus/pci/devices/{stray}/nvidia/current_vgpu_type", "0")
        assert _offered(machine, "vf")[recorded] is None
        assert machine._prepare(_xml("vm-1", _hostdev("vf", recorded))) is None
        with open(current) as fh:
            assert fh.read().strip() == "594"
    finally:
        machine.teardown()


@pytest.mark.parametrize("profile,kind,crash_at", [
    ("NVIDIA A10-6Q", "vf", 4),  # the VF's type set, then the kill
    ("GRID T4-1B", "mdev", 4),  # the vGPU created, then the kill
])
def test_what_a_killed_start_made_is_not_offered(profile: str, kind: str,
                                                  crash_at: int) -> None:
    """Found by the state machine: a start killed after its sysfs write and
    before its allocation left a typed VF (a live vGPU) and its intent. The
    report offered it free, but the next start undoes it first (journal.settle)
    and then had nothing to give. It is left out of the report until then;
    once settled, the report is what it was before the start."""
    machine = _machine(t4=kind == "mdev", a10_vfs=1 if kind == "vf" else 0)
    try:
        before = sorted(machine._offers())
        machine.start_requested(vm="vm-1", profile=profile, crash_at=crash_at)
        state = open_store(machine.ctx).load()
        [intent] = state.intents
        assert intent.vm == "vm-1" and "vm-1" not in state.allocations
        made = intent.id
        assert all(ident != made for _, ident, _ in machine._offers())
        for _, ident, _ in machine._offers():  # whatever is offered is accepted
            assert machine._prepare(_xml("vm-0", _hostdev(kind, ident))) is None
            break
        machine.do_reconcile()
        assert not open_store(machine.ctx).load().intents
        assert sorted(machine._offers()) == before
    finally:
        machine.teardown()
