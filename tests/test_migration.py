"""Live migration between two simulated hosts: the source's live XML (as libvirt
sends it, gpulib's metadata included) through the destination's qemu hook
(`migrate begin`), a failed migration, racing arrivals, a kill at every write,
`gpulib migrate check`, and the XML model's settable sources.

The source runs a VM the transformer gave its vGPUs (so its XML records what
each is); libvirt running it is its status file. The destination is another
simulated host of the same GPU model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from gpulib.domain import DeviceType, derive_uuid, parse_domain
from gpulib.entry import context_for_root
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import models
from gpulib.xmlns import GPULIB_NS
from tests.hookrun import QEMU_HOOK, STATE_CHANGE, as_agent, hook_env, run
from tests.hosts import tree_contents

STATE = "var/lib/gpulib/state.json"
BOOT_ID = "proc/sys/kernel/random/boot_id"
REPO = Path(__file__).resolve().parents[1]
GPULIB = str(Path(sys.executable).parent / "gpulib")
SCHEMA = Path("/usr/share/libvirt/schemas/domain.rng")

T4 = "0000:3b:00.0"
A10 = "0000:41:00.0"
U_VM = "4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
U_VM2 = "9b1d7c3e-5f2a-4e8b-a6c4-2d0e8f1a3b57"
U_OTHER = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
U_STRANGER = "aa0e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
T4_8Q = "nvidia-233"  # GRID T4-8Q: two instances per T4
A10_2Q = 591


# -- hosts and VMs ---------------------------------------------------------------------------------

def _host(root: str) -> FakeHost:
    host = FakeHost(root)
    host.write_file(BOOT_ID, f"boot-{os.path.basename(root)}\n", 0o444)
    return host


def _gpu(root: str, model: str, address: str, bridge: str) -> tuple[FakeHost, dict[str, Any]]:
    """A host with one GPU of `model` (gpulib.sim's models) behind its own bridge."""
    host = _host(root)
    m = models()[model]
    host.add_bridge(bridge, numa_node=0, iommu_group=host.new_iommu_group())
    host.add_function(address, m["vendor"], m["device"], m["class"], driver="nvidia",
                      iommu_group=host.new_iommu_group(), numa_node=0, parent=bridge,
                      vendor_name=m["vendor_name"], device_name=m["device_name"])
    return host, m


def t4(root: str) -> FakeHost:
    """One T4, mdev types on the PF (as tests.hosts.t4_host, at a root of choice)."""
    host, m = _gpu(root, "t4", T4, "0000:3a:00.0")
    host.populate_mdev_parent(T4, m["mdev_types"])
    return host


def a10(root: str) -> tuple[FakeHost, list[str]]:
    """One A10 with four NVIDIA vendor-specific vGPU VFs."""
    host, m = _gpu(root, "a10", A10, "0000:40:03.1")
    host.set_sriov_capability(A10, 32, m["vf_device"], offset=4)
    types = {int(k): v for k, v in m["nvidia_vf_types"].items()}
    vfs = host.enable_sriov(A10, 4, vf_driver="nvidia")
    for vf in vfs:
        host.add_nvidia_vf_types(vf, types)
    return host, [str(PciAddress.parse(v)) for v in vfs]


def request_xml(name: str, uuid: str, vgpu: str, count: int = 1) -> str:
    """A plain-libvirt domain asking gpulib for vGPUs, with what the guest sees."""
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid>"
            "<memory unit='KiB'>1048576</memory>"
            "<os><type arch='x86_64' machine='pc'>hvm</type></os><metadata>"
            "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
            f"<gpulib:vgpu {vgpu} count='{count}'/></gpulib:gpus></metadata>"
            "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator>"
            "<video><model type='none'/></video></devices></domain>")


def started_on(host: FakeHost, xml: str) -> str:
    """The transformer's XML, running (libvirt's status file, then the agent's
    onStart): what the source's libvirt sends when the VM migrates."""
    res = as_agent(host.root, xml)
    assert res.returncode == 0, res.stdout
    live = res.stdout.decode()
    dom = parse_domain(live)
    pci = tuple(str(h.address) for h in dom.pci_hostdevs())
    mdevs = tuple(h.uuid_checked() for h in dom.mdev_hostdevs())
    assert dom.name and dom.uuid
    host.add_running_domain(dom.name, dom.uuid, pci=pci, mdevs=mdevs, managed=False)
    assert run([STATE_CHANGE, "onStart", dom.name], host.root).returncode == 0
    return live


def held_elsewhere(host: FakeHost, name: str, uuid: str, mdevs: tuple[str, ...] = (),
                   vfs: tuple[str, ...] = (), type_id: str = "nvidia-233") -> None:
    """Another VM runs on `host` with these devices."""
    for u in mdevs:
        host.add_mdev(u, T4, type_id)
    host.add_running_domain(name, uuid, mdevs=mdevs, pci=vfs, managed=False)


def migrate_begin(root: str, name: str, xml: str) -> subprocess.CompletedProcess[bytes]:
    return run([QEMU_HOOK, name, "migrate", "begin", "-"], root, stdin=xml.encode())


def state_of(root: str) -> dict[str, Any]:
    path = Path(root, STATE)
    if not path.exists():
        return {"allocations": {}, "intents": [], "vgpus": {}}
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def live_mdevs(root: str) -> set[str]:
    path = os.path.join(root, "sys/bus/mdev/devices")
    return set(os.listdir(path)) if os.path.isdir(path) else set()


def mdev_type_of(root: str, uuid: str) -> str:
    return os.path.basename(os.readlink(os.path.join(root, "sys/bus/mdev/devices", uuid,
                                                     "mdev_type")))


def sources(xml: str) -> list[str]:
    dom = parse_domain(xml)
    return [h.uuid_checked() for h in dom.mdev_hostdevs()] + \
        [str(h.address) for h in dom.pci_hostdevs()]


def c14n(xml: str) -> bytes:
    return etree.tostring(etree.fromstring(xml.encode()), method="c14n")


def same_but_sources(before: str, after: str, moved: dict[str, str]) -> None:
    """`after` is `before` with only the named sources (and their records) changed."""
    expected = before
    for old, new in moved.items():
        expected = expected.replace(old, new)
    assert c14n(after) == c14n(expected)


def schema_valid(xml: str) -> None:
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} missing (libvirt schemas not installed)")
    rng = etree.RelaxNG(etree.parse(str(SCHEMA)))
    assert rng.validate(etree.fromstring(xml.encode())), rng.error_log


def cli(root: str, *args: str, stdin: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULIB, *args], capture_output=True, text=True, input=stdin,
                          env=hook_env(root), timeout=60)


@pytest.fixture
def src(tmp_path: Path) -> FakeHost:
    return t4(str(tmp_path / "src"))


@pytest.fixture
def dst(tmp_path: Path) -> FakeHost:
    return t4(str(tmp_path / "dst"))


# -- the type travels with the VM ------------------------------------------------------------------

def test_the_transformer_records_what_each_vgpu_is(src: FakeHost) -> None:
    res = as_agent(src.root, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    assert res.returncode == 0, res.stdout
    live = res.stdout.decode()
    uuid = derive_uuid(U_VM, 0)
    assert parse_domain(live).device_types() == [
        DeviceType("mdev", uuid, T4_8Q, "GRID T4-8Q", "10de:1eb8")]
    schema_valid(live)
    # The transformer run again on its own output (a retried start) changes nothing.
    again = as_agent(src.root, live)
    assert again.returncode == 0 and again.stdout.decode() == live


# -- the destination's migrate begin ---------------------------------------------------------------

def test_same_type_free_the_vm_gets_its_own_vgpu_and_keeps_its_xml(src: FakeHost,
                                                                   dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    uuid = derive_uuid(U_VM, 0)
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 0, res.stderr
    # The source's UUID is free here: the vGPU is made under it, nothing to rewrite.
    assert res.stdout.decode() == live and res.stderr == b""
    assert live_mdevs(dst.root) == {uuid} and mdev_type_of(dst.root, uuid) == T4_8Q
    alloc = state_of(dst.root)["allocations"]["mig-1"]
    assert alloc["status"] == "pending" and alloc["domain_uuid"] == U_VM
    assert alloc["devices"] == [{"kind": "mdev", "id": uuid, "on_demand": True}]
    # The source still holds its own: nothing there changed.
    assert state_of(src.root)["allocations"]["mig-1"]["devices"][0]["id"] == uuid


def test_source_uuid_held_there_by_another_vm_a_different_one_is_chosen(
        src: FakeHost, dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    uuid = derive_uuid(U_VM, 0)
    held_elsewhere(dst, "stranger", U_STRANGER, mdevs=(uuid,))
    before = tree_contents(dst.root)
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    new = derive_uuid(U_VM, 1)
    assert sources(out) == [new]
    # Only the hostdev's source (and its record) changed: the guest sees the same.
    same_but_sources(live, out, {uuid: new})
    schema_valid(out)
    assert parse_domain(out).device_types()[0].id == new
    assert mdev_type_of(dst.root, new) == T4_8Q
    # The stranger's vGPU is untouched.
    assert {k: v for k, v in tree_contents(dst.root).items() if uuid in k} == \
        {k: v for k, v in before.items() if uuid in k}


def test_a_pool_member_serves_first_and_the_uuid_is_rewritten(src: FakeHost,
                                                             dst: FakeHost) -> None:
    Path(dst.root, "etc/gpulib").mkdir(parents=True, exist_ok=True)
    Path(dst.root, "etc/gpulib/gpulib.conf").write_text(
        f"[pool t4]\nparents = {T4}\ntype = {T4_8Q}\ncount = 1\n")
    assert cli(dst.root, "pool", "apply").returncode == 0
    member = next(u for u, r in state_of(dst.root)["vgpus"].items() if r["pool"])
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    same_but_sources(live, out, {derive_uuid(U_VM, 0): member})
    assert state_of(dst.root)["allocations"]["mig-1"]["devices"] == [
        {"kind": "mdev", "id": member, "on_demand": False}]


def test_none_free_refused_and_nothing_made(src: FakeHost, dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    held_elsewhere(dst, "stranger", U_STRANGER,
                   mdevs=("11111111-2222-4333-8444-555555555555",
                          "22222222-3333-4444-8555-666666666666"))
    before = tree_contents(dst.root)
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 1 and res.stdout == b""
    err = res.stderr.decode()
    assert len(err.splitlines()) == 1 and "no free vGPU of GRID T4-8Q" in err, err
    assert tree_contents(dst.root) == before


def test_another_gpu_model_is_no_equivalent(src: FakeHost, tmp_path: Path) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    # The record says 10de:1eb8; a host whose GPU is another model refuses.
    other = live.replace('gpu="10de:1eb8"', 'gpu="10de:2236"')
    dst = t4(str(tmp_path / "dst"))
    res = migrate_begin(dst.root, "mig-1", other)
    assert res.returncode == 1 and "on a 10de:2236 GPU" in res.stderr.decode()
    assert live_mdevs(dst.root) == set()


def test_nvidia_vf_vgpu_a_vf_is_typed_and_its_address_rewritten(tmp_path: Path) -> None:
    src, src_vfs = a10(str(tmp_path / "src"))
    live = started_on(src, request_xml("mig-1", U_VM, "profile='NVIDIA A10-2Q'"))
    assert sources(live) == [src_vfs[0]]
    assert parse_domain(live).device_types()[0][:3] == ("vf", src_vfs[0], str(A10_2Q))
    dst, vfs = a10(str(tmp_path / "dst"))
    # Here the first VF is another VM's (typed, running).
    Path(dst.root, "sys/bus/pci/devices", vfs[0], "nvidia/current_vgpu_type").write_text(
        f"{A10_2Q}\n")
    held_elsewhere(dst, "stranger", U_STRANGER, vfs=(vfs[0],))
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert sources(out) == [vfs[1]]
    # Only the VF's <source><address> moved; managed='no' and the rest stay.
    before, after = parse_domain(live), parse_domain(out)
    assert after.pci_hostdevs()[0].managed is False
    assert after.device_types()[0].id == vfs[1]
    for b, a in zip(before.root.iter(), after.root.iter()):
        if b.tag == "address" and b.getparent().tag == "source":
            continue
        if b.tag == f"{{{GPULIB_NS}}}device":
            assert {**b.attrib, "id": a.get("id")} == dict(a.attrib)
            continue
        assert (b.tag, dict(b.attrib), b.text) == (a.tag, dict(a.attrib), a.text)
    schema_valid(out)
    typed = Path(dst.root, "sys/bus/pci/devices", vfs[1], "nvidia/current_vgpu_type")
    assert typed.read_text().strip() == str(A10_2Q)
    assert state_of(dst.root)["allocations"]["mig-1"]["devices"] == [
        {"kind": "vf", "id": vfs[1], "on_demand": True}]


def test_several_vgpus_all_or_nothing(src: FakeHost, dst: FakeHost, tmp_path: Path) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'", count=2))
    assert len(sources(live)) == 2
    # One instance taken here: the second vGPU has no equivalent, the first is undone.
    held_elsewhere(dst, "stranger", U_STRANGER, mdevs=("11111111-2222-4333-8444-555555555555",))
    before = tree_contents(dst.root)
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 1 and "(type nvidia-233)" in res.stderr.decode()
    assert tree_contents(dst.root) == before
    # Both free on a fresh host: both made.
    fresh = t4(str(tmp_path / "fresh"))
    res = migrate_begin(fresh.root, "mig-1", live)
    assert res.returncode == 0, res.stderr
    assert live_mdevs(fresh.root) == set(sources(live))


def test_whole_gpu_and_unknown_vgpu_refused(dst: FakeHost) -> None:
    whole = ("<domain type='kvm'><name>pt-1</name><uuid>" + U_VM + "</uuid><devices>"
             "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
             "<address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/></source>"
             "</hostdev></devices></domain>")
    before = tree_contents(dst.root)
    res = migrate_begin(dst.root, "pt-1", whole)
    assert res.returncode == 1 and res.stdout == b""
    assert "given whole" in res.stderr.decode() and len(res.stderr.splitlines()) == 1
    unknown = ("<domain type='kvm'><name>old-1</name><uuid>" + U_VM + "</uuid><devices>"
               "<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
               "<address uuid='" + U_OTHER + "'/></source></hostdev></devices></domain>")
    res = migrate_begin(dst.root, "old-1", unknown)
    assert res.returncode == 1 and "does not say what vGPU type it is" in res.stderr.decode()
    assert tree_contents(dst.root) == before


def test_a_name_running_here_is_refused(src: FakeHost, dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    dst.add_running_domain("mig-1", U_VM)
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 1 and "already runs on this host" in res.stderr.decode()
    assert live_mdevs(dst.root) == set()


def test_a_domain_without_vgpus_comes_back_whole(dst: FakeHost) -> None:
    xml = ("<domain type='kvm'><name>plain</name><uuid>" + U_VM + "</uuid>"
           "<devices/></domain>\n")
    res = migrate_begin(dst.root, "plain", xml)
    assert res.returncode == 0 and res.stdout.decode() == xml


# -- failure and success ---------------------------------------------------------------------------

def test_a_failed_migration_releases_what_the_destination_made(src: FakeHost,
                                                               dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'", count=2))
    assert migrate_begin(dst.root, "mig-1", live).returncode == 0
    assert len(live_mdevs(dst.root)) == 2
    # libvirt cancels: the incoming domain's release end on the destination.
    res = run([QEMU_HOOK, "mig-1", "release", "end", "-"], dst.root, stdin=live.encode())
    assert res.returncode == 0
    st = state_of(dst.root)
    assert st["allocations"] == {} and st["intents"] == [] and st["vgpus"] == {}
    assert live_mdevs(dst.root) == set()
    # The source's VM still runs there with its vGPUs.
    assert set(sources(live)) <= live_mdevs(src.root)
    assert "mig-1" in state_of(src.root)["allocations"]


def test_the_source_keeps_its_devices_until_the_domain_leaves(src: FakeHost,
                                                              dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    made = sources(live)
    # A release end or onStop while the status file still shows the VM: kept.
    assert run([QEMU_HOOK, "mig-1", "release", "end", "-"], src.root).returncode == 0
    assert set(made) <= live_mdevs(src.root) and "mig-1" in state_of(src.root)["allocations"]
    assert migrate_begin(dst.root, "mig-1", live).returncode == 0
    # The migration completed: the source's domain leaves, then its release end.
    src.stop_domain("mig-1")
    assert run([QEMU_HOOK, "mig-1", "release", "end", "-"], src.root).returncode == 0
    assert state_of(src.root)["allocations"] == {} and not set(made) & live_mdevs(src.root)
    assert "mig-1" in state_of(dst.root)["allocations"]


def test_discovery_shows_the_move(src: FakeHost, dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 0
    dst.add_running_domain("mig-1", U_VM, mdevs=tuple(sources(res.stdout.decode())))
    src.stop_domain("mig-1")
    assert run([QEMU_HOOK, "mig-1", "release", "end", "-"], src.root).returncode == 0

    def used(root: str) -> list[Any]:
        out = cli(root, "discover", "--format", "cloudstack")
        assert out.returncode == 0, out.stderr
        return [v["used_by_vm"] for g in json.loads(out.stdout)["gpus"]
                for v in g["vgpu_instances"]]

    assert used(dst.root) == ["mig-1"]
    assert "mig-1" not in used(src.root)


# -- concurrency and crashes -----------------------------------------------------------------------

def test_two_arrivals_race_for_the_last_instance_exactly_one_wins(tmp_path: Path) -> None:
    a = t4(str(tmp_path / "a"))
    b = t4(str(tmp_path / "b"))
    xml1 = started_on(a, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    xml2 = started_on(b, request_xml("mig-2", U_VM2, f"type='{T4_8Q}'"))
    dst = t4(str(tmp_path / "dst"))
    held_elsewhere(dst, "stranger", U_STRANGER, mdevs=("11111111-2222-4333-8444-555555555555",))
    procs = [subprocess.Popen([QEMU_HOOK, name, "migrate", "begin", "-"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=hook_env(dst.root))
             for name in ("mig-1", "mig-2")]
    for p, x in zip(procs, (xml1, xml2)):
        # Both fed before either is read: they run at once.
        assert p.stdin is not None
        p.stdin.write(x.encode())
        p.stdin.close()
    results = [(p.stdout.read(), p.stderr.read(), p.wait(timeout=60))  # type: ignore[union-attr]
               for p in procs]
    codes = sorted(r[2] for r in results)
    assert codes == [0, 1], results
    loser = next(r for r in results if r[2] == 1)
    assert b"no free vGPU" in loser[1]
    st = state_of(dst.root)
    assert set(st["allocations"]) == {"mig-1", "mig-2"} & set(st["allocations"])
    assert len(st["allocations"]) == 1 and st["intents"] == []
    assert len(live_mdevs(dst.root)) == 2  # the stranger's and the winner's


def explained(root: str) -> set[str]:
    """The devices a write-ahead intent or an allocation of the state names."""
    st = state_of(root)
    return {i["id"] for i in st["intents"]} | {
        d["id"] for a in st["allocations"].values() for d in a["devices"]}


def _killed_at(root: str, n: int, name: str, xml: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "tests.helpers.crash_worker", str(n),
                           "gpulib.hooks.qemu", name, "migrate", "begin", "-"],
                          input=xml.encode(), capture_output=True, env=hook_env(root),
                          cwd=str(REPO), timeout=60)


@pytest.mark.slow
def test_kill_migrate_begin_at_every_write_the_retry_or_the_next_run_settles(
        src: FakeHost, tmp_path: Path) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, "type='nvidia-232'", count=2))
    n = 1
    while True:
        dst = t4(str(tmp_path / f"k{n}"))
        # The source's first UUID is another VM's here: one vGPU gets a new UUID.
        held_elsewhere(dst, "stranger", U_STRANGER, mdevs=(derive_uuid(U_VM, 0),),
                       type_id="nvidia-232")
        res = _killed_at(dst.root, n, "mig-1", live)
        if res.returncode == 0:
            break
        assert res.returncode == 137, res.stderr
        # Whatever the kill left, nothing the stranger holds is touched and
        # every vGPU made for mig-1 is explained by an intent or its allocation.
        assert live_mdevs(dst.root) - {derive_uuid(U_VM, 0)} <= explained(dst.root)
        # Cancelled instead (a copy of the host): the incoming domain's release
        # end, the next run, leaves nothing of it.
        cancelled = str(tmp_path / f"c{n}")
        shutil.copytree(dst.root, cancelled, symlinks=True)
        assert run([QEMU_HOOK, "mig-1", "release", "end", "-"], cancelled).returncode == 0
        st = state_of(cancelled)
        assert st["intents"] == [] and "mig-1" not in st["allocations"]
        assert live_mdevs(cancelled) == {derive_uuid(U_VM, 0)}
        # The retry (libvirt's next attempt) gives exactly the VM's vGPUs.
        again = migrate_begin(dst.root, "mig-1", live)
        assert again.returncode == 0, again.stderr
        got = set(sources(again.stdout.decode()))
        assert len(got) == 2 and derive_uuid(U_VM, 0) not in got
        st = state_of(dst.root)
        assert st["intents"] == []
        assert {d["id"] for d in st["allocations"]["mig-1"]["devices"]} == got
        assert live_mdevs(dst.root) == got | {derive_uuid(U_VM, 0)}
        # ... and a cancelled one leaves nothing.
        assert run([QEMU_HOOK, "mig-1", "release", "end", "-"], dst.root).returncode == 0
        assert live_mdevs(dst.root) == {derive_uuid(U_VM, 0)}
        assert "mig-1" not in state_of(dst.root)["allocations"]
        n += 1
    assert n > 3, "migrate begin made a write per vGPU to kill"


# -- gpulib migrate check --------------------------------------------------------------------------

def test_migrate_check_answers_both_ways_and_changes_nothing(src: FakeHost,
                                                            dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'", count=2))
    before = tree_contents(dst.root)
    res = cli(dst.root, "migrate", "check", "-", "--json", stdin=live)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["vm"] == "mig-1" and len(doc["devices"]) == 2
    assert [d["how"] for d in doc["devices"]] == ["new", "new"]
    assert tree_contents(dst.root) == before
    # One instance taken: the dry run counts the first new vGPU against the capacity.
    held_elsewhere(dst, "stranger", U_STRANGER, mdevs=("11111111-2222-4333-8444-555555555555",))
    before = tree_contents(dst.root)
    res = cli(dst.root, "migrate", "check", "-", stdin=live)
    assert res.returncode == 1
    assert "refused: no free vGPU of GRID T4-8Q" in res.stdout, res.stdout
    assert tree_contents(dst.root) == before


# -- the XML model's settable sources --------------------------------------------------------------

def test_settable_sources_edit_in_place() -> None:
    xml = ("<domain type='kvm'><name>x</name><!-- keep --><devices>"
           "<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='on' ramfb='on'>"
           f"<source><address uuid='{U_VM.upper()}'/></source>"
           "<address type='pci' domain='0x0000' bus='0x00' slot='0x05' function='0x0'/>"
           "</hostdev><hostdev mode='subsystem' type='pci' managed='no'><source>"
           "<address domain='0x0000' bus='65' slot='0x00' function='0x4'/></source>"
           "</hostdev></devices></domain>")
    dom = parse_domain(xml)
    m, p = dom.mdev_hostdevs()[0], dom.pci_hostdevs()[0]
    m.uuid = U_VM  # the same UUID in another spelling: no change
    p.address = PciAddress.parse("0000:41:00.4")  # bus='65' is 0x41: no change
    assert not dom.changed and dom.to_xml() == xml
    m.uuid = U_OTHER
    p.address = PciAddress.parse("0000:41:00.5")
    out = dom.to_xml()
    assert out == xml.replace(U_VM.upper(), U_OTHER).replace("function='0x4'", "function='0x5'") \
        .replace("'", '"')
    with pytest.raises(Exception, match="mdev UUID"):
        m.uuid = "not-a-uuid"


def test_device_records_parse_and_refuse_bad_values() -> None:
    good = DeviceType("mdev", U_VM, T4_8Q, "GRID T4-8Q", "10de:1eb8")
    dom = parse_domain(f"<domain><name>x</name><uuid>{U_VM}</uuid><devices/></domain>")
    dom.set_device_types([good])
    text = dom.to_xml()
    assert parse_domain(text).device_types() == [good]
    assert parse_domain(text).metadata_request() is None  # a record asks for nothing
    for bad, why in (('type="../x"', "not an mdev type id"), ('gpu="nvidia"', "vendor:device"),
                     ('kind="usb"', "must be mdev or vf")):
        key = bad.split("=")[0]
        broken = etree.fromstring(text.encode())
        rec = broken.find(f"metadata/{{{GPULIB_NS}}}gpus/{{{GPULIB_NS}}}device")
        rec.set(key, bad.split('"')[1])
        with pytest.raises(Exception, match=why):
            parse_domain(etree.tostring(broken)).device_types()


# -- VMs gpulib attach gave vGPUs -----------------------------------------------------------------

def test_attach_records_the_type_and_a_request_alone_also_says_it(src: FakeHost,
                                                                  dst: FakeHost) -> None:
    from gpulib.attach import Wanted, plan_attach
    from gpulib.config import Config

    ctx = context_for_root(src.root, simulate=True)
    xml = (f"<domain type='kvm'><name>att-1</name><uuid>{U_VM}</uuid>"
           "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>")
    change = plan_attach(ctx, Config.load(ctx.config_path), xml,
                         Wanted(profile="GRID T4-8Q", count=1))
    defined = change.after
    uuid = derive_uuid(U_VM, 0)
    assert parse_domain(defined).device_types() == [
        DeviceType("mdev", uuid, T4_8Q, "GRID T4-8Q", "10de:1eb8")]
    # An older definition without the record: the request's derived UUID says
    # what the vGPU is, and the destination gives one of the profile.
    dom = parse_domain(defined)
    dom.set_device_types([])
    bare = dom.to_xml()
    assert "gpulib:device" not in bare and "GRID T4-8Q" in bare
    held_elsewhere(dst, "stranger", U_STRANGER, mdevs=(uuid,))
    res = migrate_begin(dst.root, "att-1", bare)
    assert res.returncode == 0, res.stderr
    new = derive_uuid(U_VM, 1)
    assert sources(res.stdout.decode()) == [new] and mdev_type_of(dst.root, new) == T4_8Q


# -- gpulib doctor's migration check ---------------------------------------------------------------

CAPS = ("<qemuCaps>\n  <emulator>/usr/bin/qemu-system-x86_64</emulator>\n"
        "  <qemuctime>1700000000</qemuctime>\n  <selfctime>1700000000</selfctime>\n"
        "  <selfvers>{libvirt}</selfvers>\n  <usedQMP/>\n  <version>{qemu}</version>\n"
        "</qemuCaps>\n")


def _migration_result(root: str) -> Any:
    from gpulib import doctor as dr
    from gpulib.context import Context

    report = dr.run(Context.for_root(root), only=["migration"])
    (result,) = report.results_for("migration")
    return result


@pytest.mark.parametrize("libvirt,qemu,status,words", [
    (10000000, 8002000, "ok", "libvirt 10.0.0, QEMU 8.2.0: vGPU live migration supported"),
    (9000000, 7002022, "warn", "QEMU 7.2.22 is older than 8.1.0"),
    (8004000, 9000000, "warn", "libvirt 8.4.0 is older than 8.6.0"),
])
def test_doctor_reads_libvirts_capabilities_cache(dst: FakeHost, libvirt: int, qemu: int,
                                                 status: str, words: str) -> None:
    dst.write_file("var/cache/libvirt/qemu/capabilities/3c76bc41.xml",
                   CAPS.format(libvirt=libvirt, qemu=qemu))
    r = _migration_result(dst.root)
    assert r.status == status and words in r.message, r.message
    # What no file says is named as such, whatever the versions.
    assert "cannot be seen from here" in r.message
    assert (r.fix is None) == (status == "ok")


def test_doctor_without_the_cache_reads_the_library_and_dpkg(dst: FakeHost) -> None:
    r = _migration_result(dst.root)
    # Unknown is not ready: a warning that says so, with what to look at.
    assert r.status == "warn" and r.fix and \
        "unknown: cannot tell the version of libvirt and QEMU" in r.message, r.message
    dst.write_file("usr/lib/x86_64-linux-gnu/libvirt.so.0.8006.0", "")
    dst.write_file("var/lib/dpkg/status",
                   "Package: qemu-system-x86\nStatus: install ok installed\n"
                   "Version: 1:8.1.2+ds-1\n\nPackage: other\nVersion: 1.0\n")
    r = _migration_result(dst.root)
    assert r.status == "ok" and "libvirt 8.6.0, QEMU 8.1.2" in r.message, r.message


_DPKG_LINES = st.sampled_from([
    "Package: qemu-system-x86", "Package: qemu-kvm", "Package: qemu-system-x86-xen",
    "Package: libvirt0", "Status: install ok installed", "Status: deinstall ok config-files",
    "Version: 1:8.2.2+ds-0ubuntu1", "Version: 7.2+dfsg-7", "Version: 9.0.0", "Version: x",
    " Package: qemu-kvm", "Description: Package: qemu-kvm", "", "\r", "Package: qemu-kvm\r"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_DPKG_LINES, max_size=24), st.booleans())
def test_reading_only_qemu_stanzas_answers_as_parsing_every_stanza(
        lines: list[str], trailing_blank: bool) -> None:
    from gpulib.doctor.migration import qemu_from_dpkg, qemu_version
    from gpulib.sysfs import Sysfs

    text = "\n".join(lines) + ("\n\n" if trailing_blank else "\n")

    class Database(Sysfs):
        def read(self, rel: str, limit: Optional[int] = None) -> Optional[str]:
            assert rel == "var/lib/dpkg/status"
            return text

    # Every stanza read, the first that names an installed QEMU wins.
    every = next((v for s in text.split("\n\n") if (v := qemu_version(s)) is not None), None)
    assert qemu_from_dpkg(Database("/nonexistent")) == every


def test_the_qemu_package_is_found_among_thousands_of_stanzas(dst: FakeHost) -> None:
    others = "".join(f"Package: lib{i}\nStatus: install ok installed\nVersion: 1.{i}\n"
                     f"Description: not qemu-kvm\n\n" for i in range(3000))
    dst.write_file("usr/lib/x86_64-linux-gnu/libvirt.so.0.8006.0", "")
    dst.write_file("var/lib/dpkg/status",
                   others + "Package: qemu-kvm\nStatus: deinstall ok config-files\n"
                   "Version: 1:6.2.0\n\n" + others +
                   "Package: qemu-system-x86\nStatus: install ok installed\n"
                   "Version: 1:9.2.1+ds-1\n\n" + others)
    r = _migration_result(dst.root)
    assert r.status == "ok" and "libvirt 8.6.0, QEMU 9.2.1" in r.message, r.message


def test_doctor_on_this_machines_libvirt_and_qemu() -> None:
    """This machine's own files (read-only): libvirt's library name, dpkg's database."""
    from gpulib.doctor.migration import LIBVIRT_NEEDED, QEMU_NEEDED, versions
    from gpulib.sysfs import Sysfs

    libvirt, qemu = versions(Sysfs("/"))
    if libvirt is None or qemu is None:
        pytest.skip("this machine's libvirt or QEMU version is in no file the check reads "
                    "(libvirt-daemon-system and qemu-system-x86 from packages)")
    expected = "ok" if libvirt >= LIBVIRT_NEEDED and qemu >= QEMU_NEEDED else "warn"
    r = _migration_result("/")
    assert r.status == expected, r.message
    shown = ".".join(str(x) for x in qemu)
    assert f"QEMU {shown}" in r.message, r.message


# -- after migrate begin: libvirt's start of the incoming domain -----------------------------------

@pytest.mark.parametrize("kind", ["mdev", "vf"])
def test_the_incoming_start_accepts_what_migrate_begin_made(tmp_path: Path, kind: str) -> None:
    if kind == "mdev":
        src, dst = t4(str(tmp_path / "src")), t4(str(tmp_path / "dst"))
        held_elsewhere(dst, "stranger", U_STRANGER, mdevs=(derive_uuid(U_VM, 0),))
        live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    else:
        src, _ = a10(str(tmp_path / "src"))
        dst, vfs = a10(str(tmp_path / "dst"))
        held_elsewhere(dst, "stranger", U_STRANGER, vfs=(vfs[0],))
        live = started_on(src, request_xml("mig-1", U_VM, "profile='NVIDIA A10-2Q'"))
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    held = state_of(dst.root)["allocations"]["mig-1"]["devices"]
    # libvirt goes on with the XML it got: prepare begin, its status file, then
    # started begin.
    for op in ("prepare", "started"):
        if op == "started":
            dom = parse_domain(out.decode())
            assert dom.uuid is not None
            dst.add_running_domain("mig-1", dom.uuid,
                                   mdevs=tuple(h.uuid_checked() for h in dom.mdev_hostdevs()),
                                   pci=tuple(str(h.address) for h in dom.pci_hostdevs()),
                                   managed=False)
        r = run([QEMU_HOOK, "mig-1", op, "begin", "-"], dst.root, stdin=out)
        assert r.returncode == 0, r.stderr
    alloc = state_of(dst.root)["allocations"]["mig-1"]
    assert alloc["devices"] == held and alloc["status"] == "active"
    assert state_of(dst.root)["intents"] == []
    # ... and its stop, later, destroys what was made for it (on demand).
    dst.stop_domain("mig-1")
    r = run([QEMU_HOOK, "mig-1", "release", "end", "-"], dst.root, stdin=out)
    assert r.returncode == 0 and state_of(dst.root)["allocations"] == {}
    made = sources(out.decode())[0]
    if kind == "mdev":
        assert made not in live_mdevs(dst.root)
    else:
        typed = Path(dst.root, "sys/bus/pci/devices", made, "nvidia/current_vgpu_type")
        assert typed.read_text().strip() == "0"


def test_an_old_vm_is_annotated_on_the_source_then_migrates(src: FakeHost,
                                                           dst: FakeHost) -> None:
    made = cli(src.root, "mdev", "create", "--parent", T4, "--type", T4_8Q)
    assert made.returncode == 0, made.stderr
    uuid = made.stdout.strip()
    old = ("<domain type='kvm'><name>old-1</name><uuid>" + U_VM + "</uuid><devices>"
           "<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'><source>"
           f"<address uuid='{uuid}'/></source></hostdev></devices></domain>")
    assert run([QEMU_HOOK, "old-1", "prepare", "begin", "-"], src.root,
               stdin=old.encode()).returncode == 0
    src.add_running_domain("old-1", U_VM, mdevs=(uuid,))
    # Its XML says nothing of the type: the destination cannot tell.
    res = migrate_begin(dst.root, "old-1", old)
    assert res.returncode == 1 and "does not say what vGPU type" in res.stderr.decode()
    # The source's registry answers; the annotated XML migrates.
    before = tree_contents(src.root)
    ann = cli(src.root, "migrate", "annotate", "-", stdin=old)
    assert ann.returncode == 0, ann.stderr
    assert tree_contents(src.root) == before
    assert parse_domain(ann.stdout).device_types() == [
        DeviceType("mdev", uuid, T4_8Q, "GRID T4-8Q", "10de:1eb8")]
    res = migrate_begin(dst.root, "old-1", ann.stdout)
    assert res.returncode == 0, res.stderr
    assert mdev_type_of(dst.root, sources(res.stdout.decode())[0]) == T4_8Q


@pytest.mark.parametrize("xml,words", [
    ("<domain><name>mig-1</name><devices><hostdev", "XML"),
    ("<domain><name>other</name><uuid>" + U_VM + "</uuid><metadata>"
     "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'/></metadata></domain>",
     "with the XML of 'other'"),
    ("<domain><name>mig-1</name><uuid>" + U_VM + "</uuid><metadata>"
     "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
     "<gpulib:device kind='mdev' id='" + U_OTHER + "' type='../../x'/></gpulib:gpus>"
     "</metadata><devices><hostdev mode='subsystem' type='mdev'><source>"
     "<address uuid='" + U_OTHER + "'/></source></hostdev></devices></domain>",
     "not an mdev type id"),
])
def test_bad_input_one_line_exit_2_nothing_changed(dst: FakeHost, xml: str, words: str) -> None:
    before = tree_contents(dst.root)
    res = migrate_begin(dst.root, "mig-1", xml)
    err = res.stderr.decode()
    assert res.returncode == 2 and res.stdout == b"" and len(err.splitlines()) == 1, err
    assert words in err
    assert tree_contents(dst.root) == before


def test_a_kept_vgpu_costs_no_reading_of_the_whole_host(src: FakeHost, dst: FakeHost) -> None:
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    uuid = derive_uuid(U_VM, 0)
    dst.add_mdev(uuid, T4, T4_8Q)  # the same vGPU exists here, free: kept as it is
    probe = ("import sys\nfrom gpulib.hooks.qemu import main\n"
             "rc = main(['gpulib-qemu-hook', 'mig-1', 'migrate', 'begin', '-'])\n"
             "sys.stderr.write('discovery imported: %s\\n' % ('gpulib.discovery' in sys.modules))\n"
             "sys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", probe], input=live.encode(),
                         capture_output=True, env=hook_env(dst.root), cwd=str(REPO), timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode() == live
    assert b"discovery imported: False" in res.stderr
    assert state_of(dst.root)["allocations"]["mig-1"]["devices"] == [
        {"kind": "mdev", "id": uuid, "on_demand": False}]
