"""Whose a device is, through the executables: the administrator's unmanaged GPU
(its vGPUs and VFs) is hands-off everywhere; a GPU whose IOMMU group holds an
endpoint a host driver uses is the host's whole; what the administrator made
(mdevctl, raw sysfs, a VF typed outside gpulib) stays theirs.

Besides the simulated hosts, one host is laid out here by hand with plain os
calls (real relative symlinks, PCI domain 000f, an mdev type without a `name`
file), independently of gpulib's builder and the other tests' trees."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from gpulib import doctor
from gpulib.context import Context
from gpulib.ownership import ADMIN, POOL, host_endpoints
from gpulib.pci import PciAddress
from tests import handmade
from tests.hookrun import BIN, QEMU_HOOK, as_agent, mdev_xml, run
from tests.hosts import a10_host, t4_host, tree_contents
from tests.test_ownership import pci_xml

GPULIB = str(BIN / "gpulib")
VM_UUID = "8e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e"
T4 = "0000:3b:00.0"
A10 = "0000:41:00.0"
VGPU = "4b20d080-1b54-4048-b3bb-0000000000b1"
STATE = "var/lib/gpulib/state.json"


def _gpulib(root: str, *argv: str) -> Any:
    return run([GPULIB, *argv], root)


def _report(root: str) -> dict[str, Any]:
    proc = _gpulib(root, "discover", "--format", "cloudstack")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    return {g["pci_address"]: g for g in json.loads(proc.stdout)["gpus"]}


def _state(root: str) -> dict[str, Any]:
    path = os.path.join(root, STATE)
    if not os.path.exists(path):
        return {}
    doc: dict[str, Any] = json.loads(Path(path).read_text())
    return doc


def _one_line_error(proc: Any) -> str:
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, (proc.returncode, proc.stderr)
    return lines[0]


# -- a host laid out by hand --------------------------------------------------------------


# The two primitives of a tree written with plain os calls (tests.handmade's).
_w, _ln = handmade.write, handmade.link


def _function(root: str, port: str, bdf: str, vendor: int, device: int, klass: int,
              driver: Optional[str], group: int) -> str:
    """A function behind `port` (the port itself when `bdf` is it), laid by
    tests.handmade."""
    chain = [port] if bdf == port else [port, bdf]
    return handmade.fn(root, chain, f"0x{vendor:04x}", f"0x{device:04x}", f"0x{klass:06x}",
                       driver, group)


SHARED = "000f:01:00.0"  # a GPU on vfio-pci, its audio, and an i40e NIC in one group
SHARED_AUDIO = "000f:01:00.1"
NIC = "000f:02:00.0"
MDEV_GPU = "000f:41:00.0"  # a T4 with a raw-sysfs vGPU of a type without a `name` file
RAW_VGPU = "5e1d2c3b-4a59-4687-9a5b-c4d3e2f10001"


def laid_host(root: str) -> str:
    _function(root, "000f:00:01.0", "000f:00:01.0", 0x8086, 0x2030, 0x060400, "pcieport", 5)
    _function(root, "000f:00:01.0", SHARED, 0x10DE, 0x1EB8, 0x030200, "vfio-pci", 5)
    _function(root, "000f:00:01.0", SHARED_AUDIO, 0x10DE, 0x10F8, 0x040300, "snd_hda_intel", 5)
    _function(root, "000f:00:01.0", NIC, 0x8086, 0x1572, 0x020000, "i40e", 5)
    gpu = _function(root, "000f:40:01.0", MDEV_GPU, 0x10DE, 0x1EB8, 0x030200, "nvidia", 7)
    t = os.path.join(gpu, "mdev_supported_types", "nvidia-222")
    _w(os.path.join(t, "description"), "num_heads=4, framebuffer=1024M, max_instance=16\n")
    _w(os.path.join(t, "available_instances"), "15\n")
    _w(os.path.join(t, "device_api"), "vfio-pci\n")
    m = os.path.join(gpu, RAW_VGPU)
    os.makedirs(m)
    _ln(t, os.path.join(m, "mdev_type"))
    _ln(m, os.path.join(root, "sys/bus/mdev/devices", RAW_VGPU))
    _ln(m, os.path.join(t, "devices", RAW_VGPU))
    _ln(gpu, os.path.join(root, "sys/class/mdev_bus", MDEV_GPU))
    _w(os.path.join(root, "proc/sys/kernel/random/boot_id"),
       "6a1f1b7e-8f2a-4b53-9b67-2f4c8d0e1a11\n")
    return root


def test_the_laid_host_is_read_as_laid(tmp_path: Path) -> None:
    root = laid_host(str(tmp_path / "laid"))
    ctx = Context.for_root(root)
    found = host_endpoints(ctx.sysfs, PciAddress.parse(SHARED), 5)
    # the GPU's own audio (same slot, same vendor) and the bridge are not the host's endpoints
    assert found == [(NIC, "i40e")]
    assert host_endpoints(ctx.sysfs, PciAddress.parse(MDEV_GPU), 7) == []


# -- 2: the host's NIC never goes to a guest -----------------------------------------------


def test_a_gpu_sharing_its_group_with_a_host_nic_is_not_offered_whole(tmp_path: Path) -> None:
    root = laid_host(str(tmp_path / "laid"))
    gpus = _report(root)
    assert gpus["000f:01:00.0"]["full_passthrough"]["enabled"] == 0
    # a GPU of its own group is
    assert gpus["000f:41:00.0"]["vgpu_instances"][0]["mdev_uuid"] == RAW_VGPU


def test_a_start_naming_it_is_refused_with_one_line_naming_the_nic(tmp_path: Path) -> None:
    root = laid_host(str(tmp_path / "laid"))
    before = tree_contents(os.path.join(root, "sys"))
    xml = pci_xml("i-2-7-VM", VM_UUID, SHARED)
    res = as_agent(root, xml)
    lines = res.stdout.decode().splitlines()
    assert res.returncode != 0 and len(lines) == 1, res.stdout
    assert NIC in lines[0] and "i40e" in lines[0] and "<hostdev" not in lines[0]
    hook = run([QEMU_HOOK, "i-2-7-VM", "prepare", "begin", "-"], root, stdin=xml.encode())
    assert hook.returncode != 0 and NIC.encode() in hook.stderr
    assert "i-2-7-VM" not in json.dumps(_state(root).get("allocations", {}))
    assert tree_contents(os.path.join(root, "sys")) == before
    # the NIC unbound (nobody's): it goes along as a companion, the audio too
    os.unlink(os.path.join(root, "sys/bus/pci/devices", NIC, "driver"))
    res = as_agent(root, xml)
    assert res.returncode == 0, res.stdout
    out = res.stdout.decode()
    assert 'bus="0x02"' in out and 'function="0x1"' in out


def test_the_doctor_and_setup_never_bind_the_hosts_nic(tmp_path: Path) -> None:
    root = laid_host(str(tmp_path / "laid"))
    report = doctor.run(Context.for_root(root), lock_timeout=0.1, only=["iommu-group"])
    texts = [json.dumps(r.to_json()) for r in report.results]
    assert not any("driverctl" in t or "vfio-pci\\\\n" in t for t in texts), texts
    assert any(NIC in t and "not offered whole" in t for t in texts), texts
    plan = _gpulib(root, "setup", "--json", "--passthrough", SHARED)
    text = plan.stdout.decode() + plan.stderr.decode()
    assert NIC in text and f"pci-{NIC}" not in text, text


# -- 1: unmanaged is hands-off everywhere --------------------------------------------------


def test_the_report_offers_nothing_free_of_an_unmanaged_gpu(tmp_path: Path) -> None:
    t4 = t4_host(str(tmp_path / "t4"), live=(VGPU,))
    a10 = a10_host(str(tmp_path / "a10"), numvfs=2)
    assert _gpulib(a10.root, "vf", "set-type", "0000:41:00.4", "NVIDIA A10-4Q").returncode == 0
    before = (_report(t4.root)["3b:00.0"], _report(a10.root)["41:00.0"])
    assert before[0]["vgpu_instances"][0]["used_by_vm"] is None
    assert [v["used_by_vm"] for v in before[1]["vf_instances"]] == [None]
    assert _gpulib(t4.root, "device", "unmanage", T4).returncode == 0
    assert _gpulib(a10.root, "device", "unmanage", A10).returncode == 0
    t4_entry, a10_entry = _report(t4.root)["3b:00.0"], _report(a10.root)["41:00.0"]
    assert t4_entry["full_passthrough"]["enabled"] == 0
    assert [v["used_by_vm"] for v in t4_entry["vgpu_instances"]] == ["gpulib:unavailable"]
    assert [v["used_by_vm"] for v in a10_entry["vf_instances"]] == ["gpulib:unavailable"]
    # a VM running on it is still named (hands-off, not blind)
    t4.add_running_domain("i-2-9-VM", VM_UUID, mdevs=(VGPU,))
    assert _report(t4.root)["3b:00.0"]["vgpu_instances"][0]["used_by_vm"] == "i-2-9-VM"


def test_a_start_naming_an_unmanaged_vgpu_records_nothing(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path), live=(VGPU,))
    assert _gpulib(host.root, "device", "unmanage", T4).returncode == 0
    res = as_agent(host.root, mdev_xml("i-2-7-VM", VM_UUID, VGPU))
    assert res.returncode == 0, res.stdout
    assert _state(host.root)["allocations"] == {}
    # another VM running with it: refused all the same
    host.add_running_domain("i-3-8-VM", "9e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e", mdevs=(VGPU,))
    res = as_agent(host.root, mdev_xml("i-2-7-VM", VM_UUID, VGPU))
    assert res.returncode != 0 and b"i-3-8-VM" in res.stdout


def test_commands_refuse_to_make_or_type_anything_of_an_unmanaged_gpu(tmp_path: Path) -> None:
    t4 = t4_host(str(tmp_path / "t4"))
    a10 = a10_host(str(tmp_path / "a10"), numvfs=2)
    assert _gpulib(a10.root, "vf", "set-type", "0000:41:00.5", "NVIDIA A10-4Q").returncode == 0
    for host, gpu in ((t4, T4), (a10, A10)):
        assert _gpulib(host.root, "device", "unmanage", gpu).returncode == 0
    sys_before = {h.root: tree_contents(os.path.join(h.root, "sys")) for h in (t4, a10)}
    state_before = {h.root: _state(h.root) for h in (t4, a10)}
    for host, argv in (
            (t4, ["mdev", "create", "--parent", T4, "--type", "nvidia-232"]),
            (a10, ["vf", "set-type", "0000:41:00.4", "NVIDIA A10-4Q"]),
            (a10, ["vf", "clear", "0000:41:00.5"])):
        line = _one_line_error(_gpulib(host.root, *argv))
        assert "unmanaged" in line, line
    for h in (t4, a10):
        assert tree_contents(os.path.join(h.root, "sys")) == sys_before[h.root]
        assert _state(h.root) == state_before[h.root]
    # a pool naming them makes nothing on them
    t4.write_file("etc/gpulib/gpulib.conf", "[pool p]\nparents = all\ntype = nvidia-232\n"
                  "count = 2\n")
    _gpulib(t4.root, "pool", "apply")
    assert tree_contents(os.path.join(t4.root, "sys")) == sys_before[t4.root]


def test_metrics_count_no_capacity_of_an_unmanaged_gpus_vfs(tmp_path: Path) -> None:
    host = a10_host(str(tmp_path), numvfs=2)

    def creatable() -> float:
        out = _gpulib(host.root, "metrics").stdout.decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in out.splitlines()
                   if line.startswith("gpulib_nvidia_vf_type_creatable_vfs{")
                   and 'type="593"' in line)

    assert creatable() == 2
    assert _gpulib(host.root, "device", "unmanage", A10).returncode == 0
    assert creatable() == 0


# -- 3: what the administrator made stays theirs --------------------------------------------


def test_reconcile_reports_vgpus_made_outside_gpulib_and_exits_0(tmp_path: Path) -> None:
    root = laid_host(str(tmp_path / "laid"))
    host = t4_host(str(tmp_path / "t4"))
    mdevctl_made = "6e1d2c3b-4a59-4687-9a5b-c4d3e2f10002"
    host.add_mdev(mdevctl_made, T4, "nvidia-232")
    host.write_file(f"etc/mdevctl.d/{T4}/{mdevctl_made}",
                    json.dumps({"mdev_type": "nvidia-232", "start": "auto", "attrs": []}))
    host.add_mdev(RAW_VGPU, T4, "nvidia-232")
    for r, made in ((root, [RAW_VGPU]), (host.root, [mdevctl_made, RAW_VGPU])):
        res = _gpulib(r, "reconcile", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        rows = json.loads(res.stdout)
        assert sorted(o["id"] for o in rows if o["kind"] == "mdev") == sorted(made)
        assert all(o["ok"] and ADMIN in o["detail"] for o in rows), rows
        assert all(os.path.exists(os.path.join(r, "sys/bus/mdev/devices", u)) for u in made)
        assert _state(r).get("vgpus", {}) == {}


def test_a_vf_typed_outside_gpulib_is_never_taken_into_a_pool(tmp_path: Path) -> None:
    host = a10_host(str(tmp_path), numvfs=2)
    outside = "0000:41:00.4"
    # typed straight through sysfs: gpulib has no record of it
    current = Path(host.p(f"sys/bus/pci/devices/{outside}/nvidia/current_vgpu_type"))
    assert _gpulib(host.root, "vf", "set-type", outside, "NVIDIA A10-4Q", "--no-keep"
                   ).returncode == 0
    typed = current.read_text()
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool a10]\nparents = all\nprofile = NVIDIA A10-4Q\ncount = 2\n")
    assert _gpulib(host.root, "pool", "apply").returncode in (0, 1)
    members = {a for a, r in _state(host.root)["vf_types"].items() if r.get("pool") == "a10"}
    assert outside not in members and members == {"0000:41:00.5"}
    assert current.read_text() == typed


def test_the_owner_kinds_of_one_host(tmp_path: Path) -> None:
    """Occupancy.owner: the one answer the paths ask, kind by kind."""
    from gpulib.lifecycle import open_store
    from gpulib.liveness import running_domains
    from gpulib.occupancy import Occupancy

    host = t4_host(str(tmp_path), live=(VGPU,))
    made = _gpulib(host.root, "mdev", "create", "--parent", T4, "--type", "nvidia-232"
                   ).stdout.decode().strip()
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool p]\nparents = all\ntype = nvidia-232\ncount = 1\n")
    assert _gpulib(host.root, "pool", "apply").returncode == 0
    ctx = Context.for_root(host.root)
    state = open_store(ctx).load()
    (member,) = [u for u, r in state.vgpus.items() if r.pool == "p"]
    occ = Occupancy.build(ctx.sysfs, state, running_domains(ctx.sysfs))
    kinds = {u: occ.owner("mdev", u) for u in (VGPU, made, member)}
    assert [kinds[u].kind for u in (VGPU, made, member)] == [ADMIN, ADMIN, POOL]
    assert [kinds[u].may_give for u in (VGPU, made, member)] == [False, False, True]
    assert kinds[VGPU].offered and not kinds[VGPU].may_change
    host.add_running_domain("i-2-9-VM", VM_UUID, mdevs=(member,))
    occ = Occupancy.build(ctx.sysfs, state, running_domains(ctx.sysfs))
    assert occ.owner("mdev", member).kind == "run" and occ.owner("mdev", member).name == \
        "i-2-9-VM"
    assert occ.owner("mdev", member, vm="i-2-9-VM").kind == POOL
    state.unmanaged.add(T4)
    occ = Occupancy.build(ctx.sysfs, state, running_domains(ctx.sysfs))
    assert {occ.owner("mdev", u).kind for u in (VGPU, made, member)} == {ADMIN}
    assert not any(occ.owner("mdev", u).offered for u in (VGPU, made, member))


def test_gpu_instances_made_by_hand_stay_the_administrators(tmp_path: Path) -> None:
    """A reboot, then an instance made by hand at a pool's placement before the
    boot unit ran, and one beside the pool's: the pool neither takes, counts,
    gives nor destroys them."""
    import subprocess

    from gpulib.sim.hosts import MIG_GPU, build_mig
    from gpulib.sim.migdriver import MigGpu
    from tests.hosts import reboot

    boot_id = "proc/sys/kernel/random/boot_id"
    pool = "[pool mig]\nparents = all\nprofile = NVIDIA H100-1-10C\ncount = 2\n"
    host = build_mig(str(tmp_path / "mig"))
    host.write_file(boot_id, "boot-1\n", 0o444)
    host.write_file("etc/gpulib/gpulib.conf", pool)

    def instances() -> list[tuple[int, int, int]]:
        gpu = MigGpu.load(host.device_dir(MIG_GPU))
        assert gpu is not None
        return sorted((i["profile"], i["start"], i["id"]) for i in gpu.instances())

    def by_hand(placement: str) -> None:
        smi = host.p("usr/bin/nvidia-smi")
        made = subprocess.run([smi, "mig", "-i", "0", "-cgi", placement, "-C"],
                              env={**os.environ, "GPULIB_ROOT": host.root},
                              capture_output=True, timeout=60)
        assert made.returncode == 0, made.stderr

    assert _gpulib(host.root, "pool", "apply").returncode == 0
    assert [(p, s) for p, s, _ in instances()] == [(19, 5), (19, 6)]
    host = reboot(host, lambda root: build_mig(root))
    host.write_file(boot_id, "boot-2\n", 0o444)
    by_hand("19:6")  # where the pool's second instance was
    (hand,) = instances()
    res = _gpulib(host.root, "restore")
    out = res.stdout.decode()
    assert "not made by gpulib" in out and "administrator" in out, out
    assert hand in instances()
    # shrinking the pool to nothing destroys only the pool's own instances
    host.write_file("etc/gpulib/gpulib.conf", pool.replace("count = 2", "count = 0"))
    _gpulib(host.root, "pool", "apply")
    assert instances() == [hand]
    st = _state(host.root)
    assert all(r["start"] != 6 or r.get("gi") != hand[2] for r in st.get("gpu_instances", []))
    assert not any(r.get("pool") == "mig" for r in st["vf_types"].values())


def test_an_arrival_is_given_nothing_of_an_unmanaged_gpu(tmp_path: Path) -> None:
    """`migrate begin` and `migrate check` on a host whose A10 is unmanaged: the VF the
    incoming XML names is neither kept nor typed, nor is any other."""
    from tests.test_migration import U_VM, a10, migrate_begin, request_xml, started_on

    src, _ = a10(str(tmp_path / "src"))
    live = started_on(src, request_xml("mig-1", U_VM, "profile='NVIDIA A10-2Q'"))
    dst, _ = a10(str(tmp_path / "dst"))
    assert _gpulib(dst.root, "device", "unmanage", A10).returncode == 0
    before = tree_contents(os.path.join(dst.root, "sys"))
    check = run([GPULIB, "migrate", "check", "-", "--json"], dst.root, stdin=live.encode())
    assert check.returncode == 1 and json.loads(check.stdout)["ok"] is False, check.stdout
    res = migrate_begin(dst.root, "mig-1", live)
    assert res.returncode != 0, res.stdout
    assert tree_contents(os.path.join(dst.root, "sys")) == before
    assert "mig-1" not in json.dumps(_state(dst.root).get("allocations", {}))
    # managed again: the arrival is given a VF
    assert _gpulib(dst.root, "device", "manage", A10).returncode == 0
    assert migrate_begin(dst.root, "mig-1", live).returncode == 0



def test_the_rules_kind_by_kind() -> None:
    from gpulib.ownership import (
        GI_BOOT,
        NOBODY,
        gpu_instance_owner,
        unmanaged_reason,
        vf_owner,
        vgpu_owner,
    )
    from gpulib.records import HANDMADE, GpuInstanceRecord, State, VfRecord, VgpuRecord

    assert unmanaged_reason(set(), [VGPU, T4]) is None
    assert unmanaged_reason({T4}, [T4]) is not None and "below" not in \
        str(unmanaged_reason({T4}, [T4]))
    assert f"below the unmanaged {T4}" in str(unmanaged_reason({T4}, [VGPU, T4]))
    # vGPUs: by how they came to be
    assert vgpu_owner(None, VGPU, live=True).kind == ADMIN  # mdevctl or sysfs
    assert vgpu_owner(None, VGPU, live=False).kind == NOBODY  # nothing there
    assert vgpu_owner(VgpuRecord(T4, "nvidia-232", pool=HANDMADE), VGPU, True).kind == ADMIN
    assert vgpu_owner(VgpuRecord(T4, "nvidia-232", pool="p"), VGPU, True).kind == POOL
    assert vgpu_owner(VgpuRecord(T4, "nvidia-232", on_demand=True), VGPU, True).kind == NOBODY
    # VFs: a type without a record was set outside gpulib
    assert vf_owner(None, "0000:41:00.4", 593).kind == ADMIN
    assert vf_owner(None, "0000:41:00.4", 0).kind == NOBODY
    assert vf_owner(VfRecord(593, pool=HANDMADE), "0000:41:00.4", 593).kind == ADMIN
    assert vf_owner(VfRecord(593, pool="a10"), "0000:41:00.4", 593).may_give
    # GPU instances: a pool's only with gpulib's record
    state = State()
    state.gpu_instances.append(GpuInstanceRecord(A10, 19, 5, 1, 3, "mig"))
    assert gpu_instance_owner(state, A10, 19, 5).kind == POOL
    assert gpu_instance_owner(state, A10, 19, 6).kind == ADMIN
    # ... and only the instance it made: its id, in the boot the ids are of
    state.extra[GI_BOOT] = "boot-1"
    assert gpu_instance_owner(state, A10, 19, 5, gi=3, boot="boot-1").kind == POOL
    assert gpu_instance_owner(state, A10, 19, 5, gi=4, boot="boot-1").kind == ADMIN
    # after a reboot, one at the recorded placement before gpulib made it again
    assert gpu_instance_owner(state, A10, 19, 5, gi=3, boot="boot-2").kind == ADMIN
