"""Live migration the way CloudStack performs it, on two simulated hosts.

The management server allocates the vGPUs on the destination; the source
agent (4.21.0.0 on) replaces the VM's hostdevs with them
(`updateGpuDevicesIfNeeded`, LibvirtGpuDef's renderings of 4.21/4.22.0 and
4.22.1: tests/helpers/cloudstack_migrate.py) and migrates; the destination's
`migrate begin` gets that XML. gpulib keeps the device the management server
chose when it is free and of the VM's type (making it ready through the
journal), else gives an equivalent and says CloudStack's record will be
corrected; the records travel by position; `gpulib migrate check` answers the
same for that XML.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpulib import mdev
from gpulib.domain import derive_uuid, parse_domain
from gpulib.entry import context_for_root
from tests.helpers.cloudstack_migrate import RELEASES, GpuDevice, rewrite
from tests.hosts import tree_contents
from tests.test_migration import (
    A10,
    A10_2Q,
    T4,
    T4_8Q,
    U_STRANGER,
    U_VM,
    a10,
    cli,
    held_elsewhere,
    live_mdevs,
    mdev_type_of,
    migrate_begin,
    request_xml,
    sources,
    started_on,
    state_of,
    t4,
)

PROFILE = "NVIDIA A10-2Q"


def vf_type(root: str, vf: str) -> str:
    return Path(root, "sys/bus/pci/devices", vf, "nvidia/current_vgpu_type").read_text().strip()


def set_vf_type(root: str, vf: str, tid: int) -> None:
    """Type a VF as the driver does (the simulated kernel updates the lists)."""
    context_for_root(root, simulate=True).sysfs.write(
        f"sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(tid))


def short(address: str) -> str:
    """The VF's address as CloudStack's discovery reports it (`bb:ss.f`)."""
    return address[5:] if address.startswith("0000:") else address


def no_syslog(host_root: str) -> Path:
    """gpulib logs to its file (the tests read it); the file."""
    conf = Path(host_root, "etc/gpulib/gpulib.conf")
    conf.parent.mkdir(parents=True, exist_ok=True)
    text = conf.read_text() if conf.exists() else ""
    conf.write_text(text + "[log]\nsyslog = no\n")
    return Path(host_root, "var/log/gpulib/gpulib.log")


@pytest.fixture
def vf_hosts(tmp_path: Path) -> tuple[str, list[str], str, list[str], str]:
    """A VM with one A10-2Q vendor VF running on the source; the destination's VFs."""
    src, src_vfs = a10(str(tmp_path / "src"))
    live = started_on(src, request_xml("mig-1", U_VM, f"profile='{PROFILE}'"))
    dst, vfs = a10(str(tmp_path / "dst"))
    return src.root, src_vfs, dst.root, vfs, live


# -- CloudStack's choice kept ------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_cloudstacks_typed_vf_is_kept(vf_hosts: tuple[str, list[str], str, list[str], str],
                                      release: str) -> None:
    _, _, dst, vfs, live = vf_hosts
    # Here the source's VF address is another VM's; the management server chose
    # the third VF, typed for the profile and free.
    set_vf_type(dst, vfs[0], A10_2Q)
    held_elsewhere_root(dst, vfs[0])
    set_vf_type(dst, vfs[2], A10_2Q)
    xml = rewrite(live, [GpuDevice(short(vfs[2]))], release)
    res = migrate_begin(dst, "mig-1", xml)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert sources(out) == [vfs[2]]
    # The hostdev is left as CloudStack wrote it; the record now names the VF here.
    assert parse_domain(out).pci_hostdevs()[0].element.get("managed") == "no"
    (rec,) = parse_domain(out).device_types()
    assert (rec.kind, rec.id, rec.type_id, rec.name) == ("vf", vfs[2], str(A10_2Q), PROFILE)
    alloc = state_of(dst)["allocations"]["mig-1"]
    assert alloc["devices"] == [{"kind": "vf", "id": vfs[2], "on_demand": False}]
    # migrate check says the same of the same XML (the VF is mig-1's own now).
    doc = json.loads(cli(dst, "migrate", "check", "-", "--json", stdin=xml).stdout)
    assert doc["ok"] and [d["how"] for d in doc["devices"]] == ["kept"]


def held_elsewhere_root(root: str, *vfs: str) -> None:
    """Another VM runs here with these VFs (one call: it is one domain)."""
    from gpulib.sim.fakehost import FakeHost

    held_elsewhere(FakeHost(root), "stranger", U_STRANGER, vfs=vfs)


@pytest.mark.parametrize("release", RELEASES)
def test_an_untyped_vf_cloudstack_chose_is_typed_and_kept(
        vf_hosts: tuple[str, list[str], str, list[str], str], release: str) -> None:
    _, _, dst, vfs, live = vf_hosts
    xml = rewrite(live, [GpuDevice(short(vfs[3]))], release)
    before = tree_contents(dst)
    check = cli(dst, "migrate", "check", "-", "--json", stdin=xml)
    assert check.returncode == 0, check.stderr
    assert [(d["target"], d["how"]) for d in json.loads(check.stdout)["devices"]] == \
        [(vfs[3], "readied")]
    assert tree_contents(dst) == before
    res = migrate_begin(dst, "mig-1", xml)
    assert res.returncode == 0, res.stderr
    assert sources(res.stdout.decode()) == [vfs[3]]
    assert vf_type(dst, vfs[3]) == str(A10_2Q)
    st = state_of(dst)
    assert st["allocations"]["mig-1"]["devices"] == [{"kind": "vf", "id": vfs[3],
                                                       "on_demand": True}]
    assert st["intents"] == []
    # A failed migration undoes it (release end), as for any arrival.
    rel = migrate_release(dst, xml)
    assert rel.returncode == 0 and vf_type(dst, vfs[3]) == "0"


def migrate_release(root: str, xml: str) -> object:
    from tests.hookrun import QEMU_HOOK, run

    return run([QEMU_HOOK, "mig-1", "release", "end", "-"], root, stdin=xml.encode())


def test_the_same_name_under_another_id_is_the_same_type(
        vf_hosts: tuple[str, list[str], str, list[str], str]) -> None:
    _, _, dst, vfs, live = vf_hosts
    # The destination's driver numbers NVIDIA A10-2Q 700.
    for vf in vfs:
        Path(dst, "sys/bus/pci/devices", vf, "nvidia/creatable_vgpu_types").write_text(
            "ID    : vGPU Name\n700   : NVIDIA A10-2Q\n701   : NVIDIA A10-4Q\n")
    res = migrate_begin(dst, "mig-1", rewrite(live, [GpuDevice(short(vfs[1]))]))
    assert res.returncode == 0, res.stderr
    assert vf_type(dst, vfs[1]) == "700"
    (rec,) = parse_domain(res.stdout.decode()).device_types()
    assert (rec.type_id, rec.name) == ("700", PROFILE)


def test_the_same_id_under_another_name_is_refused(
        vf_hosts: tuple[str, list[str], str, list[str], str]) -> None:
    _, _, dst, vfs, live = vf_hosts
    # Type 591 is another profile here, and nothing is named NVIDIA A10-2Q.
    for vf in vfs:
        Path(dst, "sys/bus/pci/devices", vf, "nvidia/creatable_vgpu_types").write_text(
            f"ID    : vGPU Name\n{A10_2Q}   : NVIDIA A10-3Q\n")
    before = tree_contents(dst)
    res = migrate_begin(dst, "mig-1", rewrite(live, [GpuDevice(short(vfs[1]))]))
    err = res.stderr.decode()
    assert res.returncode == 1 and len(err.splitlines()) == 1, err
    assert f"no free vGPU of {PROFILE}" in err
    assert tree_contents(dst) == before
    # Typed so already (the driver's list still names 591 so): another type all the same.
    Path(dst, "sys/bus/pci/devices", vfs[1], "nvidia/current_vgpu_type").write_text(
        f"{A10_2Q}\n")
    res = migrate_begin(dst, "mig-1", rewrite(live, [GpuDevice(short(vfs[1]))]))
    assert res.returncode == 1 and f"no free vGPU of {PROFILE}" in res.stderr.decode()


def test_cloudstacks_pool_mdev_not_live_is_made_live_and_kept(tmp_path: Path) -> None:
    src, dst = t4(str(tmp_path / "src")), t4(str(tmp_path / "dst"))
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    Path(dst.root, "etc/gpulib").mkdir(parents=True, exist_ok=True)
    Path(dst.root, "etc/gpulib/gpulib.conf").write_text(
        f"[pool t4]\nparents = {T4}\ntype = {T4_8Q}\ncount = 2\n")
    assert cli(dst.root, "pool", "apply").returncode == 0
    members = sorted(u for u, r in state_of(dst.root)["vgpus"].items() if r["pool"])
    # After a reboot the kernel has none; the agent still reports them.
    for u in members:
        mdev.remove(context_for_root(dst.root, simulate=True).sysfs, u)
    assert live_mdevs(dst.root) == set()
    chosen = members[1]
    xml = rewrite(live, [GpuDevice(chosen, mdev=True)])
    res = migrate_begin(dst.root, "mig-1", xml)
    assert res.returncode == 0, res.stderr
    assert sources(res.stdout.decode()) == [chosen]
    assert live_mdevs(dst.root) == {chosen} and mdev_type_of(dst.root, chosen) == T4_8Q
    st = state_of(dst.root)
    assert st["allocations"]["mig-1"]["devices"] == [{"kind": "mdev", "id": chosen,
                                                       "on_demand": False}]
    assert st["vgpus"][chosen]["pool"] == "t4"
    # A failed migration returns it to its pool (kept, not destroyed).
    assert migrate_release(dst.root, xml).returncode == 0  # type: ignore[attr-defined]
    assert chosen in live_mdevs(dst.root) and chosen in state_of(dst.root)["vgpus"]


# -- CloudStack's choice not usable: an equivalent, and a word in the log -----------------------

@pytest.mark.parametrize("release", RELEASES)
def test_cloudstacks_vf_held_by_another_vm_an_equivalent_is_chosen(
        vf_hosts: tuple[str, list[str], str, list[str], str], release: str) -> None:
    _, _, dst, vfs, live = vf_hosts
    log = no_syslog(dst)
    set_vf_type(dst, vfs[2], A10_2Q)
    held_elsewhere_root(dst, vfs[2])
    res = migrate_begin(dst, "mig-1", rewrite(live, [GpuDevice(short(vfs[2]))], release))
    assert res.returncode == 0, res.stderr
    (target,) = sources(res.stdout.decode())
    assert target != vfs[2] and vf_type(dst, target) == str(A10_2Q)
    assert vf_type(dst, vfs[2]) == str(A10_2Q)  # the other VM's, untouched
    text = log.read_text()
    assert f"{vfs[2]}" in text and "CloudStack's record is corrected by the next discovery " \
        "report" in text, text


def test_cloudstacks_mdev_of_another_type_an_equivalent_is_chosen(tmp_path: Path) -> None:
    src, dst = t4(str(tmp_path / "src")), t4(str(tmp_path / "dst"))
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    log = no_syslog(dst.root)
    other = "11111111-2222-4333-8444-555555555555"
    dst.add_mdev(other, T4, "nvidia-232")  # free, GRID T4-4Q: not the VM's type
    res = migrate_begin(dst.root, "mig-1", rewrite(live, [GpuDevice(other, mdev=True)]))
    assert res.returncode == 0, res.stderr
    (target,) = sources(res.stdout.decode())
    assert target == derive_uuid(U_VM, 0) and mdev_type_of(dst.root, target) == T4_8Q
    assert mdev_type_of(dst.root, other) == "nvidia-232"
    text = log.read_text()
    assert f"mdev {other}" in text and "of type nvidia-232 (GRID T4-4Q)" in text, text
    assert "CloudStack's record is corrected" in text


def test_an_mdev_uuid_free_here_is_made_under_that_uuid(tmp_path: Path) -> None:
    src, dst = t4(str(tmp_path / "src")), t4(str(tmp_path / "dst"))
    live = started_on(src, request_xml("mig-1", U_VM, f"type='{T4_8Q}'"))
    log = no_syslog(dst.root)
    gone = "22222222-3333-4444-8555-666666666666"  # nothing here knows it
    res = migrate_begin(dst.root, "mig-1", rewrite(live, [GpuDevice(gone, mdev=True)]))
    assert res.returncode == 0, res.stderr
    # Its UUID is free here: the vGPU is made under it, CloudStack's record holds.
    assert sources(res.stdout.decode()) == [gone] and mdev_type_of(dst.root, gone) == T4_8Q
    assert not log.exists() or "corrected" not in log.read_text()


# -- records and hostdevs ------------------------------------------------------------------------

def test_contradicting_records_are_refused(
        vf_hosts: tuple[str, list[str], str, list[str], str], tmp_path: Path) -> None:
    _, _, dst, vfs, live = vf_hosts
    before = tree_contents(dst)
    # A vf record on a hostdev that names this host's GPU itself (given whole).
    res = migrate_begin(dst, "mig-1", rewrite(live, [GpuDevice(short(A10), model="passthrough")]))
    err = res.stderr.decode()
    assert res.returncode == 1 and len(err.splitlines()) == 1, err
    assert f"PCI hostdev {A10}" in err and "contradicts" in err
    # An mdev vGPU's record on a PCI hostdev.
    src = t4(str(tmp_path / "t4src"))
    mdev_live = started_on(src, request_xml("mig-2", "9b1d7c3e-5f2a-4e8b-a6c4-2d0e8f1a3b57",
                                            f"type='{T4_8Q}'"))
    res = migrate_begin(dst, "mig-2", rewrite(mdev_live, [GpuDevice(short(vfs[1]))]))
    err = res.stderr.decode()
    assert res.returncode == 1 and len(err.splitlines()) == 1 and "contradicts" in err, err
    check = cli(dst, "migrate", "check", "-", stdin=rewrite(mdev_live, [GpuDevice(short(vfs[1]))]))
    assert check.returncode == 1 and "contradicts" in check.stdout
    assert tree_contents(dst) == before


def test_several_vgpus_all_or_nothing(tmp_path: Path) -> None:
    src, _ = a10(str(tmp_path / "src"))
    live = started_on(src, request_xml("mig-1", U_VM, f"profile='{PROFILE}'", count=2))
    assert len(sources(live)) == 2
    dst, vfs = a10(str(tmp_path / "dst"))
    # The management server chose two VFs; the second is another VM's, and the
    # others are taken too: no equivalent for it.
    for vf in (vfs[1], vfs[2], vfs[3]):
        set_vf_type(dst.root, vf, A10_2Q)
    held_elsewhere_root(dst.root, vfs[1], vfs[2], vfs[3])
    before = tree_contents(dst.root)
    xml = rewrite(live, [GpuDevice(short(vfs[0])), GpuDevice(short(vfs[1]))])
    res = migrate_begin(dst.root, "mig-1", xml)
    assert res.returncode == 1 and "no free vGPU" in res.stderr.decode()
    # The first VF, typed on the way, is cleared again: nothing changed.
    assert tree_contents(dst.root) == before
    check = cli(dst.root, "migrate", "check", "-", stdin=xml)
    assert check.returncode == 1 and f"{vfs[0]}, given vGPU type {A10_2Q}" in check.stdout


def test_records_follow_their_hostdevs_by_position(tmp_path: Path) -> None:
    src, _ = a10(str(tmp_path / "src"))
    live = started_on(src, request_xml("mig-1", U_VM, f"profile='{PROFILE}'", count=2))
    dst, vfs = a10(str(tmp_path / "dst"))
    xml = rewrite(live, [GpuDevice(short(vfs[3])), GpuDevice(short(vfs[2]))])
    res = migrate_begin(dst.root, "mig-1", xml)
    assert res.returncode == 0, res.stderr
    out = parse_domain(res.stdout.decode())
    assert sources(res.stdout.decode()) == [vfs[3], vfs[2]]
    assert [r.id for r in out.device_types()] == [vfs[3], vfs[2]]


def test_bad_metadata_is_ignored_without_vgpu_hostdevs(tmp_path: Path) -> None:
    dst = t4(str(tmp_path / "dst"))
    xml = ("<domain type='kvm'><name>plain</name><uuid>" + U_VM + "</uuid><metadata>"
           "<gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
           "<gpulib:device kind='usb' id='x'/></gpulib:gpus></metadata><devices/></domain>\n")
    res = migrate_begin(dst.root, "plain", xml)
    assert res.returncode == 0 and res.stdout.decode() == xml and res.stderr == b""
    check = cli(dst.root, "migrate", "check", "-", stdin=xml)
    assert check.returncode == 0 and "(it has no vGPU)" in check.stdout


@pytest.mark.slow
def test_kill_at_every_write_while_cloudstacks_vfs_are_typed(tmp_path: Path) -> None:
    """Two vGPUs: CloudStack's first VF is idle (typed here), its second is held
    (another is typed): a kill at each write, then libvirt's cancel or retry."""
    from tests.test_migration import _killed_at, explained

    src, _ = a10(str(tmp_path / "src"))
    live = started_on(src, request_xml("mig-1", U_VM, f"profile='{PROFILE}'", count=2))
    n = 1
    while True:
        dst, vfs = a10(str(tmp_path / f"k{n}"))
        set_vf_type(dst.root, vfs[1], A10_2Q)
        held_elsewhere_root(dst.root, vfs[1])
        xml = rewrite(live, [GpuDevice(short(vfs[0])), GpuDevice(short(vfs[1]))])
        res = _killed_at(dst.root, n, "mig-1", xml)
        if res.returncode == 0:
            break
        assert res.returncode == 137, res.stderr
        typed = {vf for vf in vfs if vf_type(dst.root, vf) != "0"}
        assert typed - {vfs[1]} <= explained(dst.root)
        assert vf_type(dst.root, vfs[1]) == str(A10_2Q)
        # Cancelled (a copy of the host): nothing of mig-1 is left.
        cancelled = str(tmp_path / f"c{n}")
        shutil.copytree(dst.root, cancelled, symlinks=True)
        assert migrate_release(cancelled, xml).returncode == 0  # type: ignore[attr-defined]
        st = state_of(cancelled)
        assert st["intents"] == [] and "mig-1" not in st["allocations"]
        assert {vf for vf in vfs if vf_type(cancelled, vf) != "0"} == {vfs[1]}
        # Retried: CloudStack's first VF kept, an equivalent for the second.
        again = migrate_begin(dst.root, "mig-1", xml)
        assert again.returncode == 0, again.stderr
        got = sources(again.stdout.decode())
        assert got[0] == vfs[0] and got[1] not in (vfs[0], vfs[1])
        st = state_of(dst.root)
        assert st["intents"] == []
        assert [d["id"] for d in st["allocations"]["mig-1"]["devices"]] == got
        assert {vf for vf in vfs if vf_type(dst.root, vf) != "0"} == set(got) | {vfs[1]}
        n += 1
    assert n > 3, "the run made fewer writes than the two typings need"


def test_a_vf_address_421_lost_is_refused_with_one_line(
        vf_hosts: tuple[str, list[str], str, list[str], str]) -> None:
    _, _, dst, _, live = vf_hosts
    before = tree_contents(dst)
    # 4.21 and 4.22.0 render 0001:41:00.4 as bus 0x0001, slot 0x41, function 0x0.
    xml = rewrite(live, [GpuDevice("0001:41:00.4")], "4.21")
    assert "bus=\"0x0001\" domain=\"0x0000\" function=\"0x0\" slot=\"0x41\"" in xml
    res = migrate_begin(dst, "mig-1", xml)
    err = res.stderr.decode()
    assert res.returncode == 2 and len(err.splitlines()) == 1, err
    assert "slot" in err and res.stdout == b""
    assert tree_contents(dst) == before


def test_a_pool_vf_that_lost_its_type_is_typed_again_and_stays_in_its_pool(
        vf_hosts: tuple[str, list[str], str, list[str], str]) -> None:
    _, _, dst, _, live = vf_hosts
    Path(dst, "etc/gpulib").mkdir(parents=True, exist_ok=True)
    Path(dst, "etc/gpulib/gpulib.conf").write_text(
        f"[pool a10]\nparents = {A10}\nprofile = {PROFILE.lower()}\ncount = 2\n")
    assert cli(dst, "pool", "apply").returncode == 0
    members = sorted(a for a, r in state_of(dst)["vf_types"].items() if r["pool"] == "a10")
    assert len(members) == 2
    # A reboot: the driver forgot the types; gpulib's registry did not.
    for vf in members:
        set_vf_type(dst, vf, 0)
    xml = rewrite(live, [GpuDevice(short(members[1]))])
    res = migrate_begin(dst, "mig-1", xml)
    assert res.returncode == 0, res.stderr
    assert sources(res.stdout.decode()) == [members[1]]
    assert vf_type(dst, members[1]) == str(A10_2Q)
    assert state_of(dst)["allocations"]["mig-1"]["devices"] == [
        {"kind": "vf", "id": members[1], "on_demand": False}]
    # Released (a failed migration), it stays its pool's, typed.
    assert migrate_release(dst, xml).returncode == 0  # type: ignore[attr-defined]
    assert state_of(dst)["vf_types"][members[1]]["pool"] == "a10"
    assert vf_type(dst, members[1]) == str(A10_2Q)
