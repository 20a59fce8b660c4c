"""The hooks as the CloudStack agent and libvirt run them, on simulated hosts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid as uuidlib
from pathlib import Path

import pytest
from lxml import etree

from gpulib.domain import derive_uuid
from gpulib.entry import context_for_root
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_POOL_MDEVS, build_demo
from gpulib.xmlns import GPULIB_NS
from tests.conftest import DATA, GOLDEN
from tests.hookrun import (
    QEMU_HOOK,
    STATE_CHANGE,
    TRANSFORMER,
    as_agent,
    hook_env,
    libvirt_runs,
    run,
)
from tests.hosts import tree_contents

FIXTURES = sorted((DATA / "cloudstack-xml").glob("*.xml"))
STATE = "var/lib/gpulib/state.json"


@pytest.fixture
def demo(tmp_path: Path) -> str:
    return build_demo(str(tmp_path / "demo")).root


def canonical(xml: bytes) -> bytes:
    return etree.tostring(etree.fromstring(xml), method="c14n")


def without_records(xml: bytes) -> bytes:
    """The domain without gpulib's metadata (and a <metadata> left empty), its
    layout whitespace aside."""
    root = etree.fromstring(xml, etree.XMLParser(remove_blank_text=True))
    for gpus in root.findall(f"metadata/{{{GPULIB_NS}}}gpus"):
        metadata = gpus.getparent()
        metadata.remove(gpus)
        if len(metadata) == 0:
            root.remove(metadata)
    return etree.tostring(root, method="c14n")


# -- the agent's call, for every fixture ---------------------------------------------------

@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_agent_call_returns_complete_xml(demo: str, fixture: Path, regen_golden: bool) -> None:
    xml = fixture.read_text()
    res = as_agent(demo, xml)
    assert res.returncode == 0, res.stdout.decode()
    out = res.stdout
    assert out.strip(), "never exit 0 with empty output"
    assert etree.fromstring(out).tag == "domain"
    if "<hostdev" not in xml:
        assert out == xml.encode(), "a domain without GPUs comes back byte-identical"
    golden = GOLDEN / "hooks" / f"{fixture.stem}.out.xml"
    if regen_golden:
        golden.write_bytes(out)
    assert canonical(out) == canonical(golden.read_bytes())


def _virsh_define(xml: bytes, tmp: Path, validate: bool) -> tuple[int, str]:
    path = tmp / "dom.xml"
    path.write_bytes(xml)
    cmd = ["virsh", "-q", "-c", "test:///default", "define", str(path)]
    if validate:
        cmd.insert(-1, "--validate")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return res.returncode, res.stderr.strip()


@pytest.mark.skipif(shutil.which("virsh") is None, reason="virsh (libvirt-clients) not installed")
@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_output_accepted_by_libvirt(demo: str, fixture: Path, tmp_path: Path) -> None:
    xml = fixture.read_bytes()
    out = as_agent(demo, xml.decode()).stdout
    rc, err = _virsh_define(out, tmp_path, validate=False)
    assert rc == 0, err
    rc_in, err_in = _virsh_define(xml, tmp_path, validate=True)
    rc_out, err_out = _virsh_define(out, tmp_path, validate=True)
    # The schema check may already fail on the agent's own XML: we add no error.
    assert rc_out == 0 or (rc_in != 0 and err_out == err_in), (err_in, err_out)


# -- after a reboot -------------------------------------------------------------------------

def test_reboot_mdev_and_vendor_vf_are_recreated(demo: str) -> None:
    for name in ("vgpu-mdev.xml", "vgpu-mdev-display.xml", "nvidia-vf-vgpu.xml"):
        xml = (DATA / "cloudstack-xml" / name).read_text()
        res = as_agent(demo, xml)
        assert res.returncode == 0, res.stdout
        # Only the record of what each vGPU is joins the XML (it travels with a
        # migration); without it the domain is the one given.
        out = etree.fromstring(res.stdout)
        records = out.findall(f"metadata/{{{GPULIB_NS}}}gpus/{{{GPULIB_NS}}}device")
        assert [r.get("kind") for r in records] == (["vf"] if "vf" in name else ["mdev"])
        assert all(r.get("type") and r.get("gpu", "").startswith("10de:") for r in records)
        assert without_records(res.stdout) == without_records(xml.encode()), \
            "only a start's additions may change the XML"
    for u in DEMO_POOL_MDEVS:
        assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{u}"))
    cur = Path(demo, "sys/bus/pci/devices/0000:41:00.4/nvidia/current_vgpu_type").read_text()
    assert cur.strip() == "594"
    state = json.loads(Path(demo, STATE).read_text())
    assert state["allocations"]["i-9-77-VM"]["devices"] == [
        {"id": "0000:41:00.4", "kind": "vf", "on_demand": False}]
    assert state["allocations"]["i-2-52-VM"]["status"] == "pending"


def test_passthrough_gpu_gets_its_hdmi_audio_on_the_same_slot(demo: str) -> None:
    xml = (DATA / "cloudstack-xml" / "passthrough-1gpu.xml").read_text()
    out = etree.fromstring(as_agent(demo, xml).stdout)
    hostdevs = out.findall(".//hostdev[@type='pci']")
    assert len(hostdevs) == 2
    src = [h.find("source/address").get("function") for h in hostdevs]
    guest = [h.find("address") for h in hostdevs]
    assert src == ["0x0", "0x1"]
    assert guest[0].get("multifunction") == "on" and guest[0].get("function") == "0x0"
    assert guest[1].get("slot") == guest[0].get("slot") and guest[1].get("function") == "0x1"


def test_group_peers_can_be_configured_off(demo: str) -> None:
    Path(demo, "etc/gpulib/gpulib.conf").write_text("[transformer]\nadd_group_functions = no\n")
    xml = (DATA / "cloudstack-xml" / "passthrough-1gpu.xml").read_text()
    res = as_agent(demo, xml)
    assert res.returncode == 0 and res.stdout == xml.encode()


def test_device_of_another_running_vm_is_refused(demo: str) -> None:
    from gpulib.sim.fakehost import FakeHost
    host = FakeHost(demo)
    host.add_running_domain("i-9-99-VM", str(uuidlib.uuid4()), mdevs=(DEMO_POOL_MDEVS[0],))
    before = tree_contents(demo)
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    res = as_agent(demo, xml)
    assert res.returncode == 1
    lines = res.stdout.decode().splitlines()
    assert len(lines) == 1 and "in use by running VM i-9-99-VM" in lines[0]
    assert tree_contents(demo) == before


# -- bad input ------------------------------------------------------------------------------

BOMB = ('<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaaaaaaaa">'
        '<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;"><!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;">]>'
        "<domain><name>&c;</name><devices><hostdev/></devices></domain>")
XXE = ('<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
       "<domain><name>&x;</name><devices><hostdev/></devices></domain>")


def _mdev_domain(name: str = "vm1", uuid: str = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d",
                 dom_uuid: str = "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53") -> str:
    return (f"<domain type='kvm'><name>{name}</name><uuid>{dom_uuid}</uuid><devices>"
            "<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
            f"<address uuid='{uuid}'/></source></hostdev></devices></domain>")


BAD_XML = {
    "malformed": "<domain><name>x</name><devices><hostdev></devices>",
    "entity-bomb": BOMB,
    "external-entity": XXE,
    "not-a-domain": "<network><name>x</name><hostdev/></network>",
    "vm-name-with-slash": _mdev_domain(name="../../etc/x"),
    "vm-name-with-newline": _mdev_domain(name="a\nb"),
    "bad-mdev-uuid": _mdev_domain(uuid="not-a-uuid"),
    "bad-domain-uuid": _mdev_domain(dom_uuid="1234"),
    "pci-out-of-range": ("<domain><name>v</name><devices><hostdev mode='subsystem' type='pci'>"
                         "<source><address domain='0x0000' bus='0x100' slot='0x00' "
                         "function='0x0'/></source></hostdev></devices></domain>"),
    "unknown-mdev": _mdev_domain(uuid=str(uuidlib.UUID(int=7, version=4))),
}


@pytest.mark.parametrize("case", sorted(BAD_XML))
def test_bad_input_one_line_nonzero_nothing_written(demo: str, case: str) -> None:
    before = tree_contents(demo)
    res = as_agent(demo, BAD_XML[case])
    text = res.stdout.decode()
    assert res.returncode != 0
    assert len(text.splitlines()) == 1, text
    assert "root:" not in text
    assert tree_contents(demo) == before


def test_huge_stdin_and_empty_input_are_refused(demo: str) -> None:
    big = b"<domain><name>x</name><devices>" + b" " * (9 * 1024 * 1024) + b"<hostdev/>"
    res = run([TRANSFORMER, "transform", "-"], demo, stdin=big)
    assert res.returncode == 2 and b"larger than 8 MiB" in res.stderr and res.stdout == b""
    res = run([TRANSFORMER, "transform"], demo, stdin=b"")
    assert res.returncode == 2 and res.stdout == b""
    res = run([TRANSFORMER, "frobnicate", "<domain/>"], demo)
    assert res.returncode == 2


def test_newer_state_file_is_refused_untouched(demo: str) -> None:
    path = Path(demo, STATE)
    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    before = tree_contents(demo)
    res = as_agent(demo, (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text())
    assert res.returncode == 4 and "version 99" in res.stdout.decode()
    assert tree_contents(demo) == before


def test_corrupt_state_is_rebuilt_and_the_vm_still_starts(demo: str) -> None:
    Path(demo, STATE).write_text('{"version": 1, "vgpus": ')
    # After a rebuild the registry only knows live vGPUs: make the fixture's live.
    from gpulib import mdev
    from gpulib.pci import PciAddress
    ctx = context_for_root(demo, simulate=True)
    mdev.create(ctx.sysfs, PciAddress.parse("0000:af:00.0"), "nvidia-232", DEMO_POOL_MDEVS[0])
    res = as_agent(demo, (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text())
    assert res.returncode == 0, res.stdout
    assert any(n.startswith("state.json.corrupt-") for n in os.listdir(Path(demo, STATE).parent))
    assert "i-2-52-VM" in json.loads(Path(demo, STATE).read_text())["allocations"]


# -- start and stop -------------------------------------------------------------------------

def test_on_start_and_on_stop(demo: str) -> None:
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    started = as_agent(demo, xml)
    assert started.returncode == 0
    host = FakeHost(demo)
    libvirt_runs(host, etree.fromstring(started.stdout))
    res = run([STATE_CHANGE, "onStart", "i-2-52-VM"], demo)
    assert res.returncode == 0 and res.stdout == b"" and res.stderr == b""
    state = json.loads(Path(demo, STATE).read_text())
    assert state["allocations"]["i-2-52-VM"]["status"] == "active"
    # Allocations are the one record of who holds what (schema 2).
    assert [d["id"] for d in state["allocations"]["i-2-52-VM"]["devices"]] == [
        DEMO_POOL_MDEVS[0]]
    assert "vm" not in state["vgpus"][DEMO_POOL_MDEVS[0]]
    host.stop_domain("i-2-52-VM")
    res = run([STATE_CHANGE, "stop", "i-2-52-VM"], demo)
    assert res.returncode == 0
    state = json.loads(Path(demo, STATE).read_text())
    assert "i-2-52-VM" not in state["allocations"]
    assert DEMO_POOL_MDEVS[0] in state["vgpus"]
    # pool vGPUs stay for the next VM
    assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{DEMO_POOL_MDEVS[0]}"))


def test_state_change_unknown_vm_and_bad_usage(demo: str) -> None:
    before = tree_contents(demo)
    assert run([STATE_CHANGE, "onStop", "i-1-1-VM"], demo).returncode == 0
    assert run([STATE_CHANGE, "start", "i-1-1-VM"], demo).returncode == 0
    for argv in (["onStart"], ["reboot", "vm"], ["onStart", "a/b"], ["onStop", "x\ny"]):
        res = run([STATE_CHANGE, *argv], demo)
        assert res.returncode == 2 and len(res.stderr.decode().splitlines()) == 1
    snap = tree_contents(demo)
    # The state (and its copy) may be rewritten in the current schema, nothing else.
    assert {k: v for k, v in snap.items() if not k.startswith(STATE)} == \
        {k: v for k, v in before.items() if not k.startswith(STATE)}
    assert json.loads(Path(demo, STATE).read_text())["allocations"] == {}


# -- metadata requests ------------------------------------------------------------------------

META = ("<domain type='kvm'><name>meta-vm</name><uuid>{uuid}</uuid><metadata>"
        "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
        "<gpulib:vgpu profile='{profile}' count='{count}'/></gpulib:gpus></metadata>"
        "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>")


def test_metadata_request_on_plain_libvirt_host(demo: str) -> None:
    dom_uuid = "3c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
    xml = META.format(uuid=dom_uuid, profile="GRID A100-8C", count=2)
    res = as_agent(demo, xml)
    assert res.returncode == 0, res.stdout
    uuids = [a.get("uuid") for a in etree.fromstring(res.stdout).findall(
        ".//hostdev[@type='mdev']/source/address")]
    assert uuids == [derive_uuid(dom_uuid, 0), derive_uuid(dom_uuid, 1)]
    for u in uuids:
        assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{u}"))
    # asked again (a retried start): the same devices, nothing new
    again = as_agent(demo, xml)
    assert canonical(again.stdout) == canonical(res.stdout)
    # the agent's onStop never ends a pending allocation (a newer start's)
    assert run([STATE_CHANGE, "onStop", "meta-vm"], demo).returncode == 0
    for u in uuids:
        assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{u}"))
    # nor does a late release end of an earlier run: libvirt has not prepared it
    assert run([QEMU_HOOK, "meta-vm", "release", "end", "-"], demo).returncode == 0
    for u in uuids:
        assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{u}"))
    # libvirt prepares the start, which fails: its release end destroys the
    # on-demand vGPUs
    prep = run([QEMU_HOOK, "meta-vm", "prepare", "begin", "-"], demo, stdin=res.stdout)
    assert prep.returncode == 0, prep.stderr
    assert run([QEMU_HOOK, "meta-vm", "release", "end", "-"], demo).returncode == 0
    for u in uuids:
        assert not os.path.lexists(os.path.join(demo, f"sys/bus/mdev/devices/{u}"))


def test_metadata_request_ignored_under_cloudstack(demo: str) -> None:
    Path(demo, "etc/cloudstack/agent").mkdir(parents=True)
    Path(demo, "etc/cloudstack/agent/agent.properties").write_text("hypervisor.type=kvm\n")
    xml = META.format(uuid="3c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75", profile="GRID A100-8C",
                      count=1)
    res = as_agent(demo, xml)
    assert res.returncode == 0 and res.stdout == xml.encode()


def test_impossible_metadata_request_fails_cleanly(demo: str) -> None:
    before = tree_contents(demo)
    xml = META.format(uuid="3c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75", profile="GRID A100-8C",
                      count=9)
    res = as_agent(demo, xml)
    assert res.returncode == 1 and "no free vGPU of GRID A100-8C" in res.stdout.decode()
    assert tree_contents(demo) == before


# -- libvirt's qemu hook ------------------------------------------------------------------------

def test_qemu_hook_prepare_release_and_other_operations(demo: str) -> None:
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_bytes()
    res = run([QEMU_HOOK, "i-2-52-VM", "prepare", "begin", "-"], demo, stdin=xml)
    assert res.returncode == 0 and res.stdout == b"", res.stderr
    assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{DEMO_POOL_MDEVS[0]}"))
    res = run([QEMU_HOOK, "i-2-52-VM", "started", "begin", "-"], demo, stdin=xml)
    assert res.returncode == 0 and res.stdout == b""
    # migrate begin prints the whole XML libvirt is to start: here the VM keeps
    # the pool vGPU it holds (the registry knows its type), so nothing changes.
    res = run([QEMU_HOOK, "i-2-52-VM", "migrate", "begin", "-"], demo, stdin=xml)
    assert res.returncode == 0 and res.stdout == xml, res.stderr
    res = run([QEMU_HOOK, "i-2-52-VM", "release", "end", "-"], demo, stdin=xml)
    assert res.returncode == 0
    assert json.loads(Path(demo, STATE).read_text())["allocations"] == {}
    # release after a start that never allocated anything
    res = run([QEMU_HOOK, "never-started", "release", "end", "-"], demo, stdin=b"<domain/>")
    assert res.returncode == 0
    res = run([QEMU_HOOK, "i-2-52-VM", "reconnect", "begin", "-"], demo, stdin=b"\x00garbage<")
    assert res.returncode == 0


def test_qemu_hook_prepare_failure_names_the_problem(demo: str) -> None:
    xml = _mdev_domain(name="vm1", uuid=str(uuidlib.UUID(int=9, version=4))).encode()
    res = run([QEMU_HOOK, "vm1", "prepare", "begin", "-"], demo, stdin=xml)
    assert res.returncode == 1
    assert "gpulib has no record" in res.stderr.decode()
    assert len(res.stderr.decode().splitlines()) == 1


def test_qemu_hook_reconnect_relearns_running_vm(demo: str) -> None:
    from gpulib.sim.fakehost import FakeHost
    FakeHost(demo).add_mdev(DEMO_POOL_MDEVS[1], "0000:af:00.0", "nvidia-232")
    xml = _mdev_domain(name="vm-r", uuid=DEMO_POOL_MDEVS[1]).encode()
    res = run([QEMU_HOOK, "vm-r", "reconnect", "begin", "-"], demo, stdin=xml)
    assert res.returncode == 0
    alloc = json.loads(Path(demo, STATE).read_text())["allocations"]["vm-r"]
    assert alloc["status"] == "active"


def test_50_megabyte_argument_is_refused(demo: str, monkeypatch: pytest.MonkeyPatch,
                                        capfd: pytest.CaptureFixture[str]) -> None:
    # Linux caps one exec argument at 128 KiB, so the agent cannot pass this;
    # the hook still refuses it cleanly when called in-process.
    from gpulib.hooks.transformer import main
    monkeypatch.setenv("GPULIB_ROOT", demo)
    before = tree_contents(demo)
    big = "<domain><name>x</name><devices><hostdev/>" + " " * (50 * 1024 * 1024) + "</devices>"
    assert main(["libvirt-vm-xml-transformer", "transform", big]) == 2
    out, err = capfd.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "too large" in err
    assert tree_contents(demo) == before


def test_qemu_hook_started_activates_and_derived_vgpu_is_created_at_prepare(demo: str) -> None:
    dom_uuid = "3c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
    wanted = derive_uuid(dom_uuid, 0)
    xml = (META.format(uuid=dom_uuid, profile="GRID A100-8C", count=1)
           .replace("</devices>", "<hostdev mode='subsystem' type='mdev' model='vfio-pci'>"
                    f"<source><address uuid='{wanted}'/></source></hostdev></devices>"))
    res = run([QEMU_HOOK, "meta-vm", "prepare", "begin", "-"], demo, stdin=xml.encode())
    assert res.returncode == 0, res.stderr
    assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{wanted}"))
    alloc = json.loads(Path(demo, STATE).read_text())["allocations"]["meta-vm"]
    assert alloc["status"] == "pending"
    assert alloc["devices"] == [{"id": wanted, "kind": "mdev", "on_demand": True}]
    host = FakeHost(demo)
    libvirt_runs(host, etree.fromstring(xml.encode()))
    assert run([QEMU_HOOK, "meta-vm", "started", "begin", "-"], demo,
               stdin=xml.encode()).returncode == 0
    alloc = json.loads(Path(demo, STATE).read_text())["allocations"]["meta-vm"]
    assert alloc["status"] == "active"
    host.stop_domain("meta-vm")
    assert run([QEMU_HOOK, "meta-vm", "release", "end", "-"], demo,
               stdin=xml.encode()).returncode == 0
    assert not os.path.lexists(os.path.join(demo, f"sys/bus/mdev/devices/{wanted}"))


def test_refuse_in_use_off_and_unmanaged_devices(demo: str) -> None:
    from gpulib.sim.fakehost import FakeHost
    FakeHost(demo).add_running_domain("i-9-99-VM", str(uuidlib.uuid4()),
                                      mdevs=(DEMO_POOL_MDEVS[0],))
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    Path(demo, "etc/gpulib/gpulib.conf").write_text("[transformer]\nrefuse_in_use = no\n")
    assert as_agent(demo, xml).returncode == 0
    # An unmanaged GPU's VF: gpulib does not set its recorded type.
    state = json.loads(Path(demo, STATE).read_text())
    state["unmanaged"] = ["0000:41:00.0"]
    Path(demo, STATE).write_text(json.dumps(state))
    res = as_agent(demo, (DATA / "cloudstack-xml" / "nvidia-vf-vgpu.xml").read_text())
    assert res.returncode == 0
    cur = Path(demo, "sys/bus/pci/devices/0000:41:00.4/nvidia/current_vgpu_type").read_text()
    assert cur.strip() == "0"
    assert "i-9-77-VM" not in json.loads(Path(demo, STATE).read_text())["allocations"]


PASS_META = ("<domain type='kvm'><name>pt-vm</name><uuid>{uuid}</uuid>{numatune}<metadata>"
             "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>{items}"
             "</gpulib:gpus></metadata><devices><emulator>/usr/bin/qemu-system-x86_64"
             "</emulator></devices></domain>")


def test_passthrough_request_brings_the_gpus_audio_along(demo: str) -> None:
    xml = PASS_META.format(uuid="3c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75", numatune="",
                           items="<gpulib:passthrough model='10de:2484' count='1'/>")
    res = as_agent(demo, xml)
    assert res.returncode == 0, res.stdout
    dom = etree.fromstring(res.stdout)
    funcs = [(h.find("source/address").get("bus"), h.find("source/address").get("function"),
              h.find("address").get("slot")) for h in dom.findall(".//hostdev[@type='pci']")]
    assert [f[:2] for f in funcs] == [("0x3b", "0x0"), ("0x3b", "0x1")]
    assert funcs[0][2] == funcs[1][2], "the audio function shares the GPU's guest slot"
    devices = json.loads(Path(demo, STATE).read_text())["allocations"]["pt-vm"]["devices"]
    assert [d["id"] for d in devices] == ["0000:3b:00.0", "0000:3b:00.1"]


@pytest.mark.parametrize("node", [0, 1])
def test_vgpu_request_prefers_the_domains_numa_node(tmp_path: Path, node: int) -> None:
    from tests.hosts import t4_farm
    host = t4_farm(str(tmp_path), gpus=4)  # T4s on nodes 0, 1, 0, 1; no pool created
    numatune = f"<numatune><memory mode='strict' nodeset='{node}'/></numatune>"
    xml = PASS_META.format(uuid="3c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75", numatune=numatune,
                           items="<gpulib:vgpu profile='GRID T4-1B' count='1'/>")
    res = as_agent(host.root, xml)
    assert res.returncode == 0, res.stdout
    state = json.loads(Path(host.root, STATE).read_text())
    [dev] = state["allocations"]["pt-vm"]["devices"]
    parent = state["vgpus"][dev["id"]]["parent"]
    numa = Path(host.root, f"sys/bus/pci/devices/{parent}/numa_node").read_text().strip()
    assert int(numa) == node


def test_a_new_domain_with_an_old_name_keeps_its_pool_vgpu(demo: str) -> None:
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    assert as_agent(demo, xml).returncode == 0
    assert run([STATE_CHANGE, "onStart", "i-2-52-VM"], demo).returncode == 0
    # The VM is recreated with the same name but a new UUID; onStop never came.
    old = "9b4c2e17-3a6f-4d8b-a5e1-7c0f3d9b2a46"
    new_xml = xml.replace(old, "1b4c2e17-3a6f-4d8b-a5e1-7c0f3d9b2a46")
    assert as_agent(demo, new_xml).returncode == 0
    state = json.loads(Path(demo, STATE).read_text())
    alloc = state["allocations"]["i-2-52-VM"]
    assert alloc["domain_uuid"] == "1b4c2e17-3a6f-4d8b-a5e1-7c0f3d9b2a46"
    assert alloc["status"] == "pending"
    assert [d["id"] for d in alloc["devices"]] == [DEMO_POOL_MDEVS[0]]


# -- the end of a hook's process ----------------------------------------------------------------

def test_hooks_end_without_teardown_and_lose_nothing(demo: str) -> None:
    # The executables end through exit_now (no interpreter teardown): the exit
    # code is main's, the answer is whole, and the log has every line.
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    res = as_agent(demo, xml)
    assert res.returncode == 0
    assert etree.fromstring(res.stdout).findtext("name") == "i-2-52-VM"
    assert run([STATE_CHANGE, "onStart", "i-2-52-VM"], demo).returncode == 0
    assert run([STATE_CHANGE, "onStart"], demo).returncode == 2
    res = run([QEMU_HOOK, "i-2-52-VM"], demo)
    assert res.returncode == 2 and len(res.stderr.decode().splitlines()) == 1
    assert run([STATE_CHANGE, "onStop", "i-2-52-VM"], demo).returncode == 0
    lines = Path(demo, "var/log/gpulib/gpulib.log").read_text().splitlines()
    assert any("onStart i-2-52-VM: allocation active" in line for line in lines)
    assert "onStop i-2-52-VM: " in lines[-1]


@pytest.mark.parametrize("reader_gone,code,expected", [(False, 3, 3), (False, 0, 0),
                                                       (True, 0, 120), (True, 3, 3)])
def test_exit_now_flushes_stdout_or_says_it_could_not(reader_gone: bool, code: int,
                                                      expected: int) -> None:
    # A success whose answer never left the process is not a success (120, as
    # the interpreter's own exit says it); a failure keeps its own code.
    program = ("import sys; from gpulib.process import exit_now; "
               f"sys.stdout.write('answer'); exit_now({code})")
    read, write = os.pipe()
    if reader_gone:
        os.close(read)
    try:
        # Buffered, as a hook's stdout on a pipe is: the flush is exit_now's.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        res = subprocess.run([sys.executable, "-c", program], stdout=write,
                             stderr=subprocess.PIPE, timeout=30, env=env)
    finally:
        os.close(write)
    assert res.returncode == expected
    if not reader_gone:
        assert os.read(read, 100) == b"answer"
        os.close(read)


def test_a_domain_without_gpus_loads_nothing_from_outside_gpulib(demo: str) -> None:
    # Its budget is the interpreter's own start (`python3 -c pass`): the run,
    # from the executable's first line to its end, adds no module but
    # gpulib's own (typing alone would cost it 10 ms) and fcntl, the small C
    # module of the installation's lock (gpulib.installation.hold).
    program = (
        "import os, sys\n"
        "before = set(sys.modules)\n"
        "from gpulib.installation import hold\n"
        "hold('libvirt-vm-xml-transformer')\n"
        "from gpulib.process import exit_now\n"
        "from gpulib.hooks.transformer import main\n"
        "xml = open(sys.argv[1]).read()\n"
        "code = main(['libvirt-vm-xml-transformer', 'transform', xml])\n"
        "added = sorted(m for m in set(sys.modules) - before if m.split('.')[0] != 'gpulib')\n"
        "sys.stderr.write(' '.join(added))\n"
        "exit_now(code)\n")
    res = subprocess.run([sys.executable, "-c", program,
                          str(DATA / "cloudstack-xml" / "no-gpu.xml")],
                         capture_output=True, env=hook_env(demo), timeout=30)
    assert res.returncode == 0 and b"<domain" in res.stdout
    assert res.stderr.decode() in ("", "fcntl")
