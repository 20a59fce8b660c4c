"""Every simulated host the reports are tested on, each built once a session
(`simulated_hosts` in conftest.py): the large ones take a while."""

from __future__ import annotations

import os
from typing import Callable

import pytest

from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import build_demo, build_large, build_large_nvidia, build_pool64
from tests.hosts import U1, a10_host, empty_host, healthy_host, t4_farm, t4_host, two_t4_host
from tests.test_realhosts import REAL_HOSTS

HOSTS: dict[str, Callable[[str], FakeHost]] = {
    "empty": empty_host,
    "demo": lambda tmp: build_demo(os.path.join(tmp, "demo")),
    "healthy": healthy_host,
    "large": lambda tmp: build_large(os.path.join(tmp, "large")),
    "large-nvidia": lambda tmp: build_large_nvidia(os.path.join(tmp, "large")),
    "pool64": lambda tmp: build_pool64(os.path.join(tmp, "pool64")),
    "t4": lambda tmp: t4_host(tmp, live=(U1,)),
    "a10": a10_host,
    "t4-farm": t4_farm,
    "two-t4": lambda tmp: two_t4_host(os.path.join(tmp, "host")),
}
# The layouts of real machines (odd VF numbering, VFs past the root bus,
# types without a name, shared IOMMU groups, PCI domains 000f and 10000).
HOSTS.update({f"real-{name}": (lambda tmp, build=build: build(os.path.join(tmp, "host")))
              for name, build in REAL_HOSTS.items()})


class Built:
    """name -> the root of that host, built when first asked for. Tests may
    run reports on it (which learn names, cache and fold counters) but change
    nothing else."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.roots: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        root = self.roots.get(name)
        if root is None:
            root = self.roots[name] = HOSTS[name](str(self.factory.mktemp(name))).root
        return root
