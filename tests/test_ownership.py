"""Device ownership on a live host: one occupancy model, tree and group aware,
pending starts owning like running VMs, rollback, crash consistency."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from lxml import etree

from gpulib import cloudstack
from gpulib.context import Context
from gpulib.domstatus import running_domains
from gpulib.entry import context_for_root
from gpulib.lifecycle import open_store, reconcile
from gpulib.liveness import PENDING_GRACE_SECONDS, Liveness, run_over
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_POOL_MDEVS, DEMO_T4, build_demo
from gpulib.state import Allocation
from tests.conftest import DATA
from tests.hookrun import QEMU_HOOK, as_agent, hook_env, libvirt_start_fails, mdev_xml, run
from tests.hosts import tree_contents

STATE = "var/lib/gpulib/state.json"
XMLS = DATA / "cloudstack-xml"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def demo(tmp_path: Path) -> str:
    return build_demo(str(tmp_path / "demo")).root


def state_of(root: str) -> dict[str, Any]:
    return json.loads(Path(root, STATE).read_text())  # type: ignore[no-any-return]


def renamed(xml: str, name: str, uuid: str) -> str:
    """The same devices for another VM (another name and domain UUID)."""
    dom = etree.fromstring(xml.encode())
    old_name, old_uuid = dom.findtext("name"), dom.findtext("uuid")
    assert old_name and old_uuid
    return xml.replace(f"<name>{old_name}</name>", f"<name>{name}</name>").replace(
        old_uuid, uuid)


def pci_xml(name: str, uuid: str, address: str, managed: str = "yes") -> str:
    d, rest = address.split(":", 1)
    b, sf = rest.split(":")
    s, f = sf.split(".")
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid><devices>"
            f"<hostdev mode='subsystem' type='pci' managed='{managed}'><driver name='vfio'/>"
            f"<source><address domain='0x{d}' bus='0x{b}' slot='0x{s}' function='0x{f}'/>"
            "</source></hostdev></devices></domain>")



U1 = "11111111-0000-4000-8000-000000000001"
U2 = "11111111-0000-4000-8000-000000000002"


# -- two VMs, one device ---------------------------------------------------------------------

def test_two_pending_starts_cannot_share_a_gpu(demo: str) -> None:
    xml = (XMLS / "passthrough-1gpu.xml").read_text()
    assert as_agent(demo, xml).returncode == 0
    before = tree_contents(demo)
    res = as_agent(demo, renamed(xml, "i-9-99-VM", U1))
    assert res.returncode == 1
    assert b"0000:3b:00.0 is in use by starting VM i-2-33-VM" in res.stdout
    assert tree_contents(demo) == before
    # The libvirt side refuses it too: the agent starts with its own XML after a refusal.
    res = run([QEMU_HOOK, "i-9-99-VM", "prepare", "begin", "-"], demo,
              stdin=renamed(xml, "i-9-99-VM", U1).encode())
    assert res.returncode == 1 and b"in use by starting VM i-2-33-VM" in res.stderr


def test_two_pending_starts_cannot_share_a_pool_vgpu(demo: str) -> None:
    xml = (XMLS / "vgpu-mdev.xml").read_text()
    assert as_agent(demo, xml).returncode == 0
    res = as_agent(demo, renamed(xml, "i-9-98-VM", U2))
    assert res.returncode == 1 and b"in use by starting VM i-2-52-VM" in res.stdout
    # The refused VM's release end never takes the first VM's vGPU.
    assert run([QEMU_HOOK, "i-9-98-VM", "release", "end", "-"], demo).returncode == 0
    assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{DEMO_POOL_MDEVS[0]}"))
    assert [d["id"] for d in state_of(demo)["allocations"]["i-2-52-VM"]["devices"]] == [
        DEMO_POOL_MDEVS[0]]


# -- the tree: PF, VFs, mdevs, both ways -----------------------------------------------------

def test_whole_gpu_refused_while_a_running_vm_holds_its_vf(demo: str) -> None:
    # i-4-20-VM runs with the L40S's first VF.
    res = as_agent(demo, pci_xml("i-9-97-VM", U1, "0000:82:00.0"))
    assert res.returncode == 1
    assert b"conflicts with 0000:82:00.4, in use by running VM i-4-20-VM" in res.stdout


def test_whole_gpu_refused_while_a_vm_holds_its_vgpu(demo: str) -> None:
    xml = (XMLS / "vgpu-mdev.xml").read_text()
    assert as_agent(demo, xml).returncode == 0
    res = as_agent(demo, pci_xml("i-9-96-VM", U1, DEMO_T4))
    assert res.returncode == 1
    assert f"conflicts with {DEMO_POOL_MDEVS[0]}, in use by starting VM i-2-52-VM".encode() \
        in res.stdout


def test_vgpu_and_vf_refused_while_another_vm_holds_the_whole_gpu(tmp_path: Path) -> None:
    host = build_demo(str(tmp_path / "demo"))
    # A running VM holds the T4 whole (libvirt's view, whatever gpulib thinks).
    host.add_running_domain("i-5-50-VM", "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53",
                            pci=(DEMO_T4,))
    before = tree_contents(host.root)
    res = as_agent(host.root, (XMLS / "vgpu-mdev.xml").read_text())
    assert res.returncode == 1
    assert f"conflicts with {DEMO_T4}, in use by running VM i-5-50-VM".encode() in res.stdout
    assert tree_contents(host.root) == before, "the pool vGPU was not recreated"
    host.add_running_domain("i-5-51-VM", "1f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53",
                            pci=("0000:41:00.0",))
    res = as_agent(host.root, (XMLS / "nvidia-vf-vgpu.xml").read_text())
    assert res.returncode == 1
    assert b"conflicts with 0000:41:00.0, in use by running VM i-5-51-VM" in res.stdout


def test_group_companion_held_by_another_vm_refuses_the_gpu(demo: str) -> None:
    assert as_agent(demo, pci_xml("i-9-95-VM", U1, "0000:3b:00.1")).returncode == 0
    res = as_agent(demo, (XMLS / "passthrough-1gpu.xml").read_text())
    assert res.returncode == 1 and b"in use by starting VM i-9-95-VM" in res.stdout


def test_whole_gpu_with_declared_vgpu_use_is_neither_offered_nor_accepted(demo: str) -> None:
    doc = cloudstack.render(_inventory(demo))
    t4 = next(g for g in doc["gpus"] if g["pci_address"] == DEMO_T4[5:])
    assert t4["full_passthrough"]["enabled"] == 0
    res = as_agent(demo, pci_xml("i-9-94-VM", U1, DEMO_T4))
    assert res.returncode == 1 and b"cannot be given whole: it carries 2 vGPU(s)" in res.stdout
    v620 = next(g for g in doc["gpus"] if g["pci_address"] == "c1:00.0")
    assert v620["full_passthrough"]["enabled"] == 0  # SR-IOV VFs enabled
    res = as_agent(demo, pci_xml("i-9-94-VM", U1, "0000:c1:00.0"))
    assert res.returncode == 1 and b"its SR-IOV VFs are enabled" in res.stdout


def test_non_gpu_hostdevs_are_left_alone(demo: str) -> None:
    # The X710 NIC: not a GPU, not a GPU's group peer. Not gpulib's business.
    res = as_agent(demo, pci_xml("i-9-93-VM", U1, "0000:18:00.0"))
    assert res.returncode == 0, res.stdout
    assert "i-9-93-VM" not in state_of(demo)["allocations"]


# -- discovery and the hooks agree -----------------------------------------------------------

def _inventory(root: str) -> Any:
    from gpulib.hostview import discover_host

    return discover_host(Context.for_root(root), learn=False)


def _agent_renderings(vm: str, uuid: str, gpu: dict[str, Any]) -> list[tuple[str, str]]:
    """What the agent would start for each device the report offers free (both
    LibvirtGpuDef renderings: vendor VFs with managed='no' and with 'yes')."""
    out = []
    fp = gpu["full_passthrough"]
    if fp["enabled"] == 1 and fp["used_by_vm"] is None:
        a = fp["libvirt_address"]
        out.append(("pci", pci_xml(vm, uuid, f"{a['domain'][2:]}:{a['bus'][2:]}:"
                                   f"{a['slot'][2:]}.{a['function'][2:]}")))
        if a["domain"] != "0x0000":
            # Agent 4.21 splits 'dddd:bb:ss.f' on ':' (README of the fixtures).
            out.append(("pci-4.21", pci_xml(vm, uuid, "0000:" + a["domain"][2:] + ":"
                                            + a["bus"][2:] + "." + a["function"][2:])))
    for v in gpu["vgpu_instances"]:
        if v["used_by_vm"] is None:
            out.append(("mdev", mdev_xml(vm, uuid, v["mdev_uuid"])))
    for vf in gpu["vf_instances"]:
        if vf["used_by_vm"] is None:
            a = vf["libvirt_address"]
            addr = f"{a['domain'][2:]}:{a['bus'][2:]}:{a['slot'][2:]}.{a['function'][2:]}"
            out.append(("vf", pci_xml(vm, uuid, addr, managed="no")))
            out.append(("vf", pci_xml(vm, uuid, addr, managed="yes")))
    return out


def test_offered_free_is_accepted_and_reported_used_is_refused(tmp_path: Path) -> None:
    host = build_demo(str(tmp_path / "demo"))
    doc = cloudstack.render(_inventory(host.root))
    offered = [(g, r) for g in doc["gpus"] for r in _agent_renderings("i-8-1-VM", U1, g)]
    assert len(offered) >= 5
    assert "pci-4.21" in {kind for _, (kind, _) in offered}
    for n, (_, (kind, xml)) in enumerate(offered):
        fresh = build_demo(str(tmp_path / f"h{n}")).root
        res = as_agent(fresh, xml)
        assert res.returncode == 0, (kind, xml, res.stdout)
        shutil.rmtree(fresh)  # a host for each start: kept only when it fails
    # Every device reported used is refused to another VM.
    used = []
    for g in doc["gpus"]:
        for v in g["vgpu_instances"]:
            if v["used_by_vm"]:
                used.append(mdev_xml("i-8-2-VM", U2, v["mdev_uuid"]))
        for vf in g["vf_instances"]:
            if vf["used_by_vm"]:
                a = vf["libvirt_address"]
                used.append(pci_xml("i-8-2-VM", U2, f"{a['domain'][2:]}:{a['bus'][2:]}:"
                                    f"{a['slot'][2:]}.{a['function'][2:]}", managed="no"))
    assert used
    for xml in used:
        res = as_agent(host.root, xml)
        assert res.returncode == 1 and b"in use by running VM" in res.stdout, res.stdout


def test_a_defined_but_stopped_vm_is_not_a_user(demo: str) -> None:
    # i-3-12-VM is defined (not running) with the A100's live vGPU.
    live = "3f0d5c4e-8a2b-4c1d-9e6f-7a8b9c0d1e2f"
    doc = cloudstack.render(_inventory(demo))
    a100 = next(g for g in doc["gpus"] if g["pci_address"] == "ca:00.0")
    assert a100["vgpu_instances"][0]["used_by_vm"] is None
    assert as_agent(demo, mdev_xml("i-8-3-VM", U1, live)).returncode == 0


def test_untyped_vendor_vfs_are_not_offered(demo: str) -> None:
    doc = cloudstack.render(_inventory(demo))
    a10 = next(g for g in doc["gpus"] if g["pci_address"] == "41:00.0")
    # Only 41:00.4 has a type (gpulib's record); the others would be refused.
    assert [vf["vf_pci_address"] for vf in a10["vf_instances"]] == ["41:00.4"]
    res = as_agent(demo, pci_xml("i-8-4-VM", U1, "0000:41:00.5", managed="no"))
    assert res.returncode == 1 and b"has no vGPU type" in res.stdout


# -- only real device elements count ----------------------------------------------------------

SPOOF = ("<domstatus state='running' pid='1'><domain type='kvm' id='7'><name>{name}</name>"
         "<uuid>2b7e4c1d-6f3a-4d8e-9b0c-5e1f2a3d4c6c</uuid><metadata>{meta}</metadata>"
         "<devices><!-- <hostdev mode='subsystem' type='pci'><source><address domain='0x0000'"
         " bus='0x3b' slot='0x00' function='0x0'/></source></hostdev> -->"
         "<emulator>/usr/bin/qemu</emulator></devices></domain></domstatus>\n")
HOSTDEV_3B = ("<hostdev mode='subsystem' type='pci'><source><address domain='0x0000' "
              "bus='0x3b' slot='0x00' function='0x0'/></source></hostdev>")


def test_hostdevs_in_metadata_and_comments_are_not_devices(demo: str) -> None:
    meta = (f"<x:a xmlns:x='urn:tenant'>{HOSTDEV_3B}</x:a>"
            f"<y xmlns=''>{HOSTDEV_3B}</y><![CDATA[{HOSTDEV_3B}]]>")
    Path(demo, "run/libvirt/qemu/i-6-1-VM.xml").write_text(SPOOF.format(name="i-6-1-VM",
                                                                        meta=meta))
    [dom] = [d for d in running_domains(Context.for_root(demo).sysfs) if d.name == "i-6-1-VM"]
    assert dom.pci == [] and dom.mdevs == []
    doc = cloudstack.render(_inventory(demo))
    rtx = next(g for g in doc["gpus"] if g["pci_address"] == "3b:00.0")
    assert rtx["full_passthrough"]["used_by_vm"] is None
    assert as_agent(demo, (XMLS / "passthrough-1gpu.xml").read_text()).returncode == 0


def _scan_seconds(root: str, runs: int = 3) -> float:
    sysfs = Context.for_root(root).sysfs
    best = float("inf")
    for _ in range(runs):
        from gpulib import domstatus

        domstatus._CACHE.clear()
        t = time.perf_counter()
        running_domains(sysfs)
        best = min(best, time.perf_counter() - t)
    return best


@pytest.mark.parametrize("body", [
    "<hostdev/>" * 17_000,  # the file: well-formed, ~170 kB
    "<hostdev >" * 50_000,  # unclosed: 500 kB of malformed XML
    "<!--<hostdev " * 40_000,  # an unterminated comment, 500 kB
], ids=["17000-self-closing", "unclosed-hostdev", "unclosed-comment"])
def test_a_huge_or_malformed_status_file_costs_little(demo: str, body: str) -> None:
    Path(demo, "run/libvirt/qemu/i-6-2-VM.xml").write_text(
        SPOOF.format(name="i-6-2-VM", meta=f"<x:a xmlns:x='urn:t'>{body}</x:a>"))
    assert _scan_seconds(demo) < 0.1
    t = time.perf_counter()
    res = as_agent(demo, (XMLS / "passthrough-1gpu.xml").read_text())
    assert res.returncode == 0, res.stdout
    assert time.perf_counter() - t < 10


# -- rollback and exit codes --------------------------------------------------------------------

def test_failed_start_rolls_back_every_sysfs_change(demo: str) -> None:
    # Both T4 pool vGPUs are not live; the second cannot be recreated (no room).
    xml = (XMLS / "vgpu-mdev.xml").read_text()
    dom = etree.fromstring(xml.encode())
    first = dom.find("devices/hostdev")
    assert first is not None
    second = etree.fromstring(etree.tostring(first))
    second.find("source/address").set("uuid", DEMO_POOL_MDEVS[1])  # type: ignore[union-attr]
    first.addnext(second)
    two = etree.tostring(dom, encoding="unicode")
    avail = Path(demo, f"sys/bus/pci/devices/{DEMO_T4}/mdev_supported_types/nvidia-232/"
                       "available_instances")
    avail.write_text("1\n")
    before = tree_contents(demo)
    res = as_agent(demo, two)
    assert res.returncode == 1, res.stdout
    assert tree_contents(demo) == before, "the first vGPU was removed again, state untouched"


def test_bad_vm_name_is_exit_2_before_any_sysfs_write(demo: str) -> None:
    xml = (XMLS / "vgpu-mdev.xml").read_text()
    before = tree_contents(demo)
    res = as_agent(demo, renamed(xml, "x" * 300, U1))
    assert res.returncode == 2, res.stdout
    assert tree_contents(demo) == before


def test_mangled_421_address_repaired_or_refused(tmp_path: Path) -> None:
    host = build_demo(str(tmp_path / "demo"))
    xml = (XMLS / "pcidomain-0001-agent421.xml").read_text()
    res = as_agent(host.root, xml)
    assert res.returncode == 0
    [src] = etree.fromstring(res.stdout).findall("devices/hostdev/source/address")
    assert dict(src.attrib) == {"domain": "0x0001", "bus": "0xd6", "slot": "0x00",
                                "function": "0x0"}
    # A second function that matches as well: no guessing.
    FakeHost(host.root).add_function("0001:d6:01.0", 0x1002, 0x74A1, 0x120000,
                                     numa_node=1, iommu_group=90)
    res = as_agent(host.root, renamed(xml, "i-9-90-VM", U1))
    assert res.returncode == 2
    assert b"CloudStack 4.21 agent bug" in res.stdout and b"2 GPU functions" in res.stdout


# -- pending allocations: proven dead, robust to clock jumps --------------------------------

def test_pending_death_proof(tmp_path: Path) -> None:
    def pending_is_dead(alloc: Allocation, liveness: Liveness,
                        clock: tuple[Optional[str], float]) -> bool:
        # reconcile's judgment: a status file under the name is read for its UUID.
        return run_over(alloc, liveness, clock, by_uuid=True) is not None

    nobody = Liveness(Context.for_root(FakeHost(str(tmp_path / "idle")).root).sysfs)
    host = FakeHost(str(tmp_path / "host"))
    host.add_running_domain("vm", U1)
    vm_runs = Liveness(Context.for_root(host.root).sysfs)
    now = ("boot-a", 5000.0)
    fresh = Allocation("vm", boot_id="boot-a", uptime=4990.0)
    assert not pending_is_dead(fresh, nobody, now)
    old = Allocation("vm", boot_id="boot-a", uptime=5000.0 - PENDING_GRACE_SECONDS - 1)
    assert pending_is_dead(old, nobody, now)
    assert not pending_is_dead(old, vm_runs, now), "a running VM is alive"
    other_domain = Allocation("vm", U2, boot_id="boot-a", uptime=10.0)
    assert pending_is_dead(other_domain, vm_runs, now), "another domain under its name runs"
    assert pending_is_dead(Allocation("vm", boot_id="boot-b", uptime=4999.0), nobody, now)
    # An active allocation of this boot whose VM stopped, and one of an earlier
    # boot without a boot id (its boot clock is ahead of this boot's).
    assert pending_is_dead(Allocation("vm", status="active", boot_id="boot-a",
                                      uptime=4999.0), nobody, now)
    assert pending_is_dead(Allocation("vm", status="active", uptime=9000.0), nobody,
                           (None, 5000.0))
    assert not pending_is_dead(Allocation("vm", status="active", boot_id="boot-a",
                                          uptime=10.0), vm_runs, now)
    # Wall clock jumps do not matter when the boot clock is known...
    assert not pending_is_dead(Allocation("vm", since="2099-01-01T00:00:00Z",
                                          boot_id="boot-a", uptime=4990.0), nobody, now)
    # ... and without it (schema 1), a time far in the future is releasable too.
    assert pending_is_dead(Allocation("vm", since="2099-01-01T00:00:00Z"), nobody, now)
    assert pending_is_dead(Allocation("vm", since="2000-01-01T00:00:00Z"), nobody, now)


def test_reconcile_releases_a_pending_allocation_from_the_future(demo: str) -> None:
    assert as_agent(demo, (XMLS / "passthrough-1gpu.xml").read_text()).returncode == 0
    st = state_of(demo)
    alloc = st["allocations"]["i-2-33-VM"]
    alloc.update(since="2099-01-01T00:00:00Z", boot_id=None, uptime=None)
    Path(demo, STATE).write_text(json.dumps(st))
    ctx = context_for_root(demo, simulate=True)
    with open_store(ctx).transaction() as state:
        reconcile(ctx, state)
    assert state_of(demo)["allocations"] == {}


# -- crash consistency: kill at every write, then retry ----------------------------------------

PLAIN = ("<domain type='kvm'><name>plain-1</name><uuid>4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
         "</uuid><metadata><gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
         "<gpulib:vgpu profile='GRID A100-8C' count='2'/></gpulib:gpus></metadata>"
         "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>")


def _crash_run(root: str, n: int, xml: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "tests.helpers.crash_worker", str(n),
                           "gpulib.hooks.transformer", "transform", xml],
                          capture_output=True, env=hook_env(root), cwd=str(REPO), timeout=60)


@pytest.mark.parametrize("xml", [PLAIN, (XMLS / "vgpu-mdev.xml").read_text()],
                         ids=["on-demand-vgpus", "pool-vgpu-recreated"])
def test_kill_at_every_write_then_retry_succeeds_and_nothing_leaks(tmp_path: Path,
                                                                   xml: str) -> None:
    name = etree.fromstring(xml.encode()).findtext("name")
    assert name
    base = build_demo(str(tmp_path / "base")).root
    live_before = set(os.listdir(os.path.join(base, "sys/bus/mdev/devices")))
    shutil.rmtree(base)
    n = 1
    while True:
        root = build_demo(str(tmp_path / f"k{n}")).root
        res = _crash_run(root, n, xml)
        if res.returncode == 0:
            break  # n is past the last write: every write has been killed once
        assert res.returncode == 137, res.stderr
        retry = as_agent(root, xml)
        assert retry.returncode == 0, (n, retry.stdout)
        uuids = [a.get("uuid") for a in
                 etree.fromstring(retry.stdout).findall("devices/hostdev/source/address")]
        live = set(os.listdir(os.path.join(root, "sys/bus/mdev/devices")))
        assert uuids and set(uuids) <= live, "the retry names only live vGPUs"
        st = state_of(root)
        assert st["intents"] == [], "every interrupted intent settled"
        assert {d["id"] for d in st["allocations"][name]["devices"]} == set(uuids)
        # Stop: nothing leaks (on-demand vGPUs destroyed, pool ones kept known).
        libvirt_start_fails(root, name, retry.stdout)
        st = state_of(root)
        assert st["allocations"] == {}
        left = set(os.listdir(os.path.join(root, "sys/bus/mdev/devices")))
        assert left - live_before <= set(st["vgpus"]), "no live vGPU unknown to gpulib"
        assert all(not r["on_demand"] for r in st["vgpus"].values())
        shutil.rmtree(root)  # a host for each kill: kept only when it fails
        n += 1
    assert n > 2, "the start made writes to kill"


def test_kill_at_every_write_of_a_start_that_only_records(tmp_path: Path) -> None:
    """A start whose vGPU is live changes no sysfs: it writes the state file
    (data, then the rename) and then its copy, all under the lock. Killed
    before the rename, nothing is recorded; killed after it (at the copy),
    the start is recorded whole. Either way a retry succeeds and no temp file
    stays behind."""
    xml = (XMLS / "vgpu-mdev.xml").read_text()
    name = etree.fromstring(xml.encode()).findtext("name")
    assert name
    n = 1
    outcomes = []
    while True:
        root = build_demo(str(tmp_path / f"k{n}")).root
        # Started and stopped once: its pool vGPU is live and free.
        first = as_agent(root, xml)
        assert first.returncode == 0
        libvirt_start_fails(root, name, first.stdout)
        before = state_of(root)
        res = _crash_run(root, n, xml)
        if res.returncode == 0:
            break
        assert res.returncode == 137, res.stderr
        after = state_of(root)
        recorded = name in after["allocations"]
        assert after == before or (recorded and after["intents"] == []), \
            "killed before the rename: nothing recorded; after it: the start whole"
        outcomes.append(recorded)
        retry = as_agent(root, xml)
        assert retry.returncode == 0, (n, retry.stdout)
        assert name in state_of(root)["allocations"]
        state_dir = os.path.dirname(os.path.join(root, STATE))
        assert [f for f in os.listdir(state_dir) if f.endswith(".tmp")] == [], \
            "the killed start's temp file is gone"
        shutil.rmtree(root)  # a host for each kill: kept only when it fails
        n += 1
    assert outcomes[0] is False, "killed at its first write, the start recorded nothing"
    assert outcomes == sorted(outcomes), "once renamed, the start stays recorded"
    assert n <= 4, "the state's write, its rename and its copy: no sysfs write"


@pytest.mark.parametrize("xml", [PLAIN, (XMLS / "vgpu-mdev.xml").read_text()],
                         ids=["on-demand-vgpus", "pool-vgpu-recreated"])
def test_retry_adopts_its_own_orphan_in_place(tmp_path: Path, xml: str) -> None:
    """Killed right after an mdev create: the retry keeps that very device (a file
    put into its directory survives: it was not removed and created again)."""
    name = etree.fromstring(xml.encode()).findtext("name")
    assert name
    devices = "sys/bus/mdev/devices"
    for n in range(1, 16):
        root = build_demo(str(tmp_path / f"k{n}")).root
        live_before = set(os.listdir(os.path.join(root, devices)))
        res = _crash_run(root, n, xml)
        assert res.returncode == 137, "the start ended before an mdev was left behind"
        orphans = [i["id"] for i in state_of(root).get("intents", [])
                   if i["action"] == "create-mdev" and
                   os.path.exists(os.path.join(root, devices, i["id"]))]
        if orphans:
            break
        shutil.rmtree(root)  # a host for each kill: only the one kept that left an orphan
    else:
        pytest.fail("no kill left a live mdev behind")
    for u in orphans:
        Path(root, devices, u, "marker").write_text("the same device\n")
    retry = as_agent(root, xml)
    assert retry.returncode == 0, retry.stdout
    uuids = [a.get("uuid") for a in
             etree.fromstring(retry.stdout).findall("devices/hostdev/source/address")]
    for u in orphans:
        assert u in uuids
        assert Path(root, devices, u, "marker").exists(), "adopted in place"
    st = state_of(root)
    assert st.get("intents", []) == []
    assert {d["id"] for d in st["allocations"][name]["devices"]} == set(uuids)
    libvirt_start_fails(root, name, retry.stdout)
    st = state_of(root)
    assert st["allocations"] == {}
    left = set(os.listdir(os.path.join(root, devices)))
    assert left - live_before <= set(st["vgpus"]), "no live vGPU unknown to gpulib"
    assert all(not r["on_demand"] for r in st["vgpus"].values()), "on-demand ones destroyed"


# -- the CLI takes nothing from a VM without --force -----------------------------------------

def _cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "gpulib"), *args],
                          capture_output=True, text=True, env=hook_env(root), timeout=60)


def test_mdev_remove_and_vf_clear_refuse_a_held_device(demo: str) -> None:
    assert as_agent(demo, (XMLS / "vgpu-mdev.xml").read_text()).returncode == 0
    assert as_agent(demo, (XMLS / "nvidia-vf-vgpu.xml").read_text()).returncode == 0
    res = _cli(demo, "mdev", "remove", DEMO_POOL_MDEVS[0])
    assert res.returncode == 1 and "held by starting VM i-2-52-VM" in res.stderr
    res = _cli(demo, "vf", "clear", "0000:41:00.4")
    assert res.returncode == 1 and "held by starting VM i-9-77-VM" in res.stderr
    assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{DEMO_POOL_MDEVS[0]}"))
    res = _cli(demo, "mdev", "remove", "--force", DEMO_POOL_MDEVS[0])
    assert res.returncode == 0, res.stderr
    assert not os.path.exists(os.path.join(demo, f"sys/bus/mdev/devices/{DEMO_POOL_MDEVS[0]}"))
    assert _cli(demo, "vf", "clear", "--force", "0000:41:00.4").returncode == 0


def test_retry_after_the_vgpu_vanished_names_a_live_vgpu(demo: str) -> None:
    assert as_agent(demo, PLAIN).returncode == 0
    held = [d["id"] for d in state_of(demo)["allocations"]["plain-1"]["devices"]]
    # As after a reboot: the kernel forgot them; the pending allocation remains.
    ctx = context_for_root(demo, simulate=True)
    for u in held:
        ctx.sysfs.write(f"sys/bus/mdev/devices/{u}/remove", "1")
        assert not os.path.exists(os.path.join(demo, f"sys/bus/mdev/devices/{u}"))
    res = as_agent(demo, PLAIN)
    assert res.returncode == 0, res.stdout
    named = [a.get("uuid") for a in
             etree.fromstring(res.stdout).findall("devices/hostdev/source/address")]
    assert sorted(named) == sorted(held)
    for u in held:
        assert os.path.islink(os.path.join(demo, f"sys/bus/mdev/devices/{u}"))


def test_running_domains_cache_follows_status_file_changes(tmp_path: Path) -> None:
    host = build_demo(str(tmp_path / "demo"))
    xml = (XMLS / "passthrough-1gpu.xml").read_text()
    status = host.add_running_domain("i-7-1-VM", "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53",
                                     pci=("0000:3b:00.0",))
    res = as_agent(host.root, xml)
    assert res.returncode == 1 and b"in use by running VM i-7-1-VM" in res.stdout
    assert os.path.exists(os.path.join(host.root, "run/gpulib/domains.json"))
    # libvirt rewrites a status file by rename: the VM now holds another device.
    new = status + ".new"
    Path(new).write_text(Path(status).read_text().replace("bus='0x3b'", "bus='0x65'"))
    os.replace(new, status)
    assert as_agent(host.root, xml).returncode == 0
    # The cache now records what the new file says (keyed on its identity).
    doc = json.loads(Path(host.root, "run/gpulib/domains.json").read_text())
    assert doc["i-7-1-VM"][5] == ["0000:65:00.0"]


def test_a_declared_pool_makes_a_gpu_unavailable_whole(demo: str) -> None:
    igpu = "0000:00:02.0"
    doc = cloudstack.render(_inventory(demo))
    assert next(g for g in doc["gpus"] if g["pci_address"] == "00:02.0")[
        "full_passthrough"]["enabled"] == 1
    with open(os.path.join(demo, "etc/gpulib/gpulib.conf"), "a") as fh:
        fh.write(f"\n[pool gvt]\nparents = {igpu}\ntype = i915-GVTg_V5_4\ncount = 1\n")
    from gpulib.config import Config
    from gpulib.hostview import discover_host

    config = Config.load(os.path.join(demo, "etc/gpulib/gpulib.conf"))
    doc = cloudstack.render(discover_host(Context.for_root(demo), config, learn=False))
    assert next(g for g in doc["gpus"] if g["pci_address"] == "00:02.0")[
        "full_passthrough"]["enabled"] == 0
    res = as_agent(demo, pci_xml("i-9-89-VM", U1, igpu))
    assert res.returncode == 1 and b"pool gvt declares vGPUs on it" in res.stdout


def test_a_failed_state_write_rolls_back_the_start(demo: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full at the write that records the allocation: every vGPU this start
    created is removed again, and the state file is as it was."""
    import errno

    from gpulib import atomicfile
    from gpulib.config import Config
    from gpulib.domain import parse_domain
    from gpulib.errors import StateError
    from gpulib.hooks.prepare import Preparer, StartMode

    ctx = context_for_root(demo, simulate=True)
    config = Config.load(ctx.config_path)
    before = tree_contents(demo)
    real = atomicfile.write_atomic
    writes: list[str] = []

    def full(path: str, data: bytes, *a: Any, **k: Any) -> None:
        if path.endswith("state.json"):
            writes.append(path)
            if len(writes) == 3:  # intent, intent, then the allocation itself
                raise atomicfile.AtomicWriteError(errno.ENOSPC, "No space left on device",
                                                  path)
        real(path, data, *a, **k)

    monkeypatch.setattr(atomicfile, "write_atomic", full)
    with pytest.raises(StateError, match="No space left"):
        Preparer(ctx, config, parse_domain(PLAIN),
                 StartMode("transformer", edits_xml=True, requests=True)).run()
    monkeypatch.setattr(atomicfile, "write_atomic", real)
    assert len(writes) == 4  # ... and the file put back as it was
    assert tree_contents(demo) == before
