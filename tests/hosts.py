"""Test helpers that build hosts: thin, intent-named wrappers over the builder."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import pytest

from gpulib.cloudstack import AGENT_HOOKS_DIR, STATE_CHANGE_HOOK, TRANSFORMER_HOOK
from gpulib.context import Context
from gpulib.doctor import LIBVIRT_HOOK
from gpulib.entry import context_for_root
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import build_demo, build_pool64, models


@contextmanager
def scratch(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A directory for one example of a property test, removed when the
    example passes: pytest would keep every example's host to the end of
    the run (and a failing example's stays for a look)."""
    path = factory.mktemp(name)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def demo_host(tmp: str) -> FakeHost:
    return build_demo(os.path.join(tmp, "demo"))


def empty_host(tmp: str) -> FakeHost:
    return FakeHost(os.path.join(tmp, "host"))


def t4_host(tmp: str, live: tuple[str, ...] = ()) -> FakeHost:
    """One T4 with mdev types on the PF (NVIDIA time-sliced vGPU)."""
    host = empty_host(tmp)
    m = models()["t4"]
    host.add_bridge("0000:3a:00.0", numa_node=0, iommu_group=host.new_iommu_group())
    host.add_function("0000:3b:00.0", m["vendor"], m["device"], m["class"], driver="nvidia",
                      iommu_group=host.new_iommu_group(), numa_node=0, parent="0000:3a:00.0",
                      vendor_name=m["vendor_name"], device_name=m["device_name"])
    host.populate_mdev_parent("0000:3b:00.0", m["mdev_types"])
    for u in live:
        host.add_mdev(u, "0000:3b:00.0", "nvidia-232")
    return host


def a10_host(tmp: str, numvfs: int = 4) -> FakeHost:
    """One A10 with NVIDIA vendor-specific vGPU VFs."""
    host = empty_host(tmp)
    m = models()["a10"]
    host.add_bridge("0000:40:03.1", numa_node=0, iommu_group=host.new_iommu_group())
    host.add_function("0000:41:00.0", m["vendor"], m["device"], m["class"], driver="nvidia",
                      iommu_group=host.new_iommu_group(), numa_node=0, parent="0000:40:03.1",
                      vendor_name=m["vendor_name"], device_name=m["device_name"])
    host.set_sriov_capability("0000:41:00.0", 32, m["vf_device"], offset=4)
    types = {int(k): v for k, v in m["nvidia_vf_types"].items()}
    for vf in host.enable_sriov("0000:41:00.0", numvfs, vf_driver="nvidia"):
        host.add_nvidia_vf_types(vf, types)
    return host


def simulated(host: FakeHost) -> Context:
    return context_for_root(host.root, simulate=True)


def t4_farm(tmp: str, gpus: int = 4, per_parent: int = 16) -> FakeHost:
    """`gpus` T4s and a declared pool of GRID T4-1B vGPUs on each."""
    return build_pool64(os.path.join(tmp, "host"), gpus=gpus, per_parent=per_parent)


def reboot(host: FakeHost, rebuild: object) -> FakeHost:
    """The same host after a power cycle: sysfs fresh, /etc and /var/lib kept."""
    saved = host.root + ".saved"
    os.makedirs(saved)
    for keep in ("etc", "var/lib/gpulib"):
        src = host.p(keep)
        if os.path.exists(src):
            shutil.copytree(src, os.path.join(saved, keep), symlinks=True)
    shutil.rmtree(host.root)
    new = rebuild(host.root)  # type: ignore[operator]
    for keep in ("etc", "var/lib/gpulib"):
        src = os.path.join(saved, keep)
        if os.path.exists(src):
            shutil.rmtree(new.p(keep), ignore_errors=True)
            shutil.copytree(src, new.p(keep), symlinks=True)
    shutil.rmtree(saved)
    return new  # type: ignore[no-any-return]


# -- a host ready for gpulib: hooks installed, libvirtd started after them --

BTIME = 1_700_000_000
HOOKS_AT = BTIME + 100
LIBVIRTD_AT = BTIME + 200
LIBVIRTD_PID = 2211
HOOKS = (LIBVIRT_HOOK, f"{AGENT_HOOKS_DIR}/{TRANSFORMER_HOOK}",
         f"{AGENT_HOOKS_DIR}/{STATE_CHANGE_HOOK}")

def install_hooks(host: FakeHost, mtime: float = HOOKS_AT) -> None:
    for rel in HOOKS:
        host.write_file(rel, "#!/bin/sh\nexec /usr/bin/gpulib-hook \"$@\"\n", 0o755)
        os.utime(host.p(rel), (mtime, mtime))


def start_libvirtd(host: FakeHost, started: Optional[float] = None, pid: int = LIBVIRTD_PID,
                   comm: str = "libvirtd") -> None:
    """run/libvirtd.pid, proc/<pid>/stat (starttime in clock ticks), proc/stat btime.

    By default libvirtd starts now: after the hooks the test installed (the
    doctor compares with their ctime, which a test cannot set back)."""
    if started is None:
        started = max(LIBVIRTD_AT, time.time() + 1)
    ticks = os.sysconf("SC_CLK_TCK")
    host.write_file("proc/stat", f"cpu  10 0 10 1000 0 0 0 0 0 0\nbtime {BTIME}\n"
                                 "processes 4242\n")
    host.write_file("run/libvirtd.pid", f"{pid}\n")
    fields = ["S", "1"] + ["0"] * 17 + [str(int((started - BTIME) * ticks))] + ["0"] * 30
    host.write_file(f"proc/{pid}/stat", f"{pid} ({comm}) " + " ".join(fields) + "\n", 0o444)


def probe_qemu(host: FakeHost, libvirt: int = 10000000, qemu: int = 8002000) -> None:
    """The entry of libvirt's QEMU capabilities cache a started libvirtd writes
    (versions in libvirt's encoding: major*1e6 + minor*1e3 + micro)."""
    host.write_file("var/cache/libvirt/qemu/capabilities/3c76bc41.xml",
                    "<qemuCaps>\n  <emulator>/usr/bin/qemu-system-x86_64</emulator>\n"
                    f"  <selfvers>{libvirt}</selfvers>\n  <usedQMP/>\n"
                    f"  <version>{qemu}</version>\n</qemuCaps>\n")


def healthy_host(tmp: str) -> FakeHost:
    """The demo host with gpulib's hooks installed and libvirtd started after them
    (its QEMU probed: the versions are known)."""
    host = build_demo(os.path.join(tmp, "demo"))
    os.makedirs(host.p("etc/cloudstack/agent"), exist_ok=True)
    install_hooks(host)
    start_libvirtd(host)
    probe_qemu(host)
    return host


# -- what a test compares before and after ----------------------------------------------

COUNTERS = "var/lib/gpulib/counters."


def tree_contents(root: str) -> dict[str, str]:
    """Every file and link below root (content in hex, or link target).

    The log, the lock file, gpulib's cache of running domains (`run/gpulib/`)
    and the hooks' counters (`var/lib/gpulib/counters.*`: a refused start
    counts too) are left out: none is state, and taking the lock creates its
    file; so is the simulated nvidia-smi's record of its calls.
    """
    out = {}
    for d, dirs, files in os.walk(root):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            if rel.startswith(("var/log/", "run/gpulib/", "run/gpulib-sim/", COUNTERS)) or \
                    rel.endswith("state.lock"):
                continue
            if os.path.islink(p):
                out[rel] = os.readlink(p)
            else:
                with open(p, "rb") as fh:
                    out[rel] = fh.read().hex()
    return out


def tree_state(root: str) -> dict[str, tuple[int, float, int]]:
    """Mode, mtime and size of everything below root: "was anything written?".
    The simulated nvidia-smi's record of its calls (`run/gpulib-sim`) is the
    simulator's, not a write of gpulib's: left out."""
    out: dict[str, tuple[int, float, int]] = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, root)
            if rel == "run/gpulib-sim" or rel.startswith("run/gpulib-sim/"):
                continue
            st = os.lstat(path)
            out[rel] = (st.st_mode, st.st_mtime, st.st_size)
    return out


# -- two T4s whose nvidia-232 vGPUs have attribute files (mdevctl tests) --

P1 = "0000:3b:00.0"
P2 = "0000:5e:00.0"
U1 = "11111111-2222-4333-8444-555555555555"
U2 = "22222222-3333-4444-8555-666666666666"
U3 = "33333333-4444-4555-8666-777777777777"
ATTR_SPEC = {"nvidia/vgpu_params": r"[a-z_]+=\d+(,[a-z_]+=\d+)*", "weight": r"\d+"}


def two_t4_host(root: str) -> FakeHost:
    """Two T4s (mdev types on the PF); nvidia-232 devices have attribute files."""
    host = FakeHost(root)
    m = models()["t4"]
    for bridge, gpu in (("0000:3a:00.0", P1), ("0000:5d:00.0", P2)):
        host.add_bridge(bridge, numa_node=0, iommu_group=host.new_iommu_group())
        host.add_function(gpu, m["vendor"], m["device"], m["class"], driver="nvidia",
                          iommu_group=host.new_iommu_group(), numa_node=0, parent=bridge,
                          vendor_name=m["vendor_name"], device_name=m["device_name"])
        host.populate_mdev_parent(gpu, m["mdev_types"])
        host.add_mdev_attributes(gpu, "nvidia-232", ATTR_SPEC)
    return host
