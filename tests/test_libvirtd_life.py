"""A VM's life under a real libvirtd that restarts while the VM runs.

The private libvirtd of tests/helpers/libvirtd_env.py, with the fake host's
`run/libvirt/qemu` pointed at the directory where that libvirtd writes its
status files: gpulib's notion of a running VM (`gpulib.liveness`) is then
libvirt's own. Real devices cannot be attached here (no GPU, no VFIO), so
the domain libvirt runs has no hostdev: its allocation, with a vGPU made on
demand in the fake host, is what the CloudStack transformer recorded for the
agent's XML of the same domain (name and UUID).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Callable

import pytest

from tests.helpers.libvirtd_env import PREFIX, QEMU, Env, PrivateLibvirtd, defining, marks, serving
from tests.hookrun import STATE_CHANGE, as_agent, run

pytestmark = marks()

UUID = "7a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    e = Env(tmp_path_factory.mktemp("libvirtd-life"))
    e.share_status_files()
    return e


@pytest.fixture(scope="module")
def libvirtd(env: Env) -> Iterator[PrivateLibvirtd]:
    yield from serving(env)


@pytest.fixture
def define(env: Env, libvirtd: PrivateLibvirtd) -> Iterator[Callable[..., str]]:
    yield from defining(env, libvirtd)


def plain(name: str) -> str:
    return (f"<domain type='qemu'><name>{name}</name><uuid>{UUID}</uuid>"
            "<memory unit='MiB'>64</memory><vcpu>1</vcpu>"
            "<os><type arch='x86_64' machine='pc'>hvm</type></os>"
            f"<devices><emulator>{QEMU}</emulator></devices></domain>")


def agent_xml(name: str) -> str:
    return (f"<domain type='kvm'><name>{name}</name><uuid>{UUID}</uuid><metadata>"
            "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
            "<gpulib:vgpu profile='GRID A100-8C' count='1'/></gpulib:gpus></metadata>"
            "<devices/></domain>")


def test_restart_while_running_then_stop(env: Env, libvirtd: PrivateLibvirtd,
                                         define: Callable[..., str]) -> None:
    name = PREFIX + "life"
    root = str(env.root)
    res = as_agent(root, agent_xml(name))
    assert res.returncode == 0, res.stdout
    vgpus = [d["id"] for d in env.state()["allocations"][name]["devices"]]
    assert vgpus and set(vgpus) <= set(env.live_mdevs())
    define("life", text=plain(name))
    started = libvirtd.virsh("start", name)
    assert started.returncode == 0, env.explain(started)
    assert os.path.exists(env.root / "run" / "libvirt" / "qemu" / f"{name}.xml")
    assert env.state()["allocations"][name]["status"] == "active"  # `started begin`

    libvirtd.stop_libvirtd()
    libvirtd.start_libvirtd()
    deadline = time.monotonic() + 20
    while "reconnect begin" not in [c["op"] for c in env.calls(name)] \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "reconnect begin" in [c["op"] for c in env.calls(name)], env.explain(started)
    assert libvirtd.virsh("domstate", name).stdout.strip() == "running"
    assert env.state()["allocations"][name]["status"] == "active"

    # The agent's onStop arrives while libvirt still runs the VM: nothing changes.
    late = run([STATE_CHANGE, "onStop", name], root)
    assert late.returncode == 0, late.stderr
    assert env.state()["allocations"][name]["status"] == "active"
    assert set(vgpus) <= set(env.live_mdevs())

    stopped = libvirtd.virsh("destroy", name)
    assert stopped.returncode == 0, env.explain(stopped)
    ops = [c["op"] for c in env.calls(name)]
    assert ops[-1] == "release end", env.explain(stopped)
    assert name not in env.state()["allocations"]
    assert not set(vgpus) & set(env.live_mdevs()), "the on-demand vGPU is destroyed"
    assert all(c["rc"] == 0 for c in env.calls(name)), env.explain(stopped)
