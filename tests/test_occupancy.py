"""The occupancy model on its own: who holds what, over the device tree
(PF, VF, mdev on either) and the IOMMU group, both directions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpulib.occupancy import ACTIVE, PENDING, RUNNING, Hold, Occupancy, Tree, refusal
from gpulib.sim.hosts import build_demo
from tests.hosts import simulated

A100 = "0000:ca:00.0"
RTX, RTX_AUDIO = "0000:3b:00.0", "0000:3b:00.1"
U1 = "11111111-2222-4333-8444-555555555555"
U2 = "21111111-2222-4333-8444-555555555555"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    host = build_demo(str(tmp_path_factory.mktemp("occ") / "demo"))
    vfs = sorted(os.path.basename(os.path.realpath(os.path.join(host.device_dir(A100), n)))
                 for n in os.listdir(host.device_dir(A100)) if n.startswith("virtfn"))
    return host.root, vfs


def occupancy(root: str, vfs: list[str], *holds: Hold) -> Occupancy:
    from gpulib.context import Context

    sysfs = Context.for_root(root).sysfs
    # Two vGPUs on VF 0 and VF 1 of the A100 (known to the registry, not live).
    tree = Tree(sysfs, {U1: vfs[0], U2: vfs[1]})
    return Occupancy(tree, holds)


def test_a_vgpu_excludes_its_vf_and_its_gpu_and_back(demo: tuple[str, list[str]]) -> None:
    root, vfs = demo
    occ = occupancy(root, vfs, Hold("a", ACTIVE, U1))
    assert [h.vm for h in occ.conflicts(vfs[0], "b")] == ["a"], "the VF under the vGPU"
    assert [h.vm for h in occ.conflicts(A100, "b")] == ["a"], "the GPU above it"
    assert occ.conflicts(vfs[1], "b") == [], "another VF of the same GPU is free"
    assert occ.conflicts(U2, "b") == [], "a vGPU on another VF does not conflict"
    assert occ.conflicts(vfs[0], "a") == [], "a VM never conflicts with itself"
    whole = occupancy(root, vfs, Hold("a", RUNNING, A100))
    assert [h.vm for h in whole.conflicts(U1, "b")] == ["a"], "the GPU held whole keeps its vGPUs"


def test_a_gpus_iommu_group_companions_conflict(demo: tuple[str, list[str]]) -> None:
    root, vfs = demo
    occ = occupancy(root, vfs, Hold("a", PENDING, RTX_AUDIO))
    found = occ.conflicts(RTX, "b")
    assert [(h.vm, h.device) for h in found] == [("a", RTX_AUDIO)]
    line = refusal(occ, "pci", RTX, "b")
    assert line == f"PCI device {RTX} conflicts with {RTX_AUDIO}, in use by starting VM a " \
                   "(pending allocation)"


def test_running_and_active_holds_are_named_before_pending_ones(
        demo: tuple[str, list[str]]) -> None:
    root, vfs = demo
    occ = occupancy(root, vfs, Hold("p", PENDING, A100), Hold("r", RUNNING, U1))
    assert [h.vm for h in occ.conflicts(vfs[0], "x")] == ["r", "p"]
    assert occ.user("pci", vfs[0]) == "r"


def test_build_reads_allocations_and_status_files(tmp_path: Path) -> None:
    from gpulib.domstatus import running_domains
    from gpulib.state import Allocation, Device, State

    host = build_demo(str(tmp_path / "demo"))
    host.add_running_domain("runs", "9b4c2e17-3a6f-4d8b-a5e1-7c0f3d9b2a46", pci=(RTX,))
    ctx = simulated(host)
    state = State(allocations={"starts": Allocation("starts", devices=[Device("pci", A100)])})
    occ = Occupancy.build(ctx.sysfs, state, running_domains(ctx.sysfs))
    assert occ.user("pci", RTX) == "runs" and occ.user("pci", RTX_AUDIO) == "runs"
    assert occ.user("pci", A100) == "starts"
    assert occ.user("pci", "0000:65:00.0") is None
