"""gpulib's qemu hook inside a real libvirtd (ARCHITECTURE.md, "Executables").

A private libvirtd (tests/helpers/libvirtd_env.py: own mount namespace, own
/etc/libvirt, /run, /var/lib/libvirt; the host's are untouched) starts with
`/etc/libvirt/hooks/qemu.d/60-gpulib-test` in place: a wrapper that sets
GPULIB_ROOT to a fake demo host (`gpulib.sim.hosts.build_demo`) and
GPULIB_SIMULATE=1, runs this checkout's `gpulib-qemu-hook`, and records each
call (arguments, exit code, gpulib's state and the live mdevs right after it)
so the tests see what libvirt did in which order (`Env` there).

What libvirt 9.0 does on `virsh start` (seen in its debug log, `qemuProcessStart`):
  qemuProcessInit -> qemuProcessStartValidate (XML only, no host devices)
    -> hook `prepare begin`           (non-zero exit: start aborted, stderr shown)
  qemuProcessPrepareDomain -> qemuProcessPrepareHost -> qemuHostdevPrepareDomainDevices
    (mdev: "Mediated host device assignment requires VFIO support" without
    /dev/vfio/vfio; then the mdev must exist in the real /sys)
  qemuProcessLaunch -> hook `start begin` -> exec qemu -> hook `started begin`
  on any failure, and on destroy: qemuProcessStop -> `stopped end`, `release end`.
So `prepare begin` runs before libvirt looks at an mdev on the host: the hook
gets to recreate a pool vGPU, and `release end` runs after a start that
failed later, even after our own `prepare` refused.

Every test needs root and libvirtd, virtlogd, virsh and qemu-system-x86_64;
GPULIB_SKIP_LIBVIRTD=1 skips them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Callable

import pytest

from gpulib.sim.hosts import DEMO_POOL_MDEVS, DEMO_T4
from tests.helpers.libvirtd_env import (
    HOOK_NAME,
    PREFIX,
    Env,
    PrivateLibvirtd,
    defining,
    marks,
    serving,
)

POOL_UUID = DEMO_POOL_MDEVS[0]
POOL_TYPE = "nvidia-232"

pytestmark = marks()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    """Fake root + wrapper; no daemon (the direct hook test needs only this)."""
    return Env(tmp_path_factory.mktemp("libvirtd"))


@pytest.fixture(scope="module")
def libvirtd(env: Env) -> Iterator[PrivateLibvirtd]:
    yield from serving(env)


@pytest.fixture
def define(env: Env, libvirtd: PrivateLibvirtd) -> Iterator[Callable[..., str]]:
    """define(suffix, mdev=None, pci=None) -> name; destroyed and undefined after the test."""
    yield from defining(env, libvirtd)


def domstate(libvirtd: PrivateLibvirtd, name: str) -> str:
    return libvirtd.virsh("domstate", name).stdout.strip()


def test_domain_without_gpus_starts_and_stops(env: Env, libvirtd: PrivateLibvirtd,
                                              define: Callable[..., str]) -> None:
    name = define("plain")
    state_before = env.state()

    res = libvirtd.virsh("start", name)
    assert res.returncode == 0, env.explain(res)
    assert domstate(libvirtd, name) == "running"
    res = libvirtd.virsh("destroy", name)
    assert res.returncode == 0, env.explain(res)
    assert domstate(libvirtd, name) == "shut off"

    # The hook ran for every step, and said yes each time.
    calls = env.calls(name)
    assert [c["op"] for c in calls] == ["prepare begin", "start begin", "started begin",
                                        "stopped end", "release end"], env.explain(res)
    assert all(c["rc"] == 0 for c in calls), env.explain(res)
    # Nothing recorded; the demo's schema-2 file may be rewritten in the current schema,
    # which names its writer.
    after = env.state()
    meta = ("version", "intents", "writer")
    assert {k: v for k, v in after.items() if k not in meta} == \
        {k: v for k, v in state_before.items() if k not in meta}
    assert after.get("intents", []) == []


def test_running_domain_survives_libvirtd_restart(env: Env, libvirtd: PrivateLibvirtd,
                                                  define: Callable[..., str]) -> None:
    """libvirtd re-finds the VM and calls `reconnect begin`: a failure would kill it."""
    name = define("reconnect")
    res = libvirtd.virsh("start", name)
    assert res.returncode == 0, env.explain(res)

    libvirtd.stop_libvirtd()
    libvirtd.start_libvirtd()

    # libvirtd answers clients before its per-domain reconnect threads have run the hook.
    deadline = time.monotonic() + 20
    while "reconnect begin" not in [c["op"] for c in env.calls(name)] \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert domstate(libvirtd, name) == "running"
    calls = env.calls(name)
    assert {"reconnect begin"} <= {c["op"] for c in calls}, env.explain(res)
    assert all(c["rc"] == 0 for c in calls), env.explain(res)


def test_pool_vgpu_is_recreated_then_released(env: Env, libvirtd: PrivateLibvirtd,
                                              define: Callable[..., str]) -> None:
    """A pool vGPU gpulib knows but that is not live (as after a reboot)."""
    name = define("pool-vgpu", mdev=POOL_UUID)
    mdevs_before = env.live_mdevs()
    state_before = env.state()
    assert POOL_UUID not in mdevs_before
    assert name not in state_before["allocations"]

    res = libvirtd.virsh("start", name)

    # The start fails, and it is libvirt's own refusal (no VFIO, or no such mdev in the
    # real /sys), not gpulib's: prepare had already succeeded.
    assert res.returncode != 0, env.explain(res)
    assert "Hook script execution failed" not in res.stderr, env.explain(res)
    assert "gpulib:" not in res.stderr, env.explain(res)
    assert any(s in res.stderr for s in ("VFIO", "vfio", "ediated", POOL_UUID)), \
        env.explain(res)

    calls = env.calls(name)
    ops = [c["op"] for c in calls]
    assert ops[0] == "prepare begin", env.explain(res)
    assert ops[-1] == "release end", env.explain(res)
    assert "start begin" not in ops, env.explain(res)  # qemu was never launched
    assert all(c["rc"] == 0 for c in calls), env.explain(res)
    # libvirt's own log: our hook ran first, libvirt looked at host devices after it.
    assert env.libvirt_events(name) == [
        "hook prepare begin", "prepare host devices", "host device error",
        "hook stopped end", "hook release end"], env.explain(res)

    # Right after `prepare begin`: the vGPU exists in the fake tree, on its parent with
    # its type, and gpulib recorded it (pending) for this VM.
    prepared = calls[0]
    assert env.mdevs_after(prepared) == sorted([*mdevs_before, POOL_UUID])
    link = env.root / "sys/bus/mdev/devices" / POOL_UUID
    assert link.is_symlink()
    assert os.path.basename(os.readlink(link / "mdev_type")) == POOL_TYPE
    assert os.path.basename(os.path.dirname(os.path.realpath(link))) == DEMO_T4
    state_prepared = env.state_after(prepared)
    alloc = state_prepared["allocations"][name]
    assert alloc["status"] == "pending"
    assert POOL_UUID in json.dumps(alloc["devices"])
    # Allocations are the one record of who holds a device (state schema 2).
    assert "vm" not in state_prepared["vgpus"][POOL_UUID]

    # After `release end`: the allocation is gone and the registry entry is free again;
    # the pool vGPU itself stays live for the next VM (pool devices stay:
    # ARCHITECTURE.md, "What a start and a stop do").
    expected = json.loads(json.dumps(state_prepared))
    del expected["allocations"][name]
    state_after = env.state()
    assert state_after == expected
    assert state_after["allocations"] == state_before["allocations"]
    assert env.live_mdevs() == sorted([*mdevs_before, POOL_UUID])
    assert domstate(libvirtd, name) == "shut off"


def test_unknown_vgpu_is_refused_by_prepare(env: Env, libvirtd: PrivateLibvirtd,
                                            define: Callable[..., str]) -> None:
    """An mdev UUID gpulib has no record of: prepare refuses, libvirt shows why."""
    unknown = str(uuid.uuid4())
    name = define("unknown-vgpu", mdev=unknown)
    mdevs_before = env.live_mdevs()
    state_before = env.state()

    res = libvirtd.virsh("start", name)

    assert res.returncode != 0, env.explain(res)
    assert "Hook script execution failed" in res.stderr, env.explain(res)
    assert f"/etc/libvirt/hooks/qemu.d/{HOOK_NAME} {name} prepare begin" in res.stderr
    assert f"gpulib: mdev {unknown} does not exist" in res.stderr, env.explain(res)
    assert "gpulib has no record" in res.stderr, env.explain(res)
    assert "Traceback" not in res.stderr

    calls = env.calls(name)
    assert calls[0]["op"] == "prepare begin" and calls[0]["rc"] == 1, env.explain(res)
    # libvirt still runs the stop hooks after a refused prepare; release tolerates
    # "never allocated".
    assert calls[-1]["op"] == "release end" and calls[-1]["rc"] == 0, env.explain(res)
    assert "start begin" not in [c["op"] for c in calls]
    # libvirt stopped right after the hook: it never got to the host devices.
    assert env.libvirt_events(name) == ["hook prepare begin", "hook stopped end",
                                        "hook release end"], env.explain(res)

    assert env.live_mdevs() == mdevs_before
    assert unknown not in env.live_mdevs()
    assert env.state() == state_before
    assert domstate(libvirtd, name) == "shut off"


def test_second_domain_naming_a_held_gpu_fails_to_start(env: Env, libvirtd: PrivateLibvirtd,
                                                        define: Callable[..., str]) -> None:
    """The agent starts a VM with its own XML when the transformer refused; libvirt's
    `prepare begin` refuses the same start, with the same reason, so it never runs."""
    from gpulib.sim.fakehost import FakeHost

    gpu = "0000:3b:00.0"
    holder = "i-2-33-VM"
    host = FakeHost(str(env.root))
    host.add_running_domain(holder, "8f3c6d2a-41b7-4c6e-9a0d-2b5e7f1c9a34", pci=(gpu,))
    try:
        name = define("held-gpu", pci=gpu)
        state_before = env.state()
        res = libvirtd.virsh("start", name)
        assert res.returncode != 0, env.explain(res)
        assert "Hook script execution failed" in res.stderr, env.explain(res)
        assert f"gpulib: PCI device {gpu} is in use by running VM {holder}" in res.stderr, \
            env.explain(res)
        calls = env.calls(name)
        assert calls[0]["op"] == "prepare begin" and calls[0]["rc"] == 1, env.explain(res)
        assert "start begin" not in [c["op"] for c in calls], env.explain(res)
        assert env.state() == state_before
        assert domstate(libvirtd, name) == "shut off"
    finally:
        host.stop_domain(holder)
        os.unlink(env.root / f"etc/libvirt/qemu/{holder}.xml")


GARBAGE = {
    "empty": b"",
    "binary": bytes(range(256)) * 64,
    "truncated-domain": b"<domain type='qemu'><name>gpulib-test-x</name><devices>"
                        b"<hostdev mode='subsystem' type='mdev'><source><address uuid='",
    "bad-uuid": b"<domain type='qemu'><name>gpulib-test-x</name><devices>"
                b"<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
                b"<address uuid='not-a-uuid'/></source></hostdev></devices></domain>",
    "not-utf8": b"<domain>\xff\xfe\x00<name>\x80</name><hostdev type='mdev'/></domain>",
    "huge": b"<domain><hostdev type='mdev'>" + b"A" * (9 * 1024 * 1024),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_reconnect_with_garbage_exits_zero(env: Env, kind: str) -> None:
    """`reconnect begin` must exit 0 whatever it reads: non-zero makes libvirt kill the VM.

    Called the way libvirtd calls it: the installed wrapper, libvirt's environment.
    """
    state_before = env.state()
    mdevs_before = env.live_mdevs()
    res = subprocess.run(
        [str(env.wrapper), PREFIX + "garbage", "reconnect", "begin", "-"],
        input=GARBAGE[kind], capture_output=True, timeout=30, check=False, cwd="/",
        env={"LC_ALL": "C", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 0, err
    assert res.stdout == b""
    assert "Traceback" not in err
    assert env.state() == state_before
    assert env.live_mdevs() == mdevs_before
