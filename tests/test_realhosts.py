"""Hosts shaped like real machines, run through everything an operator and the
CloudStack agent run on them.

The facts come from real hosts (../shared/fixtures, the catalog of models):
VFs numbered oddly (offset and stride other than 1, crossing a slot or a bus,
index above 9, links with gaps or out of address order), a PF with
`sriov_totalvfs` but no VFs, mdev types without a `name` file or with a
multi-line or empty `description`, IOMMU groups holding root ports beside the
GPU and its audio function or two GPUs, PCI domains like 000f and 10000.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from gpulib import cli, cloudstack
from gpulib import doctor as dr
from gpulib.context import Context
from gpulib.entry import context_for_root
from gpulib.hooks import qemu, statechange, transformer
from gpulib.hostview import discover_host
from gpulib.occupancy import Tree
from gpulib.pci import PciAddress, virtfn_links
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import add_model, add_sriov_gpu, models
from gpulib.sysfs import Sysfs
from tests.hookrun import mdev_xml
from tests.hosts import a10_host, install_hooks, start_libvirtd, tree_contents
from tests.test_discovery import check_agent_document

VM = "i-8-1-VM"
VM_UUID = "11111111-0000-4000-8000-000000000001"
OTHER = "i-8-2-VM"
OTHER_UUID = "11111111-0000-4000-8000-000000000002"
STATE = "var/lib/gpulib/state.json"


# -- hosts ------------------------------------------------------------------------------------

def _base(root: str) -> FakeHost:
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    for mod in ("vfio", "vfio_pci", "vfio_iommu_type1", "nvidia", "kvm", "kvm_intel"):
        host.load_module(mod)
    host.write_file("etc/modprobe.d/blacklist-nouveau.conf",
                    "blacklist nouveau\noptions nouveau modeset=0\n")
    return host


def _behind_port(host: FakeHost, port: str, model: dict[str, Any], address: str, numa: int,
                 driver: Optional[str] = None) -> None:
    """One function of `model` below a root port `port`, each in an IOMMU group
    of its own (as boards with ACS make them)."""
    host.add_bridge(port, numa_node=numa, iommu_group=host.new_iommu_group())
    add_model(host, model, address, numa, parent=port, driver=driver)


A10 = "0000:3b:00.0"
A100 = "0000:5e:00.0"
T4 = "0000:b0:00.0"
V620 = "0000:c1:00.0"
A100_VGPU = "5e0a1000-0000-4000-8000-00000000000b"


def odd_vf_host(root: str) -> FakeHost:
    """VFs as real hosts number them.

    * an A10 whose 16 vendor-specific VFs start at function 4 and run over two
      slot boundaries (3b:00.4 .. 3b:02.3, virtfn10..15 past virtfn9); the
      last four carry a vGPU type;
    * an A100 with VF offset 0x100 and stride 2: its VFs are on the next bus,
      every other function, each an mdev parent, the last with a live vGPU;
    * a T4 with `sriov_totalvfs` 16 and no VF enabled (the vGPU manager never
      creates T4 VFs);
    * a V620 whose `virtfnN` links have a gap and are not in address order.
    """
    m = models()
    host = _base(root)
    _behind_port(host, "0000:3a:00.0", m["a10"], A10, 0)
    host.set_sriov_capability(A10, 32, m["a10"]["vf_device"], offset=4)
    types = {int(k): v for k, v in m["a10"]["nvidia_vf_types"].items()}
    host.enable_sriov(A10, 16, vf_driver="nvidia")
    _behind_port(host, "0000:5d:00.0", m["a100"], A100, 0)
    host.set_sriov_capability(A100, 16, m["a100"]["vf_device"], offset=0x100, stride=2)
    a100_vfs = host.enable_sriov(A100, 12, vf_driver="nvidia")
    for vf in a100_vfs:
        host.populate_mdev_parent(vf, m["a100"]["vf_mdev_types"])
    # A live vGPU on the 12th VF, on the next bus.
    host.add_mdev(A100_VGPU, a100_vfs[11], "nvidia-470")
    # The A10's last four VFs (virtfn12..15: 3b:02.0 .. 3b:02.3) carry A10-4Q,
    # which leaves the others only that type.
    vfs = [vf for _, vf in sorted(_kernel_vfs(host, A10).items())]
    for vf in vfs[12:]:
        host.add_nvidia_vf_types(vf, {}, current=593)
    for vf in vfs[:12]:
        host.add_nvidia_vf_types(vf, {593: types[593]})
    _behind_port(host, "0000:af:00.0", m["t4"], T4, 1, driver="vfio-pci")
    host.set_sriov_capability(T4, 16, 0, offset=4)
    host.add_bridge("0000:c0:01.1", numa_node=1, iommu_group=host.new_iommu_group())
    vfs = add_sriov_gpu(host, m["v620"], V620, 1, "0000:c0:01.1", 4)
    host.renumber_vfs(V620, {0: vfs[2], 1: vfs[0], 3: vfs[3], 12: vfs[1]})
    return host


def root_bus_vf_host(root: str) -> FakeHost:
    """An A10 on the root bus itself (no root port above it) whose VFs, offset
    0xfc, spill from 3b:1f.4 onto bus 3c; the two at the boundary are typed."""
    m = models()
    host = _base(root)
    add_model(host, m["a10"], A10, 0)
    host.set_sriov_capability(A10, 32, m["a10"]["vf_device"], offset=0xFC)
    types = {int(k): v for k, v in m["a10"]["nvidia_vf_types"].items()}
    a10_6q = 594
    for i, vf in enumerate(host.enable_sriov(A10, 8, vf_driver="nvidia")):
        # The VFs on either side of the bus boundary carry A10-6Q, the others
        # can only take that type now (one type per GPU while vGPUs run).
        if i in (3, 4):
            host.add_nvidia_vf_types(vf, {}, current=a10_6q)
        else:
            host.add_nvidia_vf_types(vf, {a10_6q: types[a10_6q]})
    return host


IGPU = "0000:00:02.0"


def nameless_types_host(root: str) -> FakeHost:
    """mdev types as kernels before 6.1 show them: no `name` file. A T4 with
    NVIDIA's one-line descriptions, an Intel iGPU with GVT-g's multi-line one
    and a type whose description is empty."""
    m = models()
    host = _base(root)
    host.add_function("0000:00:00.0", 0x8086, 0x3E30, 0x060000, numa_node=0,
                      iommu_group=host.new_iommu_group())
    add_model(host, m["uhd630"], IGPU, 0)
    gvt = [dict(t, name=None) for t in m["uhd630"]["mdev_types"]]
    gvt[1]["description"] = ""
    host.populate_mdev_parent(IGPU, gvt)
    _behind_port(host, "0000:af:00.0", m["t4"], T4, 1)
    host.populate_mdev_parent(T4, [dict(t, name=None) for t in m["t4"]["mdev_types"]])
    return host


RTX = "0000:41:00.0"
RTX_AUDIO = "0000:41:00.1"
MI210_A = "0000:61:00.0"
MI210_B = "0000:61:00.1"
LONE_T4 = "0000:65:00.0"


def shared_group_host(root: str) -> FakeHost:
    """IOMMU groups as boards without ACS make them: a GeForce and its HDMI
    audio function in one group with the two root ports above them (as the
    A10 node device of the catalog shows), two MI210 in one group, and a T4
    alone in its own."""
    m = models()
    host = _base(root)
    group = host.new_iommu_group()
    host.add_bridge("0000:40:03.0", numa_node=0, iommu_group=group)
    host.add_bridge("0000:40:03.1", numa_node=0, iommu_group=group)
    rtx = m["rtx3070"]
    add_model(host, rtx, RTX, 0, parent="0000:40:03.1", group=group)
    add_model(host, dict(rtx, **rtx["audio"]), RTX_AUDIO, 0, parent="0000:40:03.1",
              group=group)
    host.add_bridge("0000:60:00.0", numa_node=0, iommu_group=host.new_iommu_group())
    pair = host.new_iommu_group()
    add_model(host, m["mi210"], MI210_A, 0, parent="0000:60:00.0", group=pair,
              driver="vfio-pci")
    add_model(host, m["mi210"], MI210_B, 0, parent="0000:60:00.0", group=pair,
              driver="vfio-pci")
    _behind_port(host, "0000:64:00.0", m["t4"], LONE_T4, 0, driver="vfio-pci")
    return host


MI300X = "000f:01:00.0"
VMD_T4 = "10000:01:00.0"
NIC_AT_MANGLED = "0000:0f:01.0"


def wide_domain_host(root: str, nic_at_mangled: bool = False) -> FakeHost:
    """PCI domains other than 0000: an MI300X on domain 000f and a T4 behind an
    Intel VMD controller (domain 10000). `nic_at_mangled`: a NIC sits at
    0000:0f:01.0, the address a 4.21 agent's rendering of 000f:01:00.0 reads as."""
    m = models()
    host = _base(root)
    _behind_port(host, "000f:00:01.0", m["mi300x"], MI300X, 0)
    _behind_port(host, "10000:00:02.0", m["t4"], VMD_T4, 1, driver="vfio-pci")
    if nic_at_mangled:
        _behind_port(host, "0000:0e:00.0", m["x710"], NIC_AT_MANGLED, 0)
    return host


REAL_HOSTS: dict[str, Callable[[str], FakeHost]] = {
    "odd-vfs": odd_vf_host, "root-bus-vfs": root_bus_vf_host,
    "nameless-types": nameless_types_host, "shared-groups": shared_group_host,
    "wide-domains": wide_domain_host}


@pytest.fixture(params=sorted(REAL_HOSTS))
def real_host(request: pytest.FixtureRequest, tmp_path: Path) -> FakeHost:
    return REAL_HOSTS[request.param](str(tmp_path / request.param))


# -- running what the agent and an operator run ------------------------------------------------

def cloudstack_doc(root: str) -> dict[str, Any]:
    doc = cloudstack.render(discover_host(Context.for_root(root), learn=False))
    check_agent_document(doc)
    return doc


def gpulib(root: str, args: list[str], monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    monkeypatch.setenv("GPULIB_ROOT", root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    capsys.readouterr()
    code = cli.main(args)
    return code, capsys.readouterr().out


def transform(root: str, xml: str, monkeypatch: pytest.MonkeyPatch,
              capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The agent's call: `transform <xml>`; (exit, stdout, stderr)."""
    monkeypatch.setenv("GPULIB_ROOT", root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    capfd.readouterr()
    code = transformer.main(["libvirt-vm-xml-transformer", "transform", xml])
    out, err = capfd.readouterr()
    return code, out, err


def pci_xml(name: str, uuid: str, source: dict[str, str], managed: str = "yes") -> str:
    """A domain as the agent's LibvirtGpuDef renders a PCI GPU or VF."""
    attrs = " ".join(f"{k}='{source[k]}'" for k in ("domain", "bus", "slot", "function"))
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid><devices>"
            f"<hostdev mode='subsystem' type='pci' managed='{managed}' display='off'>"
            f"<driver name='vfio'/><source><address {attrs}/></source></hostdev>"
            "</devices></domain>")



def agent421_source(address: str) -> dict[str, str]:
    """CloudStack 4.21's (and 4.22.0's) LibvirtGpuDef: `dddd:bb:ss.f` split on
    ':' into bus and slot, the domain fixed at 0x0000 and the function left at
    its default 0x0 (the fixtures' README); a domain 0000 address reaches the
    agent as `bb:ss.f`, which it renders right."""
    if address.startswith("0000:"):
        return PciAddress.parse(address).libvirt()
    d, b, _sf = address.split(":")  # the slot and the function are lost
    return {"domain": "0x0000", "bus": f"0x{d}", "slot": f"0x{b}", "function": "0x0"}


def offered_free(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, XML) the agent would start for each device the report offers free,
    in every rendering a known agent version produces."""
    out = []
    for g in doc["gpus"]:
        fp = g["full_passthrough"]
        if fp["enabled"] == 1 and fp["used_by_vm"] is None:
            out.append((f"{g['pci_address']} whole", pci_xml(VM, VM_UUID, fp["libvirt_address"])))
            if fp["libvirt_address"]["domain"] != "0x0000":
                out.append((f"{g['pci_address']} whole (4.21)",
                            pci_xml(VM, VM_UUID, agent421_source(g["pci_address"]))))
        for v in g["vgpu_instances"]:
            if v["used_by_vm"] is None:
                out.append((f"vGPU {v['mdev_uuid']}", mdev_xml(VM, VM_UUID, v["mdev_uuid"])))
        for vf in g["vf_instances"]:
            if vf["used_by_vm"] is None:
                for managed in ("no", "yes"):
                    out.append((f"VF {vf['vf_pci_address']} managed={managed}",
                                pci_xml(VM, VM_UUID, vf["libvirt_address"], managed)))
    return out


def source_addresses(xml: str) -> list[PciAddress]:
    dom = etree.fromstring(xml.encode())
    return [PciAddress.from_libvirt(a.get("domain"), a.get("bus"), a.get("slot"),
                                    a.get("function"))
            for a in dom.findall("devices/hostdev[@type='pci']/source/address")]


def class_of(host: FakeHost, address: PciAddress) -> int:
    with open(host.p(f"sys/bus/pci/devices/{address}/class")) as fh:
        return int(fh.read(), 16)


# -- discovery: every GPU, VFs under the right PF at the right addresses -----------------------

def _kernel_vfs(host: FakeHost, pf: str) -> dict[int, str]:
    """index -> VF address, from the PF's virtfnN links as the kernel made them."""
    d = host.device_dir(pf)
    return {int(n[6:]): os.path.basename(os.readlink(os.path.join(d, n)))
            for n in os.listdir(d) if n.startswith("virtfn")}


def test_vfs_are_found_under_their_pf_at_the_kernels_addresses(tmp_path: Path) -> None:
    host = odd_vf_host(str(tmp_path / "h"))
    native = discover_host(Context.for_root(host.root), learn=False)
    for pf in (A10, A100, V620):
        gpu = native.gpu(PciAddress.parse(pf))
        assert gpu is not None, pf
        assert {vf.index: str(vf.address) for vf in gpu.vfs} == _kernel_vfs(host, pf)
        # VFs never show up as GPUs of their own.
        assert not {str(vf.address) for vf in gpu.vfs} & {str(g.address) for g in native.gpus}
    a10 = native.gpu(PciAddress.parse(A10))
    assert a10 is not None
    assert [str(vf.address) for vf in a10.vfs][9:12] == [
        "0000:3b:01.5", "0000:3b:01.6", "0000:3b:01.7"], "virtfn10 follows virtfn9"
    a100 = native.gpu(PciAddress.parse(A100))
    assert a100 is not None
    assert [str(vf.address) for vf in a100.vfs][:3] == [
        "0000:5f:00.0", "0000:5f:00.2", "0000:5f:00.4"]
    v620 = native.gpu(PciAddress.parse(V620))
    assert v620 is not None
    assert [(vf.index, str(vf.address)) for vf in v620.vfs] == [
        (0, "0000:c1:00.3"), (1, "0000:c1:00.1"), (3, "0000:c1:00.4"), (12, "0000:c1:00.2")]
    assert virtfn_links(Context.for_root(host.root).sysfs, PciAddress.parse(T4)) == []
    doc = cloudstack_doc(host.root)
    t4 = next(g for g in doc["gpus"] if g["pci_address"] == "b0:00.0")
    assert (t4["sriov_totalvfs"], t4["sriov_numvfs"], t4["full_passthrough"]["enabled"]) == \
        (16, 0, 1)


@settings(max_examples=12, deadline=None)
@given(offset=st.integers(1, 0x180), stride=st.integers(1, 3), numvfs=st.integers(1, 20),
       on_root_bus=st.booleans(), order=st.randoms(use_true_random=False))
def test_any_vf_numbering_is_read_as_the_links_say(tmp_path_factory: pytest.TempPathFactory,
                                                   offset: int, stride: int, numvfs: int,
                                                   on_root_bus: bool, order: Any) -> None:
    """Whatever the routing-ID arithmetic and the virtfnN links (gaps, out of
    address order, above 9), discovery lists exactly the linked VFs under
    their PF in index order, the report offers each at its own address, and
    the PF is neither a GPU twice nor offered whole."""
    m = models()["v620"]
    host = _base(str(tmp_path_factory.mktemp("vfs") / "h"))
    parent = None if on_root_bus else "0000:20:01.0"
    if parent:
        host.add_bridge(parent, numa_node=0, iommu_group=host.new_iommu_group())
    add_model(host, m, "0000:21:00.0", 0, parent=parent)
    host.set_sriov_capability("0000:21:00.0", 32, m["vf_device"], offset=offset, stride=stride)
    vfs = host.enable_sriov("0000:21:00.0", numvfs, vf_driver="vfio-pci")
    indices = order.sample(range(2 * numvfs), numvfs)
    order.shuffle(vfs)
    links = dict(zip(indices, vfs))
    host.renumber_vfs("0000:21:00.0", links)
    inv = discover_host(Context.for_root(host.root), learn=False)
    assert [str(g.address) for g in inv.gpus] == ["0000:21:00.0"]
    assert [(vf.index, str(vf.address)) for vf in inv.gpus[0].vfs] == sorted(links.items())
    [g] = cloudstack.render(inv)["gpus"]
    assert [vf["libvirt_address"] for vf in g["vf_instances"]] == [
        PciAddress.parse(links[i]).libvirt() for i in sorted(links)]
    assert g["full_passthrough"]["enabled"] == 0 and g["sriov_numvfs"] == numvfs


def test_vfs_past_the_root_bus_sit_beside_their_pf(tmp_path: Path) -> None:
    """The kernel puts VFs whose routing IDs pass the PF's bus on a bus of their
    own, below the same host bridge: sys/devices/pci0000:3b/0000:3c:00.0."""
    host = root_bus_vf_host(str(tmp_path / "h"))
    vfs = _kernel_vfs(host, A10)
    assert vfs[3] == "0000:3b:1f.7" and vfs[4] == "0000:3c:00.0"
    for vf in vfs.values():
        assert os.path.dirname(host.device_dir(vf)) == host.p("sys/devices/pci0000:3b")
    assert not os.path.exists(host.p("sys/devices/pci0000:3c"))
    gpu = discover_host(Context.for_root(host.root), learn=False).gpu(PciAddress.parse(A10))
    assert gpu is not None and [str(vf.address) for vf in gpu.vfs] == [vfs[i] for i in sorted(vfs)]


def test_reports_of_every_real_host_keep_the_contract(real_host: FakeHost,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    root = real_host.root
    code, out = gpulib(root, ["discover", "--format", "cloudstack"], monkeypatch, capsys)
    assert code == 0
    doc = json.loads(out)
    check_agent_document(doc)
    code, out = gpulib(root, ["discover", "--format", "json"], monkeypatch, capsys)
    assert code == 0
    native = json.loads(out)
    assert [g["pci_address"] for g in doc["gpus"]] == \
        [PciAddress.parse(g["address"]).lspci for g in native["gpus"]]
    for g, n in zip(doc["gpus"], native["gpus"]):
        a = PciAddress.parse(n["address"])
        # Domains as lspci prints them: 4 digits at least, left out when 0000.
        assert g["pci_address"] == (f"{a.bus:02x}:{a.slot:02x}.{a.function:x}" if not a.domain
                                    else f"{a.domain:04x}:{a.bus:02x}:{a.slot:02x}."
                                         f"{a.function:x}")
        assert g["full_passthrough"]["libvirt_address"] == a.libvirt()
        assert n["errors"] == []
    code, out = gpulib(root, ["status", "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)
    # Replayed from its snapshot, the host reads the same.
    tarball = str(Path(root).parent / "snapshot.tar.gz")
    code, out = gpulib(root, ["snapshot", "-o", tarball], monkeypatch, capsys)
    assert code == 0, out
    replay = Path(root).parent / "replay"
    replay.mkdir()
    with tarfile.open(tarball) as tar:
        tar.extractall(replay)
    code, out = gpulib(str(replay), ["discover", "--format", "json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out) == native
    # A correct report is not a doctor failure, whatever the host's layout.
    install_hooks(real_host)
    start_libvirtd(real_host)
    report = dr.run(Context.for_root(root))
    assert [r.to_json() for r in report.results_for("discovery")
            if r.status != "ok"] == []


def test_the_groups_discovery_hands_the_occupancy_are_those_it_would_read(
        real_host: FakeHost) -> None:
    """Discovery tells the occupancy each GPU's and VF's IOMMU group (the
    link it read already): the answer a tree reading the links gives."""
    inventory = discover_host(Context.for_root(real_host.root), learn=False)
    fresh = Tree(Sysfs(real_host.root))
    nodes = [str(a) for g in inventory.gpus for a in (g.address, *(vf.address for vf in g.vfs))]
    assert nodes
    assert [inventory.occupancy.tree.group(n) for n in nodes] == [fresh.group(n) for n in nodes]
    assert any(fresh.group(n) is not None for n in nodes)


def test_doctor_accepts_a_split_gpu_that_offers_nothing_yet(tmp_path: Path) -> None:
    """An A10 whose vendor VFs are enabled but untyped offers no instance and is
    not offered whole either (`enabled` 0): that report is right, not a bug."""
    host = a10_host(str(tmp_path))
    install_hooks(host)
    start_libvirtd(host)
    doc = cloudstack_doc(host.root)
    a10 = next(g for g in doc["gpus"] if g["pci_address"] == "41:00.0")
    assert a10["vf_instances"] == [] and a10["full_passthrough"]["enabled"] == 0
    report = dr.run(Context.for_root(host.root))
    assert [r.to_json() for r in report.results_for("discovery") if r.status != "ok"] == []
    # A report offering a split GPU whole is still caught.
    from gpulib.doctor.discovery import agent_document_problems

    a10["full_passthrough"]["enabled"] = 1
    assert [s for s, _ in agent_document_problems(doc)] == ["41:00.0"]


def test_device_list_columns_line_up_whatever_the_address_width(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A T4 behind an Intel VMD (domain 10000) has a longer address than the
    MI300X on domain 000f: every column of `gpulib device list` still starts
    at one place, just past the longest address."""
    host = wide_domain_host(str(tmp_path / "h"))
    assert gpulib(host.root, ["device", "unmanage", MI300X], monkeypatch, capsys)[0] == 0
    code, out = gpulib(host.root, ["device", "list"], monkeypatch, capsys)
    assert code == 0
    lines = out.splitlines()
    cells = [line.split(None, 3) for line in lines]  # address, kind, flag, device
    assert [c[:3] for c in cells] == [[MI300X, "gpu", "UNMANAGED"], [VMD_T4, "gpu", "managed"]]
    starts = []
    for line, row in zip(lines, cells):
        at, where = 0, []
        for cell in row:
            at = line.index(cell, at)
            where.append(at)
            at += len(cell)
        starts.append(where)
    assert starts[0] == starts[1]
    assert starts[0][1] == len(VMD_T4) + 2


# -- the agent starts what the report offers -------------------------------------------------

def test_every_device_offered_free_is_accepted_and_prepared(real_host: FakeHost,
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capfd: pytest.CaptureFixture[str]
                                                           ) -> None:
    """Each device the report offers free, in each agent's rendering, one
    after the other on one copy of the host: the transformer accepts it,
    bridges never go to the guest, libvirt's `prepare begin` accepts the
    result, and the stop hooks leave sysfs as they found it (so each start
    finds the host as the report described it)."""
    offered = offered_free(cloudstack_doc(real_host.root))
    assert offered
    root = str(tmp_path / "copy")
    shutil.copytree(real_host.root, root, symlinks=True)
    host = FakeHost(root)
    before = tree_contents(root)
    for what, xml in offered:
        code, out, err = transform(root, xml, monkeypatch, capfd)
        assert (code, err) == (0, ""), (what, err)
        for a in source_addresses(out):
            assert class_of(host, a) >> 16 != 0x06, (what, f"bridge {a} given to the guest")
        capfd.readouterr()
        monkeypatch.setattr("sys.stdin", _Stdin(out))
        assert qemu.main(["gpulib-qemu-hook", VM, "prepare", "begin", "-"]) == 0, \
            (what, capfd.readouterr().err)
        status = out.replace("<domain type='kvm'>", "<domain type='kvm' id='3'>", 1)
        host.write_file(f"run/libvirt/qemu/{VM}.xml",
                        "<domstatus state='running' pid='4711'>\n" + status + "</domstatus>\n")
        assert statechange.main(["libvirt-vm-state-change", "onStart", VM]) == 0
        held = json.loads(Path(root, STATE).read_text())["allocations"][VM]
        assert held["status"] == "active", what
        host.stop_domain(VM)
        assert statechange.main(["libvirt-vm-state-change", "onStop", VM]) == 0
        assert VM not in json.loads(Path(root, STATE).read_text())["allocations"]
        after = tree_contents(root)
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)
                   and not k.startswith(("var/lib/gpulib", "run/"))}
        assert changed == set(), (what, sorted(changed))


class _Stdin:
    """sys.stdin for an in-process hook: text and its bytes buffer."""

    def __init__(self, text: str) -> None:
        import io

        self.buffer = io.BytesIO(text.encode())
        self._text = io.StringIO(text)

    def read(self, n: int = -1) -> str:
        return self._text.read(n)

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("no file descriptor")


# -- CloudStack 4.21's rendering of PCI domains other than 0000 --------------------------------

@pytest.mark.parametrize("gpu", [MI300X, VMD_T4])
def test_agent421_rendering_of_a_wide_domain_is_repaired(tmp_path: Path, gpu: str,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]
                                                        ) -> None:
    """4.21 writes 000f:01:00.0 as bus='0x000f' slot='0x01' (which reads as the
    valid 0000:0f:01.0) and 10000:01:00.0 as bus='0x10000': the bus's four or
    more hex digits give it away, whatever the slot."""
    host = wide_domain_host(str(tmp_path / "h"), nic_at_mangled=True)
    code, out, err = transform(host.root, pci_xml(VM, VM_UUID, agent421_source(gpu)),
                               monkeypatch, capfd)
    assert (code, err) == (0, "")
    assert source_addresses(out) == [PciAddress.parse(gpu)]
    assert [d["id"] for d in json.loads(Path(host.root, STATE).read_text())
            ["allocations"][VM]["devices"]] == [gpu]


def test_agent421_rendering_never_hands_over_the_device_it_misreads_as(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A GPU at 000f:01:00.0 and another at 0000:0f:01.0: 4.21's rendering of
    the first reads as the second, so it is ambiguous and refused."""
    host = wide_domain_host(str(tmp_path / "h"))
    _behind_port(host, "0000:0e:00.0", models()["t4"], NIC_AT_MANGLED, 0, driver="vfio-pci")
    before = tree_contents(host.root)
    code, out, err = transform(host.root, pci_xml(VM, VM_UUID, agent421_source(MI300X)),
                               monkeypatch, capfd)
    assert code == 2 and out == ""
    assert "CloudStack 4.21 agent bug" in err and "2 GPU functions" in err
    assert tree_contents(host.root) == before


def test_qemu_hook_refuses_a_421_rendering_libvirt_would_misread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Without the transformer's repair libvirt would give the VM the NIC at
    0000:0f:01.0: `prepare begin` stops that start."""
    host = wide_domain_host(str(tmp_path / "h"), nic_at_mangled=True)
    before = tree_contents(host.root)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    monkeypatch.setattr("sys.stdin", _Stdin(pci_xml(VM, VM_UUID, agent421_source(MI300X))))
    capfd.readouterr()
    assert qemu.main(["gpulib-qemu-hook", VM, "prepare", "begin", "-"]) == 2
    err = capfd.readouterr().err
    assert f"names {NIC_AT_MANGLED}, not the GPU {MI300X}" in err
    assert "CloudStack 4.21 agent bug" in err
    assert tree_contents(host.root) == before


# -- IOMMU groups: what goes along with a passthrough GPU --------------------------------------

def test_group_peers_go_along_but_bridges_and_other_gpus_do_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    host = shared_group_host(str(tmp_path / "h"))
    code, out, err = transform(host.root, pci_xml(VM, VM_UUID, PciAddress.parse(RTX).libvirt()),
                               monkeypatch, capfd)
    assert (code, err) == (0, "")
    # The HDMI audio function goes along; the root ports of its group stay.
    assert source_addresses(out) == [PciAddress.parse(RTX), PciAddress.parse(RTX_AUDIO)]
    # The second MI210 of a shared group is a GPU of its own that the agent
    # tracks: the VM gets the one it was given, and the other is kept from
    # everyone else while it runs (vfio gives a group to one VM).
    code, out, err = transform(host.root, pci_xml(OTHER, OTHER_UUID,
                                                  PciAddress.parse(MI210_A).libvirt()),
                               monkeypatch, capfd)
    assert (code, err) == (0, "")
    assert source_addresses(out) == [PciAddress.parse(MI210_A)]
    doc = cloudstack_doc(host.root)
    users = {g["pci_address"]: g["full_passthrough"]["used_by_vm"] for g in doc["gpus"]}
    assert users == {"41:00.0": VM, "61:00.0": OTHER, "61:00.1": OTHER, "65:00.0": None}
    code, out, err = transform(host.root, pci_xml("i-8-3-VM", VM_UUID.replace("1", "3"),
                                                  PciAddress.parse(MI210_B).libvirt()),
                               monkeypatch, capfd)
    assert code == 1 and f"in use by starting VM {OTHER}" in err


def test_sibling_vfs_of_one_group_are_not_handed_over_with_a_vf(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A multi-function MxGPU card without ACS: the PF and its VFs (functions
    1-4 of its slot) in one IOMMU group. A VF given to a VM takes no sibling
    VF along; the siblings are kept from other VMs while it runs."""
    host = odd_vf_host(str(tmp_path / "h"))
    group = int(os.path.basename(os.readlink(os.path.join(host.device_dir(V620),
                                                           "iommu_group"))))
    vfs = [vf for _, vf in sorted(_kernel_vfs(host, V620).items())]
    for vf in vfs:
        host.set_iommu_group(vf, group)
    code, out, err = transform(host.root, pci_xml(VM, VM_UUID, PciAddress.parse(vfs[0]).libvirt(),
                                                  "no"), monkeypatch, capfd)
    assert (code, err) == (0, "")
    assert source_addresses(out) == [PciAddress.parse(vfs[0])]
    doc = cloudstack_doc(host.root)
    v620 = next(g for g in doc["gpus"] if g["pci_address"] == "c1:00.0")
    assert {vf["used_by_vm"] for vf in v620["vf_instances"]} == {VM}
    code, out, err = transform(host.root, pci_xml(OTHER, OTHER_UUID,
                                                  PciAddress.parse(vfs[1]).libvirt(), "no"),
                               monkeypatch, capfd)
    assert code == 1 and f"in use by starting VM {VM}" in err


def test_attach_and_detach_keep_the_gpus_of_a_shared_group_apart(tmp_path: Path) -> None:
    """Plain libvirt (`gpulib attach/detach`): the same rule as the agent's start."""
    from gpulib.attach import Wanted, plan_attach, plan_detach
    from gpulib.config import Config

    host = shared_group_host(str(tmp_path / "h"))
    ctx, config = context_for_root(host.root, simulate=True), Config()
    xml = FakeHost.domain_xml(VM, VM_UUID)
    xml = plan_attach(ctx, config, xml, Wanted(gpu=MI210_A)).after
    assert source_addresses(xml) == [PciAddress.parse(MI210_A)]
    xml = plan_attach(ctx, config, xml, Wanted(gpu=RTX)).after
    xml = plan_attach(ctx, config, xml, Wanted(gpu=MI210_B)).after
    assert source_addresses(xml) == [PciAddress.parse(a)
                                     for a in (MI210_A, RTX, RTX_AUDIO, MI210_B)]
    # Detaching one MI210 leaves the other; detaching the GeForce takes its audio.
    xml = plan_detach(ctx, config, xml, [MI210_A]).after
    xml = plan_detach(ctx, config, xml, [RTX]).after
    assert source_addresses(xml) == [PciAddress.parse(MI210_B)]


# -- mdev types without a name ------------------------------------------------------------------

def test_a_pool_takes_the_profile_the_report_shows_for_a_nameless_type(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without a `name` file the report's profile is the type id; a pool that
    names that profile is served as the agent's request for it is."""
    host = nameless_types_host(str(tmp_path / "h"))
    doc = cloudstack_doc(host.root)
    t4 = next(g for g in doc["gpus"] if g["pci_address"] == "b0:00.0")
    assert t4["full_passthrough"]["enabled"] == 1
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool t4]\nparents = 10de:1eb8\nprofile = nvidia-223\nper_parent = 2\n")
    code, out = gpulib(host.root, ["pool", "apply"], monkeypatch, capsys)
    assert code == 0, out
    doc = cloudstack_doc(host.root)
    t4 = next(g for g in doc["gpus"] if g["pci_address"] == "b0:00.0")
    assert [v["profile_name"] for v in t4["vgpu_instances"]] == ["nvidia-223", "nvidia-223"]
    assert t4["full_passthrough"]["enabled"] == 0
    assert [v["max_instances"] for v in t4["vgpu_instances"]] == [8, 8]
    igpu = next(g for g in doc["gpus"] if g["pci_address"] == "00:02.0")
    assert igpu["full_passthrough"]["enabled"] == 1


def test_vgpus_of_nameless_and_multiline_types_go_round(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]
                                                        ) -> None:
    """mdev create, list, the agent's start and stop, then mdev remove, on the
    GVT-g type with a multi-line description and the one with an empty one."""
    host = nameless_types_host(str(tmp_path / "h"))
    before = tree_contents(host.root)
    made = []
    for type_id in ("i915-GVTg_V5_8", "i915-GVTg_V5_4"):
        code, out = gpulib(host.root, ["mdev", "create", "--parent", IGPU, "--type", type_id],
                           monkeypatch, capfd)
        assert code == 0, out
        made.append(out.strip())
    code, out = gpulib(host.root, ["mdev", "list", "--json"], monkeypatch, capfd)
    assert sorted((m["uuid"], m["type_id"], m["live"]) for m in json.loads(out)) == sorted(
        [(made[0], "i915-GVTg_V5_8", True), (made[1], "i915-GVTg_V5_4", True)])
    doc = cloudstack_doc(host.root)
    igpu = next(g for g in doc["gpus"] if g["pci_address"] == "00:02.0")
    assert {v["mdev_uuid"]: (v["profile_name"], v["max_resolution_x"])
            for v in igpu["vgpu_instances"]} == {
        made[0]: ("i915-GVTg_V5_8", 1024), made[1]: ("i915-GVTg_V5_4", None)}
    capfd.readouterr()
    for uuid in made:
        code, _, err = transform(host.root, mdev_xml(VM, VM_UUID, uuid), monkeypatch, capfd)
        assert (code, err) == (0, "")
        # libvirt prepares that start, which fails: its release end ends it.
        monkeypatch.setattr("sys.stdin", _Stdin(mdev_xml(VM, VM_UUID, uuid)))
        assert qemu.main(["gpulib-qemu-hook", VM, "prepare", "begin", "-"]) == 0
        monkeypatch.setattr("sys.stdin", _Stdin(""))
        assert qemu.main(["gpulib-qemu-hook", VM, "release", "end", "-"]) == 0
        code, out = gpulib(host.root, ["mdev", "remove", uuid], monkeypatch, capfd)
        assert code == 0, out
    after = tree_contents(host.root)
    assert {k for k in set(before) | set(after) if before.get(k) != after.get(k)
            and k.startswith("sys/")} == set()
