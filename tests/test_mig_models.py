"""MIG-backed vGPUs on every simulated model (gpulib/sim/data/mig_models.json
and the H100 PCIe of models.json): the table names a source for each fact,
`pool apply` makes GPU instances where `choose_placement` puts them on that
model's slices, a pool is as large as the model's profile allows and no
larger, and the CloudStack report gives each model's numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpulib import mig
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import MIG_GPU, PLACEHOLDER_TYPE_IDS, build_mig, mig_catalog, mig_models
from gpulib.sim.migdriver import MigGpu
from tests.hookrun import hook_env

GPULIB = str(Path(sys.executable).parent / "gpulib")
MODELS = sorted(mig_catalog())


def cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULIB, *args], capture_output=True, text=True,
                          env=hook_env(root), timeout=120)


def first_type(key: str) -> tuple[int, str, int, int]:
    """(type id, name, GPU instance profile, vGPUs per instance) of the model's first type."""
    tid, t = next(iter(mig_catalog()[key]["nvidia_mig_vf_types"].items()))
    return int(tid), str(t[0]), int(t[1]), int(t[2]) if len(t) > 2 else 1


def profile_of(key: str, pid: int) -> dict[str, Any]:
    return next(p for p in mig_catalog()[key]["mig_profiles"] if p["id"] == pid)


def instances(host: FakeHost) -> list[tuple[int, int, int]]:
    gpu = MigGpu.load(host.device_dir(MIG_GPU))
    assert gpu is not None
    return sorted((i["profile"], i["start"], i["id"]) for i in gpu.instances())


def pool(name: str, count: int) -> str:
    return f"[pool mig]\nparents = 0000:41:00.0\nprofile = {name}\ncount = {count}\n"


def report(root: str) -> dict[str, Any]:
    res = cli(root, "discover", "--format", "cloudstack")
    assert res.returncode == 0, res.stderr
    gpus = {g["pci_address"]: g for g in json.loads(res.stdout)["gpus"]}
    return gpus["41:00.0"]  # type: ignore[no-any-return]


def test_every_fact_of_the_table_names_its_source() -> None:
    for key, m in mig_models().items():
        assert m["pci"]["source"] and m["profiles_source"] and m["vgpu_types_source"], key
        assert m["instance_ids_source"], key
        ids = {p["id"] for p in m["profiles"]}
        assert len(ids) == len(m["profiles"]), key
        for t in m["vgpu_types"]:
            assert t["profile"] in ids, (key, t["name"])
            # A public number or none: placeholders live in the simulator only.
            assert t["type_id"] is None or t["type_id"] < PLACEHOLDER_TYPE_IDS, (key, t)
    numbers = [int(k) for m in mig_catalog().values() for k in m["nvidia_mig_vf_types"]]
    assert len(numbers) == len(set(numbers))


@pytest.mark.parametrize("key", MODELS)
def test_a_pool_fills_the_model_and_no_more(tmp_path: Path, key: str) -> None:
    tid, name, pid, per_gi = first_type(key)
    prof = profile_of(key, pid)
    host = build_mig(str(tmp_path / key), model=key)
    host.write_file("etc/gpulib/gpulib.conf", pool(name, 2))
    res = cli(host.root, "pool", "apply")
    assert res.returncode == 0, res.stdout + res.stderr
    # Packed from the top of the model's slices, as choose_placement says.
    gpu = MigGpu.load(host.device_dir(MIG_GPU))
    assert gpu is not None
    profiles, _ = gpu.model()
    want: list[mig.Instance] = []
    for _ in range(2):
        p = next(x for x in profiles if x.id == pid)
        start = mig.choose_placement(p, profiles, want)
        assert start is not None
        want.append(mig.Instance(-1, pid, p.name, start, p.size))
    got = instances(host)
    assert sorted((i, s) for i, s, _ in got) == sorted((pid, w.start) for w in want)
    assert max(s for _, s, _ in got) == max(prof["placements"])
    # The report's numbers follow the model.
    vfs = report(host.root)["vf_instances"]
    typed = [v for v in vfs if v["vf_profile"] == name]
    assert [v["vf_pci_address"] for v in typed] == ["41:00.4", "41:00.5"]
    gb = int(name.rsplit("-", 1)[1].rstrip("CMEQ"))
    assert {(v["max_instances"], v["video_ram"]) for v in typed} == {
        (prof["total"] * per_gi, gb * 1024)}
    st = json.loads(Path(host.root, "var/lib/gpulib/state.json").read_text())
    assert {r["type_id"] for r in st["vf_types"].values()} == {tid}
    # As many as the profile's total; one more has no room and leaves things as they were.
    host.write_file("etc/gpulib/gpulib.conf", pool(name, prof["total"]))
    res = cli(host.root, "pool", "apply")
    assert res.returncode == 0, res.stdout + res.stderr
    # (each model's first type runs on a profile with a placement per instance)
    assert sorted(s for _, s, _ in instances(host)) == sorted(prof["placements"])
    before = instances(host)
    host.write_file("etc/gpulib/gpulib.conf", pool(name, prof["total"] + 1))
    res = cli(host.root, "pool", "apply")
    assert res.returncode != 0
    assert f"holds at most {prof['total']} {prof['name']} GPU instance(s)" in res.stdout
    assert instances(host) == before


@pytest.mark.parametrize("key", [k for k in MODELS if k != "h100"])
def test_instance_ids_follow_the_model(tmp_path: Path, key: str) -> None:
    """The driver's GPU instance ids: A30-like four-slice GPUs number 1g
    instances from 3, seven-slice ones from 7 (the captures of the table)."""
    host = build_mig(str(tmp_path / key), model=key)
    bases = {int(k): v for k, v in mig_models()[key]["instance_ids"].items()}
    _, name, pid, _ = first_type(key)
    host.write_file("etc/gpulib/gpulib.conf", pool(name, 1))
    assert cli(host.root, "pool", "apply").returncode == 0
    [(_, start, gi)] = instances(host)
    size = profile_of(key, pid)["size"]
    assert gi == bases[size] + start // size


@pytest.mark.parametrize("key", MODELS)
def test_the_tool_names_the_product(tmp_path: Path, key: str) -> None:
    host = build_mig(str(tmp_path / key), model=key)
    res = subprocess.run([host.p("usr/bin/nvidia-smi"), "-q", "-i", "00000000:41:00.0"],
                         capture_output=True, text=True, env=hook_env(host.root), timeout=60)
    want = mig_catalog()[key].get("product_name", "NVIDIA H100 PCIe")
    assert f": {want}\n" in res.stdout, res.stdout + res.stderr


DC_1_8Q = "NVIDIA RTX Pro 6000 Blackwell DC-1-8Q"


def bound(host: FakeHost) -> dict[str, int]:
    gpu = MigGpu.load(host.device_dir(MIG_GPU))
    assert gpu is not None
    return gpu.bound()


def test_several_vgpus_share_a_gpu_instance_on_the_rtx_pro_6000(tmp_path: Path) -> None:
    """DC-1-8Q runs three to a 1g.24gb+gfx instance: six vGPUs take two
    instances, not six (the GPU has four); a VM starts on one; a shrink to
    three gives one instance back."""
    from tests.test_mig_pools import VM, agent, libvirt_runs, state_change, state_of

    host = build_mig(str(tmp_path / "rtx"), model="rtx-pro-6000-bw")
    host.write_file("proc/sys/kernel/random/boot_id", "boot-1\n", 0o444)
    host.write_file("etc/gpulib/gpulib.conf", pool(DC_1_8Q, 6))
    res = cli(host.root, "pool", "apply")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [(p, s) for p, s, _ in instances(host)] == [(47, 2), (47, 3)]
    on = bound(host)
    assert len(on) == 6 and sorted(list(on.values()).count(gi) for gi in set(on.values())) == [
        3, 3]
    vfs = [v for v in report(host.root)["vf_instances"] if v["vf_profile"] == DC_1_8Q]
    assert len(vfs) == 6 and {v["max_instances"] for v in vfs} == {12}
    assert "nothing to do" in cli(host.root, "pool", "apply").stdout
    # A VM starts on a VF whose instance it shares with two others.
    started = agent(host)
    assert started.returncode == 0, started.stdout
    libvirt_runs(host)
    state_change(host, "onStart")
    assert state_of(host.root)["allocations"][VM]["status"] == "active"
    # Three are enough for one instance: the other goes, the VM's VF stays put.
    held_gi = bound(host)["0000:41:00.4"]
    host.write_file("etc/gpulib/gpulib.conf", pool(DC_1_8Q, 3))
    res = cli(host.root, "pool", "apply")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [gi for _, _, gi in instances(host)] == [held_gi]
    assert len(bound(host)) == 3 and set(bound(host).values()) == {held_gi}
    assert bound(host)["0000:41:00.4"] == held_gi


def test_max_instances_per_gi_is_read_from_the_tool() -> None:
    """A capture of `nvidia-smi vgpu -s -v` (RTX PRO 6000 Blackwell, driver
    580.105.06): a MIG-backed type says how many vGPUs one instance runs, a
    time-sliced one says N/A; and the report's stored numbers keep it."""
    from gpulib import nvidiasmi
    from gpulib.pci import PciAddress

    text = (Path(__file__).resolve().parents[1] / "gpulib/sim/data/nvidia-smi"
            / "rtx-pro-6000-580.105.06-vgpu-s-v.txt").read_text()
    types = nvidiasmi.parse(text)[PciAddress.parse("0000:8c:00.0")]
    assert {tid: (n.gi_profile, n.per_gi) for tid, n in types.items()} == {
        0x5EE: (None, None), 0x5F1: (None, None), 0x604: (None, None), 0x60A: (19, 1)}
    three = types[0x60A]._replace(per_gi=3)
    assert nvidiasmi.TypeNumbers.from_json(three.as_json()) == three
    assert "per_gi" not in types[0x60A].as_json()


def test_the_h200_answers_lgip_as_a_public_capture(tmp_path: Path) -> None:
    """An H200 141GB's `nvidia-smi mig -lgip` rows, as a public capture prints
    them (id, total, GiB, SMs, DEC, ENC, CE, JPEG, OFA): the simulated tool
    answers the same from the table."""
    host = build_mig(str(tmp_path / "h200"), model="h200")
    res = subprocess.run([host.p("usr/bin/nvidia-smi"), "mig", "-lgip"], capture_output=True,
                         text=True, env=hook_env(host.root), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    [rows] = mig.parse_profiles(res.stdout).values()  # the one GPU in MIG mode
    got = {p.name: (p.id, p.total, p.memory_gib, p.sm, p.dec, p.enc, p.ce, p.jpeg, p.ofa)
           for p in rows.values()}
    assert got == {
        "MIG 1g.18gb": (19, 7, "16.00", 16, 1, 0, 1, 1, 0),
        "MIG 1g.18gb+me": (20, 1, "16.00", 16, 1, 0, 1, 1, 1),
        "MIG 2g.35gb": (14, 3, "32.50", 32, 2, 0, 2, 2, 0),
        "MIG 7g.141gb": (0, 1, "140.00", 132, 7, 0, 8, 7, 1),
    }
