"""MIG-backed vGPU pools end to end on the simulated H100 host: `pool apply`
makes the GPU instances and types the VFs, the CloudStack report lists
them, a VM started with one (the agent's VF rendering) holds it and its stop
gives the instance back, a reboot and the boot unit make the pool again,
placements leave room for larger profiles, surplus goes only when free, and
a kill at every write of `pool apply` is settled by the next run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import MIG_GPU, PLAIN_H100, build_mig
from gpulib.sim.migdriver import MigGpu
from tests.conftest import DATA
from tests.hookrun import STATE_CHANGE, as_agent, hook_env, run
from tests.hosts import reboot

STATE = "var/lib/gpulib/state.json"
BOOT_ID = "proc/sys/kernel/random/boot_id"
GPULIB = str(Path(sys.executable).parent / "gpulib")
REPO = Path(__file__).resolve().parents[1]
VM = "i-9-77-VM"  # the agent's fixture: the VF 0000:41:00.4, managed='no'
VF_XML = (DATA / "cloudstack-xml" / "nvidia-vf-vgpu.xml").read_text()
H100_1_10C = 517
POOL = "[pool mig]\nparents = all\nprofile = NVIDIA H100-1-10C\ncount = 2\n"


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    h = build_mig(str(tmp_path / "mig"))
    h.write_file(BOOT_ID, "boot-1\n", 0o444)
    return h


def cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULIB, *args], capture_output=True, text=True,
                          env=hook_env(root), timeout=120)


def state_of(root: str) -> dict[str, Any]:
    return json.loads(Path(root, STATE).read_text())  # type: ignore[no-any-return]


def instances(host: FakeHost) -> list[tuple[int, int]]:
    """(profile, start) of every GPU instance of the MIG GPU, as the driver has them."""
    gpu = MigGpu.load(host.device_dir(MIG_GPU))
    assert gpu is not None
    return sorted((i["profile"], i["start"]) for i in gpu.instances())


def vf_type(host: FakeHost, vf: str) -> int:
    return int(Path(host.p(f"sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type"))
               .read_text())


def cloudstack_vfs(root: str) -> list[tuple[str, str, Any]]:
    res = cli(root, "discover", "--format", "cloudstack")
    assert res.returncode == 0, res.stderr
    gpus = {g["pci_address"]: g for g in json.loads(res.stdout)["gpus"]}
    return [(v["vf_pci_address"], v["vf_profile"], v["used_by_vm"])
            for v in gpus["41:00.0"]["vf_instances"]]


def applied(host: FakeHost) -> str:
    res = cli(host.root, "pool", "apply")
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def agent(host: FakeHost, xml: str = VF_XML) -> subprocess.CompletedProcess[bytes]:
    """The agent's transformer; it never runs NVIDIA's tool."""
    calls = len(host.nvidia_smi_calls())
    res = as_agent(host.root, xml)
    assert len(host.nvidia_smi_calls()) == calls, "a hook ran nvidia-smi"
    return res


def state_change(host: FakeHost, method: str, vm: str = VM) -> None:
    calls = len(host.nvidia_smi_calls())
    assert run([STATE_CHANGE, method, vm], host.root).returncode == 0
    assert len(host.nvidia_smi_calls()) == calls, "a hook ran nvidia-smi"


def libvirt_runs(host: FakeHost, vf: str = "0000:41:00.4") -> None:
    host.add_running_domain(VM, "6a2f4c8e-0d1b-4e3a-9c57-8b6d2f0e4a19", pci=(vf,),
                            managed=False)


def test_pool_apply_makes_the_instances_then_types_the_vfs(host: FakeHost) -> None:
    out = applied(host)
    assert out.count("created GPU instance MIG 1g.10gb") == 2
    assert instances(host) == [(19, 5), (19, 6)]
    st = state_of(host.root)
    assert sorted((r["profile"], r["start"], r["pool"]) for r in st["gpu_instances"]) == [
        (19, 5, "mig"), (19, 6, "mig")]
    assert {a: (r["type_id"], r["pool"], r["gpu_instance_profile"])
            for a, r in st["vf_types"].items()} == {
        "0000:41:00.4": (H100_1_10C, "mig", 19), "0000:41:00.5": (H100_1_10C, "mig", 19)}
    assert st["intents"] == []
    assert cloudstack_vfs(host.root) == [("41:00.4", "NVIDIA H100-1-10C", None),
                                         ("41:00.5", "NVIDIA H100-1-10C", None)]
    assert "nothing to do" in applied(host)
    assert instances(host) == [(19, 5), (19, 6)]
    # `pool list` shows the members.
    res = cli(host.root, "pool", "list", "--json")
    assert [m["id"] for m in json.loads(res.stdout)["mig"]] == ["0000:41:00.4", "0000:41:00.5"]


def test_a_vm_holds_its_vf_and_its_stop_keeps_the_instance(host: FakeHost) -> None:
    applied(host)
    res = agent(host)
    assert res.returncode == 0, res.stdout
    assert b'bus="0x41" slot="0x00" function="0x4"' in res.stdout
    libvirt_runs(host)
    state_change(host, "onStart")
    alloc = state_of(host.root)["allocations"][VM]
    assert alloc["status"] == "active" and [d["id"] for d in alloc["devices"]] == [
        "0000:41:00.4"]
    assert cloudstack_vfs(host.root) == [("41:00.4", "NVIDIA H100-1-10C", VM),
                                         ("41:00.5", "NVIDIA H100-1-10C", None)]
    # Another VM naming the same VF is refused.
    other = agent(host, VF_XML.replace(VM, "i-9-78-VM").replace(
        "6a2f4c8e-0d1b-4e3a-9c57-8b6d2f0e4a19", "7b3f5d9f-1e2c-4f4b-8d68-9c7e3f1f5b2a"))
    assert other.returncode != 0 and b"in use by" in other.stdout
    # The stop: the VF is free, its type cleared, its GPU instance kept.
    host.stop_domain(VM)
    state_change(host, "onStop")
    st = state_of(host.root)
    assert VM not in st["allocations"] and st["intents"] == []
    assert vf_type(host, "0000:41:00.4") == 0
    assert st["vf_types"]["0000:41:00.4"]["pool"] == "mig"
    assert instances(host) == [(19, 5), (19, 6)]
    assert cloudstack_vfs(host.root) == [("41:00.4", "NVIDIA H100-1-10C", None),
                                         ("41:00.5", "NVIDIA H100-1-10C", None)]
    # Started again: the VF takes the free instance again.
    res = agent(host)
    assert res.returncode == 0, res.stdout
    assert vf_type(host, "0000:41:00.4") == H100_1_10C
    # `pool apply` while it is held changes nothing of it.
    libvirt_runs(host)
    state_change(host, "onStart")
    assert "nothing to do" in applied(host)


def test_a_reboot_and_the_boot_unit_make_the_pool_again(host: FakeHost) -> None:
    applied(host)
    assert agent(host).returncode == 0
    libvirt_runs(host)
    state_change(host, "onStart")
    before = state_of(host.root)["gpu_instances"]

    host = reboot(host, lambda root: build_mig(root))
    host.write_file(BOOT_ID, "boot-2\n", 0o444)
    assert instances(host) == [] and vf_type(host, "0000:41:00.4") == 0
    # Before the boot unit ran, a start finds no GPU instance: refused, at once.
    early = agent(host)
    assert early.returncode != 0 and len(early.stdout.splitlines()) == 1, early.stdout
    assert b"not available" in early.stdout
    # The boot unit: gpulib restore, then gpulib pool apply.
    res = cli(host.root, "restore")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("created GPU instance MIG 1g.10gb") == 2
    assert instances(host) == [(19, 5), (19, 6)]
    assert "nothing to do" in applied(host)
    st = state_of(host.root)
    assert [(r["profile"], r["start"]) for r in st["gpu_instances"]] == \
        [(r["profile"], r["start"]) for r in before]
    assert VM not in st["allocations"], "the allocation of the last boot is released"
    assert vf_type(host, "0000:41:00.4") == vf_type(host, "0000:41:00.5") == H100_1_10C
    assert cloudstack_vfs(host.root) == [("41:00.4", "NVIDIA H100-1-10C", None),
                                         ("41:00.5", "NVIDIA H100-1-10C", None)]
    assert agent(host).returncode == 0


def test_larger_profiles_still_fit_after_small_ones(host: FakeHost) -> None:
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool small]\nparents = 0000:41:00.0\nprofile = NVIDIA H100-1-10C\n"
                    "count = 3\n")
    applied(host)
    assert instances(host) == [(19, 4), (19, 5), (19, 6)]
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool small]\nparents = 0000:41:00.0\nprofile = NVIDIA H100-1-10C\n"
                    "count = 3\n[pool big]\nparents = 0000:41:00.0\n"
                    "profile = NVIDIA H100-3-40C\ncount = 1\n")
    out = applied(host)
    assert "created GPU instance MIG 3g.40gb at 0:4" in out
    assert instances(host) == [(9, 0), (19, 4), (19, 5), (19, 6)]
    st = state_of(host.root)
    assert sorted(r["type_id"] for r in st["vf_types"].values()) == [517, 517, 517, 520]


def test_one_apply_places_the_larger_profiles_first(host: FakeHost) -> None:
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool a]\nparents = 0000:41:00.0\nprofile = NVIDIA H100-1-10C\n"
                    "count = 3\n[pool b]\nparents = 0000:41:00.0\n"
                    "profile = NVIDIA H100-4-40C\ncount = 1\n")
    applied(host)
    assert instances(host) == [(5, 0), (19, 4), (19, 5), (19, 6)]


def test_surplus_goes_only_when_free(host: FakeHost) -> None:
    applied(host)
    assert agent(host).returncode == 0  # 41:00.4, pending
    host.write_file("etc/gpulib/gpulib.conf", POOL.replace("count = 2", "count = 0"))
    out = applied(host)
    # 41:00.5 and its instance go; the held 41:00.4 and its instance stay.
    assert "clear surplus of pool mig vf 0000:41:00.5" in out
    assert out.count("destroyed GPU instance") == 1
    assert len(instances(host)) == 1
    st = state_of(host.root)
    assert list(st["vf_types"]) == ["0000:41:00.4"] and len(st["gpu_instances"]) == 1
    assert vf_type(host, "0000:41:00.4") == H100_1_10C


def test_without_mig_mode_the_pool_says_why(host: FakeHost) -> None:
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool tsliced]\nparents = 0000:c1:00.0\nprofile = NVIDIA H100-1-10C\n"
                    "count = 1\n")
    res = cli(host.root, "pool", "apply")
    assert res.returncode == 1
    assert "no parent offers NVIDIA H100-1-10C" in res.stdout


# -- a kill at every write of pool apply --------------------------------------------------------

def _killed_apply(root: str, n: int) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "tests.helpers.crash_worker", str(n),
                           "gpulib.cli", "pool", "apply"], capture_output=True,
                          env=hook_env(root), cwd=str(REPO), timeout=120)


def _settled(host: FakeHost) -> None:
    """What a whole `pool apply` leaves: two recorded 1g instances, two typed
    recorded VFs, no intent, no instance nobody recorded."""
    st = state_of(host.root)
    assert st["intents"] == [], st["intents"]
    recorded = sorted((r["profile"], r["start"]) for r in st["gpu_instances"])
    assert recorded == instances(host) and len(recorded) == 2
    typed = {a: r["type_id"] for a, r in st["vf_types"].items()}
    assert sorted(typed.values()) == [H100_1_10C, H100_1_10C]
    assert all(vf_type(host, a) == H100_1_10C for a in typed)
    gpu = MigGpu.load(host.device_dir(MIG_GPU))
    assert gpu is not None and sorted(gpu.bound()) == sorted(typed)


@pytest.mark.slow
def test_kill_pool_apply_at_every_write_then_the_next_run_settles(tmp_path: Path) -> None:
    n = 1
    while True:
        host = build_mig(str(tmp_path / f"k{n}"))
        res = _killed_apply(host.root, n)
        if res.returncode == 0:
            break
        assert res.returncode == 137, res.stderr
        st = state_of(host.root) if Path(host.root, STATE).exists() else {"intents": [],
                                                                         "gpu_instances": []}
        # Whatever the kill left is explained: an instance nobody recorded
        # has an intent that announced it.
        recorded = {(r["profile"], r["start"]) for r in st.get("gpu_instances", [])}
        announced = {mig_placement(i["type_id"]) for i in st["intents"]
                     if i["action"] == "create-gi"}
        assert set(instances(host)) <= recorded | announced, (n, st)
        # A hook meanwhile neither runs the tool nor touches the instances.
        left = instances(host)
        state_change(host, "onStart", "i-1-1-VM")
        assert instances(host) == left
        # The next pool apply settles and completes.
        applied(host)
        _settled(host)
        n += 1
    assert n > 8, "pool apply made a write per instance and per VF to kill"
    _settled(host)


def mig_placement(text: str) -> tuple[int, int]:
    profile, start = text.split("@")
    return int(profile), int(start)


def test_reconcile_settles_an_interrupted_creation(host: FakeHost) -> None:
    # A creation announced and made, the run killed before it recorded it.
    out = subprocess.run([host.p("usr/bin/nvidia-smi"), "mig", "-i", "0", "-cgi", "19:6", "-C"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    st = state_of(host.root) if Path(host.root, STATE).exists() else None
    assert st is None
    res = cli(host.root, "status")  # makes the state file
    doc = json.loads(Path(host.root, STATE).read_text()) if Path(host.root, STATE).exists() \
        else {"version": 4}
    doc.setdefault("intents", []).append({"action": "create-gi", "id": MIG_GPU,
                                          "vm": "pool:mig", "parent": None, "type_id": "19@6",
                                          "on_demand": False})
    Path(host.root, STATE).parent.mkdir(parents=True, exist_ok=True)
    Path(host.root, STATE).write_text(json.dumps(doc))
    # A hook leaves it (it may not run the tool) ...
    state_change(host, "onStart", "i-1-1-VM")
    assert len(state_of(host.root)["intents"]) == 1 and instances(host) == [(19, 6)]
    # ... reconcile undoes it.
    res = cli(host.root, "reconcile")
    assert "undone (destroyed)" in res.stdout, res.stdout + res.stderr
    assert state_of(host.root)["intents"] == [] and instances(host) == []
    assert PciAddress.parse(MIG_GPU).bus_id in " ".join(host.nvidia_smi_calls())


# -- the state's records of MIG ------------------------------------------------------------------

def test_the_state_keeps_gpu_instances_and_refuses_bad_ones() -> None:
    from gpulib.records import CorruptStateError, State, dumps

    doc = {"version": 4, "gpu_instances": [
        {"gpu": "0000:41:00.0", "profile": 19, "start": 6, "size": 1, "gi": 13, "pool": "mig"}],
        "vf_types": {"0000:41:00.4": {"type_id": 517, "name": "NVIDIA H100-1-10C",
                                      "pool": "mig", "gpu_instance_profile": 19}},
        "intents": [{"action": "create-gi", "id": "0000:41:00.0", "vm": "pool:mig",
                     "type_id": "19@5"}]}
    state = State.from_json(doc)
    assert state.gpu_instances[0].key == ("0000:41:00.0", 6)
    assert state.vf_types["0000:41:00.4"].gi_profile == 19
    assert State.from_json(json.loads(dumps(state))) == state
    # A host without MIG keeps the document it had.
    assert "gpu_instances" not in State().to_json()
    bad = [
        {"gpu_instances": [{"gpu": "0000:41:00.0", "profile": -1, "start": 6, "size": 1}]},
        {"gpu_instances": [{"gpu": "../x", "profile": 19, "start": 6, "size": 1}]},
        {"gpu_instances": [{"gpu": "0000:41:00.0", "profile": 19, "start": 6, "size": 1}] * 2},
        {"gpu_instances": {}},
        {"vf_types": {"0000:41:00.4": {"type_id": 517, "gpu_instance_profile": "19"}}},
        {"intents": [{"action": "create-gi", "id": "0000:41:00.0", "vm": "pool:mig",
                      "type_id": "19/5"}]},
    ]
    for extra in bad:
        with pytest.raises(CorruptStateError):
            State.from_json({"version": 4, **extra})


# -- metrics, the doctor, migration --------------------------------------------------------------

def samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def test_metrics_count_gpu_instances_free_and_held(host: FakeHost) -> None:
    applied(host)
    assert agent(host).returncode == 0
    libvirt_runs(host)
    state_change(host, "onStart")
    res = cli(host.root, "metrics")
    assert res.returncode == 0, res.stderr
    gi = samples(res.stdout, "gpulib_mig_gpu_instances")
    gpu = 'pci_bus_id="00000000:41:00.0"'
    assert gi == {f'{{{gpu},profile="MIG 1g.10gb",state="free"}}': 1,
                  f'{{{gpu},profile="MIG 1g.10gb",state="held"}}': 1}
    assert samples(res.stdout, "gpulib_mig_mode_enabled") == {
        f'{{{gpu}}}': 1, '{pci_bus_id="00000000:C1:00.0"}': 0}
    creatable = samples(res.stdout, "gpulib_mig_profile_creatable_instances")
    assert creatable[f'{{{gpu},profile="MIG 1g.10gb"}}'] == 5
    assert creatable[f'{{{gpu},profile="MIG 4g.40gb"}}'] == 1
    assert samples(res.stdout, "gpulib_readiness_check_status")['{check="mig"}'] == 0
    # promtool's lint finds nothing to say of the MIG series.
    from tests.test_metrics import PROMTOOL

    if PROMTOOL is not None:
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=res.stdout,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), \
            check.stdout + check.stderr
    # A second scrape asks the tool nothing more of MIG (the layout is cached).
    calls = [c for c in host.nvidia_smi_calls() if c.startswith(("mig", "-q"))]
    assert cli(host.root, "metrics").returncode == 0
    assert [c for c in host.nvidia_smi_calls() if c.startswith(("mig", "-q"))] == calls


def doctor_mig(host: FakeHost) -> list[dict[str, Any]]:
    res = cli(host.root, "doctor", "--check", "mig", "--json")
    return list(json.loads(res.stdout)["checks"])


def test_the_doctor_checks_mig_mode_compute_instances_and_the_pools_instances(
        host: FakeHost) -> None:
    [ok] = doctor_mig(host)
    assert ok["status"] == "ok"
    smi = host.p("usr/bin/nvidia-smi")
    # MIG mode asked for on the other H100: it needs a reset.
    assert subprocess.run([smi, "-i", "1", "-mig", "1"], capture_output=True).returncode == 0
    # A GPU instance without a compute instance.
    assert subprocess.run([smi, "mig", "-i", "0", "-cgi", "9:0"],
                          capture_output=True).returncode == 0
    found = {(r["status"], r["subject"]): r for r in doctor_mig(host)}
    pending = found[("warn", "0000:c1:00.0")]
    assert "goes on at the GPU's next reset" in pending["message"]
    assert "nvidia-smi -i 00000000:C1:00.0 -r" in pending["fix"]
    no_ci = found[("fail", "0000:41:00.0")]
    assert "GPU instance 1 (MIG 3g.40gb at 0:4) has no compute instance" in no_ci["message"]
    assert no_ci["fix"] == "nvidia-smi mig -i 00000000:41:00.0 -gi 1 -cci"
    # The doctor changed nothing, and wrote no cache.
    assert not Path(host.p("var/lib/gpulib/nvidia-mig.json")).exists()


def test_the_doctor_sees_a_pools_instance_gone(host: FakeHost) -> None:
    applied(host)
    host = reboot(host, lambda root: build_mig(root))
    found = [r for r in doctor_mig(host) if r["status"] == "warn"]
    assert len(found) == 2 and all("gpulib restore" in r["fix"] for r in found)
    assert cli(host.root, "restore").returncode == 0
    assert [r["status"] for r in doctor_mig(host)] == ["ok"]


def test_a_vm_migrates_to_a_free_mig_backed_vf_of_another_host(tmp_path: Path) -> None:
    from gpulib.domain import parse_domain
    from tests.hookrun import QEMU_HOOK

    src = build_mig(str(tmp_path / "src"))
    dst = build_mig(str(tmp_path / "dst"))
    for h in (src, dst):
        h.write_file(BOOT_ID, f"boot-{h.root[-3:]}\n", 0o444)
        applied(h)
    res = agent(src)
    assert res.returncode == 0
    live = res.stdout.decode()
    # Here 41:00.4 is another VM's.
    dst.add_running_domain("stranger", "aa0e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a",
                           pci=("0000:41:00.4",), managed=False)
    calls = len(dst.nvidia_smi_calls())
    moved = run([QEMU_HOOK, VM, "migrate", "begin", "-"], dst.root, stdin=live.encode())
    assert moved.returncode == 0, moved.stderr
    assert [str(h.address) for h in parse_domain(moved.stdout.decode()).pci_hostdevs()] == [
        "0000:41:00.5"]
    assert len(dst.nvidia_smi_calls()) == calls
    # A host whose GPU has no free instance of the type refuses, with one line.
    bare = build_mig(str(tmp_path / "bare"))
    refused = run([QEMU_HOOK, VM, "migrate", "begin", "-"], bare.root, stdin=live.encode())
    assert refused.returncode != 0 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert instances(bare) == []


# -- scripts/device -----------------------------------------------------------------------------

def test_the_device_script_reports_and_exercises_one_mig_backed_vgpu(host: FakeHost,
                                                                     tmp_path: Path) -> None:
    applied(host)  # the pool's instances and VFs are left alone
    before = (instances(host), state_of(host.root)["vf_types"])
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "device"), "--root", host.root,
                          "--exercise", "--out", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "as it was (GPU instances and VF types)" in res.stdout
    for name in ("discover-table.txt", "discover.json", "discover-cloudstack.json",
                 "doctor.json", "snapshot.tar.gz", "nvidia-smi-q.txt",
                 "nvidia-smi-vgpu-s-v.txt", f"nvidia-smi-mig-lgi-{MIG_GPU}.txt"):
        assert (out / name).stat().st_size > 0, name
    # It made one instance of the smallest profile that fits, typed an idle VF
    # on it, and took both away again.
    exercised = json.loads((out / "discover-exercised.json").read_text())
    gpu = next(g for g in exercised["gpus"] if g["address"] == MIG_GPU)
    vfs = {gi["vf"] for gi in gpu["mig"]["gpu_instances"]}
    assert "0000:41:00.6" in vfs
    calls = host.nvidia_smi_calls()
    assert any("-cgi 19:4 -C" in c for c in calls) and any("-dgi" in c for c in calls)
    assert (instances(host), state_of(host.root)["vf_types"]) == before
    # Without NVIDIA's tool it says so.
    Path(host.p("usr/bin/nvidia-smi")).unlink()
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "device"), "--root", host.root,
                          "--out", str(tmp_path / "none")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "no nvidia-smi below" in res.stderr


# -- one apply settles every pool; restore finds another placement -------------------------------

def test_one_apply_shrinks_a_pool_to_make_room_for_another(host: FakeHost) -> None:
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool small]\nparents = 0000:41:00.0\nprofile = NVIDIA H100-1-10C\n"
                    "count = 7\n")
    applied(host)
    assert instances(host) == [(19, s) for s in range(7)]
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool small]\nparents = 0000:41:00.0\nprofile = NVIDIA H100-1-10C\n"
                    "count = 3\n[pool big]\nparents = 0000:41:00.0\n"
                    "profile = NVIDIA H100-4-40C\ncount = 1\n")
    # One run, as the boot unit makes it: the small pool's surplus goes
    # first, from the bottom slices, and the 4g instance takes them.
    out = applied(host)
    assert "FAILED" not in out, out
    assert instances(host) == [(5, 0), (19, 4), (19, 5), (19, 6)]
    st = state_of(host.root)
    assert sorted((r["pool"], r["start"]) for r in st["gpu_instances"]) == [
        ("big", 0), ("small", 4), ("small", 5), ("small", 6)]
    assert sorted(r["pool"] for r in st["vf_types"].values()) == ["big"] + ["small"] * 3
    assert "nothing to do" in applied(host)


def test_restore_finds_another_placement_when_the_recorded_one_is_taken(
        host: FakeHost) -> None:
    applied(host)  # 1g instances at 5 and 6
    host = reboot(host, lambda root: build_mig(root))
    host.write_file(BOOT_ID, "boot-2\n", 0o444)
    # Before the boot unit, another tool made a 2g instance over slices 4 and 5.
    smi = host.p("usr/bin/nvidia-smi")
    assert subprocess.run([smi, "mig", "-i", "0", "-cgi", "14:4", "-C"],
                          capture_output=True).returncode == 0
    res = cli(host.root, "restore")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "placement 5 was taken" in res.stdout
    assert instances(host) == [(14, 4), (19, 3), (19, 6)]
    st = state_of(host.root)
    assert sorted((r["pool"], r["start"]) for r in st["gpu_instances"]) == [("mig", 3),
                                                                            ("mig", 6)]
    # Both VFs of the pool have their type again; none is left unavailable.
    assert vf_type(host, "0000:41:00.4") == vf_type(host, "0000:41:00.5") == H100_1_10C
    assert cloudstack_vfs(host.root) == [("41:00.4", "NVIDIA H100-1-10C", None),
                                         ("41:00.5", "NVIDIA H100-1-10C", None)]
    assert "nothing to do" in applied(host)
    assert [r["status"] for r in doctor_mig(host)] == ["ok"]


def test_a_pool_beyond_its_profiles_total_stops_at_the_first_refusal(host: FakeHost) -> None:
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool me]\nparents = 0000:41:00.0\nprofile = NVIDIA H100-1-10CME\n"
                    "count = 3\n")
    res = cli(host.root, "pool", "apply")
    assert res.returncode == 1
    # One +me instance per GPU: the driver is asked for one, once.
    assert sum("-cgi 20:" in c for c in host.nvidia_smi_calls()) == 1
    assert instances(host) == [(20, 6)]
    failed = [line for line in res.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2, res.stdout
    assert "holds at most 1 MIG 1g.10gb+me GPU instance(s)" in failed[0]
    assert "no free GPU instance for 518" in failed[1]
    st = state_of(host.root)
    assert list(st["vf_types"]) == ["0000:41:00.4"] and st["intents"] == []


def test_a_failed_destroy_leaves_the_instance_its_compute_instance(tmp_path: Path) -> None:
    from gpulib import migtool
    from gpulib.nvidiasmi import ToolFailed

    calls = tmp_path / "calls"
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                    'case "$*" in *-dgi*) echo "Unable to destroy GPU instance ID  1 from GPU  0:'
                    ' Unknown Error"; exit 255;; esac\nexit 0\n')
    tool.chmod(0o755)
    with pytest.raises(ToolFailed, match="Unknown Error"):
        migtool.Tool(str(tool)).destroy(PciAddress.parse(MIG_GPU), 1)
    assert [c.split()[-1] for c in calls.read_text().splitlines()] == ["-dci", "-dgi", "-cci"]


# -- the doctor says what is known and what is not ----------------------------------------------

def _tool_replaced(host: FakeHost, body: str) -> None:
    tool = Path(host.p("usr/bin/nvidia-smi"))
    tool.unlink()
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)


@pytest.mark.parametrize("body", [
    'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver. '
    'Make sure that the latest NVIDIA driver is installed and running."\nexit 9\n',
    "exec sleep 30\n"], ids=["failing", "hanging"])
def test_the_doctor_is_honest_when_the_tool_does_not_answer(host: FakeHost, body: str) -> None:
    applied(host)
    _tool_replaced(host, body)
    host.write_file("etc/gpulib/gpulib.conf", POOL + "[discovery]\nnvidia_smi_timeout = 1\n")
    found = doctor_mig(host)
    assert not any("no GPU is in MIG mode" in r["message"] for r in found), found
    [fail] = [r for r in found if r["status"] == "fail"]
    assert fail["subject"] == MIG_GPU
    assert "MIG mode and GPU instances unknown" in fail["message"]
    assert "pool(s) mig record 2 GPU instance(s)" in fail["message"]
    assert "2 of its VFs carry or are recorded with a MIG-backed type" in fail["message"]
    why = "exit 9" if "exit 9" in body else "gave no answer within 1 s"
    assert why in fail["message"] or "s ago" in fail["message"], fail["message"]
    # The GPU without MIG records is not called out of MIG mode either.
    assert all(r["subject"] != PLAIN_H100 for r in found)


def test_the_doctor_fails_a_pool_whose_gpu_left_mig_mode(host: FakeHost) -> None:
    applied(host)
    assert agent(host).returncode == 0  # 41:00.4 pending for the VM
    host = reboot(host, lambda root: build_mig(root, mig_mode=False))
    host.write_file(BOOT_ID, "boot-2\n", 0o444)
    [fail] = [r for r in doctor_mig(host) if r["status"] == "fail"]
    assert "left MIG mode (it is disabled)" in fail["message"]
    assert "the 2 GPU instance(s) pool(s) mig record on it are gone" in fail["message"]
    assert f"nvidia-smi -i {PciAddress.parse(MIG_GPU).bus_id} -mig 1" in fail["fix"]
    # The start is refused for that reason, not for other VFs' types.
    refused = agent(host)
    assert refused.returncode != 0
    assert b"needs MIG mode, which is off on its GPU" in refused.stdout, refused.stdout


def test_a_fresh_mig_host_has_no_warning_before_the_first_pool_apply(host: FakeHost) -> None:
    assert not Path(host.p("var/lib/gpulib")).exists() or not any(
        Path(host.p("var/lib/gpulib")).iterdir())
    res = cli(host.root, "doctor", "--check", "mdev", "--check", "mig", "--json")
    checks = json.loads(res.stdout)["checks"]
    assert [c["status"] for c in checks] == ["ok", "ok"], checks
    assert not Path(host.p("var/lib/gpulib/nvidia-smi.json")).exists()
