"""Run the hook executables the way their callers do (helpers for tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

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
