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
from gpulib.lifecycle import open_store
from gpulib.liveness import running_domains
from gpulib.occupancy import Occupancy
from gpulib.ownership import ADMIN, HOST, NOBODY, POOL, RUN
from gpulib.runtime import discover_host
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import add_model, models
from tests.hookrun import BIN, mdev_xml, run
from tests.hosts import empty_host
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
    return host.root, made


# The devices and the owner each must have: (kind, ident, owner kind).
def devices(made: dict[str, str]) -> list[tuple[str, str, str]]:
    return [("pci", IGPU, HOST), ("pci", SHARED, HOST), ("pci", FREE, NOBODY),
            ("mdev", U_UNMANAGED, ADMIN), ("mdev", U_RAW, ADMIN), ("mdev", U_MDEVCTL, ADMIN),
            ("mdev", made["cli"], ADMIN), ("mdev", made["pool"], POOL),
            ("mdev", U_RUN, RUN)]


HANDS_OFF = {U_UNMANAGED}  # the administrator's unmanaged devices: not even offered


def _copy(root: str, tmp: Path) -> str:
    dst = str(tmp / f"copy{len(os.listdir(tmp))}")
    shutil.copytree(root, dst, symlinks=True)
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
    raise AssertionError(f"{ident} is not in the report")


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
    if path == "report":
        return owner in (NOBODY, POOL) or (owner == ADMIN and ident not in HANDS_OFF)
    if path == "transformer":
        return owner in (NOBODY, POOL) or (owner == ADMIN and ident not in HANDS_OFF)
    if path in ("pools", "metrics", "mdev create"):
        # gpulib may make vGPUs on a parent that is not hands-off (its capacity)
        return kind == "mdev" and ident not in HANDS_OFF
    raise AssertionError(path)


PATHS: dict[str, Callable[[str, Path, str, str], Any]] = {
    "owner": owner_says, "report": report_offers, "transformer": transformer_records,
    "pools": pools_would_use, "metrics": metrics_count, "mdev create": vgpu_command_makes}


def walk(root: str, made: dict[str, str], tmp: Path) -> list[str]:
    wrong = []
    for path, ask in PATHS.items():
        for kind, ident, owner in devices(made):
            got = ask(root, tmp, kind, ident)
            want = expected(path, kind, ident, owner)
            if got != want:
                wrong.append(f"{path}: {ident} ({owner}'s) answered {got!r}, not {want!r}")
    return wrong


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
