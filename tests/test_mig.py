"""MIG: NVIDIA's formats read from real captures and written back the same,
where a new GPU instance goes, and the simulated H100 host whose tool and
kernel make a VF's MIG-backed types follow the free GPU instances."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import mig
from gpulib.entry import context_for_root
from gpulib.errors import NotAvailableError
from gpulib.nvidia import creatable_types, current_type, gpu_instance, set_type
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import MIG_GPU, PLAIN_H100, build_mig, models
from gpulib.sim.migdriver import MigGpu

DATA = Path(__file__).parent / "data" / "nvidia-smi"
H100_1_10C = 517
H100_3_40C = 520


def capture(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def h100_profiles() -> list[mig.Profile]:
    found = mig.parse_profiles(capture("h100-80gb-mig-lgip.txt"))[0]
    placements = mig.parse_placements(capture("h100-mig-lgipp.txt"))[0]
    for pid, (starts, size) in placements.items():
        found[pid].placements, found[pid].size = starts, size
    return list(found.values())


# -- real captures --------------------------------------------------------------------------

def test_the_profiles_of_an_h100_80gb_as_its_tool_lists_them() -> None:
    found = mig.parse_profiles(capture("h100-80gb-mig-lgip.txt"))
    assert list(found) == [0]
    by_id = found[0]
    assert {p: by_id[p].name for p in by_id} == {
        19: "MIG 1g.10gb", 20: "MIG 1g.10gb+me", 15: "MIG 1g.20gb", 14: "MIG 2g.20gb",
        9: "MIG 3g.40gb", 5: "MIG 4g.40gb", 0: "MIG 7g.80gb"}
    one = by_id[19]
    assert (one.free, one.total, one.memory_gib, one.sm, one.ce, one.slices) == (
        7, 7, "9.75", 16, 1, 1)
    whole = by_id[0]
    assert (whole.sm, whole.ce, whole.jpeg, whole.ofa, whole.slices) == (132, 8, 7, 1, 7)
    # The older driver's narrower table reads the same.
    older = mig.parse_profiles(capture("h100-80gb-hbm3-mig-lgip-older.txt"))[0]
    assert {p: (v.name, v.free, v.total, v.sm, v.ce) for p, v in older.items()} == \
        {p: (v.name, v.free, v.total, v.sm, v.ce) for p, v in by_id.items()}


def test_placements_instances_and_compute_instances_of_real_captures() -> None:
    placements = mig.parse_placements(capture("h100-mig-lgipp.txt"))[0]
    assert placements[19] == ((0, 1, 2, 3, 4, 5, 6), 1)
    assert placements[9] == ((0, 4), 4) and placements[5] == ((0,), 4)
    assert placements[0] == ((0,), 8)
    gis = mig.parse_instances(capture("h100-80gb-mig-lgi.txt"))[0]
    assert [(i.id, i.profile_id, i.start, i.size) for i in gis] == [(3, 14, 0, 2), (2, 9, 4, 4)]
    assert mig.parse_compute(capture("h100-80gb-mig-lci.txt")) == {0: {3: [0], 2: [0]}}
    seven = mig.parse_instances(capture("h100-80gb-hbm3-mig-lgi-7x1g.txt"))[0]
    assert [(i.id, i.start) for i in seven] == [(7 + s, s) for s in range(7)]
    assert mig.parse_compute(capture("h100-80gb-hbm3-mig-lci-7x1g.txt"))[0] == {
        gi: [0] for gi in range(7, 14)}
    gis_made, cis_made = mig.parse_created(capture("h100-nvl-mig-cgi-7x19-C.txt"))
    assert gis_made == [(13, 19), (11, 19), (12, 19), (7, 19), (8, 19), (9, 19), (10, 19)]
    assert cis_made == [(gi, 0) for gi, _ in gis_made]
    assert mig.parse_created(capture("h100-80gb-mig-cgi-9-14.txt")) == ([(2, 9), (3, 14)], [])
    fields = mig.parse_query(capture("h100-nvl-550.127.06-q-mig.txt"))
    nvl = fields[PciAddress.parse("0000:98:00.0")]
    assert mig.mode_of(nvl) == ("Enabled", "Enabled")
    assert nvl["Product Name"] == "NVIDIA H100 NVL"
    assert nvl["vGPU Device Capability.Fractional Multi-vGPU"] == "Not Supported"


TABLES = ("h100-80gb-mig-lgip.txt", "h100-80gb-hbm3-mig-lgip-older.txt",
          "h100-80gb-mig-lgi.txt", "h100-80gb-hbm3-mig-lgi-7x1g.txt",
          "h100-80gb-mig-lci.txt", "h100-80gb-hbm3-mig-lci-7x1g.txt")
_LCI_ROW = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+(MIG \S+)\s+(\d+)\s+(\d+)\s+(\S+)\s*\|$")


def _rows_of(name: str, text: str) -> list[list[list[object]]]:
    """A capture's rows as the values the simulator prints, read with
    gpulib's parsers (the compute instances' own columns by a pattern)."""
    if "lgip" in name:
        return [[[0, p.name, p.id, f"{p.free}/{p.total}", p.memory_gib, p.p2p, p.sm, p.dec,
                  p.enc], [p.ce, p.jpeg, p.ofa]] for p in mig.parse_profiles(text)[0].values()]
    if "lgi" in name:
        return [[[0, i.profile_name, i.profile_id, i.id, f"{i.start}:{i.size}"]]
                for i in mig.parse_instances(text)[0]]
    return [[[int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)), int(m.group(5)),
              m.group(6)]] for m in map(_LCI_ROW.match, text.splitlines()) if m]


@pytest.mark.parametrize("name", TABLES)
def test_the_simulator_lays_out_its_tables_as_each_capture(name: str) -> None:
    """A table learned from a capture (every driver's layout here) prints
    that capture's own rows byte for byte: the simulated tool's layout is
    the captures', not gpulib's."""
    from gpulib.sim.captured import Table

    text = capture(name)
    rows = _rows_of(name, text)
    assert rows
    assert Table.learn(text).render(rows) == text


def test_the_simulators_one_line_answers_are_the_captures() -> None:
    from gpulib.sim import captured

    profiles = h100_profiles()
    assert "".join(captured.placements_line(0, p.id, p.placements, p.size) + "\n"
                   for p in profiles) == capture("h100-mig-lgipp.txt")
    by_id = {p.id: p for p in profiles}
    made = "\n".join([captured.created_gi(2, 0, by_id[9].name, 9),
                      captured.created_gi(3, 0, by_id[14].name, 14)]) + "\n"
    assert made == capture("h100-80gb-mig-cgi-9-14.txt")
    assert captured.created_ci(0, 0, 13, "MIG 1g.12gb", 0) == \
        capture("h100-nvl-mig-cgi-7x19-C.txt").splitlines()[1]
    assert captured.destroyed_gi(1, 0) == capture("mig-dci-dgi.txt").splitlines()[3]
    assert captured.destroyed_ci(2, 0, 1) == capture("mig-dci-dgi.txt").splitlines()[2]
    lines = capture("h100-nvl-550.127.06-q-mig.txt").splitlines()
    assert captured.query_line("Product Name", "NVIDIA H100 NVL") in lines
    assert captured.query_line("Current", "Enabled", 8) in lines


def test_the_simulated_tool_answers_what_the_parsers_read(tmp_path: Path) -> None:
    """The simulated tool's tables (their layout learned from the captures)
    read back with gpulib's parsers as the driver's state holds them."""
    host = build_mig(str(tmp_path / "h"))
    smi = host.p("usr/bin/nvidia-smi")

    def tool(*args: str) -> str:
        res = subprocess.run([smi, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout
        return res.stdout

    tool("mig", "-i", "0", "-cgi", "9:0,19:6,14:4", "-C")
    profiles = mig.parse_profiles(tool("mig", "-i", "0", "-lgip"))[0]
    assert (profiles[19].free, profiles[19].total, profiles[15].free, profiles[9].free) == (
        0, 7, 0, 0)
    assert mig.parse_placements(tool("mig", "-i", "0", "-lgipp"))[0][9] == ((0, 4), 4)
    assert [(i.profile_id, i.start, i.size) for i in
            mig.parse_instances(tool("mig", "-i", "0", "-lgi"))[0]] == [
        (9, 0, 4), (14, 4, 2), (19, 6, 1)]
    assert {gi: len(c) for gi, c in mig.parse_compute(tool("mig", "-i", "0", "-lci"))[0]
            .items()} == {1: 1, 5: 1, 13: 1}


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("|+-=: {}/.,0123456789MIGgbme IDPlacement\n")),
               max_size=400))
def test_no_text_makes_a_parser_fail(text: str) -> None:
    for parse in (mig.parse_profiles, mig.parse_placements, mig.parse_instances,
                  mig.parse_compute, mig.parse_created, mig.parse_query):
        parse(text)  # type: ignore[operator]


profiles_st = st.builds(
    mig.Profile, st.integers(0, 99), st.sampled_from(["MIG 1g.10gb", "MIG 3g.40gb+me",
                                                      "MIG 7g.80gb", "MIG 2g.24gb"]),
    st.integers(0, 7), st.integers(0, 7), st.sampled_from(["9.75", "39.50", "123.12"]),
    st.just("No"), st.integers(0, 999), st.integers(0, 9), st.integers(0, 9),
    st.integers(0, 9), st.integers(0, 9), st.integers(0, 9),
    st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True).map(sorted),
    st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 15), st.lists(profiles_st, max_size=6, unique_by=lambda p: p.id))
def test_what_the_simulator_prints_reads_back(gpu: int, profiles: list[mig.Profile]) -> None:
    from gpulib.sim import captured

    text = captured.profiles_table().render([
        [[gpu, p.name, p.id, f"{p.free}/{p.total}", p.memory_gib, p.p2p, p.sm, p.dec, p.enc],
         [p.ce, p.jpeg, p.ofa]] for p in profiles])
    read = mig.parse_profiles(text).get(gpu, {})
    assert [(p.id, p.name, p.free, p.total, p.memory_gib, p.sm, p.dec, p.enc, p.ce, p.jpeg,
             p.ofa) for p in read.values()] == \
        [(p.id, p.name, p.free, p.total, p.memory_gib, p.sm, p.dec, p.enc, p.ce, p.jpeg, p.ofa)
         for p in profiles]
    placed = mig.parse_placements("".join(
        captured.placements_line(gpu, p.id, p.placements, p.size) + "\n"
        for p in profiles)).get(gpu, {})
    assert placed == {p.id: (p.placements, p.size) for p in profiles}
    gis = [mig.Instance(7 + i, p.id, p.name, p.placements[0], p.size, [0])
           for i, p in enumerate(profiles)]
    listed = captured.instances_table().render([
        [[gpu, i.profile_name, i.profile_id, i.id, f"{i.start}:{i.size}"]] for i in gis])
    assert [(i.id, i.profile_id, i.start, i.size) for i in
            mig.parse_instances(listed).get(gpu, [])] == \
        [(i.id, i.profile_id, i.start, i.size) for i in gis]


# -- where a GPU instance goes ---------------------------------------------------------------

def test_a_larger_profile_still_fits_after_small_ones() -> None:
    profiles = h100_profiles()
    by_id = {p.id: p for p in profiles}
    used: list[mig.Instance] = []
    for n in range(3):
        start = mig.choose_placement(by_id[19], profiles, used)
        assert start is not None
        used.append(mig.Instance(n, 19, "MIG 1g.10gb", start, 1))
    # Packed from the top: the 4g (only at 0) and the 3g (at 0 or 4) still fit.
    assert sorted(i.start for i in used) == [4, 5, 6]
    assert mig.choose_placement(by_id[5], profiles, used) == 0
    assert mig.choose_placement(by_id[9], profiles, used) == 0
    # The first free start would have taken slice 0 and left neither.
    naive = [mig.Instance(n, 19, "MIG 1g.10gb", n, 1) for n in range(3)]
    assert mig.free_placements(by_id[5], naive) == []
    # Full: nothing.
    whole = [mig.Instance(0, 0, "MIG 7g.80gb", 0, 8)]
    assert mig.choose_placement(by_id[19], profiles, whole) is None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([19, 20, 15, 14, 9, 5, 0]), max_size=10))
def test_a_chosen_placement_is_free_and_one_of_the_profiles(order: list[int]) -> None:
    profiles = h100_profiles()
    by_id = {p.id: p for p in profiles}
    used: list[mig.Instance] = []
    for pid in order:
        p = by_id[pid]
        start = mig.choose_placement(p, profiles, used)
        if start is None:
            assert mig.free_placements(p, used) == []
            continue
        assert start in p.placements
        taken = {s for i in used for s in i.slots()}
        assert not taken & set(range(start, start + p.size))
        used.append(mig.Instance(len(used), pid, p.name, start, p.size))


def test_what_a_type_name_says() -> None:
    assert mig.mig_backed_slices("NVIDIA H100-3-40C") == 3
    assert mig.mig_backed_slices("NVIDIA H100-1-10CME") == 1
    assert mig.mig_backed_slices("NVIDIA RTX Pro 6000 Blackwell DC-1-2Q") == 1
    assert mig.mig_backed_slices("NVIDIA A10-6Q") is None
    assert mig.mig_backed_slices("NVIDIA RTX6000-Ada-1Q") is None
    assert PciAddress.parse("0001:c1:00.0").bus_id == "00000001:C1:00.0"


# -- the simulated host ----------------------------------------------------------------------

@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return build_mig(str(tmp_path / "mig"))


def tool(host: FakeHost, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([host.p("usr/bin/nvidia-smi"), *args], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}, timeout=60)


def vfs_of(host: FakeHost, pf: str) -> list[PciAddress]:
    d = host.device_dir(pf)
    return sorted(PciAddress.parse(os.path.basename(os.path.realpath(os.path.join(d, n))))
                  for n in os.listdir(d) if n.startswith("virtfn"))


def test_the_mig_host_as_built(host: FakeHost) -> None:
    ctx = context_for_root(host.root, simulate=True)
    mig_vfs = vfs_of(host, MIG_GPU)
    assert str(mig_vfs[0]) == "0000:41:00.4" and len(mig_vfs) == 8
    # In MIG mode without a GPU instance a VF can take no type.
    assert creatable_types(ctx.sysfs, mig_vfs[0]) == {}
    plain = creatable_types(ctx.sysfs, vfs_of(host, PLAIN_H100)[0])
    assert plain == {int(k): v for k, v in models()["h100"]["nvidia_vf_types"].items()}
    q = mig.parse_query(tool(host, "-q").stdout)
    assert mig.mode_of(q[PciAddress.parse(MIG_GPU)]) == ("Enabled", "Enabled")
    assert mig.mode_of(q[PciAddress.parse(PLAIN_H100)]) == ("Disabled", "Disabled")
    listed = tool(host, "mig", "-i", "00000000:41:00.0", "-lgi")
    assert listed.returncode == 6 and "No GPU instances found" in listed.stdout
    assert tool(host, "mig", "-i", "1", "-lgi").returncode == 6  # not in MIG mode
    assert tool(host, "bogus").returncode == 2


def test_creatable_types_follow_the_free_gpu_instances(host: FakeHost) -> None:
    ctx = context_for_root(host.root, simulate=True)
    sysfs = ctx.sysfs
    a, b, c = vfs_of(host, MIG_GPU)[:3]
    made = tool(host, "mig", "-i", "00000000:41:00.0", "-cgi", "19:6", "-C")
    assert made.returncode == 0, made.stdout
    assert mig.parse_created(made.stdout) == ([(13, 19)], [(13, 0)])
    assert creatable_types(sysfs, a) == {H100_1_10C: "NVIDIA H100-1-10C"}
    set_type(sysfs, a, H100_1_10C)
    assert (current_type(sysfs, a), gpu_instance(sysfs, a)) == (H100_1_10C, 13)
    # Its one instance taken, no other VF can take the type.
    assert creatable_types(sysfs, b) == {} and creatable_types(sysfs, a) == {}
    with pytest.raises(NotAvailableError):
        set_type(sysfs, b, H100_1_10C)
    # A GPU instance that runs a vGPU is not destroyed.
    busy = tool(host, "mig", "-i", "0", "-gi", "13", "-dci")
    assert busy.returncode == 19 and "In use by another client" in busy.stdout
    # A second instance, a second VF.
    assert tool(host, "mig", "-i", "0", "-cgi", "19:5", "-C").returncode == 0
    set_type(sysfs, b, H100_1_10C)
    assert gpu_instance(sysfs, b) == 12 and creatable_types(sysfs, c) == {}
    # A GPU instance without a compute instance backs no vGPU.
    assert tool(host, "mig", "-i", "0", "-cgi", "9:0").returncode == 0
    assert creatable_types(sysfs, c) == {}
    assert tool(host, "mig", "-i", "0", "-gi", "1", "-cci").returncode == 0
    assert creatable_types(sysfs, c) == {H100_3_40C: "NVIDIA H100-3-40C"}
    # Placements are the driver's: taken slices and unknown starts are refused.
    full = tool(host, "mig", "-i", "0", "-cgi", "19:6")
    assert full.returncode == 23 and "Insufficient Resources" in full.stdout
    assert tool(host, "mig", "-i", "0", "-cgi", "9:2").returncode == 2
    # Clearing the type gives the instance back.
    from gpulib.nvidia import clear_type

    clear_type(sysfs, a)
    assert creatable_types(sysfs, c) == {H100_1_10C: "NVIDIA H100-1-10C",
                                         H100_3_40C: "NVIDIA H100-3-40C"}
    layout = mig.parse_instances(tool(host, "mig", "-lgi").stdout)[0]
    assert [(i.id, i.profile_id, i.start) for i in layout] == [(1, 9, 0), (12, 19, 5),
                                                              (13, 19, 6)]
    assert tool(host, "mig", "-i", "0", "-gi", "13", "-dci").returncode == 0
    assert tool(host, "mig", "-i", "0", "-gi", "13", "-dgi").returncode == 0
    assert MigGpu.load(host.device_dir(MIG_GPU)).instance(13) is None  # type: ignore[union-attr]
    # `-mig` sets the mode for the next reset only.
    out = tool(host, "-i", "1", "-mig", "1")
    assert out.returncode == 0 and "Enabled MIG Mode for GPU 00000000:C1:00.0" in out.stdout
    q = mig.parse_query(tool(host, "-q").stdout)[PciAddress.parse(PLAIN_H100)]
    assert mig.mode_of(q) == ("Disabled", "Enabled")
    assert host.nvidia_smi_calls()[0] == "mig -i 00000000:41:00.0 -cgi 19:6 -C"


def test_the_tool_lists_the_types_of_each_gpus_mode(host: FakeHost) -> None:
    from gpulib import nvidiasmi

    found = nvidiasmi.parse(tool(host, "vgpu", "-s", "-v").stdout)
    on_mig = found[PciAddress.parse(MIG_GPU)]
    assert on_mig[H100_1_10C].name == "NVIDIA H100-1-10C"
    assert (on_mig[H100_1_10C].gi_profile, on_mig[H100_1_10C].max_instances,
            on_mig[H100_1_10C].framebuffer_mb) == (19, 7, 10240)
    assert on_mig[H100_3_40C].gi_profile == 9
    plain = found[PciAddress.parse(PLAIN_H100)]
    assert all(n.gi_profile is None for n in plain.values())
    assert {n.name for n in plain.values()} == set(models()["h100"]["nvidia_vf_types"].values())


# -- discovery and the reports ----------------------------------------------------------------

def gpulib(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], root: str,
           *args: str) -> tuple[int, str]:
    from gpulib import cli

    monkeypatch.setenv("GPULIB_ROOT", root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    capsys.readouterr()
    code = cli.main(list(args))
    return code, capsys.readouterr().out


def test_discovery_shows_the_mig_layout_and_the_cloudstack_report_the_typed_vf(
        host: FakeHost, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tests.test_cloudstack_contract import check_agent_document

    assert tool(host, "mig", "-i", "0", "-cgi", "19:6", "-C").returncode == 0
    code, _ = gpulib(monkeypatch, capsys, host.root, "vf", "set-type", "0000:41:00.4",
                     "NVIDIA H100-1-10C")
    assert code == 0
    code, out = gpulib(monkeypatch, capsys, host.root, "discover", "--format", "json")
    assert code == 0
    gpus = {g["address"]: g for g in json.loads(out)["gpus"]}
    layout = gpus[MIG_GPU]["mig"]
    assert layout["mode"] == {"current": "Enabled", "pending": "Enabled"}
    assert layout["gpu_instances"] == [{
        "id": 13, "profile_id": 19, "profile": "MIG 1g.10gb",
        "placement": {"start": 6, "size": 1}, "compute_instances": [0],
        "vf": "0000:41:00.4", "used_by": None}]
    by_profile = {p["id"]: (p["free"], p["total"]) for p in layout["profiles"]}
    assert by_profile[19] == (6, 7) and by_profile[5] == (1, 1) and by_profile[0] == (0, 1)
    vf = next(v for v in gpus[MIG_GPU]["vfs"] if v["address"] == "0000:41:00.4")
    assert vf["nvidia"]["gpu_instance"] == 13
    types = {t["name"]: t for t in gpus[MIG_GPU]["nvidia_types"]}
    assert (types["NVIDIA H100-1-10C"]["gpu_instance_profile"],
            types["NVIDIA H100-1-10C"]["framebuffer_mb"]) == (19, 10240)
    assert gpus[PLAIN_H100]["mig"]["mode"] == {"current": "Disabled", "pending": "Disabled"}
    assert gpus[PLAIN_H100]["mig"]["gpu_instances"] == []
    code, table = gpulib(monkeypatch, capsys, host.root, "discover", "--format", "table")
    assert code == 0
    assert "nvidia-vf+mig" in table and "MIG 0000:41:00.0: Enabled; 1 GPU instance(s)" in table
    assert any(line.split()[:5] == ["13", "MIG", "1g.10gb", "6:1", "0"] and
               "0000:41:00.4" in line for line in table.splitlines())
    code, out = gpulib(monkeypatch, capsys, host.root, "discover", "--format", "cloudstack")
    doc = json.loads(out)
    check_agent_document(doc)
    h100 = {g["pci_address"]: g for g in doc["gpus"]}["41:00.0"]
    assert h100["full_passthrough"]["enabled"] == 0
    assert [(v["vf_pci_address"], v["vf_profile"], v["video_ram"], v["max_instances"])
            for v in h100["vf_instances"]] == [("41:00.4", "NVIDIA H100-1-10C", 10240, 7)]


def test_the_reports_ask_the_tool_again_only_when_the_layout_may_have_changed(
        host: FakeHost, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def mig_calls() -> list[str]:
        return [c for c in host.nvidia_smi_calls() if c.startswith(("mig", "-q"))]

    assert gpulib(monkeypatch, capsys, host.root, "discover", "--format", "json")[0] == 0
    first = mig_calls()
    # -q for both GPUs, the four listings for the one in MIG mode.
    assert first == ["-q", "mig -i 00000000:41:00.0 -lgip", "mig -i 00000000:41:00.0 -lgipp",
                     "mig -i 00000000:41:00.0 -lgi", "mig -i 00000000:41:00.0 -lci"]
    assert gpulib(monkeypatch, capsys, host.root, "discover", "--format", "json")[0] == 0
    assert mig_calls() == first
    # A GPU instance made by hand shows on the VFs: asked again.
    assert tool(host, "mig", "-i", "0", "-cgi", "9:0", "-C").returncode == 0
    code, out = gpulib(monkeypatch, capsys, host.root, "discover", "--format", "json")
    assert code == 0 and len(mig_calls()) == len(first) * 2 + 1
    assert '"profile": "MIG 3g.40gb"' in out


def test_a_failing_tool_leaves_the_report_whole(host: FakeHost, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from gpulib.sim.hosts import install_nvidia_smi

    install_nvidia_smi(host, "fail")
    code, out = gpulib(monkeypatch, capsys, host.root, "discover", "--format", "json")
    assert code == 0
    gpus = json.loads(out)["gpus"]
    assert [g["mig"] for g in gpus] == [None, None] and len(gpus[0]["vfs"]) == 8
    calls = len(host.nvidia_smi_calls())
    assert gpulib(monkeypatch, capsys, host.root, "discover", "--format", "json")[0] == 0
    assert len(host.nvidia_smi_calls()) == calls, "a failure is not asked again at once"
