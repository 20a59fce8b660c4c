"""`gpulib metrics`, the hooks' counters, the metrics timer and the alert rules.

The output is checked by Prometheus' own tools where the machine has them
(Debian's `prometheus` package: promtool; `prometheus-node-exporter`): the
format by `promtool check metrics` on every simulated host, the alert rules
by `promtool test rules` against series made from gpulib's output, and a
real node exporter's textfile collector serves the file over HTTP before and
after a VM started through the real hooks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import counters, metrics
from gpulib.config import Config
from gpulib.context import Context
from gpulib.entry import context_for_root
from gpulib.hostview import discover_host
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import build_demo
from gpulib.state import Allocation, Device, State, StateStore, VgpuRecord, dumps
from tests.hookrun import BIN, STATE_CHANGE, as_agent, hook_env, mdev_xml
from tests.hosts import P1, P2, a10_host, empty_host, healthy_host, t4_host, two_t4_host
from tests.simhosts import HOSTS, Built

ROOT = Path(__file__).resolve().parent.parent
ETC = ROOT / "etc"
ALERTS = ETC / "prometheus" / "gpulib-alerts.yml"
GPULIB = str(BIN / "gpulib")
PROMTOOL = shutil.which("promtool")
NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool (Debian package prometheus) is not "
                                           "installed")
needs_node_exporter = pytest.mark.skipif(
    NODE_EXPORTER is None, reason="prometheus-node-exporter is not installed")

T4 = "0000:3b:00.0"


def bus(address: str) -> str:
    """The `pci_bus_id` label of a GPU at `address` (as NVIDIA's tools write it)."""
    return metrics.pci_bus_id(PciAddress.parse(address))


T4_BUS = "00000000:3B:00.0"
U1 = "11111111-2222-4333-8444-555555555555"
U2 = "22222222-3333-4444-8555-666666666666"
DOMAIN_UUID = "9f3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b"


# -- reading the text format back (the test's own reader) -----------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse(text: str) -> Series:
    """Every sample of an exposition: (name, labels) -> value."""
    out: Series = {}
    for line in text.split("\n"):  # the format's one line end (a "\r" is a character)
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        labels: dict[str, str] = {}
        if m.group(2):
            pos = 0
            body = m.group(2)
            while pos < len(body):
                lm = _LABEL.match(body, pos)
                assert lm, line
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
        key = (m.group(1), frozenset(labels.items()))
        assert key not in out, f"duplicate series {line}"
        out[key] = float(m.group(3))
    return out


def value(series: Series, name: str, **labels: str) -> float:
    return series[(name, frozenset(labels.items()))]


def matching(series: Series, name: str, **labels: str) -> dict[frozenset[tuple[str, str]],
                                                               float]:
    want = set(labels.items())
    return {ls: v for (n, ls), v in series.items() if n == name and want <= ls}


def run_metrics(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULIB, "metrics", *args], capture_output=True, text=True,
                          env=hook_env(root), timeout=60)


def scrape(root: str) -> Series:
    r = run_metrics(root)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return parse(r.stdout)


def native(root: str) -> dict:  # type: ignore[type-arg]
    r = subprocess.run([GPULIB, "discover", "--format", "json"], capture_output=True,
                       text=True, env=hook_env(root), timeout=60, check=True)
    return json.loads(r.stdout)  # type: ignore[no-any-return]


# -- every simulated host -------------------------------------------------------------------


@pytest.fixture
def built(simulated_hosts: Built) -> Built:
    """Every simulated host (`tests.simhosts`), built once a session."""
    return simulated_hosts


@needs_promtool
@pytest.mark.parametrize("name", sorted(HOSTS))
def test_promtool_accepts_every_simulated_host(built: dict[str, str], name: str) -> None:
    r = run_metrics(built[name])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert PROMTOOL is not None
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=r.stdout, capture_output=True,
                           text=True, timeout=60)
    # promtool prints its lint findings (naming, units, HELP) and exits 1 on any.
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip() == "" and check.stderr.strip() == ""


def cloudstack_report(root: str) -> dict:  # type: ignore[type-arg]
    r = subprocess.run([GPULIB, "discover", "--format", "cloudstack"], capture_output=True,
                       text=True, env=hook_env(root), timeout=60, check=True)
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def assert_unavailable_as_reported(root: str) -> int:
    """gpulib_gpu_unavailable_instances counts, per GPU and kind, exactly the
    instances the CloudStack report lists used by gpulib:unavailable; the
    number of them."""
    series = scrape(root)
    total = 0
    for g in cloudstack_report(root)["gpus"]:
        address = g["pci_address"] if g["pci_address"].count(":") == 2 else \
            "0000:" + g["pci_address"]
        for kind, key in (("vgpu", "vgpu_instances"), ("vf", "vf_instances")):
            want = sum(1 for i in g[key] if i["used_by_vm"] == "gpulib:unavailable")
            got = value(series, "gpulib_gpu_unavailable_instances", pci_bus_id=bus(address),
                        kind=kind)
            assert got == want, (address, kind)
            total += want
    return total


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_vendor_vf_types_left_are_mdev_types_answer(built: dict[str, str], name: str) -> None:
    """What an NVIDIA vendor-VF type has left on a GPU is one answer: `gpulib mdev
    types` shows per GPU what gpulib_nvidia_vf_type_creatable_vfs counts (never
    more than the GPU runs of the type)."""
    root = built[name]
    series = scrape(root)
    r = subprocess.run([GPULIB, "mdev", "types", "--json"], capture_output=True, text=True,
                       env=hook_env(root), timeout=60, check=True)
    rows = {(bus(row["parent"]), row["type_id"]): row for row in json.loads(r.stdout)
            if row["kind"] == "nvidia-vf"}
    creatable = {(dict(ls)["pci_bus_id"], dict(ls)["type"]): v for ls, v in
                 matching(series, "gpulib_nvidia_vf_type_creatable_vfs").items() if v}
    assert {k: row["available_instances"] for k, row in rows.items()} == creatable
    for row in rows.values():
        if row["max_instances"] is not None:
            assert row["available_instances"] <= row["max_instances"], row


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_unavailable_instances_are_the_reports(built: dict[str, str], name: str) -> None:
    assert_unavailable_as_reported(built[name])


def test_an_unmanaged_gpus_instances_have_a_series(tmp_path: Path) -> None:
    """What the report marks unavailable (an unmanaged GPU's idle vGPU) is no
    blind spot: its series says how many, so an alert can see it."""
    host = t4_host(str(tmp_path), live=(U1,))
    assert assert_unavailable_as_reported(host.root) == 0
    r = subprocess.run([GPULIB, "device", "unmanage", "0000:3b:00.0"], capture_output=True,
                       text=True,
                       env=hook_env(host.root), timeout=60)
    assert r.returncode == 0, r.stderr
    assert assert_unavailable_as_reported(host.root) > 0


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_metrics_agree_with_discovery(built: dict[str, str], name: str) -> None:
    """The same model as `gpulib discover`: its GPUs, their types' instances
    left, the vGPUs per parent and type and their users, the vendor VFs."""
    root = built[name]
    series = scrape(root)
    doc = native(root)
    gpus = {g["address"]: g for g in doc["gpus"]}
    info = matching(series, "gpulib_gpu_info")
    assert {dict(ls)["address"] for ls in info} == set(gpus)
    for ls in info:
        labels = dict(ls)
        g = gpus[labels["address"]]
        assert labels["pci_bus_id"] == bus(g["address"])
        assert (labels["vendor_id"], labels["device_id"], labels["mode"], labels["numa_node"]) \
            == (g["vendor_id"], g["device_id"], g["mode"], str(g["numa_node"]))
        assert labels["device"] == g["device"] and labels["driver"] == (g["driver"] or "")
    # Per GPU and type: the instances left on all its parents, summed.
    creatable = {(dict(ls)["pci_bus_id"], dict(ls)["type"]): v
                 for ls, v in matching(series, "gpulib_vgpu_creatable_instances").items()}
    want_creatable: dict[tuple[str, str], int] = {}
    for g in doc["gpus"]:
        for t in g["mdev_types"]:
            if t["available_instances"] is not None:
                key = (bus(g["address"]), t["type_id"])
                want_creatable[key] = want_creatable.get(key, 0) + t["available_instances"]
    assert creatable == want_creatable
    for kind, pick in (("live", lambda v: v["live"]),
                       ("held", lambda v: v["used_by"] is not None)):
        want: dict[tuple[str, str], int] = {}
        for g in doc["gpus"]:
            for v in g["vgpus"]:
                key = (bus(g["address"]), v["type_id"])
                want[key] = want.get(key, 0) + bool(pick(v))
        got = {(dict(ls)["pci_bus_id"], dict(ls)["type"]): v
               for ls, v in matching(series, f"gpulib_vgpu_{kind}_instances").items()}
        assert got == want, kind
    for g in doc["gpus"]:
        gpu = bus(g["address"])
        vendor = [vf for vf in g["vfs"] if vf["nvidia"] is not None]
        if not vendor:
            assert not matching(series, "gpulib_nvidia_vfs", pci_bus_id=gpu)
            continue
        assert value(series, "gpulib_nvidia_vfs", pci_bus_id=gpu) == len(vendor)
        assert value(series, "gpulib_nvidia_vfs_typed", pci_bus_id=gpu) == \
            sum(1 for vf in vendor if vf["nvidia"]["current_type"])
        assert value(series, "gpulib_nvidia_vfs_held", pci_bus_id=gpu) == \
            sum(1 for vf in vendor if vf["used_by"])
        free = matching(series, "gpulib_nvidia_vf_type_creatable_vfs", pci_bus_id=gpu)
        runs = {str(t["type_id"]): t["max_instances"] for t in g["nvidia_types"]
                if t["max_instances"]}
        for ls, n in free.items():
            tid = dict(ls)["type"]
            # Idle VFs that could take the type, never more than the GPU runs
            # of it less those it has.
            idle = sum(1 for vf in vendor if not vf["nvidia"]["current_type"]
                       and tid in vf["nvidia"]["creatable"])
            has = sum(1 for vf in vendor if str(vf["nvidia"]["current_type"]) == tid)
            assert n == (min(idle, max(0, runs[tid] - has)) if tid in runs else idle), tid
        # Typed and held VFs per type where a VF has the type (absent: 0).
        typed = {dict(ls)["type"]: v for ls, v in
                 matching(series, "gpulib_nvidia_vf_type_typed_vfs", pci_bus_id=gpu).items()}
        held = {dict(ls)["type"]: v for ls, v in
                matching(series, "gpulib_nvidia_vf_type_held_vfs", pci_bus_id=gpu).items()}
        want_typed: dict[str, int] = {}
        want_held: dict[str, int] = {}
        for vf in vendor:
            tid = str(vf["nvidia"]["current_type"])
            if tid != "0":
                want_typed[tid] = want_typed.get(tid, 0) + 1
                want_held[tid] = want_held.get(tid, 0) + bool(vf["used_by"])
        assert typed == want_typed and held == want_held
    # Every doctor check has its series.
    from gpulib.doctor import CHECK_IDS

    checks = {dict(ls)["check"]: v
              for ls, v in matching(series, "gpulib_readiness_check_status").items()}
    assert set(checks) == set(CHECK_IDS) and set(checks.values()) <= {0, 1, 2}


def test_readiness_is_the_doctors_report(built: dict[str, str]) -> None:
    root = built["healthy"]
    series = scrape(root)
    r = subprocess.run([GPULIB, "doctor", "--json"], capture_output=True, text=True,
                       env=hook_env(root), timeout=60)
    summary = json.loads(r.stdout)["summary"]
    got = {dict(ls)["check"]: v
           for ls, v in matching(series, "gpulib_readiness_check_status").items()}
    assert got == {c: {"ok": 0, "warn": 1, "fail": 2}[s] for c, s in summary.items()}


def test_a_gpu_held_whole_and_a_gpu_whose_vgpu_is_held(tmp_path: Path) -> None:
    """In use means held whole: the VM of one of a GPU's VFs keeps the GPU
    from being given whole but does not hold the GPU itself (discovery's
    used_by, like the CloudStack report's, names only a VM holding the GPU
    whole; the VF names its own user). Offered whole is the report's `enabled`."""
    host = build_demo(str(tmp_path / "demo"))
    series = scrape(host.root)
    doc = native(host.root)
    vf_user = next(g for g in doc["gpus"] if g["address"] == "0000:82:00.0")
    assert vf_user["used_by"] is None and vf_user["mode"] == "nvidia-vf"
    assert [vf["used_by"] for vf in vf_user["vfs"] if vf["used_by"]] == ["i-4-20-VM"]
    assert {dict(ls)["pci_bus_id"]: v
            for ls, v in matching(series, "gpulib_gpu_in_use").items()} \
        == {bus(g["address"]): 0 for g in doc["gpus"]}
    r = subprocess.run([GPULIB, "discover", "--format", "cloudstack"], capture_output=True,
                       text=True, env=hook_env(host.root), check=True)
    enabled = {g["pci_address"]: g["full_passthrough"]["enabled"]
               for g in json.loads(r.stdout)["gpus"]}
    offered = {dict(ls)["pci_bus_id"]: v
               for ls, v in matching(series, "gpulib_gpu_whole_offered").items()}
    assert offered == {bus(a if a.count(":") == 2 else "0000:" + a): v
                       for a, v in enabled.items()}
    # A passthrough GPU given to a running VM is in use.
    host.add_running_domain("i-9-9-VM", "7a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b",
                            pci=("0000:3b:00.0",))
    assert value(scrape(host.root), "gpulib_gpu_in_use", pci_bus_id=T4_BUS) == 1


def two_allocations(pool_members: tuple[str, ...]) -> State:
    """U1 held by a pending allocation made long ago (the wall clock decides:
    no boot clock), U2 by an active one; `pool_members` in pool t4. Both VMs
    run (`both_run`): a start past its grace whose VM does not run is over,
    and holds nothing (liveness.run_over); this one's onStart never came."""
    state = State()
    for uuid in pool_members:
        state.vgpus[uuid] = VgpuRecord(T4, "nvidia-232", pool="t4")
    state.allocations["i-1-1-VM"] = Allocation("i-1-1-VM", status="pending",
                                               since="2020-01-01T00:00:00Z",
                                               devices=[Device("mdev", U1)])
    state.allocations["i-1-2-VM"] = Allocation("i-1-2-VM", status="active",
                                               devices=[Device("mdev", U2)])
    return state


def both_run(host: FakeHost) -> None:
    """The VMs of `two_allocations` run: their status files."""
    host.add_running_domain("i-1-1-VM", "1a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b", mdevs=(U1,),
                            pid=4141)
    host.add_running_domain("i-1-2-VM", "2a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b", mdevs=(U2,),
                            pid=4244)


def test_stray_vgpus_are_counted_on_the_whole_bus_discovery_listed(tmp_path: Path) -> None:
    """The stray count comes from the listing discovery made of the mdev bus:
    all of it, also the vGPUs of a GPU the configuration leaves out."""
    host = t4_host(str(tmp_path), live=(U1, U2))
    host.write_file("etc/gpulib/gpulib.conf", f"[discovery]\nexclude = {T4}\n")
    ctx = Context.for_root(host.root)
    inventory = discover_host(ctx, Config.load(ctx.config_path), learn=False)
    assert inventory.gpus == [] and inventory.live == {U1, U2}
    assert value(scrape(host.root), "gpulib_stray_vgpus") == 2


def test_allocations_stray_pools_and_state(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(U1, U2))
    root = host.root
    series = scrape(root)
    # Two live vGPUs gpulib has no record of, used by nobody: stray.
    assert value(series, "gpulib_stray_vgpus") == 2
    assert value(series, "gpulib_allocations", state="pending") == 0
    assert value(series, "gpulib_allocation_pending_oldest_age_seconds") == 0
    assert value(series, "gpulib_state_healthy") == 1
    assert not matching(series, "gpulib_state_last_write_timestamp_seconds")
    # A pending allocation made long ago and an active one; the registry
    # knows U1 as a pool member.
    state = two_allocations(pool_members=(U1,))
    both_run(host)
    os.makedirs(os.path.join(root, "var/lib/gpulib"), exist_ok=True)
    Path(root, "var/lib/gpulib/state.json").write_text(dumps(state))
    os.makedirs(os.path.join(root, "etc/gpulib"), exist_ok=True)
    Path(root, "etc/gpulib/gpulib.conf").write_text(
        f"[pool t4]\nparents = {T4}\ntype = nvidia-232\ncount = 3\n")
    before = time.time()
    series = scrape(root)
    assert value(series, "gpulib_stray_vgpus") == 0
    assert value(series, "gpulib_allocations", state="pending") == 1
    assert value(series, "gpulib_allocations", state="active") == 1
    assert value(series, "gpulib_allocation_pending_oldest_age_seconds") >= \
        before - 1577836800
    assert value(series, "gpulib_pool_members", pool="t4") == 1
    assert value(series, "gpulib_pool_held_members", pool="t4") == 1
    assert value(series, "gpulib_pool_target_members", pool="t4") == 3
    assert value(series, "gpulib_vgpu_pool_instances", pci_bus_id=T4_BUS, type="nvidia-232",
                 profile="GRID T4-4Q") == 1
    mtime = os.stat(os.path.join(root, "var/lib/gpulib/state.json")).st_mtime
    assert value(series, "gpulib_state_last_write_timestamp_seconds") == pytest.approx(
        mtime, abs=0.01)
    # A damaged state file: unhealthy, the doctor's state check fails, the
    # host's GPUs are still reported; with its copy beside it (what the next
    # hook rebuilds it from) gpulib's records read as the copy says, so no
    # series jumps meanwhile.
    healthy = {k: v for k, v in series.items() if not k[0].startswith(
        ("gpulib_state_", "gpulib_readiness_"))}
    Path(root, "var/lib/gpulib/state.json.bak").write_text(dumps(state))
    Path(root, "var/lib/gpulib/state.json").write_text("{not json")
    series = scrape(root)
    assert value(series, "gpulib_state_healthy") == 0
    assert value(series, "gpulib_readiness_check_status", check="state") == 2
    assert matching(series, "gpulib_gpu_info", pci_bus_id=T4_BUS)
    assert {k: v for k, v in series.items() if k in healthy and not k[0].endswith(
        "_age_seconds")} == {k: v for k, v in healthy.items() if not k[0].endswith(
            "_age_seconds")}
    # The copy unusable too: gpulib's records are unknown, so what they say
    # (strays, pools, allocations, intents) is absent, never a 0 or a jump.
    Path(root, "var/lib/gpulib/state.json.bak").write_text("{not json either")
    series = scrape(root)
    assert value(series, "gpulib_state_healthy") == 0
    for name in ("gpulib_stray_vgpus", "gpulib_pool_members", "gpulib_allocations",
                 "gpulib_vgpu_pool_instances", "gpulib_state_intents"):
        assert not matching(series, name), name
    assert matching(series, "gpulib_vgpu_live_instances", pci_bus_id=T4_BUS)
    Path(root, "var/lib/gpulib/state.json").write_text('{"version": 99}')
    assert value(scrape(root), "gpulib_state_healthy") == 0


@needs_promtool
def test_unreadable_files_cost_only_their_own_series(tmp_path: Path) -> None:
    """A type's `available_instances` failing with EIO, a VF's vGPU state
    unreadable: the rest is reported, the output still valid, and each
    leaves a trace: the GPU's read errors, its errors in `gpulib discover
    --format json`, a warning of the doctor's (and so its readiness series)."""
    from gpulib.sim import faults

    host = build_demo(str(tmp_path / "demo"))
    t4_types = "sys/bus/pci/devices/0000:af:00.0/mdev_supported_types"
    faults.inject(host.root, f"{t4_types}/nvidia-232/available_instances", "eio")
    faults.inject(host.root, "sys/bus/pci/devices/0000:41:00.4/nvidia/current_vgpu_type",
                  "eio")
    r = run_metrics(host.root)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    series = parse(r.stdout)
    t4 = bus("0000:af:00.0")
    left = {dict(ls)["type"] for ls in matching(series, "gpulib_vgpu_creatable_instances",
                                                pci_bus_id=t4)}
    assert "nvidia-232" not in left and "nvidia-231" in left
    assert value(series, "gpulib_gpu_read_errors", pci_bus_id=t4) == 1
    assert value(series, "gpulib_gpu_read_errors", pci_bus_id=bus("0000:41:00.0")) >= 1
    assert value(series, "gpulib_readiness_check_status", check="mdev") == 1
    assert value(series, "gpulib_readiness_check_status", check="discovery") == 1
    # The native report: the count null, the file and its error on the GPU.
    doc = {g["address"]: g for g in native(host.root)["gpus"]}
    [t] = [t for t in doc["0000:af:00.0"]["mdev_types"] if t["type_id"] == "nvidia-232"]
    assert t["available_instances"] is None
    assert any(e.startswith(f"{t4_types}/nvidia-232/available_instances: ")
               for e in doc["0000:af:00.0"]["errors"])
    # The doctor, run alone: the mdev check warns, naming the file.
    d = subprocess.run([GPULIB, "doctor", "--json", "--check", "mdev"], capture_output=True,
                       text=True, env=hook_env(host.root), timeout=60)
    report = json.loads(d.stdout)
    assert d.returncode == 5 and report["summary"] == {"mdev": "warn"}
    [warned] = [c for c in report["checks"] if c["status"] == "warn"]
    assert warned["subject"] == "0000:af:00.0" and "nvidia-232/available_instances" in \
        warned["message"]
    assert PROMTOOL is not None
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=r.stdout,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_label_values_are_escaped(tmp_path: Path) -> None:
    """A device name with quotes and backslashes (pci.ids has some) stays one label."""
    host = empty_host(str(tmp_path))
    name = 'GPU "X" \\ 2\nnext'
    host.add_function("0000:3b:00.0", 0x10DE, 0x1EB8, 0x030200, driver="vfio-pci",
                      iommu_group=host.new_iommu_group(), numa_node=0,
                      vendor_name="NVIDIA Corporation", device_name=name)
    series = scrape(host.root)
    (labels,) = matching(series, "gpulib_gpu_info")
    assert dict(labels)["device"] in (name, name.split("\n")[0])


@given(st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_label_escaping_reads_back(text: str) -> None:
    fam = metrics.Family("gpulib_x_info", "gauge", "x", "v")
    fam.add(1, text)
    lines = list(fam.lines())
    assert len(lines) == 3  # HELP, TYPE, one sample: no newline survives unescaped
    assert parse("\n".join(lines)) == {("gpulib_x_info", frozenset({("v", text)})): 1.0}


# -- output file, errors, the CLI ----------------------------------------------------------


def test_output_replaces_the_file_atomically(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(U1,))
    out_dir = tmp_path / "textfile"
    out_dir.mkdir()
    target = out_dir / "gpulib.prom"
    target.write_text("old\n")
    inode = target.stat().st_ino
    r = run_metrics(host.root, "--output", str(target))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    assert os.listdir(out_dir) == ["gpulib.prom"]  # no temp file left
    assert target.stat().st_ino != inode  # renamed over, never rewritten in place
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    assert parse(target.read_text()) == scrape(host.root) | {
        k: v for k, v in parse(target.read_text()).items()
        if k[0] == "gpulib_state_last_write_timestamp_seconds"}
    r = run_metrics(host.root, f"--output={out_dir / 'other.prom'}")
    assert r.returncode == 0 and (out_dir / "other.prom").exists()


def test_output_onto_a_symlink_replaces_the_file_it_names(tmp_path: Path) -> None:
    """A textfile collector's entry that is a link (to a file a configuration
    tool placed elsewhere): the file it names gets the new text, the link stays."""
    host = t4_host(str(tmp_path), live=(U1,))
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = real_dir / "gpulib.prom"
    real.write_text("old\n")
    out_dir = tmp_path / "textfile"
    out_dir.mkdir()
    link = out_dir / "gpulib.prom"
    link.symlink_to(os.path.relpath(real, out_dir))
    r = run_metrics(host.root, "--output", str(link))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    assert link.is_symlink() and os.readlink(link) == os.path.relpath(real, out_dir)
    assert "gpulib_gpu_info" in real.read_text()
    assert sorted(os.listdir(real_dir)) == ["gpulib.prom"] and os.listdir(out_dir) == [
        "gpulib.prom"]


def test_the_state_check_waits_for_the_lock_as_the_doctor_does(tmp_path: Path) -> None:
    """A lock held for a second (a slow start) is the doctor's `ok` and metrics'
    0 alike: both wait the same time before they call it stuck."""
    host = t4_host(str(tmp_path), live=(U1,))
    lock = host.p("var/lib/gpulib/state.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import filelock, sys, time\n"
         "with filelock.FileLock(sys.argv[1]):\n"
         "    print('held', flush=True)\n    time.sleep(1.0)\n", lock],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        series = scrape(host.root)
    finally:
        holder.wait(timeout=30)
    assert value(series, "gpulib_readiness_check_status", check="state") == 0


def test_output_into_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    r = run_metrics(host.root, "--output", str(tmp_path / "nowhere" / "gpulib.prom"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("gpulib: error: cannot write ") and r.stderr.count("\n") == 1
    assert not (tmp_path / "nowhere").exists()


def test_help_and_bad_options_go_through_click(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    r = run_metrics(host.root, "--help")
    assert r.returncode == 0 and "--output" in r.stdout and "Prometheus" in r.stdout
    r = run_metrics(host.root, "--bogus")
    assert r.returncode == 2 and r.stderr.startswith("gpulib: error:")


def test_plain_forms_are_served_without_click() -> None:
    from gpulib.cli import metrics as cli_metrics

    assert cli_metrics.parse_args(["metrics"]) == (0, None)
    assert cli_metrics.parse_args(["-vv", "metrics", "-o", "f.prom"]) == (2, "f.prom")
    assert cli_metrics.parse_args(["metrics", "--output=f.prom"]) == (0, "f.prom")
    for args in (["metrics", "--help"], ["metrics", "--output"], ["metrics", "-o", "-x"],
                 ["discover"], ["metrics", "extra"], ["-x", "metrics"]):
        assert cli_metrics.parse_args(args) is None, args
    r = subprocess.run([sys.executable, "-c",
                        "import sys; from gpulib.cli import main; main(['metrics']); "
                        "sys.stderr.write(str('click' in sys.modules))"],
                       capture_output=True, text=True, timeout=60,
                       env=hook_env(str(ROOT / "tests" / "data" / "no-such-root")))
    assert r.stderr.endswith("False"), r.stderr


# -- the hooks' counters -------------------------------------------------------------------


def totals(root: str) -> dict[str, float]:
    series = scrape(root)
    out = {}
    for (name, labels), v in series.items():
        if name.endswith("_total"):
            out[name + "".join(f" {k}={val}" for k, val in sorted(labels))] = v
    return out


def test_counters_start_at_zero_for_every_label_value(tmp_path: Path) -> None:
    t = totals(t4_host(str(tmp_path)).root)
    expected = 0
    for spec in counters.COUNTERS.values():
        n = 1
        for _label, allowed in spec:
            n *= len(allowed)
        expected += n
    assert len(t) == expected and set(t.values()) == {0}


def test_hooks_count_what_they_did(tmp_path: Path) -> None:
    """A start prepared, a start refused (the vGPU is another VM's), a vGPU
    the CLI created, a stop: each counted once, through the real executables."""
    host = t4_host(str(tmp_path))
    root = host.root
    made = subprocess.run([GPULIB, "mdev", "create", "--parent", T4, "--type", "nvidia-232"],
                          capture_output=True, text=True, env=hook_env(root), check=True)
    uuid = made.stdout.strip()
    r = as_agent(root, mdev_xml("i-2-10-VM", DOMAIN_UUID, uuid))
    assert r.returncode == 0, r.stdout
    other = mdev_xml("i-2-11-VM", "0f3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b", uuid)
    r = as_agent(root, other)
    assert r.returncode == 1 and b"in use" in r.stdout
    host.add_running_domain("i-2-10-VM", DOMAIN_UUID, mdevs=(uuid,))  # libvirt runs it
    assert subprocess.run([STATE_CHANGE, "onStart", "i-2-10-VM"], env=hook_env(root)
                          ).returncode == 0
    t = totals(root)
    assert t["gpulib_starts_prepared_total hook=transformer"] == 1
    assert t["gpulib_starts_refused_total hook=transformer reason=device"] == 1
    assert t["gpulib_vgpus_created_total kind=mdev"] == 1
    assert t["gpulib_releases_total by=stop"] == 0
    host.stop_domain("i-2-10-VM")
    assert subprocess.run([STATE_CHANGE, "onStop", "i-2-10-VM"], env=hook_env(root)
                          ).returncode == 0
    # A second stop releases nothing: not counted.
    assert subprocess.run([STATE_CHANGE, "onStop", "i-2-10-VM"], env=hook_env(root)
                          ).returncode == 0
    r = subprocess.run([GPULIB, "mdev", "remove", uuid], capture_output=True,
                       env=hook_env(root))
    assert r.returncode == 0, r.stderr
    t = totals(root)
    assert t["gpulib_releases_total by=stop"] == 1
    assert t["gpulib_vgpus_destroyed_total kind=mdev"] == 1
    assert sum(t.values()) == 5


def test_nvidia_vf_types_count_as_vgpus(tmp_path: Path) -> None:
    host = a10_host(str(tmp_path), numvfs=2)
    root = host.root
    vf = "0000:41:00.4"
    for args in (["vf", "set-type", vf, "NVIDIA A10-4Q"], ["vf", "clear", vf]):
        r = subprocess.run([GPULIB, *args], capture_output=True, text=True,
                           env=hook_env(root))
        assert r.returncode == 0, r.stderr
    t = totals(root)
    assert t["gpulib_vgpus_created_total kind=vf"] == 1
    assert t["gpulib_vgpus_destroyed_total kind=vf"] == 1


def test_no_gpu_start_writes_nothing(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    xml = (ROOT / "tests" / "data" / "cloudstack-xml" / "no-gpu.xml").read_text()
    r = as_agent(host.root, xml)
    assert r.returncode == 0
    assert not os.path.exists(os.path.join(host.root, counters.EVENTS_FILE))
    assert not os.path.exists(os.path.join(host.root, "var/lib/gpulib"))


def test_a_hook_never_imports_the_metrics(tmp_path: Path) -> None:
    """The counters are written by a module of their own; the renderer, the
    doctor and pools stay out of every hook."""
    host = t4_host(str(tmp_path))
    made = subprocess.run([GPULIB, "mdev", "create", "--parent", T4, "--type", "nvidia-232"],
                          capture_output=True, text=True, env=hook_env(host.root), check=True)
    xml = mdev_xml("i-2-10-VM", DOMAIN_UUID, made.stdout.strip())
    code = ("import sys; from gpulib.hooks.transformer import main; "
            f"rc = main(['t', 'transform', {xml!r}]); "
            "sys.stderr.write(repr((rc, sorted(m for m in sys.modules "
            "if m.startswith(('gpulib.metrics', 'gpulib.doctor', 'gpulib.pools', 'click'))))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=hook_env(host.root), timeout=60)
    assert r.stderr.endswith("(0, [])"), r.stderr


def test_counter_file_is_folded_and_rotated(tmp_path: Path) -> None:
    root = str(tmp_path)
    for _ in range(3):
        counters.note(root, "starts_prepared", hook="qemu")
    counters.note(root, "releases", times=2, by="stop")
    counters.note(root, "releases", times=0, by="stop")
    key = "starts_prepared hook=qemu"
    assert counters.read(root) == {key: 3, "releases by=stop": 2}
    assert counters.fold(root) == {key: 3, "releases by=stop": 2}
    # Nothing new: the totals file is not written again.
    totals_file = os.path.join(root, counters.TOTALS_FILE)
    inode = os.stat(totals_file).st_ino
    assert counters.fold(root)[key] == 3 and os.stat(totals_file).st_ino == inode
    # Folded once: the same events are not counted again, new ones are.
    counters.note(root, "starts_prepared", hook="qemu")
    assert counters.read(root)[key] == 4
    assert counters.fold(root)[key] == 4 and counters.fold(root)[key] == 4
    # A long event file is rotated; a late write into the rotated file (a hook
    # that opened it just before) still counts; it goes once folded and old.
    line = counters.event_line("starts_prepared", hook="qemu").encode()
    events = os.path.join(root, counters.EVENTS_FILE)
    n = counters.ROTATE_BYTES // len(line) + 1
    with open(events, "ab") as fh:
        fh.write(line * n)
    assert counters.fold(root)[key] == 4 + n
    rotated = os.path.join(root, counters.ROTATED_FILE)
    assert os.path.exists(rotated) and not os.path.exists(events)
    with open(rotated, "ab") as fh:
        fh.write(line)
    counters.note(root, "starts_prepared", hook="qemu")
    assert counters.read(root)[key] == 6 + n
    assert counters.fold(root)[key] == 6 + n and os.path.exists(rotated)
    assert counters.fold(root, now=time.time() + counters.ROTATED_KEEP_SECONDS + 1)[key] == \
        6 + n
    assert not os.path.exists(rotated)
    assert counters.fold(root)[key] == 6 + n
    # A torn last line is left for later; a garbage line is skipped.
    with open(events, "ab") as fh:
        fh.write(b"garbage line\n\xff\xfe\nstarts_prepared hook=qemu")
    assert counters.fold(root)[key] == 6 + n
    with open(events, "ab") as fh:
        fh.write(b"\n")
    assert counters.fold(root)[key] == 7 + n
    # The totals file lost: a reset, never an error (what the event file
    # still holds counts again: the note after the rotation and the line
    # completed above).
    os.unlink(os.path.join(root, counters.TOTALS_FILE))
    assert counters.read(root)[key] == 2


def test_counting_never_fails_the_caller(tmp_path: Path) -> None:
    Path(tmp_path, "var").write_text("a file where a directory should be")
    counters.note(str(tmp_path), "starts_prepared", hook="qemu")  # no exception
    assert counters.read(str(tmp_path)) == {}
    with pytest.raises(ValueError):
        counters.event_line("starts_prepared", hook="nonsense")
    with pytest.raises(ValueError):
        counters.event_line("starts_prepared")


def test_concurrent_appends_are_all_counted(tmp_path: Path) -> None:
    code = ("import sys; from gpulib import counters\n"
            "for _ in range(200): counters.note(sys.argv[1], 'vgpus_created', kind='mdev')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)]) for _ in range(8)]
    folds = []
    while any(p.poll() is None for p in procs):
        folds.append(counters.fold(str(tmp_path)).get("vgpus_created kind=mdev", 0))
        time.sleep(0.01)
    assert all(p.wait() == 0 for p in procs)
    assert folds == sorted(folds)  # a counter never goes back
    assert counters.fold(str(tmp_path))["vgpus_created kind=mdev"] == 1600


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_event_parser_takes_any_bytes(data: bytes) -> None:
    counts: dict[str, int] = {}
    used = counters.count_lines(data, counts)
    assert used == data.rfind(b"\n") + 1
    for key, n in counts.items():
        assert n > 0 and counters.parse_line(key) == key


@given(st.sampled_from(sorted(counters.COUNTERS)), st.data())
@settings(max_examples=100, deadline=None)
def test_event_lines_read_back(name: str, data: st.DataObject) -> None:
    labels = {label: data.draw(st.sampled_from(allowed))
              for label, allowed in counters.COUNTERS[name]}
    line = counters.event_line(name, **labels)
    counts: dict[str, int] = {}
    assert counters.count_lines(line.encode() * 3, counts) == 3 * len(line)
    assert counts == {line[:-1]: 3}
    assert counters.labels_of(line[:-1]) == (name, labels)


# -- the systemd units and the packaging ----------------------------------------------------


def unit(name: str) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for line in (ETC / "systemd" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, val = line.partition("=")
        out.setdefault((section, key), []).append(val)
    return out


def test_timer_and_service() -> None:
    service = unit("gpulib-metrics.service")
    timer = unit("gpulib-metrics.timer")
    assert service[("Service", "Type")] == ["oneshot"]
    assert service[("Service", "Environment")] == [
        "GPULIB_METRICS_OUTPUT=/var/lib/prometheus/node-exporter/gpulib.prom"]
    assert service[("Service", "ExecStart")] == [
        "/usr/bin/gpulib metrics --output ${GPULIB_METRICS_OUTPUT}"]
    assert ("Install", "WantedBy") not in service  # started by its timer only
    assert timer[("Timer", "OnUnitActiveSec")] == ["1min"]
    assert timer[("Install", "WantedBy")] == ["timers.target"]
    preset = (ETC / "systemd" / "50-gpulib.preset").read_text().splitlines()
    assert "disable gpulib-metrics.timer" in preset
    rules = (ROOT / "packaging" / "debian" / "rules").read_text()
    assert "gpulib-metrics.timer" in rules and "gpulib-metrics.service" in rules
    spec = (ROOT / "packaging" / "rpm" / "gpulib.spec").read_text()
    for name in ("gpulib-metrics.service", "gpulib-metrics.timer"):
        assert f"%{{_unitdir}}/{name}" in spec.split("%files", 1)[1]
    assert "etc/prometheus/gpulib-alerts.yml" in \
        (ROOT / "packaging" / "debian" / "gpulib.examples").read_text().split()
    assert "%{_docdir}/gpulib/examples/gpulib-alerts.yml" in spec.split("%files", 1)[1]


def test_service_condition_skips_without_a_textfile_directory(tmp_path: Path) -> None:
    (condition,) = unit("gpulib-metrics.service")[("Service", "ExecCondition")]
    argv = ["/bin/sh", "-c", condition.split("-c ", 1)[1].strip("'")]
    for target, code in ((tmp_path / "gpulib.prom", 0), (tmp_path / "no" / "gpulib.prom", 1)):
        env = dict(os.environ, GPULIB_METRICS_OUTPUT=str(target))
        assert subprocess.run(argv, env=env).returncode == code


def timer_refresh(root: str, output: Path) -> None:
    """What gpulib-metrics.service runs, from the unit's own ExecStart."""
    (command,) = unit("gpulib-metrics.service")[("Service", "ExecStart")]
    argv = [GPULIB if word == "/usr/bin/gpulib" else
            str(output) if word == "${GPULIB_METRICS_OUTPUT}" else word
            for word in command.split()]
    r = subprocess.run(argv, capture_output=True, text=True, env=hook_env(root), timeout=60)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr


# -- a real node exporter ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def node_exporter(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A node exporter with only its textfile collector, on a free loopback
    port, reading a temporary directory: (directory, metrics URL)."""
    assert NODE_EXPORTER is not None
    textfile = tmp_path / "textfile"
    textfile.mkdir()
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}",
             "--collector.disable-defaults", "--collector.textfile",
             f"--collector.textfile.directory={textfile}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            break
        proc.wait()  # the port was taken meanwhile: another one
    else:
        pytest.fail("the node exporter did not start")
    try:
        yield textfile, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def scrape_http(url: str) -> Series:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return parse(text)


@needs_node_exporter
def test_node_exporter_serves_the_metrics_before_and_after_a_start(
        tmp_path: Path, node_exporter: tuple[Path, str]) -> None:
    textfile, url = node_exporter
    host = t4_host(str(tmp_path))
    root = host.root
    labels = {"pci_bus_id": T4_BUS, "type": "nvidia-232", "profile": "GRID T4-4Q"}
    avail = Path(root, f"sys/bus/pci/devices/{T4}/mdev_supported_types/nvidia-232/"
                       "available_instances")
    made = subprocess.run([GPULIB, "mdev", "create", "--parent", T4, "--type", "nvidia-232"],
                          capture_output=True, text=True, env=hook_env(root), check=True)
    uuid = made.stdout.strip()
    r = run_metrics(root, "--output", str(textfile / "gpulib.prom"))
    assert r.returncode == 0, r.stderr
    before = scrape_http(url)
    assert value(before, "node_textfile_scrape_error") == 0
    assert value(before, "gpulib_vgpu_creatable_instances", **labels) == \
        int(avail.read_text()) == 3
    assert value(before, "gpulib_vgpu_live_instances", **labels) == 1
    assert value(before, "gpulib_vgpu_held_instances", **labels) == 0
    assert value(before, "gpulib_allocations", state="active") == 0
    assert value(before, "gpulib_starts_prepared_total", hook="transformer") == 0
    assert value(before, "gpulib_vgpus_created_total", kind="mdev") == 1
    mtimes = matching(before, "node_textfile_mtime_seconds")
    assert [dict(ls)["file"].endswith("gpulib.prom") for ls in mtimes] == [True]
    # A VM starts through the real hooks (the agent's transformer, the VM
    # runs, onStart), then the timer's service refreshes the file.
    assert as_agent(root, mdev_xml("i-2-10-VM", DOMAIN_UUID, uuid)).returncode == 0
    host.add_running_domain("i-2-10-VM", DOMAIN_UUID, mdevs=(uuid,))
    assert subprocess.run([STATE_CHANGE, "onStart", "i-2-10-VM"], env=hook_env(root)
                          ).returncode == 0
    timer_refresh(root, textfile / "gpulib.prom")
    after = scrape_http(url)
    assert value(after, "gpulib_vgpu_held_instances", **labels) == 1
    assert value(after, "gpulib_vgpu_creatable_instances", **labels) == \
        int(avail.read_text()) == 3
    assert value(after, "gpulib_allocations", state="active") == 1
    assert value(after, "gpulib_allocations", state="pending") == 0
    assert value(after, "gpulib_starts_prepared_total", hook="transformer") == 1
    assert value(after, "gpulib_stray_vgpus") == 0
    assert os.listdir(textfile) == ["gpulib.prom"]


# -- the alert rules -----------------------------------------------------------------------


def input_series(series: Series, instance: str = "gpu-host-1") -> list[dict[str, str]]:
    """gpulib's samples as promtool's input series for an hour: a gauge
    constant; a counter 0 for the first 10 minutes, then its value (what it
    counted happened then)."""
    out = []
    for (name, labels), v in sorted(series.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))):
        all_labels = dict(labels, instance=instance, job="node")
        text = ",".join(f'{k}="{val}"' for k, val in sorted(all_labels.items())
                        if "\\" not in val and '"' not in val and "\n" not in val)
        values = f"0+0x10 {v:g}+0x50" if name.endswith("_total") else f"{v:g}+0x60"
        out.append({"series": f"{name}{{{text}}}", "values": values})
    return out


def without_annotations(text: str) -> str:
    """The rules file with every rule's `annotations:` block left out."""
    out: list[str] = []
    skip: Optional[int] = None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip is not None and (indent > skip or not line.strip()):
            continue
        skip = None
        if line.strip() == "annotations:":
            skip = indent
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert: (\S+)$", ALERTS.read_text(), re.M)


def rule_test(tmp_path: Path, series: Series, expect: dict[str, list[dict[str, str]]],
              extra: Optional[list[dict[str, str]]] = None) -> None:
    """Run promtool test rules: every alert of the file evaluated after 40
    minutes; `expect`: alert name -> the label sets it fires with (every
    other alert must not fire). Annotations are left out of the comparison
    (the copy tested has none); promtool check rules checks their templates."""
    names = alert_names()
    (tmp_path / "rules.yml").write_text(without_annotations(ALERTS.read_text()))
    # JSON is YAML: promtool reads the test file as it is written here.
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": input_series(series) + (extra or []),
        "alert_rule_test": [{"eval_time": "40m", "alertname": name,
                             "exp_alerts": [{"exp_labels": labels}
                                            for labels in expect.get(name, [])]}
                            for name in names],
    }]}
    assert set(expect) <= set(names)
    (tmp_path / "tests.yml").write_text(json.dumps(tests, indent=1))
    assert PROMTOOL is not None
    r = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_alert_rules_are_valid() -> None:
    assert PROMTOOL is not None
    r = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _base(severity: str, **labels: str) -> dict[str, str]:
    return dict(labels, instance="gpu-host-1", job="node", severity=severity)


def _failing_checks(series: Series) -> list[dict[str, str]]:
    return [_base("critical", check=dict(ls)["check"])
            for ls, v in matching(series, "gpulib_readiness_check_status").items() if v == 2]


U3 = "33333333-4444-4555-8666-777777777777"
U4 = "44444444-5555-4666-8777-888888888888"
STALE = [{"series": 'node_textfile_mtime_seconds{file="/var/lib/prometheus/node-exporter/'
                    'gpulib.prom",instance="gpu-host-1",job="node"}',
          "values": "0+0x60"}]
Scenario = tuple[Series, dict[str, list[dict[str, str]]], Optional[list[dict[str, str]]]]


def _gpulib(root: str, *args: str) -> None:
    r = subprocess.run([GPULIB, *args], capture_output=True, text=True, env=hook_env(root),
                       timeout=60)
    assert r.returncode == 0, r.stderr


def _healthy(tmp: Path) -> Scenario:
    """The healthy demo (its hand-made vGPU is known: no stray): nothing fires."""
    host = healthy_host(str(tmp))
    series = scrape(host.root)
    assert value(series, "gpulib_stray_vgpus") == 0 and not _failing_checks(series)
    return series, {}, None


def _t4_pool(tmp: Path, all_held: bool) -> FakeHost:
    """GRID T4-4Q: 4 per T4, all four live. U1 and U2, pool t4's members,
    held (a pending allocation made long ago, an active one); U3 and U4
    strays, or (all_held) held by running VMs."""
    host = t4_host(str(tmp), live=(U1, U2, U3, U4))
    store = StateStore(os.path.join(host.root, "var/lib/gpulib/state.json"),
                       os.path.join(host.root, "var/lib/gpulib/state.lock"))
    with store.transaction() as st_:
        st_.assign(two_allocations(pool_members=(U1, U2)))
    both_run(host)
    if all_held:
        host.add_running_domain("i-3-3-VM", "3a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b",
                                mdevs=(U3,))
        host.add_running_domain("i-4-4-VM", "4a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b",
                                mdevs=(U4,), pid=4343)
    return host


def _t4_strays(tmp: Path) -> Scenario:
    """Two of four T4-4Q free (strays): the type is not exhausted; the
    strays, the stuck pending allocation, the full pool and stale metrics
    fire."""
    series = scrape(_t4_pool(tmp, all_held=False).root)
    assert value(series, "gpulib_stray_vgpus") == 2
    return series, {
        "GpulibStrayVgpus": [_base("warning")],
        "GpulibPendingAllocationStuck": [_base("warning")],
        "GpulibPoolExhausted": [_base("warning", pool="t4")],
        "GpulibMetricsStale": [_base("warning", file="/var/lib/prometheus/node-exporter/"
                                                     "gpulib.prom")],
        "GpulibReadinessCheckFailing": _failing_checks(series),
    }, STALE


def _t4_exhausted(tmp: Path) -> Scenario:
    """All four T4-4Q held, none creatable: the type is exhausted. A start
    refused because its vGPU is another VM's (reason device) is no hook
    failure."""
    host = _t4_pool(tmp, all_held=True)
    r = as_agent(host.root, mdev_xml("i-5-5-VM", "5a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6b", U3))
    assert r.returncode == 1 and b"in use" in r.stdout
    series = scrape(host.root)
    assert value(series, "gpulib_starts_refused_total", hook="transformer",
                 reason="device") == 1
    return series, {
        "GpulibVgpuTypeExhausted": [_base("warning", type="nvidia-232",
                                          profile="GRID T4-4Q")],
        "GpulibPendingAllocationStuck": [_base("warning")],
        "GpulibPoolExhausted": [_base("warning", pool="t4")],
        "GpulibReadinessCheckFailing": _failing_checks(series),
    }, None


def _unmanaged_spare(tmp: Path) -> Scenario:
    """Two T4s: the first's four T4-4Q all held, the second unmanaged (`gpulib
    device unmanage`) with room for four. gpulib gives nothing of an
    unmanaged GPU: its capacity does not count, the type is exhausted."""
    host = two_t4_host(str(tmp))
    for n, u in enumerate((U1, U2, U3, U4)):
        host.add_mdev(u, P1, "nvidia-232")
        host.add_running_domain(f"i-6-{n}-VM", f"6a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6{n}",
                                mdevs=(u,), pid=4500 + n)
    _gpulib(host.root, "device", "unmanage", P2)
    series = scrape(host.root)
    assert value(series, "gpulib_gpu_managed", pci_bus_id=bus(P2)) == 0
    # the administrator's: no capacity of gpulib's (the rules' product with
    # gpulib_gpu_managed says the same)
    assert value(series, "gpulib_vgpu_creatable_instances", pci_bus_id=bus(P2),
                 type="nvidia-232", profile="GRID T4-4Q") == 0
    return series, {
        "GpulibVgpuTypeExhausted": [_base("warning", type="nvidia-232",
                                          profile="GRID T4-4Q")],
        "GpulibReadinessCheckFailing": _failing_checks(series),
    }, None


def _a10(tmp: Path, held: int) -> Scenario:
    """An A10's two VFs given NVIDIA A10-4Q by hand (`gpulib vf set-type`),
    `held` of them by running VMs: with both held the profile is exhausted
    (the GPU runs one type at a time: no idle VF can take it); the
    hand-made VFs are in no pool, so no pool alert."""
    host = a10_host(str(tmp), numvfs=2)
    vfs = ["0000:41:00.4", "0000:41:00.5"]
    for vf in vfs:
        _gpulib(host.root, "vf", "set-type", vf, "NVIDIA A10-4Q")
    for n, vf in enumerate(vfs[:held]):
        host.add_running_domain(f"i-7-{n}-VM", f"7a3c2a10-5b4d-4e6f-8a7b-1c2d3e4f5a6{n}",
                                pci=(vf,), managed=False, pid=4400 + n)
    series = scrape(host.root)
    assert value(series, "gpulib_handmade_devices", kind="vf") == 2
    assert not matching(series, "gpulib_pool_members")
    expect = {"GpulibReadinessCheckFailing": _failing_checks(series)}
    if held == 2:
        expect["GpulibNvidiaVfProfileExhausted"] = [
            _base("warning", type="593", profile="NVIDIA A10-4Q")]
    return series, expect, None


def _a10_unreadable_vf(tmp: Path) -> Scenario:
    """Two VFs given NVIDIA A10-4Q, one whose vGPU state cannot be read: the
    report lists it gpulib:unavailable, and its series makes that an alert
    (the read errors fire too)."""
    from gpulib.sim import faults

    host = a10_host(str(tmp), numvfs=2)
    for vf in ("0000:41:00.4", "0000:41:00.5"):
        _gpulib(host.root, "vf", "set-type", vf, "NVIDIA A10-4Q")
    faults.inject(host.root, "sys/bus/pci/devices/0000:41:00.5/nvidia/current_vgpu_type", "eio")
    series = scrape(host.root)
    a10 = bus("0000:41:00.0")
    assert value(series, "gpulib_gpu_unavailable_instances", pci_bus_id=a10, kind="vf") == 1
    return series, {
        "GpulibInstancesUnavailable": [_base("warning", pci_bus_id=a10, kind="vf")],
        "GpulibGpuReadErrors": [_base("warning", pci_bus_id=a10)],
        "GpulibReadinessCheckFailing": _failing_checks(series),
    }, None


def _damaged_state(tmp: Path) -> Scenario:
    """A state file from a newer gpulib: its alert, the doctor's state
    check, and the hooks failing starts for it (reason state)."""
    host = t4_host(str(tmp), live=(U1,))
    host.write_file("var/lib/gpulib/state.json", '{"version": 99}')
    r = as_agent(host.root, mdev_xml("i-2-10-VM", DOMAIN_UUID, U1))
    assert r.returncode != 0
    series = scrape(host.root)
    failing = _failing_checks(series)
    assert _base("critical", check="state") in failing
    assert value(series, "gpulib_starts_refused_total", hook="transformer",
                 reason="state") == 1
    return series, {
        "GpulibStateFileDamaged": [_base("critical")],
        "GpulibHookStartsFailing": [_base("critical", hook="transformer", reason="state")],
        # gpulib's records unknown: its live vGPU is no stray for all it knows.
        "GpulibReadinessCheckFailing": failing,
    }, None


def _read_errors(tmp: Path) -> Scenario:
    """A T4 whose GRID T4-4Q instances left cannot be read: the GPU's read
    errors fire; a bogus policy in gpulib.conf fails the config check."""
    from gpulib.sim import faults

    host = t4_host(str(tmp))
    faults.inject(host.root, f"sys/bus/pci/devices/{T4}/mdev_supported_types/nvidia-232/"
                             "available_instances", "eio")
    host.write_file("etc/gpulib/gpulib.conf", "[allocator]\npolicy = bogus\n")
    series = scrape(host.root)
    failing = _failing_checks(series)
    assert _base("critical", check="config") in failing
    return series, {
        "GpulibGpuReadErrors": [_base("warning", pci_bus_id=T4_BUS)],
        "GpulibReadinessCheckFailing": failing,
    }, None


SCENARIOS: dict[str, tuple[Callable[[Path], Scenario], set[str]]] = {
    # name: (its host and expectations, the alerts that fire)
    "healthy": (_healthy, set()),
    "t4-strays": (_t4_strays, {"GpulibStrayVgpus", "GpulibPendingAllocationStuck",
                               "GpulibPoolExhausted", "GpulibMetricsStale",
                               "GpulibReadinessCheckFailing"}),
    "t4-exhausted": (_t4_exhausted, {"GpulibVgpuTypeExhausted", "GpulibPendingAllocationStuck",
                                     "GpulibPoolExhausted", "GpulibReadinessCheckFailing"}),
    "t4-unmanaged-spare": (_unmanaged_spare, {"GpulibVgpuTypeExhausted",
                                              "GpulibReadinessCheckFailing"}),
    "a10-one-held": (lambda tmp: _a10(tmp, held=1), {"GpulibReadinessCheckFailing"}),
    "a10-exhausted": (lambda tmp: _a10(tmp, held=2), {"GpulibNvidiaVfProfileExhausted",
                                                      "GpulibReadinessCheckFailing"}),
    "damaged-state": (_damaged_state, {"GpulibStateFileDamaged", "GpulibHookStartsFailing",
                                       "GpulibReadinessCheckFailing"}),
    "read-errors": (_read_errors, {"GpulibGpuReadErrors", "GpulibReadinessCheckFailing"}),
    "a10-unreadable-vf": (_a10_unreadable_vf, {"GpulibInstancesUnavailable",
                                               "GpulibGpuReadErrors",
                                               "GpulibReadinessCheckFailing"}),
}


def test_every_alert_fires_in_a_scenario_and_is_silent_in_another() -> None:
    names = set(alert_names())
    for name in names:
        assert any(name in fires for _, fires in SCENARIOS.values()), f"{name} never fires"
        assert any(name not in fires for _, fires in SCENARIOS.values()), \
            f"{name} is never silent"
    assert set().union(*(fires for _, fires in SCENARIOS.values())) <= names


@needs_promtool
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_alert_rules_on_gpulib_output(tmp_path: Path, name: str) -> None:
    """Each scenario's host, its metrics as promtool's input: exactly the
    alerts it names fire, with the labels expected; every other is silent."""
    build, fires = SCENARIOS[name]
    series, expect, extra = build(tmp_path / "host")
    assert {alert for alert, labels in expect.items() if labels} == fires
    rule_test(tmp_path, series, expect, extra)


def test_unmanaged_gpus_and_vfs_are_told_apart(tmp_path: Path) -> None:
    """`gpulib device unmanage` of a GPU, or of one VF: the GPU's managed
    series and its count of VFs gpulib leaves alone say so."""
    host = a10_host(str(tmp_path), numvfs=3)
    a10 = bus("0000:41:00.0")
    series = scrape(host.root)
    assert value(series, "gpulib_gpu_managed", pci_bus_id=a10) == 1
    assert value(series, "gpulib_gpu_unmanaged_vfs", pci_bus_id=a10) == 0
    _gpulib(host.root, "device", "unmanage", "0000:41:00.5")
    series = scrape(host.root)
    assert value(series, "gpulib_gpu_managed", pci_bus_id=a10) == 1
    assert value(series, "gpulib_gpu_unmanaged_vfs", pci_bus_id=a10) == 1
    _gpulib(host.root, "device", "unmanage", "0000:41:00.0")
    series = scrape(host.root)
    assert value(series, "gpulib_gpu_managed", pci_bus_id=a10) == 0
    assert value(series, "gpulib_gpu_unmanaged_vfs", pci_bus_id=a10) == 3
    _gpulib(host.root, "device", "manage", "0000:41:00.0")
    _gpulib(host.root, "device", "manage", "0000:41:00.5")
    series = scrape(host.root)
    assert value(series, "gpulib_gpu_managed", pci_bus_id=a10) == 1
    assert value(series, "gpulib_gpu_unmanaged_vfs", pci_bus_id=a10) == 0


def test_handmade_devices_are_counted_apart_and_in_no_pool(tmp_path: Path) -> None:
    """`gpulib mdev create` and `gpulib vf set-type` record their devices as
    hand-made: counted as such, never as a pool's members (so a full pool
    alert never fires for them)."""
    host = t4_host(str(tmp_path))
    made = subprocess.run([GPULIB, "mdev", "create", "--parent", T4, "--type", "nvidia-232"],
                          capture_output=True, text=True, env=hook_env(host.root), check=True)
    uuid = made.stdout.strip()
    host.add_running_domain("i-2-10-VM", DOMAIN_UUID, mdevs=(uuid,))
    series = scrape(host.root)
    assert value(series, "gpulib_handmade_devices", kind="mdev") == 1
    assert value(series, "gpulib_handmade_devices", kind="vf") == 0
    assert not matching(series, "gpulib_pool_members")
    assert value(series, "gpulib_vgpu_pool_instances", pci_bus_id=T4_BUS, type="nvidia-232",
                 profile="GRID T4-4Q") == 0
    assert value(series, "gpulib_vgpu_held_instances", pci_bus_id=T4_BUS, type="nvidia-232",
                 profile="GRID T4-4Q") == 1


def test_a_config_that_stops_the_hooks_fails_the_config_check(tmp_path: Path) -> None:
    """`gpulib metrics` reads gpulib.conf leniently (a bad file must not hide
    the host), yet its config check is the doctor's: a bad value or a
    duplicated section (the hooks refuse to run) fails it, an unknown key
    (the hooks warn and go on) warns."""
    host = t4_host(str(tmp_path))
    for text, status in (("[allocator]\npolicy = bogus\n", 2),
                         ("[allocator]\npolicy = pack\n[allocator]\npolicy = spread\n", 2),
                         ("[allocator]\npolicy = pack\nbogus_key = 1\n", 1),
                         ("[allocator]\npolicy = pack\n", 0)):
        host.write_file("etc/gpulib/gpulib.conf", text)
        r = subprocess.run([GPULIB, "doctor", "--json", "--check", "config"],
                           capture_output=True, text=True, env=hook_env(host.root), timeout=60)
        doctor = json.loads(r.stdout)["summary"]["config"]
        assert value(scrape(host.root), "gpulib_readiness_check_status", check="config") == \
            status == {"ok": 0, "warn": 1, "fail": 2}[doctor], text
        starts = subprocess.run([STATE_CHANGE, "onStart", "i-1-1-VM"], capture_output=True,
                                env=hook_env(host.root), timeout=60)
        assert (starts.returncode != 0) == (status == 2), text


def test_large_host_series_are_per_gpu_and_type_unless_asked(built: dict[str, str],
                                                            tmp_path: Path) -> None:
    """The large host (8 GPUs x 16 VFs x 24 types, 64 VMs): one creatable
    series per GPU and type, the sum of its 16 VFs' counts; one held vGPU
    per running VM. `[metrics] parent_series = yes` gives the 3072 series per
    VF and type, whose sums by GPU and type are the same."""
    series = scrape(built["large"])
    creatable = matching(series, "gpulib_vgpu_creatable_instances")
    assert len(creatable) == 8 * 24
    assert sum(matching(series, "gpulib_vgpu_held_instances").values()) == 64
    assert sum(value(series, "gpulib_allocations", state=s) for s in ("active", "pending")) \
        == 0  # the VMs run, gpulib allocated none of them
    assert len(series) < 700  # bounded: no series per (VF, type)

    conf = tmp_path / "gpulib.conf"
    conf.write_text("[metrics]\nparent_series = yes\n")
    ctx = context_for_root(built["large"], simulate=True)
    detail = parse(metrics.render(ctx, Config.load(str(conf)), fold=False))
    per_parent = matching(detail, "gpulib_vgpu_creatable_instances")
    assert len(per_parent) == 8 * 16 * 24
    summed: dict[frozenset[tuple[str, str]], float] = {}
    for ls, v in per_parent.items():
        key = frozenset((k, val) for k, val in ls if k != "parent")
        summed[key] = summed.get(key, 0) + v
    assert summed == creatable
    for kind in ("live", "held", "pool"):
        summed = {}
        for ls, v in matching(detail, f"gpulib_vgpu_{kind}_instances").items():
            key = frozenset((k, val) for k, val in ls if k != "parent")
            summed[key] = summed.get(key, 0) + v
        assert summed == matching(series, f"gpulib_vgpu_{kind}_instances"), kind
