"""Run the hook executables the way their callers do (helpers for tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from lxml import etree

from gpulib.sim.fakehost import FakeHost

BIN = Path(sys.executable).parent
TRANSFORMER = str(BIN / "libvirt-vm-xml-transformer")
STATE_CHANGE = str(BIN / "libvirt-vm-state-change")
QEMU_HOOK = str(BIN / "gpulib-qemu-hook")


def hook_env(root: str, simulate: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULIB_")}
    env["GPULIB_ROOT"] = root
    if simulate:
        env["GPULIB_SIMULATE"] = "1"
    return env


def as_agent(root: str, xml: str, timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    """The CloudStack agent: argv `transform <xml>`, stderr merged into stdout."""
    return subprocess.run([TRANSFORMER, "transform", xml], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=hook_env(root), timeout=timeout)


def run(argv: list[str], root: str, stdin: Optional[bytes] = None,
        timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=stdin if stdin is not None else b"",
                          capture_output=True, env=hook_env(root), timeout=timeout)


def mdev_xml(name: str, uuid: str, mdev: str) -> str:
    """A domain as the agent's LibvirtGpuDef renders an mdev vGPU."""
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid><devices>"
            "<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'>"
            f"<source><address uuid='{mdev}'/></source></hostdev></devices></domain>")


def pci_hostdev(address: str) -> str:
    """The agent's passthrough <hostdev> for a PCI address (dddd:bb:ss.f)."""
    d, rest = address.split(":", 1)
    b, sf = rest.split(":")
    s, f = sf.split(".")
    return ("<hostdev mode='subsystem' type='pci' managed='yes'><driver name='vfio'/>"
            f"<source><address domain='0x{d}' bus='0x{b}' slot='0x{s}' function='0x{f}'/>"
            "</source></hostdev>")


def hostdev_uuids(dom: etree._Element) -> list[str]:
    """The mdev UUIDs a domain's hostdevs name, in order."""
    return [str(a.get("uuid")) for a in dom.findall("devices/hostdev/source/address")
            if a.get("uuid")]


def libvirt_runs(host: FakeHost, dom: etree._Element) -> None:
    """libvirt started the domain as the transformer left it (its status file)."""
    name, uuid = dom.findtext("name"), dom.findtext("uuid")
    assert name and uuid
    pci = []
    for a in dom.findall("devices/hostdev[@type='pci']/source/address"):
        d, b, sl, f = (int(str(a.get(k)), 16) for k in ("domain", "bus", "slot", "function"))
        pci.append(f"{d:04x}:{b:02x}:{sl:02x}.{f:x}")
    host.add_running_domain(name, uuid, pci=tuple(pci), mdevs=tuple(hostdev_uuids(dom)))


def libvirt_start_fails(root: str, name: str, xml: bytes) -> None:
    """libvirt starts the domain the transformer left (`xml`) and the start fails
    after `prepare begin`: its `release end`, which ends the run libvirt
    prepared (a `release end` alone is a late one of an earlier run)."""
    res = run([QEMU_HOOK, name, "prepare", "begin", "-"], root, stdin=xml)
    assert res.returncode == 0, res.stderr
    assert run([QEMU_HOOK, name, "release", "end", "-"], root).returncode == 0


def as_the_agent_runs(argv: list[str], root: str, stdin: Optional[bytes] = None,
                      timeout: float = 30) -> tuple[int, float, bytes]:
    """CloudStack's Script: argv, stderr merged, wait for the exit (its 30 s),
    then read to the end: (exit code, -1 when killed; seconds; output)."""
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=hook_env(root))
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = -1
    took = time.monotonic() - began
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.stdout.close()
    return code, took, out
