"""Every path against every kind of owner: each gives the one answer
(`Occupancy.owner`, `gpulib.ownership`), and a path that skips it is caught.

One simulated host holds a device of each kind: the console GPU and a GPU
sharing its IOMMU group with the host's NIC (the host's), an unmanaged GPU with
its vGPU and a vGPU made by gpulib's CLI, mdevctl or raw sysfs (the
administrator's), a pool member, a running VM's vGPU (a run's), and a free
passthrough GPU (nobody's). The walk asks each path about each device and
compares the path's answer with what the owner allows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from gpulib import cloudstack, pools
from gpulib.config import Config
from gpulib.context import Context
from gpulib.domain import parse_domain
from gpulib.entry import context_for_root
from gpulib.errors import GpulibError
from gpulib.hooks import prepare as prepare_mod
from gpulib.hostview import discover_host
from gpulib.lifecycle import open_store
from gpulib.liveness import running_domains
from gpulib.occupancy import Occupancy
from gpulib.ownership import ADMIN, HOST, NOBODY, POOL, RUN
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import add_model, models
from gpulib.xmlns import GPULIB_NS
from tests.hookrun import BIN, QEMU_HOOK, STATE_CHANGE, hook_env, mdev_xml, pci_hostdev, run
from tests.hosts import a10_host, empty_host
from tests.test_ownership import pci_xml

IGPU = "0000:00:02.0"  # the boot VGA device
FREE = "0000:65:00.0"  # a T4 on vfio-pci, alone in its group
SHARED = "0000:71:00.0"  # a T4 on vfio-pci whose group holds an i40e NIC
NIC = "0000:71:00.1"
UNMANAGED = "0000:3b:00.0"  # a T4 with vGPU types, unmanaged
MANAGED = "0000:5e:00.0"  # a T4 with vGPU types
U_UNMANAGED = "4b20d080-1b54-4048-b3bb-000000000001"
U_RAW = "4b20d080-1b54-4048-b3bb-000000000002"
U_MDEVCTL = "4b20d080-1b54-4048-b3bb-000000000003"
U_RUN = "4b20d080-1b54-4048-b3bb-000000000004"
VM_UUID = "8e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e"
U_PENDING = "4b20d080-1b54-4048-b3bb-000000000005"
U_ARRIVING = "4b20d080-1b54-4048-b3bb-000000000006"
U_DEAD = "4b20d080-1b54-4048-b3bb-000000000007"
U_EARLIER = "4b20d080-1b54-4048-b3bb-000000000008"
BOOT = "5f0c2b1e-0000-4000-8000-00000000b007"
RUNS = {U_PENDING: ("i-4-4-VM", "pending", False), U_ARRIVING: ("i-5-5-VM", "pending", True),
        U_DEAD: ("i-6-6-VM", "pending", False), U_EARLIER: ("i-8-8-VM", "active", False)}


def add_runs(host: FakeHost) -> None:
    """Runs beside the running VM: a pending start, an arriving migration, a
    start that died past its grace, and an allocation of an earlier boot, each
    holding an on-demand vGPU gpulib made."""
    host.write_file("proc/sys/kernel/random/boot_id", BOOT + "\n")
    path = Path(host.root, "var/lib/gpulib/state.json")
    state = json.loads(path.read_text())
    for n, (uuid, (vm, status, arriving)) in enumerate(RUNS.items()):
        host.add_mdev(uuid, MANAGED, "nvidia-222")
        state["vgpus"][uuid] = {"created": "2026-01-01T00:00:00Z", "on_demand": True,
                                "parent": MANAGED, "type_id": "nvidia-222"}
        alloc = {"vm": vm, "domain_uuid": f"{n}e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e",
                 "status": status, "since": "2026-01-01T00:00:00Z", "boot_id": BOOT,
                 "uptime": 0.0, "devices": [{"kind": "mdev", "id": uuid, "on_demand": True}]}
        if arriving:
            alloc["arriving"] = True
        if uuid == U_EARLIER:
            alloc["boot_id"] = "5f0c2b1e-0000-4000-8000-0000000e001e"
        state["allocations"][vm] = alloc
    path.write_text(json.dumps(state))
    Path(host.root, "var/lib/gpulib/state.json.bak").unlink()
    refresh(host.root)


def refresh(root: str) -> None:
    """The pending start and the arrival are fresh (within their grace) now,
    the dead start well past it."""
    path = Path(root, "var/lib/gpulib/state.json")
    state = json.loads(path.read_text())
    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    for uuid, (vm, _, _) in RUNS.items():
        a = state["allocations"].get(vm)
        if a is not None:
            a["uptime"] = now - 10_000.0 if uuid == U_DEAD else now
            a["since"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(
                time.time() - (10_000 if uuid == U_DEAD else 0)))
    path.write_text(json.dumps(state))


def owners_host(tmp: str) -> tuple[FakeHost, dict[str, str]]:
    """The host, and its vGPUs made by gpulib's CLI and for the pool."""
    m = models()
    host = empty_host(tmp)
    host.add_iommu_unit("dmar0")
    host.add_function("0000:00:00.0", 0x8086, 0x3E30, 0x060000, numa_node=0,
                      iommu_group=host.new_iommu_group())
    add_model(host, m["uhd630"], IGPU, 0)
    host.write_file(os.path.relpath(os.path.join(host.device_dir(IGPU), "boot_vga"),
                                    host.root), "1\n", 0o444)
    host.add_bridge("0000:64:00.0", numa_node=0, iommu_group=host.new_iommu_group())
    add_model(host, m["t4"], FREE, 0, parent="0000:64:00.0", driver="vfio-pci")
    host.add_bridge("0000:70:00.0", numa_node=0, iommu_group=host.new_iommu_group())
    group = host.new_iommu_group()
    add_model(host, m["t4"], SHARED, 0, parent="0000:70:00.0", driver="vfio-pci", group=group)
    host.add_function(NIC, 0x8086, 0x1572, 0x020000, driver="i40e", iommu_group=group,
                      numa_node=0, parent="0000:70:00.0")
    for addr, bridge in ((UNMANAGED, "0000:3a:00.0"), (MANAGED, "0000:5d:00.0")):
        host.add_bridge(bridge, numa_node=0, iommu_group=host.new_iommu_group())
        add_model(host, m["t4"], addr, 0, parent=bridge)
        host.populate_mdev_parent(addr, m["t4"]["mdev_types"])
    host.add_mdev(U_UNMANAGED, UNMANAGED, "nvidia-222")
    host.add_mdev(U_RAW, MANAGED, "nvidia-222")
    host.add_mdev(U_MDEVCTL, MANAGED, "nvidia-222")
    host.write_file(f"etc/mdevctl.d/{MANAGED}/{U_MDEVCTL}",
                    json.dumps({"mdev_type": "nvidia-222", "start": "auto", "attrs": []}))
    host.add_mdev(U_RUN, MANAGED, "nvidia-222")
    host.add_running_domain("i-3-3-VM", "3e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e",
                            mdevs=(U_RUN,))
    gpulib = str(BIN / "gpulib")
    made = run([gpulib, "mdev", "create", "--parent", MANAGED, "--type", "nvidia-222"],
               host.root)
    assert made.returncode == 0, made.stderr
    host.write_file("etc/gpulib/gpulib.conf",
                    f"[pool p]\nparents = {MANAGED}\ntype = nvidia-222\ncount = 1\n")
    applied = run([gpulib, "pool", "apply"], host.root)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    state = json.loads(Path(host.root, "var/lib/gpulib/state.json").read_text())
    (member,) = [u for u, r in state["vgpus"].items() if r.get("pool") == "p"]
    assert run([gpulib, "device", "unmanage", UNMANAGED], host.root).returncode == 0
    return host, {"cli": made.stdout.decode().strip(), "pool": member}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    host, made = owners_host(str(tmp_path_factory.mktemp("owners")))
    add_runs(host)
    return host.root, made


# The devices and the owner each must have: (kind, ident, owner kind).
def devices(made: dict[str, str]) -> list[tuple[str, str, str]]:
    return [("pci", IGPU, HOST), ("pci", SHARED, HOST), ("pci", FREE, NOBODY),
            ("mdev", U_UNMANAGED, ADMIN), ("mdev", U_RAW, ADMIN), ("mdev", U_MDEVCTL, ADMIN),
            ("mdev", made["cli"], ADMIN), ("mdev", made["pool"], POOL),
            ("mdev", U_RUN, RUN), ("mdev", U_PENDING, RUN), ("mdev", U_ARRIVING, RUN),
            # a run that is over holds nothing: its on-demand vGPU is nobody's
            ("mdev", U_DEAD, NOBODY), ("mdev", U_EARLIER, NOBODY)]


HANDS_OFF = {U_UNMANAGED}  # the administrator's unmanaged devices: not even offered
# On-demand vGPUs of runs that are over: nobody's, and the next hook's to
# destroy (may_change), so neither offered nor given (a start makes its own).
LEFT_OVER = {U_DEAD, U_EARLIER}


def _copy(root: str, tmp: Path) -> str:
    dst = str(tmp / f"copy{len(os.listdir(tmp))}")
    shutil.copytree(root, dst, symlinks=True)
    refresh(dst)
    return dst


# -- the paths: each answers, for one device, whether it offers or gives it -------------------


def report_offers(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """The CloudStack report lists it free (a vGPU no VM uses; a GPU `enabled` 1)."""
    doc = cloudstack.render(discover_host(Context.for_root(root), learn=False))
    for g in doc["gpus"]:
        if kind == "pci" and g["pci_address"] in (ident, ident[5:]):
            return bool(g["full_passthrough"]["enabled"] == 1)
        for v in g["vgpu_instances"]:
            if v["mdev_uuid"] == ident:
                return v["used_by_vm"] is None
    assert kind == "mdev", f"{ident} is not in the report"
    return False  # not listed: not offered


def transformer_records(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """A start naming it succeeds and records it as the VM's."""
    copy = _copy(root, tmp)
    ctx = context_for_root(copy, simulate=True)
    xml = pci_xml("i-2-7-VM", VM_UUID, ident) if kind == "pci" else \
        mdev_xml("i-2-7-VM", VM_UUID, ident)
    mode = prepare_mod.StartMode("transformer", edits_xml=True, requests=False)
    try:
        got = prepare_mod.Preparer(ctx, Config.load(ctx.path("etc/gpulib/gpulib.conf")),
                                   parse_domain(xml), mode).run()
    except GpulibError:
        return False
    return any(d.id == ident for d in got)


def pools_would_use(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """A pool of every GPU would make vGPUs beside it (on its parent)."""
    if kind == "pci":
        return False  # a whole GPU is no vGPU pool's
    ctx = Context.for_root(root)
    state = open_store(ctx).load()
    conf = tmp / "pool.conf"
    conf.write_text("[pool all]\nparents = all\ntype = nvidia-222\ncount = 9\n")
    pool = Config.load(str(conf)).pools["all"]
    inv = discover_host(ctx, state=state, learn=False)
    plan = pools.plan(pool, inv, frozenset(state.unmanaged))
    parents = {str(t.parent) for _, t in plan.mdev_parents}
    occ = Occupancy.build(ctx.sysfs, state, running_domains(ctx.sysfs))
    return occ.tree.parent(ident) in parents


def metrics_count(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """gpulib metrics counts capacity of its type on its parent."""
    from gpulib import metrics
    from gpulib.pci import PciAddress

    if kind == "pci":
        return False
    ctx = Context.for_root(root)
    occ = Occupancy.build(ctx.sysfs, open_store(ctx).load(), running_domains(ctx.sysfs))
    bus = metrics.pci_bus_id(PciAddress.parse(str(occ.tree.parent(ident))))
    text = metrics.render(ctx, Config())
    return any(line.startswith("gpulib_vgpu_creatable_instances{") and bus in line
               and 'type="nvidia-222"' in line and float(line.rsplit(" ", 1)[1]) > 0
               for line in text.splitlines())


def vgpu_command_makes(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """`gpulib mdev create` on its parent makes a vGPU."""
    from gpulib.cli import main

    if kind == "pci":
        return False
    copy = _copy(root, tmp)
    ctx = context_for_root(copy, simulate=True)
    parent = Occupancy.build(ctx.sysfs, open_store(ctx).load()).tree.parent(ident)
    saved = {k: os.environ.get(k) for k in ("GPULIB_ROOT", "GPULIB_SIMULATE")}
    os.environ.update({"GPULIB_ROOT": copy, "GPULIB_SIMULATE": "1"})
    try:
        code = main(["mdev", "create", "--parent", str(parent), "--type", "nvidia-222"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code == 0


def owner_says(root: str, tmp: Path, kind: str, ident: str) -> str:
    ctx = Context.for_root(root)
    state = open_store(ctx).load()
    occ = Occupancy.build(ctx.sysfs, state, running_domains(ctx.sysfs))
    return occ.owner(kind, ident).kind


def expected(path: str, kind: str, ident: str, owner: str) -> Any:
    if path == "owner":
        # the host's whole GPUs are the rules' of `whole_gpu_refusal`; as
        # nodes nobody holds they are nobody's
        return NOBODY if owner == HOST else owner
    if path in ("report", "transformer"):
        if ident in LEFT_OVER:
            return False
        return owner in (NOBODY, POOL) or (owner == ADMIN and ident not in HANDS_OFF)
    if path in ("pools", "metrics", "mdev create"):
        # gpulib may make vGPUs on a parent that is not hands-off (its capacity)
        return kind == "mdev" and ident not in HANDS_OFF
    raise AssertionError(path)


PATHS: dict[str, Callable[[str, Path, str, str], Any]] = {
    "owner": owner_says, "report": report_offers, "transformer": transformer_records,
    "pools": pools_would_use, "metrics": metrics_count, "mdev create": vgpu_command_makes}


Ask = Callable[[str, Path, str, str], Any]


def _compare(root: str, tmp: Path, paths: dict[str, Ask], only: Any,
             owned: list[tuple[str, str, str]], want: Callable[[str, str, str, str], Any],
             before: Callable[[], None] = lambda: None) -> list[str]:
    """Each path (of `only`) asked of each device (kind, ident, owner): what it
    answered where that differs from what the one answer makes of it."""
    wrong = []
    for path in only:
        before()
        for kind, ident, owner in owned:
            got = paths[path](root, tmp, kind, ident)
            expect = want(path, kind, ident, owner)
            if got != expect:
                wrong.append(f"{path}: {ident} ({owner}'s) answered {got!r}, not {expect!r}")
    return wrong


def walk(root: str, made: dict[str, str], tmp: Path) -> list[str]:
    # refresh: the arrival's grace is seconds
    return _compare(root, tmp, PATHS, PATHS, devices(made), expected, lambda: refresh(root))


def test_every_path_gives_the_one_answer(built: tuple[str, dict[str, str]],
                                         tmp_path: Path) -> None:
    root, made = built
    assert walk(root, made, tmp_path) == []


@pytest.mark.parametrize("path, target, value", [
    ("report", "gpulib.discovery.host_endpoints", lambda *a, **k: []),
    ("transformer", "gpulib.hostfacts.host_endpoints", lambda *a, **k: []),
    ("pools", "gpulib.pools.unmanaged_reason", lambda *a, **k: None),
    ("report", "gpulib.occupancy.Occupancy.hands_off", lambda *a, **k: None),
    ("mdev create", "gpulib.cli.vgpu._refuse_hands_off", lambda *a, **k: None),
])
def test_a_path_that_skips_the_answer_is_caught(built: tuple[str, dict[str, str]],
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                path: str, target: str,
                                                value: Callable[..., Any]) -> None:
    root, made = built
    monkeypatch.setattr(target, value)
    wrong = walk(root, made, tmp_path)
    assert any(w.startswith(f"{path}:") for w in wrong), wrong


# -- the executables: the same walk through the commands and hooks a host runs ----------------
#
# Each runs on its own copy of the host. A path that does not depend on the
# device (reconcile, another VM's stop) runs once per copy of the host and is
# asked about every device.

GPULIB = str(BIN / "gpulib")
OTHER = f"<domain><name>i-2-7-VM</name><uuid>{VM_UUID}</uuid></domain>".encode()


def _state(root: str) -> dict[str, Any]:
    return dict(json.loads(Path(root, "var/lib/gpulib/state.json").read_text()))


def _held(root: str) -> set[str]:
    return {d["id"] for a in _state(root)["allocations"].values() for d in a["devices"]}


def _live(root: str, uuid: str) -> bool:
    return os.path.lexists(os.path.join(root, "sys/bus/mdev/devices", uuid))


def qemu_prepare_records(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """Plain libvirt: `prepare begin` of a domain naming it exits 0 and
    records it as the VM's."""
    copy = _copy(root, tmp)
    xml = pci_xml("i-2-7-VM", VM_UUID, ident) if kind == "pci" else \
        mdev_xml("i-2-7-VM", VM_UUID, ident)
    res = run([QEMU_HOOK, "i-2-7-VM", "prepare", "begin", "-"], copy, stdin=xml.encode())
    return res.returncode == 0 and ident in _held(copy)


def mdev_remove_removes(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """`gpulib mdev remove` exits 0 and the vGPU is gone."""
    if kind == "pci":
        return False
    copy = _copy(root, tmp)
    res = run([GPULIB, "mdev", "remove", ident], copy)
    return res.returncode == 0 and not _live(copy, ident)


_ONCE: dict[tuple[str, str], str] = {}


def _once(path: str, root: str, tmp: Path, argv: list[str], stdin: bytes = b"",
          conf: str = "", codes: tuple[int, ...] = (0,)) -> str:
    """The copy `argv` ran on (once per host and path; `conf`: its gpulib.conf
    then), and its exit code checked."""
    key = (path, root)
    if key not in _ONCE:
        copy = _copy(root, tmp)
        if conf:
            Path(copy, "etc/gpulib/gpulib.conf").write_text(conf)
        res = run(argv, copy, stdin=stdin)
        assert res.returncode in codes, (path, res.stdout, res.stderr)
        _ONCE[key] = copy
    return _ONCE[key]


def reconcile_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After `gpulib reconcile` it is still there (a vGPU live, a GPU's driver as it was)."""
    copy = _once("reconcile", root, tmp, [GPULIB, "reconcile"])
    if kind == "pci":
        drv = f"sys/bus/pci/devices/{ident}/driver"
        return os.readlink(os.path.join(copy, drv)) == os.readlink(os.path.join(root, drv))
    return _live(copy, ident)


def other_onstop_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After another VM's onStop it is still held by the run that held it."""
    copy = _once("onStop", root, tmp, [STATE_CHANGE, "onStop", "i-2-7-VM"])
    return ident in _held(copy)


def other_release_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After another VM's `release end` it is still held by the run that held it."""
    copy = _once("release", root, tmp, [QEMU_HOOK, "i-2-7-VM", "release", "end", "-"], OTHER)
    return ident in _held(copy)


def restore_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After `gpulib restore` (at boot) it is still there."""
    copy = _once("restore", root, tmp, [GPULIB, "restore"])
    return reconcile_keeps(copy, tmp, kind, ident) if kind == "pci" else _live(copy, ident)


def other_onstart_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After another VM's onStart it is still held by the run that held it."""
    copy = _once("onStart", root, tmp, [STATE_CHANGE, "onStart", "i-2-7-VM"])
    return ident in _held(copy)


def other_started_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After another VM's `started begin` it is still held by the run that held it."""
    copy = _once("started", root, tmp, [QEMU_HOOK, "i-2-7-VM", "started", "begin", "-"], OTHER)
    return ident in _held(copy)


_STATUS: dict[str, Any] = {}


def status_says(root: str, tmp: Path, kind: str, ident: str) -> tuple[bool, bool]:
    """`gpulib status --json`: (a VM holds it, it may be given)."""
    if root not in _STATUS:
        res = run([GPULIB, "status", "--json"], _copy(root, tmp))  # a fresh arrival
        assert res.returncode == 0, res.stderr
        _STATUS[root] = json.loads(res.stdout)
    for g in _STATUS[root]["gpus"]:
        if kind == "pci" and g["address"] == ident:
            return g["used_by"] is not None, g["whole_refusal"] is None
        for v in g["vgpus"]:
            if v["uuid"] == ident:
                return v["used_by"] is not None, bool(v["available"])
    raise AssertionError(f"{ident} is not in gpulib status")


def _seen(root: str, kind: str, ident: str) -> Any:
    """What the host and the state say of a device: a GPU's driver, a vGPU's
    life and record, a VF's type and record."""
    state = _state(root)
    if kind == "mdev":
        return _live(root, ident), state["vgpus"].get(ident)
    if kind == "vf":
        return _vf_type(root, ident), state["vf_types"].get(ident)
    return os.readlink(os.path.join(root, f"sys/bus/pci/devices/{ident}/driver"))


def doctor_leaves(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """`gpulib doctor` (every check) leaves the device and its record as they were."""
    copy = _once("doctor", root, tmp, [GPULIB, "doctor"], codes=(0, 1, 5))
    return bool(_seen(copy, kind, ident) == _seen(root, kind, ident))


def own_late_release_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After a `release end` of the holder's VM (a late one of its previous
    run, as libvirt sends it) the run still holds it."""
    if ident not in RUNS:
        return False
    vm = RUNS[ident][0]
    copy = _copy(root, tmp)
    uuid = _state(copy)["allocations"][vm]["domain_uuid"]
    xml = f"<domain><name>{vm}</name><uuid>{uuid}</uuid></domain>".encode()
    res = run([QEMU_HOOK, vm, "release", "end", "-"], copy, stdin=xml)
    return res.returncode == 0 and ident in _held(copy)


HELD = {U_PENDING, U_ARRIVING, U_DEAD, U_EARLIER}  # held by an allocation as built


def expected_exec(path: str, kind: str, ident: str, owner: str) -> Any:
    if path == "qemu prepare":
        return expected("transformer", kind, ident, owner)
    if path == "mdev remove":
        # the administrator's command removes what is not hands-off and no run holds
        return kind == "mdev" and owner != RUN and ident not in HANDS_OFF
    if path == "doctor":
        return True  # it reads; its fixes are printed, never applied
    if path == "status":
        # held by a run, and offered: the report's answer
        return owner == RUN, owner == RUN or expected("report", kind, ident, owner)
    if path in ("reconcile", "restore"):
        # it changes only what is gpulib's and nobody's: a run's that is over
        return ident not in LEFT_OVER
    if path == "own late release":
        # `release end` ends its VM's run only if libvirt prepared it, an
        # arrival (a failed incoming migration) or one of an earlier boot: a
        # start of this boot libvirt has not prepared is a newer run's, dead
        # or not (the next hook's sweep ends a dead one)
        return ident in (U_PENDING, U_DEAD)
    if path in ("migrate check", "migrate begin"):
        # a whole GPU cannot migrate; a vGPU keeps the device its hostdev names
        # when the start would be given it, else it is given an equivalent
        if kind == "pci":
            return None
        return "kept" if expected("transformer", kind, ident, owner) else "other"
    if path == "own onStop":
        # onStop releases what is not pending: a pending start or arrival is
        # a newer run's (one past its grace too: the VM's own hook never
        # sweeps it, another VM's hook does); an earlier boot's is released
        return ident in RUNS and RUNS[ident][1] == "pending"
    if path == "own onStart":
        # onStart activates only a run libvirt launched (none of these is): a
        # pending start or arrival stays pending, held (one past its grace
        # too: the VM's own hook leaves it to another hook's sweep, as its
        # onStop does); an earlier boot's run is over and released
        if ident not in RUNS:
            return None
        return (True, "pending") if RUNS[ident][1] == "pending" else (False, None)
    if path == "reconnect":
        # it records what the VM runs with; the administrator's, a pool's and
        # another run's outlive its stop: only a run's that is over was
        # gpulib's on-demand vGPU, now this VM's
        return None if kind == "pci" else (True, ident not in LEFT_OVER)
    if path in ("onStop", "release end", "onStart", "started"):
        # another VM's stop keeps every run's hold; a run that is over is released
        return owner == RUN and ident in HELD
    raise AssertionError(path)


EXEC_PATHS: dict[str, Callable[[str, Path, str, str], Any]] = {
    "qemu prepare": qemu_prepare_records, "mdev remove": mdev_remove_removes,
    "reconcile": reconcile_keeps, "restore": restore_keeps, "onStart": other_onstart_keeps,
    "onStop": other_onstop_keeps, "started": other_started_keeps,
    "release end": other_release_keeps, "own late release": own_late_release_keeps,
    "status": status_says, "doctor": doctor_leaves,
    "migrate check": lambda *a: migrate_check_keeps(*a),
    "migrate begin": lambda *a: migrate_begin_keeps(*a),
    "reconnect": lambda *a: reconnect_records(*a),
    "own onStop": lambda *a: own_onstop_keeps(*a),
    "own onStart": lambda *a: own_onstart_keeps(*a)}


def walk_executables(root: str, made: dict[str, str], tmp: Path,
                     only: tuple[str, ...] = tuple(EXEC_PATHS)) -> list[str]:
    _ONCE.clear()
    _STATUS.clear()
    refresh(root)  # the arrival's grace is seconds
    return _compare(root, tmp, EXEC_PATHS, only, devices(made), expected_exec)


def test_every_executable_gives_the_one_answer(built: tuple[str, dict[str, str]],
                                               tmp_path: Path) -> None:
    root, made = built
    assert walk_executables(root, made, tmp_path) == []


# A bypass in the executables' own processes: a sitecustomize that replaces
# one function before gpulib is imported (hook_env drops GPULIB_* names).
BYPASS = """
import importlib, os
names = os.environ["OWNER_PATHS_BYPASS"].split(".")
for i in range(len(names) - 1, 0, -1):
    try:
        owner = importlib.import_module(".".join(names[:i]))
    except ImportError:
        continue
    for n in names[i:-1]:
        owner = getattr(owner, n)
    setattr(owner, names[-1], lambda *a, **k: {value})
    break
"""


@pytest.mark.parametrize("path, target, value", [
    ("qemu prepare", "gpulib.hostfacts.host_endpoints", "[]"),
    ("mdev remove", "gpulib.cli.vgpu._refuse_hands_off", "None"),
    ("onStop", "gpulib.liveness.run_over", "'expired'"),
    ("release end", "gpulib.liveness.run_over", "'expired'"),
    ("onStart", "gpulib.liveness.run_over", "'expired'"),
    ("reconcile", "gpulib.liveness.run_over", "'expired'"),
    ("own late release", "gpulib.hooks.vmstate._stop_ends", "True"),
    ("status", "gpulib.occupancy.Occupancy.hands_off", "None"),
    ("migrate check", "gpulib.migration._left_over", "frozenset()"),
    ("migrate begin", "gpulib.migration.Planner._taken", "None"),
    ("own onStop", "gpulib.hooks.vmstate._stop_ends", "True"),
    ("own onStart", "gpulib.liveness.Liveness.launched", "True"),
])
def test_an_executable_that_skips_the_answer_is_caught(built: tuple[str, dict[str, str]],
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       path: str, target: str,
                                                       value: str) -> None:
    root, made = built
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BYPASS.format(value=value))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("OWNER_PATHS_BYPASS", target)
    cases = tmp_path / "cases"
    cases.mkdir()
    wrong = walk_executables(root, made, cases, only=(path,))
    assert any(w.startswith(f"{path}:") for w in wrong), wrong


# -- the VFs: an A10 with a VF typed outside gpulib, a pool member and free VFs,
# and an unmanaged A10 whose VFs (one typed by hand) are hands-off ---------------------------

A10 = "0000:41:00.0"
A10_UNMANAGED = "0000:43:00.0"
VF_OUTSIDE, VF_POOL, VF_FREE = "0000:41:00.4", "0000:41:00.5", "0000:41:00.6"
VF_UNMANAGED, VF_UNMANAGED_TYPED = "0000:43:00.4", "0000:43:00.5"
VF_HANDS_OFF = {VF_UNMANAGED, VF_UNMANAGED_TYPED}
A10_4Q = "NVIDIA A10-4Q"


def vf_owners_host(tmp: str) -> FakeHost:
    host = a10_host(tmp, numvfs=4)
    m = models()["a10"]
    host.add_bridge("0000:42:03.1", numa_node=0, iommu_group=host.new_iommu_group())
    host.add_function(A10_UNMANAGED, m["vendor"], m["device"], m["class"], driver="nvidia",
                      iommu_group=host.new_iommu_group(), numa_node=0, parent="0000:42:03.1",
                      vendor_name=m["vendor_name"], device_name=m["device_name"])
    host.set_sriov_capability(A10_UNMANAGED, 32, m["vf_device"], offset=4)
    types = {int(k): v for k, v in m["nvidia_vf_types"].items()}
    for vf in host.enable_sriov(A10_UNMANAGED, 2, vf_driver="nvidia"):
        host.add_nvidia_vf_types(vf, types)
    for argv in (["vf", "set-type", VF_OUTSIDE, A10_4Q, "--no-keep"],  # no record: outside
                 ["vf", "set-type", VF_UNMANAGED_TYPED, A10_4Q]):
        res = run([GPULIB, *argv], host.root)
        assert res.returncode == 0, res.stderr
    host.write_file("etc/gpulib/gpulib.conf",
                    f"[pool a]\nparents = {A10}\nprofile = {A10_4Q}\ncount = 1\n")
    res = run([GPULIB, "pool", "apply"], host.root)
    assert res.returncode == 0, res.stdout + res.stderr
    assert VF_POOL in _state(host.root)["vf_types"]
    assert run([GPULIB, "device", "unmanage", A10_UNMANAGED], host.root).returncode == 0
    return host


@pytest.fixture(scope="module")
def vf_built(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vf_owners_host(str(tmp_path_factory.mktemp("vf-owners"))).root


VF_DEVICES = [("vf", VF_OUTSIDE, ADMIN), ("vf", VF_POOL, POOL), ("vf", VF_FREE, NOBODY),
              ("vf", VF_UNMANAGED, ADMIN), ("vf", VF_UNMANAGED_TYPED, ADMIN)]


def _vf_type(root: str, vf: str) -> int:
    return int(Path(root, f"sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type").read_text())


def vf_report_offers(root: str, tmp: Path, kind: str, vf: str) -> bool:
    """The CloudStack report lists the VF free (`used_by_vm` null)."""
    doc = cloudstack.render(discover_host(Context.for_root(root), learn=False))
    for g in doc["gpus"]:
        for v in g.get("vf_instances", []):
            if v["vf_pci_address"] == vf[5:]:
                return v["used_by_vm"] is None
    return False  # an untyped VF is capacity, not an instance


def vf_set_type_types(root: str, tmp: Path, kind: str, vf: str) -> bool:
    copy = _copy(root, tmp)
    res = run([GPULIB, "vf", "set-type", vf, A10_4Q], copy)
    return res.returncode == 0 and _vf_type(copy, vf) != 0


def vf_clear_clears(root: str, tmp: Path, kind: str, vf: str) -> bool:
    copy = _copy(root, tmp)
    res = run([GPULIB, "vf", "clear", vf], copy)
    return res.returncode == 0 and _vf_type(copy, vf) == 0


def vf_pool_takes(root: str, tmp: Path, kind: str, vf: str) -> bool:
    """A pool of every GPU's VFs, as many as there are, holds it after `pool apply`."""
    copy = _once("vf pool", root, tmp, [GPULIB, "pool", "apply"],
                 conf=f"[pool a]\nparents = all\nprofile = {A10_4Q}\ncount = 9\n")
    rec = _state(copy)["vf_types"].get(vf)
    return rec is not None and rec.get("pool") == "a"


def vf_owner_says(root: str, tmp: Path, kind: str, vf: str) -> str:
    return owner_says(root, tmp, kind, vf)


def expected_vf(path: str, kind: str, vf: str, owner: str) -> Any:
    hands_off = vf in VF_HANDS_OFF
    if path == "owner":
        return owner
    if path == "report":
        # a typed VF not hands-off (the administrator's is theirs to hand to CloudStack)
        return owner in (POOL, ADMIN) and not hands_off
    if path in ("transformer", "qemu prepare"):
        # a start naming it is given what the report offers (an untyped VF is
        # no vGPU to name)
        return expected_vf("report", kind, vf, owner)
    if path == "vf set-type":
        # only an untyped VF nobody holds (the driver refuses to retype a typed one)
        return owner == NOBODY
    if path == "vf clear":
        # the administrator's command: whatever is not hands-off and no run holds
        return not hands_off and owner != RUN
    if path == "pool apply":
        return owner in (POOL, NOBODY)  # may_give
    if path == "doctor":
        return True
    if path in ("migrate check", "migrate begin"):
        # kept when typed and offered or free to type, else an equivalent
        return "kept" if owner == NOBODY or expected_vf("report", kind, vf, owner) else "other"
    raise AssertionError(path)


VF_PATHS: dict[str, Callable[[str, Path, str, str], Any]] = {
    "owner": vf_owner_says, "report": vf_report_offers, "vf set-type": vf_set_type_types,
    "vf clear": vf_clear_clears, "pool apply": vf_pool_takes, "doctor": doctor_leaves,
    "transformer": lambda root, tmp, kind, vf: transformer_records(root, tmp, "pci", vf),
    "qemu prepare": lambda root, tmp, kind, vf: qemu_prepare_records(root, tmp, "pci", vf),
    "migrate check": lambda *a: migrate_check_keeps(*a),
    "migrate begin": lambda *a: migrate_begin_keeps(*a)}


def walk_vfs(root: str, tmp: Path, only: tuple[str, ...] = tuple(VF_PATHS)) -> list[str]:
    _ONCE.clear()
    return _compare(root, tmp, VF_PATHS, only, VF_DEVICES, expected_vf)


def test_every_path_gives_the_one_answer_for_vfs(vf_built: str, tmp_path: Path) -> None:
    assert walk_vfs(vf_built, tmp_path) == []


@pytest.mark.parametrize("path, target, value", [
    ("vf clear", "gpulib.cli.vgpu._refuse_hands_off", "None"),
    ("pool apply", "gpulib.occupancy.Occupancy.owner",
     "__import__('gpulib.ownership').ownership.NOBODYS"),
    ("migrate check", "gpulib.occupancy.Occupancy.hands_off", "None"),
    ("migrate begin", "gpulib.migration.Planner._taken", "None"),
])
def test_a_vf_path_that_skips_the_answer_is_caught(vf_built: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   path: str, target: str, value: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BYPASS.format(value=value))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("OWNER_PATHS_BYPASS", target)
    cases = tmp_path / "cases"
    cases.mkdir()
    wrong = walk_vfs(vf_built, cases, only=(path,))
    assert any(w.startswith(f"{path}:") for w in wrong), wrong


# -- a live migration's destination: `gpulib migrate check` and `migrate begin` of
# an incoming VM whose hostdev names each device, with gpulib's record of its type ---------

MIG_VM, MIG_UUID = "i-9-9-VM", "9e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e"
T4_ID = "10de:1eb8"
A10_4Q_ID = 593


def incoming_xml(kind: str, ident: str) -> str:
    """The live XML of a VM arriving with a vGPU the hostdev names as `ident`
    (a GPU: given whole, no record)."""
    if kind == "mdev":
        dev = (f"<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
               f"<address uuid='{ident}'/></source></hostdev>")
        rec = f"<gpulib:device kind='mdev' id='{ident}' type='nvidia-222' gpu='{T4_ID}'/>"
    else:
        dev = pci_hostdev(ident)
        rec = "" if kind == "pci" else (f"<gpulib:device kind='vf' id='{ident}' "
                                        f"type='{A10_4Q_ID}' name='{A10_4Q}' gpu='10de:2236'/>")
    meta = f"<metadata><gpulib:gpus xmlns:gpulib='{GPULIB_NS}'>{rec}</gpulib:gpus></metadata>"
    return (f"<domain type='kvm'><name>{MIG_VM}</name><uuid>{MIG_UUID}</uuid>{meta}"
            f"<devices>{dev}</devices></domain>")


def migrate_check_keeps(root: str, tmp: Path, kind: str, ident: str) -> Any:
    """`gpulib migrate check`: the arrival keeps the device its hostdev names
    ('kept', 'readied'), is given another ('other') or is refused (None)."""
    copy = _once("migrate check", root, tmp, ["true"])
    res = run([GPULIB, "migrate", "check", "-", "--json"], copy,
              stdin=incoming_xml(kind, ident).encode())
    doc = json.loads(res.stdout)
    assert (res.returncode == 0) == bool(doc["ok"]), (res.stdout, res.stderr)
    if not doc["ok"]:
        return None
    (dev,) = doc["devices"]
    return "kept" if dev["target"] == ident else "other"


def migrate_begin_keeps(root: str, tmp: Path, kind: str, ident: str) -> Any:
    """`migrate begin`: the arrival holds the device its hostdev names ('kept'),
    another ('other') or nothing (refused: None)."""
    copy = _copy(root, tmp)
    res = run([QEMU_HOOK, MIG_VM, "migrate", "begin", "-"], copy,
              stdin=incoming_xml(kind, ident).encode())
    if res.returncode != 0:
        return None
    held = {d["id"] for d in _state(copy)["allocations"][MIG_VM]["devices"]}
    return "kept" if ident in held else "other"


# -- `reconnect begin`: a VM that runs with the device, re-learned after libvirtd restarts ---


def reconnect_records(root: str, tmp: Path, kind: str, ident: str) -> Any:
    """(the VM is recorded holding it, it outlives the VM's stop): a running VM
    is re-learned with what its status file names; only gpulib's on-demand
    vGPUs that no other run holds go with it."""
    if kind == "pci":
        return None
    copy = _copy(root, tmp)
    host = FakeHost(copy)
    host.add_running_domain(MIG_VM, MIG_UUID, mdevs=(ident,), pid=5000, domain_id=9)
    res = run([QEMU_HOOK, MIG_VM, "reconnect", "begin", "-"], copy,
              stdin=mdev_xml(MIG_VM, MIG_UUID, ident).encode())
    assert res.returncode == 0, res.stderr
    alloc = _state(copy)["allocations"].get(MIG_VM)
    recorded = alloc is not None and any(d["id"] == ident for d in alloc["devices"])
    host.stop_domain(MIG_VM)
    assert run([STATE_CHANGE, "onStop", MIG_VM], copy).returncode == 0
    return recorded, _live(copy, ident)


def own_onstart_keeps(root: str, tmp: Path, kind: str, ident: str) -> Any:
    """After the holder's own onStart, while libvirt runs none of these VMs: (the
    run still holds it, its allocation still pending or of an earlier boot)."""
    if ident not in RUNS:
        return None
    vm = RUNS[ident][0]
    copy = _copy(root, tmp)
    res = run([STATE_CHANGE, "onStart", vm], copy)
    alloc = _state(copy)["allocations"].get(vm)
    return res.returncode == 0 and ident in _held(copy), \
        alloc["status"] if alloc is not None else None


def own_onstop_keeps(root: str, tmp: Path, kind: str, ident: str) -> bool:
    """After the holder's own onStop (the CloudStack agent's) the run still holds it."""
    if ident not in RUNS:
        return False
    copy = _copy(root, tmp)
    res = run([STATE_CHANGE, "onStop", RUNS[ident][0]], copy)
    return res.returncode == 0 and ident in _held(copy)


# -- attach and detach (plain libvirt): whole GPUs of every owner ---------------------------

# Whole GPUs and whose each is: the console and a GPU beside a NIC the host uses
# (the host's), an unmanaged GPU (the administrator's), a GPU carrying vGPUs
# (its vGPUs' owners', never given whole) and a free one (nobody's).
WHOLE = [(IGPU, HOST), (SHARED, HOST), (UNMANAGED, ADMIN), (MANAGED, RUN), (FREE, NOBODY)]


def attach_gives(root: str, tmp: Path, address: str) -> bool:
    """`gpulib attach test --gpu ADDR --dry-run` on libvirt's test driver (which
    virsh serves itself) accepts the GPU."""
    r = run([GPULIB, "attach", "test", "--gpu", address, "--dry-run", "-c", "test:///default"],
            _copy(root, tmp))
    return r.returncode == 0


def whole_offered(root: str, address: str) -> bool:
    """The one answer for a whole GPU, as the report gives it: `enabled`."""
    return report_offers(root, Path("/nonexistent"), "pci", address)


@pytest.mark.skipif(shutil.which("virsh") is None, reason="no virsh")
def test_attach_gives_a_whole_gpu_exactly_when_the_report_offers_it(
        built: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    root, _ = built
    refresh(root)
    wrong = []
    for address, owner in WHOLE:
        offered = whole_offered(root, address)
        assert offered == (owner == NOBODY), (address, owner, offered)
        got = attach_gives(root, tmp_path, address)
        if got != offered:
            wrong.append(f"attach: {address} ({owner}'s) given {got}, offered {offered}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.skipif(shutil.which("virsh") is None, reason="no virsh")
def test_attach_that_skips_the_answer_is_caught(built: tuple[str, dict[str, str]],
                                                 tmp_path: Path) -> None:
    """attach asking nobody whether a GPU may go whole (every refusal answered
    None) gives the console: the walk catches it."""
    root, _ = built
    refresh(root)
    (tmp_path / "bypass").mkdir()
    (tmp_path / "bypass" / "sitecustomize.py").write_text(
        "import gpulib.ownership as o\n"
        "o.whole_gpu_refusal = lambda *a, **k: None\n"
        "o.host_endpoint_reason = lambda *a, **k: None\n")
    env_root = _copy(root, tmp_path)
    r = subprocess.run([GPULIB, "attach", "test", "--gpu", IGPU, "--dry-run", "-c",
                        "test:///default"], capture_output=True, timeout=60,
                       env={**hook_env(env_root), "PYTHONPATH": str(tmp_path / "bypass")})
    assert r.returncode == 0, "the bypass did not take: the walk would not catch a skip"
    assert not whole_offered(root, IGPU)


# -- MIG pools: GPU instances of the pool's and made by hand --------------------------------


def _mig_host(tmp: Path) -> FakeHost:
    """An H100 in MIG mode with a pool of two instances made, and one more made by
    hand beside them (the administrator's)."""
    from gpulib.sim.hosts import MIG_GPU, build_mig

    host = build_mig(str(tmp / "mig"))
    host.write_file("proc/sys/kernel/random/boot_id", "boot-1\n", 0o444)
    host.write_file("etc/gpulib/gpulib.conf",
                    f"[pool mig]\nparents = {MIG_GPU}\nprofile = NVIDIA H100-1-10C\ncount = 2\n")
    made = run([GPULIB, "pool", "apply"], host.root)
    assert made.returncode == 0, made.stdout + made.stderr
    hand = run([host.p("usr/bin/nvidia-smi"), "mig", "-i", "0", "-cgi", "19", "-C"],
               host.root)
    assert hand.returncode == 0, hand.stderr
    return host


def _instances(root: str) -> set[tuple[int, int, int]]:
    from gpulib.sim.hosts import MIG_GPU
    from gpulib.sim.migdriver import MigGpu

    gpu = MigGpu.load(os.path.join(root, "sys/bus/pci/devices", MIG_GPU))
    assert gpu is not None
    return {(int(i["profile"]), int(i["start"]), int(i["id"])) for i in gpu.instances()}


def _gi_owners(root: str) -> dict[tuple[int, int, int], str]:
    """Each live GPU instance and whose the one answer says it is."""
    from gpulib.ownership import gpu_instance_owner
    from gpulib.sim.hosts import MIG_GPU

    ctx = Context.for_root(root)
    state = open_store(ctx).load()
    boot = Path(root, "proc/sys/kernel/random/boot_id").read_text().strip()
    return {i: gpu_instance_owner(state, MIG_GPU, i[0], i[1], gi=i[2], boot=boot).kind
            for i in _instances(root)}


def mig_walk(root: str, extra_env: dict[str, str]) -> list[str]:
    """pool apply grown to three and shrunk to none: it makes new instances rather
    than take the administrator's, and destroys exactly the pool's."""
    env = {**hook_env(root), **extra_env}
    owners = _gi_owners(root)
    wrong = []
    conf = Path(root, "etc/gpulib/gpulib.conf")
    conf.write_text(conf.read_text().replace("count = 2", "count = 3"))
    subprocess.run([GPULIB, "pool", "apply"], env=env, capture_output=True, timeout=120)
    grown = _instances(root)
    for i, owner in owners.items():
        if i not in grown:
            wrong.append(f"pool apply (grow) destroyed {i} ({owner}'s)")
    want_new = 3 - sum(1 for owner in owners.values() if owner == POOL)
    if len(grown - set(owners)) != want_new:
        wrong.append(f"pool apply (grow) made {len(grown - set(owners))} instance(s), "
                     f"not {want_new}")
    conf.write_text(conf.read_text().replace("count = 3", "count = 0"))
    subprocess.run([GPULIB, "pool", "apply"], env=env, capture_output=True, timeout=120)
    left = _instances(root)
    for i, owner in owners.items():
        if (i in left) != (owner != POOL):
            wrong.append(f"pool apply (shrink) {'kept' if i in left else 'destroyed'} {i} "
                         f"({owner}'s)")
    return wrong


def test_mig_pools_give_and_change_only_the_pools_instances(tmp_path: Path) -> None:
    host = _mig_host(tmp_path)
    owners = _gi_owners(host.root)
    assert sorted(owners.values()) == [ADMIN, POOL, POOL], owners
    assert mig_walk(host.root, {}) == []


def test_a_mig_pool_that_skips_the_answer_is_caught(tmp_path: Path) -> None:
    """pool apply taking every instance at a recorded placement for its own
    (`made_by_gpulib` always yes) is caught when the administrator's sits at one."""
    host = _mig_host(tmp_path)
    # After a reboot, the administrator makes an instance where the pool's was.
    for i in list(_instances(host.root)):
        run([host.p("usr/bin/nvidia-smi"), "mig", "-i", "0", "-dci", "-gi", str(i[2])],
            host.root)
        run([host.p("usr/bin/nvidia-smi"), "mig", "-i", "0", "-dgi", "-gi", str(i[2])],
            host.root)
    host.write_file("proc/sys/kernel/random/boot_id", "boot-2\n", 0o444)
    run([host.p("usr/bin/nvidia-smi"), "mig", "-i", "0", "-cgi", "19", "-C"], host.root)
    (tmp_path / "bypass").mkdir()
    (tmp_path / "bypass" / "sitecustomize.py").write_text(
        "import gpulib.ownership as o\n"
        "o.made_by_gpulib = lambda *a, **k: True\n")
    honest = mig_walk(_copy_tree(host.root, tmp_path / "honest"), {})
    assert honest == [], honest
    skipped = mig_walk(_copy_tree(host.root, tmp_path / "skipped"),
                       {"PYTHONPATH": str(tmp_path / "bypass")})
    assert skipped, "the bypass went unnoticed"


def _copy_tree(root: str, dst: Path) -> str:
    shutil.copytree(root, str(dst), symlinks=True)
    return str(dst)
