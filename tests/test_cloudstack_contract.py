"""The CloudStack contract as CloudStack's own code reads it, on hosts in PCI
domains 0000, 0001 and 000f:

* a GPU's own entry (`full_passthrough.used_by_vm`) names only the VM that
  holds it whole: the management server copies that name onto the GPU's row
  (GpuServiceImpl.setStateAndVmName), so naming a vGPU's user there would
  keep the row from being deleted and free it when that one VM stops;
* CloudStack 4.21 and 4.22.0 agents render a VF in a PCI domain other than
  0000 (`0001:04:00.2`) as bus='0x0001' slot='0x04' function='0x0': which
  VF was meant is lost, so neither the transformer nor `prepare begin`
  picks one (or the PF), while whole GPUs of such domains are still repaired.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpulib import cli
from gpulib.entry import context_for_root
from gpulib.hooks import qemu
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import add_model, install_nvidia_smi, models
from tests.hosts import tree_contents
from tests.test_discovery import check_agent_document
from tests.test_realhosts import _Stdin, agent421_source, pci_xml, source_addresses, transform

DOMAINS = ("0000", "0001", "000f")
VGPU = "7a1e0c3d-2b4f-4e6a-9c8d-0f1e2d3c4b5a"
VGPU_VM, VF_VM, WHOLE_VM = "i-2-10-VM", "i-2-11-VM", "i-2-12-VM"
NEW_VM, NEW_UUID = "i-2-20-VM", "22222222-0000-4000-8000-000000000020"
A10_6Q = 594


def addresses(domain: str) -> dict[str, str]:
    return {"t4": f"{domain}:af:00.0", "a10": f"{domain}:04:00.0",
            "mi210": f"{domain}:17:00.0", "spare": f"{domain}:65:00.0"}


def lspci(address: str) -> str:
    """`pci_address` as the report (and lspci) writes it."""
    return address[5:] if address.startswith("0000:") else address


def contract_host(root: str, domain: str) -> FakeHost:
    """Every kind of instance on one PCI domain, each used by a running VM: a
    T4 with a vGPU on the PF, an A10 whose vendor-specific VFs start at
    function 2 (the first, 04:00.2, typed A10-6Q), an MI210 given whole, and
    a spare T4 for passthrough; NVIDIA's tool answers for the A10."""
    m = models()
    a = addresses(domain)
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    for mod in ("vfio", "vfio_pci", "nvidia", "kvm"):
        host.load_module(mod)

    def port(bus: str) -> str:
        address = f"{domain}:{bus}:00.0"
        host.add_bridge(address, numa_node=0, iommu_group=host.new_iommu_group())
        return address

    add_model(host, m["t4"], a["t4"], 0, parent=port("ae"))
    host.populate_mdev_parent(a["t4"], m["t4"]["mdev_types"])
    host.add_mdev(VGPU, a["t4"], "nvidia-232")
    add_model(host, m["a10"], a["a10"], 0, parent=port("03"))
    host.set_sriov_capability(a["a10"], 32, m["a10"]["vf_device"], offset=2)
    vfs = host.enable_sriov(a["a10"], 4, vf_driver="nvidia")
    name = m["a10"]["nvidia_vf_types"][str(A10_6Q)]
    host.add_nvidia_vf_types(vfs[0], {}, current=A10_6Q)
    for vf in vfs[1:]:
        host.add_nvidia_vf_types(vf, {A10_6Q: name}, current=A10_6Q)
    add_model(host, m["mi210"], a["mi210"], 0, parent=port("16"), driver="vfio-pci")
    add_model(host, m["t4"], a["spare"], 0, parent=port("64"), driver="vfio-pci")
    host.add_running_domain(VGPU_VM, "22222222-0000-4000-8000-000000000010", mdevs=(VGPU,),
                            pid=4310)
    host.add_running_domain(VF_VM, "22222222-0000-4000-8000-000000000011", pci=(vfs[0],),
                            managed=False, pid=4311, domain_id=2)
    host.add_running_domain(WHOLE_VM, "22222222-0000-4000-8000-000000000012",
                            pci=(a["mi210"],), pid=4312, domain_id=3)
    install_nvidia_smi(host)
    return host


@pytest.fixture(params=DOMAINS)
def domain(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def host(tmp_path: Path, domain: str) -> FakeHost:
    return contract_host(str(tmp_path / f"domain-{domain}"), domain)


def discover_cloudstack(root: str, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """`gpulib discover --format cloudstack`, as the agent runs it."""
    monkeypatch.setenv("GPULIB_ROOT", root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    capsys.readouterr()
    assert cli.main(["discover", "--format", "cloudstack"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    check_agent_document(doc)
    return doc


def by_address(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["pci_address"]: g for g in doc["gpus"]}


# -- a GPU's own entry names only its whole holder ----------------------------------------------

def test_a_gpus_own_entry_names_only_the_vm_holding_it_whole(
        host: FakeHost, domain: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    a = addresses(domain)
    gpus = by_address(discover_cloudstack(host.root, monkeypatch, capsys))
    t4, a10, mi210 = gpus[lspci(a["t4"])], gpus[lspci(a["a10"])], gpus[lspci(a["mi210"])]
    # vGPUs and VFs name their own users; the GPU they are on is nobody's whole.
    assert [(v["mdev_uuid"], v["used_by_vm"]) for v in t4["vgpu_instances"]] == [(VGPU, VGPU_VM)]
    assert t4["full_passthrough"]["used_by_vm"] is None
    assert {vf["vf_pci_address"]: vf["used_by_vm"] for vf in a10["vf_instances"]} == {
        lspci(f"{domain}:04:00.2"): VF_VM, lspci(f"{domain}:04:00.3"): None,
        lspci(f"{domain}:04:00.4"): None, lspci(f"{domain}:04:00.5"): None}
    assert a10["full_passthrough"]["used_by_vm"] is None
    # `enabled` still says whether the GPU can be given whole.
    assert (t4["full_passthrough"]["enabled"], a10["full_passthrough"]["enabled"]) == (0, 0)
    assert mi210["full_passthrough"] == {
        "enabled": 1, "used_by_vm": WHOLE_VM,
        "libvirt_address": PciAddress.parse(a["mi210"]).libvirt()}


def test_a_start_through_the_transformer_moves_only_what_it_takes(
        host: FakeHost, domain: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A start pending (the transformer ran, onStart not yet): a VF it takes
    names it, its GPU's entry does not; a GPU it takes whole names it."""
    a = addresses(domain)
    vf = PciAddress.parse(f"{domain}:04:00.3")
    code, _out, err = transform(host.root, pci_xml(NEW_VM, NEW_UUID, vf.libvirt(), "no"),
                               monkeypatch, capfd)
    assert (code, err) == (0, "")
    gpus = by_address(discover_cloudstack(host.root, monkeypatch, capfd))
    a10 = gpus[lspci(a["a10"])]
    assert {x["vf_pci_address"]: x["used_by_vm"] for x in a10["vf_instances"]}[
        lspci(str(vf))] == NEW_VM
    assert a10["full_passthrough"]["used_by_vm"] is None
    spare = PciAddress.parse(a["spare"])
    code, _out, err = transform(host.root, pci_xml("i-2-21-VM", NEW_UUID.replace("20", "21"),
                                                   spare.libvirt()), monkeypatch, capfd)
    assert (code, err) == (0, "")
    gpus = by_address(discover_cloudstack(host.root, monkeypatch, capfd))
    assert gpus[lspci(a["spare"])]["full_passthrough"]["used_by_vm"] == "i-2-21-VM"


# -- VFs whose address a 4.21/4.22.0 agent lost -------------------------------------------------

def test_a_vf_rendered_by_a_421_agent_is_refused_naming_the_fix(
        host: FakeHost, domain: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    vf = f"{domain}:04:00.3"
    rendered = agent421_source(vf)
    before = tree_contents(host.root)
    code, out, err = transform(host.root, pci_xml(NEW_VM, NEW_UUID, rendered, "no"),
                               monkeypatch, capfd)
    if domain == "0000":
        # An address of domain 0000 reaches the agent as bb:ss.f, which it renders right.
        assert rendered == PciAddress.parse(vf).libvirt()
        assert (code, err) == (0, "")
        assert source_addresses(out) == [PciAddress.parse(vf)]
        return
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert "lost the VF's address" in line and "apache/cloudstack pull 12981" in line
    assert f"4 VFs on {domain}:04" in line
    # Neither a VF nor the PF was taken: nothing changed, nothing recorded.
    assert tree_contents(host.root) == before


def test_prepare_begin_refuses_a_vf_rendered_by_a_421_agent(
        host: FakeHost, domain: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    if domain == "0000":
        pytest.skip("domain 0000 reaches the agent without its domain: rendered right")
    before = tree_contents(host.root)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    monkeypatch.setattr("sys.stdin", _Stdin(pci_xml(NEW_VM, NEW_UUID,
                                                    agent421_source(f"{domain}:04:00.4"), "no")))
    capfd.readouterr()
    assert qemu.main(["gpulib-qemu-hook", NEW_VM, "prepare", "begin", "-"]) == 2
    [line] = capfd.readouterr().err.splitlines()
    assert "lost the VF's address" in line and "apache/cloudstack pull 12981" in line
    assert "cannot be given whole" not in line
    assert tree_contents(host.root) == before


def test_a_whole_gpu_rendered_by_a_421_agent_is_still_repaired(
        host: FakeHost, domain: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    spare = PciAddress.parse(addresses(domain)["spare"])
    code, out, err = transform(host.root, pci_xml(NEW_VM, NEW_UUID, agent421_source(str(spare))),
                               monkeypatch, capfd)
    assert (code, err) == (0, "")
    assert source_addresses(out) == [spare]


# -- no device dropped for a passing reason -------------------------------------------------------

class ManagementServer:
    """What the management server keeps of a host's GPU devices, by bus address
    (the PCI address of a GPU or VF, an mdev's UUID), as
    GpuServiceImpl.addGpuDevicesToHost and setStateAndVmName keep it: a device
    in the report is updated (a VM it cannot find: Error; no VM: Free); one
    missing from it becomes Error and Unmanaged, and nothing but an
    administrator's manageGpuDevice makes it Managed again. Allocation takes
    Free and Managed devices only (GpuDeviceDao.listDevicesForAllocation)."""

    def __init__(self, vms: set[str]) -> None:
        self.vms = vms
        self.rows: dict[str, dict[str, Any]] = {}

    def report(self, doc: dict[str, Any]) -> None:
        seen = set()
        for g in doc["gpus"]:
            for bus, vm in [(g["pci_address"], g["full_passthrough"]["used_by_vm"]),
                            *((v["mdev_uuid"], v["used_by_vm"]) for v in g["vgpu_instances"]),
                            *((v["vf_pci_address"], v["used_by_vm"])
                              for v in g["vf_instances"])]:
                row = self.rows.setdefault(bus, {"state": "Free", "managed": True, "vm": None})
                if vm:
                    if vm in self.vms:
                        row.update(state="Allocated", vm=vm)
                    else:
                        row["state"] = "Error"
                else:
                    row.update(state="Free", vm=None)
                seen.add(bus)
        for bus, row in self.rows.items():
            if bus not in seen:
                row.update(state="Error", managed=False)

    def allocatable(self, bus: str) -> bool:
        row = self.rows[bus]
        return row["state"] == "Free" and row["managed"]


def test_a_device_that_cannot_be_given_for_a_while_is_never_dropped(tmp_path: Path) -> None:
    """A pool's vGPU (not live after a reboot) that a stray vGPU of another
    type keeps from being created, and an A10 VF with gpulib's recorded type
    whose vGPU state cannot be read: while so, each is reported used by
    `gpulib:unavailable` (Error, not allocated), never left out (Error and
    Unmanaged for good); once the cause is gone it is Free and Managed again
    without an administrator. Left out, CloudStack's rule would have kept
    them from allocation."""
    from gpulib import cloudstack
    from gpulib.config import Config
    from gpulib.hostview import discover_host
    from gpulib.sim import faults
    from gpulib.sim.hosts import add_sriov_gpu

    m = models()
    host = FakeHost(str(tmp_path / "host"))
    t4, pooled, stray = "0000:af:00.0", "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c00", \
        "5b2e8c1d-3a4f-4b6c-8d7e-9f0a1b2c3d4e"
    add_model(host, m["t4"], t4, 1)
    host.populate_mdev_parent(t4, m["t4"]["mdev_types"])
    vfs = add_sriov_gpu(host, m["a10"], "0000:41:00.0", 0, None, 2)
    types = {int(k): v for k, v in m["a10"]["nvidia_vf_types"].items()}
    for vf in vfs:
        host.add_nvidia_vf_types(vf, types)
    host.write_file("var/lib/gpulib/state.json", json.dumps({
        "version": 2, "allocations": {},
        "vgpus": {pooled: {"parent": t4, "type_id": "nvidia-232", "pool": "desk",
                           "on_demand": False, "created": "2026-01-01T00:00:00Z"}},
        "vf_types": {vfs[0]: {"type_id": A10_6Q, "name": "NVIDIA A10-6Q", "pool": None,
                              "on_demand": False}}}), 0o600)
    ctx = context_for_root(host.root, simulate=True)
    current = f"sys/bus/pci/devices/{vfs[0]}/nvidia/current_vgpu_type"

    def report() -> dict[str, Any]:
        # A context of its own, as each `gpulib discover` (it reads the faults).
        fresh = context_for_root(host.root, simulate=True)
        doc = cloudstack.render(discover_host(fresh, Config(), learn=False))
        check_agent_document(doc)
        return doc

    server = ManagementServer(vms=set())
    vf = lspci(vfs[0])
    server.report(report())
    assert server.allocatable(pooled) and server.allocatable(vf)
    # A T4-1B no VM holds keeps the T4-4Q from being made; the VF cannot be read.
    ctx.sysfs.write(f"sys/class/mdev_bus/{t4}/mdev_supported_types/nvidia-222/create", stray)
    faults.inject(host.root, current, "eio")
    doc = report()
    instances = {v["mdev_uuid"]: v["used_by_vm"]
                 for g in doc["gpus"] for v in g["vgpu_instances"]}
    assert instances == {pooled: cloudstack.UNAVAILABLE, stray: None}
    [a10] = [g for g in doc["gpus"] if g["pci_address"] == "41:00.0"]
    assert [(v["vf_pci_address"], v["vf_profile"], v["used_by_vm"])
            for v in a10["vf_instances"]] == [(vf, "NVIDIA A10-6Q", cloudstack.UNAVAILABLE)]
    server.report(doc)
    assert not server.allocatable(pooled) and not server.allocatable(vf)
    assert server.rows[pooled]["managed"] and server.rows[vf]["managed"]
    # The causes gone: both allocatable again, nobody had to manage them.
    ctx.sysfs.write(f"sys/bus/mdev/devices/{stray}/remove", "1")
    Path(host.root, faults.FAULTS_FILE).unlink()
    server.report(report())
    assert server.allocatable(pooled) and server.allocatable(vf)
    # The rule the report keeps to: a device left out of one report stays
    # out of allocation when it is listed again.
    doc = report()
    for g in doc["gpus"]:
        g["vgpu_instances"] = [v for v in g["vgpu_instances"] if v["mdev_uuid"] != pooled]
    server.report(doc)
    server.report(report())
    assert server.rows[pooled]["state"] == "Free" and not server.allocatable(pooled)
