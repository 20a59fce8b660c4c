"""64 VMs started at once against a pool of 64 vGPUs, with real processes."""

from __future__ import annotations

import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpulib.cli import main
from gpulib.sim.fakehost import FakeHost
from tests.hookrun import STATE_CHANGE, TRANSFORMER, hook_env
from tests.hosts import t4_farm

META = ("<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid><metadata>"
        "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
        "<gpulib:vgpu profile='GRID T4-1B' count='1'/></gpulib:gpus></metadata>"
        "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>")


def start_vm(root: str, i: int) -> tuple[int, str, float]:
    """What the agent does for one VM: transformer, then onStart."""
    t0 = time.monotonic()
    name = f"i-2-{1000 + i}-VM"
    xml = META.format(name=name, uuid=f"00000000-0000-4000-8000-{i:012x}")
    env = hook_env(root)
    res = subprocess.run([TRANSFORMER, "transform", xml], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env, timeout=30)
    if res.returncode != 0:
        return res.returncode, res.stdout.decode(), time.monotonic() - t0
    # libvirt runs it (its status file), then the agent says onStart.
    mdevs = re.findall(r"address uuid=['\"]([0-9a-f-]{36})", res.stdout.decode())
    FakeHost(root).add_running_domain(name, f"00000000-0000-4000-8000-{i:012x}",
                                      mdevs=tuple(mdevs))
    started = subprocess.run([STATE_CHANGE, "onStart", name], capture_output=True, env=env,
                             timeout=30)
    return started.returncode, res.stdout.decode(), time.monotonic() - t0


@pytest.mark.slow
def test_64_vms_start_at_once_against_a_pool_of_64(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    host = t4_farm(str(tmp_path), gpus=4, per_parent=16)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    assert main(["pool", "apply"]) == 0
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(lambda i: start_vm(host.root, i), range(64)))
    elapsed = time.monotonic() - t0
    failures = [(i, r[1]) for i, r in enumerate(results) if r[0] != 0]
    assert not failures, failures[:3]
    uuids = []
    for _, out, _ in results:
        from lxml import etree
        addrs = etree.fromstring(out.encode()).findall(".//hostdev[@type='mdev']/source/address")
        assert len(addrs) == 1
        uuids.append(addrs[0].get("uuid"))
    assert len(set(uuids)) == 64, "every VM got its own vGPU"
    state = json.loads(Path(host.root, "var/lib/gpulib/state.json").read_text())
    assert len(state["allocations"]) == 64
    assert all(a["status"] == "active" for a in state["allocations"].values())
    holders = {d["id"]: vm for vm, a in state["allocations"].items() for d in a["devices"]}
    assert sorted(holders) == sorted(state["vgpus"]), "every pool vGPU held, once"
    assert sorted(holders.values()) == sorted(f"i-2-{1000 + i}-VM" for i in range(64))
    # the 65th VM finds the pool empty: a clear error, nothing changed
    code, out, _ = start_vm(host.root, 64)
    assert code == 1 and "no free vGPU of GRID T4-1B" in out
    print(f"64 transformer + onStart runs: {elapsed:.1f} s")


@pytest.mark.slow
def test_transformers_killed_at_random_leave_consistent_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import random
    import signal

    from gpulib.state import StateStore

    host = t4_farm(str(tmp_path), gpus=1, per_parent=16)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    assert main(["pool", "apply"]) == 0
    rng = random.Random(7)
    env = hook_env(host.root)
    procs = []
    for i in range(16):
        xml = META.format(name=f"vm-{i}", uuid=f"00000000-0000-4000-8000-{i:012x}")
        procs.append(subprocess.Popen([TRANSFORMER, "transform", xml], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in procs[::2]:
        time.sleep(rng.uniform(0.02, 0.12))  # spread over the lock-serialised starts
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=60)
    state = StateStore(str(Path(host.root, "var/lib/gpulib/state.json")),
                       str(Path(host.root, "var/lib/gpulib/state.lock"))).load()
    held: dict[str, str] = {}
    for vm, alloc in state.allocations.items():
        for d in alloc.devices:
            assert d.id not in held, f"{d.id} given to {held[d.id]} and {vm}"
            held[d.id] = vm
            assert d.id in state.vgpus
    # Every VM whose transformer was not killed got its vGPU; the rest start now.
    for i in range(16):
        if procs[i].returncode == 0:
            assert f"vm-{i}" in state.allocations
    for i in range(16):
        code, out, _ = start_vm_named(host.root, f"vm-{i}", i)
        assert code == 0, out
    final = StateStore(str(Path(host.root, "var/lib/gpulib/state.json")),
                       str(Path(host.root, "var/lib/gpulib/state.lock"))).load()
    assert len({d.id for a in final.allocations.values() for d in a.devices}) == 16


def start_vm_named(root: str, name: str, i: int) -> tuple[int, str, float]:
    t0 = time.monotonic()
    xml = META.format(name=name, uuid=f"00000000-0000-4000-8000-{i:012x}")
    res = subprocess.run([TRANSFORMER, "transform", xml], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=hook_env(root), timeout=30)
    return res.returncode, res.stdout.decode(), time.monotonic() - t0
