from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulib import cloudstack, report
from gpulib.cli import inventory
from gpulib.config import Config
from gpulib.context import Context
from gpulib.discovery import discover
from gpulib.entry import context_for_root
from gpulib.hostview import attach_type_numbers, discover_host
from gpulib.pci import group_number
from gpulib.sim import faults
from gpulib.sim.fakehost import FakeHost
from gpulib.sysfs import Sysfs
from tests import handmade, hookrun
from tests.conftest import GOLDEN
from tests.hookrun import hook_env
from tests.hosts import demo_host, t4_host

# -- the agent's parsing rules ---------------------------------------------------------

ADDRESS_KEYS = {"domain", "bus", "slot", "function"}


def check_libvirt_address(a: Any) -> None:
    assert set(a) == ADDRESS_KEYS
    for k in ADDRESS_KEYS:
        assert isinstance(a[k], str) and a[k].startswith("0x"), a


def check_number_or_null(v: Any) -> None:
    assert v is None or (isinstance(v, int) and not isinstance(v, bool)), v


def check_agent_document(doc: Any) -> None:
    """What CloudStack's KVM agent requires of gpudiscovery.sh output."""
    assert set(doc) == {"gpus"}
    for g in doc["gpus"]:
        for key in ("pci_address", "vendor_id", "device_id", "vendor", "device", "driver",
                    "pci_class", "iommu_group", "pci_root"):
            assert isinstance(g[key], str), (key, g[key])
        assert len(g["vendor_id"]) == 4 and g["vendor_id"] == g["vendor_id"].lower()
        assert len(g["device_id"]) == 4 and g["device_id"] == g["device_id"].lower()
        for key in ("numa_node", "sriov_totalvfs", "sriov_numvfs"):
            assert isinstance(g[key], int) and not isinstance(g[key], bool)
        for key in ("max_instances", "video_ram", "max_heads", "max_resolution_x",
                    "max_resolution_y"):
            check_number_or_null(g[key])
        fp = g["full_passthrough"]
        # getAsInt: a JSON number 0 or 1, never true/false
        assert type(fp["enabled"]) is int and fp["enabled"] in (0, 1)
        check_libvirt_address(fp["libvirt_address"])
        assert fp["used_by_vm"] is None or isinstance(fp["used_by_vm"], str)
        for v in g["vgpu_instances"]:
            assert isinstance(v["mdev_uuid"], str) and isinstance(v["profile_name"], str)
            for key in ("max_instances", "video_ram", "max_heads", "max_resolution_x",
                        "max_resolution_y"):
                check_number_or_null(v[key])
            check_libvirt_address(v["libvirt_address"])
        for vf in g["vf_instances"]:
            assert isinstance(vf["vf_pci_address"], str)
            assert isinstance(vf["vf_profile"], str) and vf["vf_profile"]
            check_libvirt_address(vf["libvirt_address"])
        # Whole only without vGPU use and without enabled VFs (offered or not: an
        # untyped vendor VF is not offered, yet the GPU is split).
        expected_enabled = 1 if not g["vgpu_instances"] and not g["vf_instances"] \
            and not g["sriov_numvfs"] else 0
        assert fp["enabled"] == expected_enabled


def cloudstack_doc(root: str, config: Optional[Config] = None) -> dict[str, Any]:
    ctx = Context.for_root(root)
    doc = json.loads(cloudstack.dumps(discover_host(ctx, config)))
    check_agent_document(doc)
    return doc


def by_address(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["pci_address"]: g for g in doc["gpus"]}


# -- a tree gpulib did not build -------------------------------------------------------

@pytest.fixture
def handmade_root(tmp_path: Path) -> str:
    root = str(tmp_path / "hand")
    handmade.build(root)
    return root


def test_handmade_tree_reports_exactly_its_gpus(handmade_root: str) -> None:
    gpus = by_address(cloudstack_doc(handmade_root))
    # No BMC VGA (ASPEED, Matrox), no NIC, no audio, no Gaudi, no VF as a GPU.
    assert sorted(gpus) == ["0001:d6:00.0", "0001:e6:00.0", "65:00.0", "82:00.0", "ca:00.0"]


def test_pci_domain_0001_is_written_with_its_domain(handmade_root: str) -> None:
    g = by_address(cloudstack_doc(handmade_root))["0001:d6:00.0"]
    assert g["full_passthrough"]["libvirt_address"] == {
        "domain": "0x0001", "bus": "0xd6", "slot": "0x00", "function": "0x0"}
    assert g["pci_class"] == "Display controller [0380]"
    assert g["pci_root"] == "0001:d5:00.0"
    assert g["numa_node"] == 1
    # named by a defined (not running) domain only: not a user, free for anyone
    assert g["full_passthrough"]["used_by_vm"] is None
    accel = by_address(cloudstack_doc(handmade_root))["0001:e6:00.0"]
    assert accel["pci_class"] == "Processing accelerators [1200]"
    assert accel["full_passthrough"]["used_by_vm"] is None


def test_mdev_on_vf_numbers_come_from_the_type_description(handmade_root: str) -> None:
    g = by_address(cloudstack_doc(handmade_root))["ca:00.0"]
    assert g["vf_instances"] == []  # its VFs offer mdev types: their mdevs are the instances
    [v] = g["vgpu_instances"]
    assert v["mdev_uuid"] == "0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
    assert (v["profile_name"], v["max_instances"], v["video_ram"], v["max_heads"],
            v["max_resolution_x"], v["max_resolution_y"]) == ("GRID A100-8C", 5, 8192, 1,
                                                              4096, 2160)
    assert v["libvirt_address"]["function"] == "0x5"
    assert v["used_by_vm"] == "vm-running"
    assert g["full_passthrough"]["enabled"] == 0


def test_vendor_vfs_in_virtfn_order_with_profile_from_current_type(handmade_root: str) -> None:
    g = by_address(cloudstack_doc(handmade_root))["82:00.0"]
    addrs = [vf["vf_pci_address"] for vf in g["vf_instances"]]
    # Untyped vendor VFs (type 0, no record, no pool) are not offered: the hooks
    # would refuse them (no type to give).
    assert addrs == ["82:00.4"]
    first = g["vf_instances"][0]
    assert first["vf_profile"] == "NVIDIA L40S-6Q"
    assert first["video_ram"] == 6144
    assert first["used_by_vm"] == "vm-running"
    assert g["sriov_numvfs"] == 11 and g["full_passthrough"]["enabled"] == 0


def test_passthrough_gpu_used_by_running_vm(handmade_root: str) -> None:
    g = by_address(cloudstack_doc(handmade_root))["65:00.0"]
    assert g["full_passthrough"] == {
        "enabled": 1, "used_by_vm": "vm-running",
        "libvirt_address": {"domain": "0x0000", "bus": "0x65", "slot": "0x00",
                            "function": "0x0"}}
    assert (g["vendor"], g["device"]) == ("Vendor 10de", "Device 2484")
    assert g["iommu_group"] == "7"


def test_config_include_and_exclude(handmade_root: str, tmp_path: Path) -> None:
    conf = tmp_path / "gpulib.conf"
    conf.write_text("[discovery]\ninclude = 0000:03:00.0\nexclude = 10de:26b9, 0000:65:00.0\n")
    gpus = by_address(cloudstack_doc(handmade_root, Config.load(str(conf))))
    assert "03:00.0" in gpus and "82:00.0" not in gpus and "65:00.0" not in gpus


# -- names ------------------------------------------------------------------------------

def test_names_from_udev_database_win_over_pci_ids(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    host.write_file("run/udev/data/+pci:0000:3b:00.0",
                    "E:ID_VENDOR_FROM_DATABASE=NVIDIA Corp. (udev)\n"
                    "E:ID_MODEL_FROM_DATABASE=Tesla T4 (udev)\n")
    [g] = cloudstack_doc(host.root)["gpus"]
    assert (g["vendor"], g["device"]) == ("NVIDIA Corp. (udev)", "Tesla T4 (udev)")


def test_names_from_pci_ids_under_the_root(tmp_path: Path) -> None:
    [g] = cloudstack_doc(t4_host(str(tmp_path)).root)["gpus"]
    assert (g["vendor"], g["device"]) == ("NVIDIA Corporation", "TU104GL [Tesla T4]")


# -- partial failures never empty the report -------------------------------------------

def test_unreadable_attribute_degrades_only_that_device(handmade_root: str) -> None:
    faults.inject(handmade_root, "sys/bus/pci/devices/0000:ca:00.0/sriov_totalvfs", "eacces")
    ctx = context_for_root(handmade_root, simulate=True)
    inv = discover_host(ctx)
    assert len(inv.gpus) == 5
    broken = next(g for g in inv.gpus if str(g.address) == "0000:ca:00.0")
    assert broken.errors and "sriov_totalvfs: Permission denied" in broken.errors[0]
    assert all(not g.errors for g in inv.gpus if g is not broken)
    check_agent_document(cloudstack.render(inv))


def test_device_vanishing_mid_scan(handmade_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpulib import discovery
    real = discovery.list_addresses

    def listing_then_vanish(sysfs: Sysfs) -> Any:
        out = real(sysfs)
        shutil.rmtree(os.path.realpath(os.path.join(handmade_root,
                                                    "sys/bus/pci/devices/0000:65:00.1")))
        os.unlink(os.path.join(handmade_root, "sys/bus/pci/devices/0000:65:00.0"))
        return out

    monkeypatch.setattr(discovery, "list_addresses", listing_then_vanish)
    doc = cloudstack_doc(handmade_root)
    assert "ca:00.0" in by_address(doc) and "82:00.0" in by_address(doc)


def _pci_ids_subclasses(path: Path) -> dict[int, str]:
    """The class names of a pci.ids file (`C 03` then `\t02  3D controller`),
    the database lspci names classes from: 16-bit code -> name."""
    out: dict[int, str] = {}
    base: Optional[int] = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("C "):
            base = int(line[2:4], 16)
        elif base is not None and line.startswith("\t") and not line.startswith("\t\t"):
            code, _, name = line[1:].partition("  ")
            out[(base << 8) | int(code, 16)] = name.strip()
        elif line and not line.startswith(("\t", "#")):
            base = None
    return out


def test_pci_class_is_written_as_the_stock_script_writes_it(handmade_root: str) -> None:
    """The class field of `lspci -nnm` (the stock gpudiscovery.sh copies it):
    the class's name from pci.ids and its 4 hex digits in brackets."""
    assert cloudstack.pci_class(0x0302) == "3D controller [0302]"
    assert cloudstack.pci_class(0x0300) == "VGA compatible controller [0300]"
    assert cloudstack.pci_class(0xFF00) == "Class [ff00]"  # lspci's word for no name
    ids = Path("/usr/share/misc/pci.ids")
    if ids.exists():  # the names are pci.ids' (lspci's database) for every GPU class
        names = _pci_ids_subclasses(ids)
        for code in (0x0300, 0x0301, 0x0302, 0x0380, 0x1200):
            assert cloudstack.pci_class(code) == f"{names[code]} [{code:04x}]"
    for address, g in by_address(cloudstack_doc(handmade_root)).items():
        full = address if address.count(":") == 2 else f"0000:{address}"
        with open(os.path.join(handmade_root, "sys/bus/pci/devices", full, "class")) as fh:
            code = int(fh.read(), 16) >> 8
        assert g["pci_class"] == cloudstack.pci_class(code), address
        assert re.fullmatch(r".+ \[[0-9a-f]{4}\]", g["pci_class"]), g["pci_class"]


# -- golden output of the sample host -----------------------------------------------------

@pytest.mark.parametrize("fmt", ["cloudstack", "json"])
def test_demo_host_golden(tmp_path: Path, fmt: str, regen_golden: bool) -> None:
    host = demo_host(str(tmp_path))
    inv = discover_host(Context.for_root(host.root), learn=False)
    # The numbers of the A10's and L40S's types, from the demo's nvidia-smi.
    attach_type_numbers(inv, host.root)
    doc = cloudstack.render(inv) if fmt == "cloudstack" else report.document(inv)
    text = json.dumps(doc, indent=2) + "\n"
    golden = GOLDEN / "discovery" / f"demo-{fmt}.json"
    if regen_golden:
        golden.write_text(text)
    assert text == golden.read_text()
    if fmt == "cloudstack":
        check_agent_document(doc)


def test_demo_host_reports_registry_vgpus_after_reboot(tmp_path: Path) -> None:
    host = demo_host(str(tmp_path))
    gpus = by_address(cloudstack_doc(host.root))
    t4 = gpus["af:00.0"]
    assert sorted(v["mdev_uuid"] for v in t4["vgpu_instances"]) == sorted(
        ["6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d", "a3d5f7e9-1b2c-4d6e-8f0a-2c4e6a8b0d13"])
    assert gpus["41:00.0"]["vf_instances"][0]["vf_profile"] == "NVIDIA A10-6Q"
    assert "02:00.0" not in gpus and "18:00.0" not in gpus and "3b:00.1" not in gpus


def test_table_lists_every_gpu(tmp_path: Path) -> None:
    host = demo_host(str(tmp_path))
    inv = discover_host(Context.for_root(host.root), learn=False)
    lines = report.table(inv).splitlines()
    assert lines[0].startswith("ADDRESS")
    assert len(lines) == 1 + len(inv.gpus)


# -- properties over random hosts -------------------------------------------------------

gpu_specs = st.lists(st.tuples(st.integers(0, 6),            # VFs
                               st.booleans(),                # mdev types on the VFs
                               st.integers(0, 3),            # live mdevs
                               st.sampled_from([0x030000, 0x030200, 0x038000, 0x120000])),
                     min_size=1, max_size=4)


def build_random_host(root: str, specs: list[tuple[int, bool, int, int]]) -> FakeHost:
    host = FakeHost(root)
    types = [{"type_id": f"nvidia-{i}", "name": f"GRID X-{i}Q",
              "description": f"num_heads=4, framebuffer={i * 1024}M, max_instance={16 // i}",
              "available_instances": 4} for i in (1, 2)]
    n = 0
    for i, (nvfs, vf_mdev, live, klass) in enumerate(specs):
        bus = 0x10 + i * 0x10
        pf = f"{i % 2:04x}:{bus:02x}:00.0"
        host.add_function(pf, 0x10DE if klass != 0x120000 else 0x1002, 0x2000 + i, klass,
                          driver="nvidia", iommu_group=host.new_iommu_group())
        parents = [pf]
        if nvfs:
            host.set_sriov_capability(pf, 16, 0x2000 + i, offset=4)
            vfs = host.enable_sriov(pf, nvfs, vf_driver="nvidia")
            if vf_mdev:
                parents = vfs
        for p in parents:
            if p != pf or not nvfs:
                host.populate_mdev_parent(p, types)
        for j in range(live):
            if parents == [pf] and nvfs:
                break
            host.add_mdev(f"{n:08x}-0000-4000-8000-000000000000", parents[j % len(parents)],
                          "nvidia-1")
            n += 1
    return host


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpu_specs)
def test_every_vf_and_mdev_appears_once_under_its_gpu(
        tmp_path_factory: pytest.TempPathFactory,
        specs: list[tuple[int, bool, int, int]]) -> None:
    root = str(tmp_path_factory.mktemp("rnd"))
    host = build_random_host(root, specs)
    inv = discover(Sysfs(host.root))
    doc = cloudstack.render(inv)
    check_agent_document(doc)
    gpu_addrs = {g["pci_address"] for g in doc["gpus"]}
    assert len(doc["gpus"]) == len(specs)
    seen_vfs = [vf["vf_pci_address"] for g in doc["gpus"] for vf in g["vf_instances"]]
    seen_mdevs = [v["mdev_uuid"] for g in doc["gpus"] for v in g["vgpu_instances"]]
    live = os.listdir(os.path.join(host.root, "sys/bus/mdev/devices")) \
        if os.path.isdir(os.path.join(host.root, "sys/bus/mdev/devices")) else []
    assert sorted(seen_mdevs) == sorted(live)
    assert len(seen_vfs) == len(set(seen_vfs))
    assert not gpu_addrs & set(seen_vfs)
    expected_vfs = sum(n for n, vf_mdev, _, _ in specs if not vf_mdev)
    assert len(seen_vfs) == expected_vfs


def test_learned_type_names_survive_a_full_card(tmp_path: Path) -> None:
    from gpulib.state import StateStore
    from tests.hosts import a10_host

    host = a10_host(str(tmp_path), numvfs=2)
    ctx = Context.for_root(host.root)
    discover_host(ctx)  # sees the creatable lists and remembers their names
    learned = StateStore.for_context(ctx).load().type_names
    assert learned["10de:2236"]["594"] == "NVIDIA A10-6Q"
    # The card fills up: no VF lists any type any more, one VF runs A10-6Q.
    for vf, current in (("0000:41:00.4", 594), ("0000:41:00.5", 0)):
        host.add_nvidia_vf_types(vf, {}, current=current)
    [g] = cloudstack_doc(host.root)["gpus"]
    assert g["vf_instances"][0]["vf_profile"] == "NVIDIA A10-6Q"
    assert g["vf_instances"][0]["video_ram"] == 6144


def test_gpu_numbers_from_its_own_description_as_the_stock_script(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    host.write_file("sys/bus/pci/devices/0000:3b:00.0/description",
                    "num_heads=4, framebuffer=16384M, max_resolution=7680x4320, max_instance=1\n")
    [g] = cloudstack_doc(host.root)["gpus"]
    assert (g["max_instances"], g["video_ram"], g["max_heads"], g["max_resolution_x"],
            g["max_resolution_y"]) == (1, 16384, 4, 7680, 4320)


# -- the command line the agent runs ------------------------------------------------------

@pytest.mark.parametrize("args,expected", [
    (["discover", "--format", "cloudstack"], (0, "cloudstack")),
    (["discover", "-f", "json"], (0, "json")),
    (["discover", "--format=cloudstack"], (0, "cloudstack")),
    (["-vv", "discover", "--json"], (2, "json")),
    (["-v", "--verbose", "discover", "-f", "json", "--format", "cloudstack"], (2, "cloudstack")),
    (["discover", "--json", "--format", "cloudstack"], (0, "json")),
])
def test_plain_discover_forms_are_served_without_click(args: list[str],
                                                       expected: tuple[int, str]) -> None:
    assert inventory.parse_args(args) == expected


@pytest.mark.parametrize("args", [
    [], ["status"], ["discover", "--help"], ["discover", "-h"], ["--help", "discover"],
    ["--version", "discover"], ["discover", "--format", "xml"], ["discover", "--format=CSV"],
    ["discover", "--format"], ["discover", "-fjson"], ["discover", "extra"],
    ["-x", "discover"], ["discovery"],
])
def test_other_forms_are_left_to_click(args: list[str]) -> None:
    assert inventory.parse_args(args) is None


def test_discover_prints_the_same_with_and_without_click(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpulib.cli import main
    from gpulib.cli.commands import cli
    from gpulib.cli.common import run_main

    host = demo_host(str(tmp_path))
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    monkeypatch.delenv("GPULIB_SIMULATE", raising=False)
    for fmt in ("cloudstack", "json"):
        assert main(["discover", "--format", fmt]) == 0
        fast = capsys.readouterr().out
        assert run_main(cli, ["discover", "--format", fmt]) == 0
        assert capsys.readouterr().out == fast
        doc = json.loads(fast)
        if fmt == "cloudstack":
            check_agent_document(doc)
        else:
            assert doc["schema"] == report.SCHEMA and doc["gpus"]


def test_discover_for_the_agent_does_not_load_click(tmp_path: Path) -> None:
    host = demo_host(str(tmp_path))
    code = ("import sys\n"
            "from gpulib.cli import main\n"
            "rc = main(['discover', '--format', 'cloudstack'])\n"
            "sys.stdout.flush()\n"
            "sys.exit(99 if 'click' in sys.modules else rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=hook_env(host.root),
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    check_agent_document(json.loads(proc.stdout))


def test_discover_errors_are_one_line_with_and_without_click(tmp_path: Path) -> None:
    host = demo_host(str(tmp_path))
    faults.inject(host.root, "sys/bus/pci/devices", "eio")
    gpulib = str(hookrun.BIN / "gpulib")
    for args in (["discover", "--format", "cloudstack"], ["discover", "--format", "table"]):
        proc = subprocess.run([gpulib, *args], env=hook_env(host.root), capture_output=True,
                              timeout=60)
        assert proc.returncode == 1 and proc.stdout == b""
        assert proc.stderr.decode().splitlines() == [
            f"gpulib: error: cannot list the PCI devices in {host.root}/sys/bus/pci/devices: "
            "Input/output error"]


# -- a VF's mdev types ---------------------------------------------------------------------

def vf_sriov_host(root: str) -> FakeHost:
    """One GPU whose three VFs offer two mdev types each, two vGPUs live."""
    return build_random_host(root, [(3, True, 2, 0x030200)])


def test_each_vf_offers_its_own_types(tmp_path: Path) -> None:
    host = vf_sriov_host(str(tmp_path))
    # what each VF's files say, different per VF where a VF has its own value
    for i, vf in enumerate(("0000:10:00.4", "0000:10:00.5", "0000:10:00.6")):
        host.write_file(f"sys/bus/pci/devices/{vf}/mdev_supported_types/nvidia-2/"
                        "available_instances", f"{i}\n")
    [g] = discover(Sysfs(host.root)).gpus
    assert len(g.vfs) == 3 and len(g.vgpus) == 2
    for v in g.vgpus:
        [owner] = [vf for vf in g.vfs if vf.address == v.parent]
        # the vGPU's type is the very object its VF lists
        assert any(t is v.mdev_type for t in owner.mdev_types)
    for i, vf in enumerate(g.vfs):
        assert [t.type_id for t in vf.mdev_types] == ["nvidia-1", "nvidia-2"]
        for t in vf.mdev_types:
            assert t.parent == vf.address
            assert t.rel == f"sys/bus/pci/devices/{vf.address}/mdev_supported_types/{t.type_id}"
            assert t.profile_name == {"nvidia-1": "GRID X-1Q", "nvidia-2": "GRID X-2Q"}[t.type_id]
            assert t.description.framebuffer_mb == int(t.type_id[-1]) * 1024
        assert vf.mdev_types[1].available_instances == i
    native = report.document(discover(Sysfs(host.root)))
    [doc] = native["gpus"]
    expected = []
    for vf in ("0000:10:00.4", "0000:10:00.5", "0000:10:00.6"):
        for tid in ("nvidia-1", "nvidia-2"):
            count = Path(host.root, "sys/bus/pci/devices", vf, "mdev_supported_types", tid,
                         "available_instances").read_text()
            expected.append((vf, tid, "GRID X-" + tid[-1] + "Q", int(count)))
    assert [(t["parent"], t["type_id"], t["name"], t["available_instances"])
            for t in doc["mdev_types"]] == expected


@pytest.mark.parametrize("made_first", [False, True])
def test_a_gpus_mdev_offers_answer_as_its_types_do(tmp_path: Path, made_first: bool) -> None:
    """What metrics and the doctor read of every parent's types, without an
    object per VF type (or with them, once made), is what the types say."""
    host = vf_sriov_host(str(tmp_path))
    base = "sys/bus/pci/devices/{}/mdev_supported_types/{}/available_instances"
    for i, vf in enumerate(("0000:10:00.4", "0000:10:00.5", "0000:10:00.6")):
        host.write_file(base.format(vf, "nvidia-1"), f"{i + 3}\n")
    host.write_file(base.format("0000:10:00.5", "nvidia-2"), "many\n")  # not a number
    unreadable = Path(host.root, base.format("0000:10:00.6", "nvidia-2"))
    unreadable.unlink()
    unreadable.mkdir()
    sysfs = Sysfs(host.root)
    [g] = discover(sysfs).gpus
    if made_first:
        assert all(vf.mdev_types for vf in g.vfs)
    offers = [(str(parent), type_id, t.profile_name, n)
              for parent, types, available in g.mdev_offers()
              for (type_id, t), n in zip(types, available)]
    [fresh] = discover(sysfs).gpus
    expected = [(str(t.parent), t.type_id, t.profile_name, t.available_instances)
                for vf in fresh.vfs for t in vf.mdev_types]
    assert offers == expected
    assert [n for *_, n in offers] == [3, 4, 4, None, 5, None]
    # Read once: asked again, the answers stay those of the first read.
    host.write_file(base.format("0000:10:00.4", "nvidia-1"), "0\n")
    assert [n for _, _, available in g.mdev_offers() for n in available] == \
        [3, 4, 4, None, 5, None]


def test_a_type_unreadable_where_first_listed_is_offered_by_no_vf(tmp_path: Path) -> None:
    host = vf_sriov_host(str(tmp_path))
    name = Path(host.root, "sys/bus/pci/devices/0000:10:00.4/mdev_supported_types/nvidia-1/name")
    name.unlink()
    name.mkdir()
    [g] = discover(Sysfs(host.root)).gpus
    assert [[t.type_id for t in vf.mdev_types] for vf in g.vfs] == [["nvidia-2"]] * 3
    assert [e for e in g.errors if "nvidia-1" in e] == [f"{name.relative_to(host.root)}: "
                                                        "a directory, not a file"]
    # its live vGPU there stays listed, named by the type id
    assert len(g.vgpus) == 2
    [there] = [v for v in g.vgpus if str(v.parent) == "0000:10:00.4"]
    assert there.mdev_type.type_id == "nvidia-1" and there.mdev_type.profile_name == "nvidia-1"


@pytest.mark.parametrize("kind", ["file", "dangling", "loop", "elsewhere"])
def test_a_vfs_types_entry_that_lists_nothing_makes_it_no_parent(tmp_path: Path,
                                                                  kind: str) -> None:
    """A VF is an mdev parent when its `mdev_supported_types` is a directory
    (a link to one too), whatever else stands there, as `mdev.is_parent` says."""
    host = vf_sriov_host(str(tmp_path))
    odd = Path(host.root, "sys/bus/pci/devices/0000:10:00.6/mdev_supported_types")
    shutil.rmtree(odd)
    if kind == "file":
        odd.write_text("nvidia-1\n")
    elif kind == "dangling":
        odd.symlink_to("gone")
    elif kind == "loop":
        odd.symlink_to("mdev_supported_types")
    else:  # the sibling's directory, through a link
        odd.symlink_to("../0000:10:00.5/mdev_supported_types")
    [g] = discover(Sysfs(host.root)).gpus
    by_address = {str(vf.address): vf for vf in g.vfs}
    assert sorted(by_address) == ["0000:10:00.4", "0000:10:00.5", "0000:10:00.6"]
    vf = by_address["0000:10:00.6"]
    assert vf.mdev_parent is (kind == "elsewhere")
    assert [t.type_id for t in vf.mdev_types] == \
        (["nvidia-1", "nvidia-2"] if kind == "elsewhere" else [])
    assert g.errors == []
    assert [t.type_id for t in by_address["0000:10:00.5"].mdev_types] == ["nvidia-1", "nvidia-2"]


def test_a_group_link_named_by_other_digits_is_no_group(tmp_path: Path) -> None:
    """`iommu_group` -> "²": str.isdigit() says digits, int() refuses them. The
    GPU is listed without a group, its VFs still offered."""
    host = vf_sriov_host(str(tmp_path))
    [before] = cloudstack.render(discover(Sysfs(host.root)))["gpus"]
    odd = Path(host.root, "sys/kernel/iommu_groups/\u00b2")
    (odd / "devices").mkdir(parents=True)
    link = Path(host.device_dir("0000:10:00.0"), "iommu_group")
    link.unlink()
    link.symlink_to(os.path.relpath(odd, link.parent))
    inventory = discover(Sysfs(host.root))
    [g] = inventory.gpus
    assert g.fn.iommu_group is None and g.group_members == []
    assert inventory.occupancy.tree.group("0000:10:00.0") is None
    assert len(g.vfs) == 3 and all(vf.fn.iommu_group is not None for vf in g.vfs)
    # The report is the one before, but for the group it no longer names.
    [doc] = cloudstack.render(inventory)["gpus"]
    assert before["iommu_group"] != doc["iommu_group"]
    assert {k: v for k, v in doc.items() if k != "iommu_group"} == \
        {k: v for k, v in before.items() if k != "iommu_group"}
    assert len(doc["vgpu_instances"]) == 2


@given(st.text(max_size=11))
def test_a_group_number_is_one_to_nine_ascii_digits(name: str) -> None:
    expected = int(name) if re.fullmatch(r"[0-9]{1,9}", name, re.ASCII) else None
    assert group_number(name) == expected


def test_a_virtfn_link_named_by_other_digits_is_no_vf(tmp_path: Path) -> None:
    """`virtfn\u00b2` beside a PF's real links: no VF index (int() refused it, and
    the GPU lost all its VFs), the VFs the links name stay listed."""
    host = vf_sriov_host(str(tmp_path))
    pf = Path(host.device_dir("0000:10:00.0"))
    (pf / "virtfn\u00b2").symlink_to("../0000:10:00.4")
    [g] = discover(Sysfs(host.root)).gpus
    assert [str(vf.address) for vf in g.vfs] == ["0000:10:00.4", "0000:10:00.5", "0000:10:00.6"]
    assert g.errors == []
