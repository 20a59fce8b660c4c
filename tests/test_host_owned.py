"""What belongs to the host and its administrator stays theirs: the boot VGA device is
never offered or given whole (its vGPUs are), and hand-made vGPUs and VF types are never
pool members. The boot configuration's side (`gpulib setup`) is tests/test_setup_owned.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpulib.config import Config
from gpulib.context import Context
from gpulib.errors import ConfigError
from gpulib.hostview import discover_host
from gpulib.lifecycle import open_store
from gpulib.records import HANDMADE, VfRecord, VgpuRecord, is_handmade, pool_of
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import add_model, models
from tests.hookrun import BIN, QEMU_HOOK, as_agent, run
from tests.hosts import a10_host, empty_host, t4_host
from tests.test_ownership import pci_xml

IGPU = "0000:00:02.0"
T4 = "0000:65:00.0"
VM_UUID = "8e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e"
GVT_VGPU = "4b20d080-1b54-4048-b3bb-0000000000b1"


def console_host(tmp: str, vgpu: bool = True) -> FakeHost:
    """An Intel iGPU that is the boot VGA device, with GVT-g types (and one vGPU), and a
    T4 on vfio-pci for passthrough."""
    m = models()
    host = empty_host(tmp)
    host.add_iommu_unit("dmar0")
    host.add_function("0000:00:00.0", 0x8086, 0x3E30, 0x060000, numa_node=0,
                      iommu_group=host.new_iommu_group())
    add_model(host, m["uhd630"], IGPU, 0)
    host.write_file(os.path.relpath(os.path.join(host.device_dir(IGPU), "boot_vga"),
                                    host.root), "1\n", 0o444)
    host.populate_mdev_parent(IGPU, m["uhd630"]["mdev_types"])
    if vgpu:
        host.add_mdev(GVT_VGPU, IGPU, "i915-GVTg_V5_4")
    host.add_bridge("0000:64:00.0", numa_node=0, iommu_group=host.new_iommu_group())
    add_model(host, m["t4"], T4, 0, parent="0000:64:00.0", driver="vfio-pci")
    return host


def _discover(root: str) -> dict[str, Any]:
    proc = run([str(BIN / "gpulib"), "discover", "--format", "cloudstack"], root)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return {g["pci_address"]: g for g in doc["gpus"]}


def _allow(host: FakeHost, value: str) -> None:
    host.write_file("etc/gpulib/gpulib.conf", f"[discovery]\nallow_boot_vga = {value}\n")


# -- 1: the host's console -----------------------------------------------------------------


def test_the_boot_vga_igpu_offers_its_vgpus_not_itself(tmp_path: Any) -> None:
    host = console_host(str(tmp_path))
    gpus = _discover(host.root)
    igpu, t4 = gpus["00:02.0"], gpus["65:00.0"]
    assert igpu["full_passthrough"]["enabled"] == 0
    assert [(v["mdev_uuid"], v["profile_name"]) for v in igpu["vgpu_instances"]] == \
        [(GVT_VGPU, "GVTg_V5_4")]
    assert t4["full_passthrough"]["enabled"] == 1  # only the console is kept
    # the native report says why
    inv = discover_host(Context.for_root(host.root), learn=False)
    (gpu,) = [g for g in inv.gpus if str(g.address) == IGPU]
    assert gpu.boot_vga and gpu.console and "allow_boot_vga" in (gpu.whole_refusal or "")


def test_the_boot_vga_device_without_vgpus_is_not_offered_whole_either(tmp_path: Any) -> None:
    host = console_host(str(tmp_path), vgpu=False)
    igpu = _discover(host.root)["00:02.0"]
    assert igpu["full_passthrough"]["enabled"] == 0 and igpu["vgpu_instances"] == []
    # the setting gives it up: now it is offered whole
    _allow(host, "yes")
    assert _discover(host.root)["00:02.0"]["full_passthrough"]["enabled"] == 1


def test_the_transformer_refuses_the_console_with_one_line_naming_the_setting(
        tmp_path: Any) -> None:
    host = console_host(str(tmp_path), vgpu=False)
    xml = pci_xml("i-2-7-VM", VM_UUID, IGPU)
    state = os.path.join(host.root, "var/lib/gpulib/state.json")
    res = as_agent(host.root, xml)
    lines = res.stdout.decode().splitlines()
    assert res.returncode != 0 and len(lines) == 1, res.stdout
    assert "boot VGA" in lines[0] and "[discovery] allow_boot_vga = yes" in lines[0]
    assert not os.path.exists(state) or "i-2-7-VM" not in Path(state).read_text()
    # libvirt's own start says the same
    hook = run([QEMU_HOOK, "i-2-7-VM", "prepare", "begin", "-"], host.root,
               stdin=xml.encode())
    assert hook.returncode != 0 and b"allow_boot_vga" in hook.stderr
    # allowed: the start goes through, the GPU given whole
    _allow(host, "yes")
    res = as_agent(host.root, xml)
    assert res.returncode == 0 and b"<domain" in res.stdout, res.stdout


def test_the_doctor_does_not_ask_to_take_the_console_from_the_host(tmp_path: Any) -> None:
    from gpulib import doctor

    host = console_host(str(tmp_path), vgpu=False)
    # a boot VGA GPU without vGPU types: on its host driver, where it belongs
    os.system(f"rm -rf {host.device_dir(IGPU)}/mdev_supported_types")
    report = doctor.run(Context.for_root(host.root), lock_timeout=0.1,
                        only=["driver-binding", "iommu-group"])
    assert report.summary() == {"driver-binding": "ok", "iommu-group": "ok"}, \
        [r.to_json() for r in report.results]
    assert "boot VGA GPU kept for the host's console" in report.results[0].message


# -- 2: hand-made devices are never pool members --------------------------------------------


def test_the_rule_is_one_predicate() -> None:
    made = VgpuRecord("0000:3b:00.0", "nvidia-232", pool=HANDMADE)
    pooled = VgpuRecord("0000:3b:00.0", "nvidia-232", pool="desktops")
    assert is_handmade(made) and pool_of(made) is None
    assert not is_handmade(pooled) and pool_of(pooled) == "desktops"
    assert is_handmade(VfRecord(558, pool=HANDMADE))
    assert pool_of(VgpuRecord("0000:3b:00.0", "nvidia-232")) is None


@pytest.mark.parametrize("name", [HANDMADE, HANDMADE.upper()])
def test_a_pool_named_like_hand_made_devices_is_refused(tmp_path: Any, name: str) -> None:
    path = tmp_path / "gpulib.conf"
    path.write_text(f"[pool {name}]\nparents = all\ntype = nvidia-232\ncount = 1\n")
    with pytest.raises(ConfigError, match="reserved for hand-made devices") as raised:
        Config.load(str(path))
    assert "\n" not in raised.value.message and f"[pool {name}]" in raised.value.message
    lenient = Config.load(str(path), lenient=True)
    assert lenient.pools == {} and "reserved" in lenient.problems[0]


def _state(host: FakeHost) -> Any:
    return open_store(Context.for_root(host.root)).load()


def test_pool_apply_never_removes_a_hand_made_vgpu(tmp_path: Any) -> None:
    host = t4_host(str(tmp_path))
    gpulib = str(BIN / "gpulib")
    made = run([gpulib, "mdev", "create", "--parent", "0000:3b:00.0", "--type",
                "nvidia-232"], host.root)
    assert made.returncode == 0, made.stderr
    uuid = made.stdout.decode().strip()
    assert is_handmade(_state(host).vgpus[uuid])
    # a stopped VM's definition names it
    host.add_defined_domain("i-2-7-VM", VM_UUID)
    # the reserved name: refused, one line, nothing changed
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool manual]\nparents = all\ntype = nvidia-232\ncount = 0\n")
    res = run([gpulib, "pool", "apply"], host.root)
    assert res.returncode != 0 and b"reserved for hand-made devices" in res.stderr
    assert len(res.stderr.decode().strip().splitlines()) == 1
    assert os.path.exists(host.p(f"sys/bus/mdev/devices/{uuid}"))
    from gpulib import doctor

    (cfg,) = doctor.run(Context.for_root(host.root), only=["config"]).results
    assert cfg.status == "fail" and "reserved for hand-made devices" in cfg.message
    # a pool of the same type on the same GPU: its members are its own, the hand-made
    # vGPU is neither counted nor removed as surplus
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool desktops]\nparents = all\ntype = nvidia-232\ncount = 1\n")
    res = run([gpulib, "pool", "apply"], host.root)
    assert res.returncode == 0, res.stderr
    state = _state(host)
    members = [u for u, r in state.vgpus.items() if pool_of(r) == "desktops"]
    assert len(members) == 1 and uuid not in members and is_handmade(state.vgpus[uuid])
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool desktops]\nparents = all\ntype = nvidia-232\ncount = 0\n")
    assert run([gpulib, "pool", "apply"], host.root).returncode == 0
    assert os.path.exists(host.p(f"sys/bus/mdev/devices/{uuid}"))
    assert set(_state(host).vgpus) == {uuid}
    listed = json.loads(run([gpulib, "pool", "list", "--json"], host.root).stdout)
    assert HANDMADE not in json.dumps(listed)
    (row,) = json.loads(run([gpulib, "mdev", "list", "--json"], host.root).stdout)
    assert row["uuid"] == uuid and row["handmade"] is True and row["pool"] is None


def test_pool_apply_never_clears_a_hand_made_vf_type(tmp_path: Any) -> None:
    host = a10_host(str(tmp_path))
    gpulib = str(BIN / "gpulib")
    vf = "0000:41:00.4"
    res = run([gpulib, "vf", "set-type", vf, "NVIDIA A10-4Q"], host.root)
    assert res.returncode == 0, res.stderr
    assert is_handmade(_state(host).vf_types[vf])
    current = Path(host.p(f"sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type"))
    typed = current.read_text()
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool a10]\nparents = all\nprofile = NVIDIA A10-4Q\ncount = 0\n")
    assert run([gpulib, "pool", "apply"], host.root).returncode == 0
    assert current.read_text() == typed
    assert is_handmade(_state(host).vf_types[vf])


def test_a_metadata_request_is_never_given_a_hand_made_vgpu(tmp_path: Any) -> None:
    """Plain libvirt with a request for a vGPU of the hand-made one's type: the start gets
    a vGPU of its own, the hand-made one stays its administrator's."""
    host = t4_host(str(tmp_path))
    gpulib = str(BIN / "gpulib")
    made = run([gpulib, "mdev", "create", "--parent", "0000:3b:00.0", "--type",
                "nvidia-222"], host.root).stdout.decode().strip()
    xml = ("<domain type='kvm'><name>vm1</name>"
           f"<uuid>{VM_UUID}</uuid><metadata>"
           "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
           "<gpulib:vgpu profile='GRID T4-1B' count='1'/></gpulib:gpus></metadata>"
           "<devices/></domain>")
    assert _state(host).vgpus[made].type_id == "nvidia-222"
    res = as_agent(host.root, xml)
    assert res.returncode == 0, res.stdout
    (held,) = _state(host).allocations["vm1"].devices
    assert held.kind == "mdev" and held.id != made and made not in res.stdout.decode()
