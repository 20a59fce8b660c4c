"""NVIDIA's tool as gpulib asks it for the numbers of vendor-specific VF types:
real captures parsed, the simulator's tool answering, failing and hanging,
the cache, and the numbers in `gpulib discover` and `gpulib mdev types` on
hosts in PCI domains 0000, 0001 and 000f."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import cli, nvidiasmi
from gpulib.nvidiasmi import TypeNumbers
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import install_nvidia_smi, nvidia_smi_output
from tests.test_cloudstack_contract import (
    A10_6Q,
    DOMAINS,
    NEW_UUID,
    NEW_VM,
    addresses,
    by_address,
    contract_host,
    discover_cloudstack,
    lspci,
)
from tests.test_realhosts import pci_xml, transform

DATA = Path(__file__).parent / "data" / "nvidia-smi"
UNKNOWN = "NVIDIA vGPU type numbers unknown"


def capture(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


# -- real captures ------------------------------------------------------------------------------

def test_a_real_capture_gives_each_types_numbers() -> None:
    found = nvidiasmi.parse(capture("rtx-pro-6000-580.105.06-vgpu-s-v.txt"))
    assert list(found) == [PciAddress.parse("0000:8c:00.0")]
    types = found[PciAddress.parse("0000:8c:00.0")]
    assert sorted(types) == [0x5EE, 0x5F1, 0x604, 0x60A]
    dc4q = types[0x5F1]
    # "Max Instances", not "Max Instances Per VM" (16) or "Per GI".
    assert (dc4q.name, dc4q.max_instances, dc4q.framebuffer_mb) == (
        "NVIDIA RTX Pro 6000 Blackwell DC-4Q", 24, 4096)
    assert types[0x60A].max_instances == 48 and types[0x604].framebuffer_mb == 49152
    # The capture was cut before the display fields: unknown, not made up.
    assert (dc4q.num_heads, dc4q.max_resolution) == (None, None)


def test_a_type_id_is_the_creatable_lists_decimal_one() -> None:
    """0x252 is the 594 of `creatable_vgpu_types` (NVIDIA A10-6Q); a block
    outside a GPU's section belongs to no GPU."""
    text = capture("a10-vgpu-s-v-type-0x252.txt")
    assert nvidiasmi.parse(text) == {}
    [types] = nvidiasmi.parse("GPU 00000000:41:00.0\n" + text).values()
    assert types[A10_6Q].name == "NVIDIA A10-6Q"


def test_a_gpu_of_another_pci_domain_and_a_listing_without_numbers() -> None:
    found = nvidiasmi.parse(capture("rtx-pro-6000-580.105.06-vgpu-i-2-s.txt"))
    assert found == {PciAddress.parse("0001:04:00.0"): {}}
    assert nvidiasmi.parse(capture("no-driver.txt")) == {}


def test_the_simulators_tool_prints_the_captures_layout(tmp_path: Path) -> None:
    host = contract_host(str(tmp_path / "h"), "0001")
    text = nvidia_smi_output(host)
    lines = text.splitlines()
    assert lines[0] == "GPU 00000001:04:00.0"
    real = capture("rtx-pro-6000-580.105.06-vgpu-s-v.txt").splitlines()
    # The same keys at the same indent and column as the real tool's.
    keys = {line.split(":")[0] for line in real[1:]}
    assert keys <= {line.split(":")[0] for line in lines[1:]}
    a10_6q = nvidiasmi.parse(text)[PciAddress.parse("0001:04:00.0")][A10_6Q]
    # As the stock script reported the A10-6Q from the real tool.
    assert a10_6q == TypeNumbers("NVIDIA A10-6Q", 4, 6144, 4, (7680, 4320))


numbers = st.builds(TypeNumbers, st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl",
                                                                           "Zp")),
                                         min_size=1, max_size=40).map(str.strip)
                    .filter(bool),
                    st.integers(1, 64), st.integers(1, 200_000), st.integers(1, 8),
                    st.tuples(st.integers(1, 16384), st.integers(1, 16384)))
gpus = st.dictionaries(
    st.builds(PciAddress, st.integers(0, 0xFFFF), st.integers(0, 255), st.integers(0, 31),
              st.integers(0, 7)),
    st.dictionaries(st.integers(1, 10 ** 6), st.tuples(st.sampled_from(["Quadro", "NVS"]),
                                                       numbers), max_size=4),
    max_size=3)


@settings(max_examples=60, deadline=None)
@given(gpus)
def test_what_the_tool_prints_is_read_back(found: dict[PciAddress, dict[int, Any]]) -> None:
    """What the simulated tool prints (its layout learned from the RTX PRO
    6000 capture, not written by gpulib) reads back."""
    from gpulib.sim.captured import vgpu_types

    assert nvidiasmi.parse(vgpu_types(found)) == {
        a: {t: n for t, (_k, n) in types.items()} for a, types in found.items()}


def test_the_simulated_tool_prints_the_captures_blocks_byte_for_byte() -> None:
    """The capture's own types, printed by the simulator, are the capture's
    lines (its blocks end at FB Memory; a type's per-VM limit, which the
    simulator prints as 1, aside)."""
    from gpulib.sim.captured import vgpu_types

    text = (DATA / "rtx-pro-6000-580.105.06-vgpu-s-v.txt").read_text(encoding="utf-8")
    classes = {int(m.group(1), 16): m.group(2) for m in re.finditer(
        r"vGPU Type ID\s+: 0x([0-9a-f]+)\n.*\n\s+Class\s+: (\S+)", text)}
    found = nvidiasmi.parse(text)
    assert len(classes) == 4 and sum(len(t) for t in found.values()) == 4
    printed = vgpu_types({a: {t: (classes[t], n) for t, n in types.items()}
                          for a, types in found.items()})
    skip = ("Max Instances Per VM", "Display Heads", "Maximum")
    assert [line for line in printed.splitlines() if not line.strip().startswith(skip)] == \
        [line for line in text.splitlines() if not line.strip().startswith(skip)]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400) | st.lists(st.sampled_from(
    ["GPU 00000000:41:00.0", "    vGPU Type ID : 0x252", "Name : x", "Max Instances : 99999999999",
     "FB Memory : N/A", "vGPU Type ID : zz", "Display Heads : -1", ":", " : ", "GPU x"]),
    max_size=30).map("\n".join))
def test_any_output_parses_to_numbers_in_range(text: str) -> None:
    for types in nvidiasmi.parse(text).values():
        for tid, n in types.items():
            assert 0 < tid <= nvidiasmi.NUMBER_MAX
            for v in (n.max_instances, n.framebuffer_mb, n.num_heads,
                      *(n.max_resolution or ())):
                assert v is None or 0 <= v <= nvidiasmi.NUMBER_MAX


# -- the tool, bounded, and the cache -----------------------------------------------------------

A10 = PciAddress.parse("0000:04:00.0")


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return contract_host(str(tmp_path / "h"), "0000")


def test_a_failing_tool_is_one_line_and_a_hanging_one_is_killed(host: FakeHost) -> None:
    install_nvidia_smi(host, "fail")
    tool = nvidiasmi.tool_path(host.root)
    assert tool == host.p("usr/bin/nvidia-smi")
    with pytest.raises(nvidiasmi.ToolFailed) as failed:
        nvidiasmi.run_tool(tool, 5.0)
    assert "(exit 9)" in str(failed.value) and "couldn't communicate" in str(failed.value)
    install_nvidia_smi(host, "hang")
    start = time.monotonic()
    with pytest.raises(nvidiasmi.ToolFailed, match=r"no answer within 0\.3 s"):
        nvidiasmi.run_tool(tool, 0.3)
    assert time.monotonic() - start < 5


def test_numbers_are_asked_once_for_the_loaded_driver(host: FakeHost) -> None:
    first = nvidiasmi.numbers(host.root, [A10])
    assert first[A10][A10_6Q].max_instances == 4
    assert nvidiasmi.numbers(host.root, [A10]) == first
    assert host.nvidia_smi_calls() == ["vgpu -s -v"]
    # A GPU the cache does not know is asked about: the tool does not list it
    # (no vGPU on it), and it is not asked about again for a while.
    other = PciAddress.parse("0000:af:00.0")
    now = time.time()
    assert other not in nvidiasmi.numbers(host.root, [A10, other], now=now)
    assert other not in nvidiasmi.numbers(host.root, [A10, other], now=now + 1)
    assert len(host.nvidia_smi_calls()) == 2
    nvidiasmi.numbers(host.root, [A10, other], now=now + nvidiasmi.RETRY_SECONDS + 1)
    assert len(host.nvidia_smi_calls()) == 3
    assert nvidiasmi.numbers(host.root, [A10]) == first
    assert len(host.nvidia_smi_calls()) == 3
    # A driver update is asked about again.
    install_nvidia_smi(host)
    host.write_file("sys/module/nvidia/version", "580.126.02\n")
    assert nvidiasmi.numbers(host.root, [A10]) == first
    assert len(host.nvidia_smi_calls()) == 4


@pytest.mark.parametrize("behaviour", ["fail", "hang"])
def test_a_failure_is_logged_once_and_not_asked_again_for_a_while(
        host: FakeHost, behaviour: str, caplog: pytest.LogCaptureFixture) -> None:
    install_nvidia_smi(host, behaviour)
    caplog.set_level(logging.INFO, logger="gpulib.nvidiasmi")
    now = 1_000_000.0
    for i in range(3):
        assert nvidiasmi.numbers(host.root, [A10], timeout=0.3, now=now + i) == {}
    assert len(host.nvidia_smi_calls()) == 1
    assert [r.levelname for r in caplog.records if UNKNOWN in r.getMessage()] == ["WARNING"]
    # Later, and answering again: asked, and its numbers kept.
    install_nvidia_smi(host)
    later = now + nvidiasmi.RETRY_SECONDS + 1
    assert nvidiasmi.numbers(host.root, [A10], now=later)[A10][A10_6Q].num_heads == 4
    assert len(host.nvidia_smi_calls()) == 2


def test_no_tool_no_numbers_nothing_logged(host: FakeHost,
                                           caplog: pytest.LogCaptureFixture) -> None:
    os.unlink(host.p("usr/bin/nvidia-smi"))
    caplog.set_level(logging.INFO, logger="gpulib.nvidiasmi")
    assert nvidiasmi.numbers(host.root, [A10]) == {}
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


def test_a_corrupt_cache_is_asked_again(host: FakeHost) -> None:
    nvidiasmi.numbers(host.root, [A10])
    Path(host.p(nvidiasmi.CACHE_FILE)).write_text('{"version": 1, "gpus": [')
    assert nvidiasmi.numbers(host.root, [A10])[A10][A10_6Q].framebuffer_mb == 6144
    assert len(host.nvidia_smi_calls()) == 2


# -- through the commands ----------------------------------------------------------------------

@pytest.fixture(params=DOMAINS)
def domain_host(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, FakeHost]:
    domain = str(request.param)
    return domain, contract_host(str(tmp_path / f"domain-{domain}"), domain)


def vf_numbers(doc: dict[str, Any], domain: str) -> dict[str, tuple[Any, ...]]:
    a10 = by_address(doc)[lspci(addresses(domain)["a10"])]
    return {vf["vf_pci_address"]: (vf["vf_profile"], vf["max_instances"], vf["video_ram"],
                                   vf["max_heads"], vf["max_resolution_x"],
                                   vf["max_resolution_y"])
            for vf in a10["vf_instances"]}


def test_discover_reports_the_tools_numbers_for_every_domain(
        domain_host: tuple[str, FakeHost], monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    domain, host = domain_host
    doc = discover_cloudstack(host.root, monkeypatch, capfd)
    assert set(vf_numbers(doc, domain).values()) == {("NVIDIA A10-6Q", 4, 6144, 4, 7680, 4320)}
    # The native report and `mdev types` give the same numbers.
    assert cli.main(["discover", "--format", "json"]) == 0
    a10 = next(g for g in json.loads(capfd.readouterr().out)["gpus"]
               if g["address"] == addresses(domain)["a10"])
    assert {t["type_id"]: (t["max_instances"], t["framebuffer_mb"], t["num_heads"],
                           t["max_resolution"]) for t in a10["nvidia_types"]}[A10_6Q] == (
        4, 6144, 4, "7680x4320")
    # An A10 has no MIG (`MIG Mode: N/A`): asked once for this driver, never again.
    assert a10["mig"] is None
    assert cli.main(["discover", "--format", "json"]) == 0
    capfd.readouterr()
    vf = f"{domain}:04:00.3"
    assert cli.main(["mdev", "types", "--parent", vf, "--json"]) == 0
    [row] = json.loads(capfd.readouterr().out)
    assert (row["parent"], row["kind"], row["type_id"], row["max_instances"],
            row["framebuffer_mb"], row["num_heads"], row["max_resolution"]) == (
        vf, "nvidia-vf", str(A10_6Q), 4, 6144, 4, "7680x4320")
    # One run of the tool for the four, and one question of MIG.
    assert host.nvidia_smi_calls() == ["vgpu -s -v", "-q"]


@pytest.mark.parametrize("behaviour", ["fail", "hang"])
def test_discover_stays_complete_when_the_tool_fails_or_hangs(
        domain_host: tuple[str, FakeHost], behaviour: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    domain, host = domain_host
    install_nvidia_smi(host, "answer")
    answered = discover_cloudstack(host.root, monkeypatch, capfd)
    os.unlink(host.p(nvidiasmi.CACHE_FILE))
    install_nvidia_smi(host, behaviour)
    host.write_file("etc/gpulib/gpulib.conf", "[discovery]\nnvidia_smi_timeout = 0.5\n")
    start = time.monotonic()
    docs = [discover_cloudstack(host.root, monkeypatch, capfd) for _ in range(2)]
    assert time.monotonic() - start < 10
    for doc in docs:
        # Every GPU and instance still listed; only the tool's numbers are null
        # (the frame buffer still told by the profile's name).
        assert [(g["pci_address"], len(g["vgpu_instances"]), len(g["vf_instances"]))
                for g in doc["gpus"]] == [(g["pci_address"], len(g["vgpu_instances"]),
                                           len(g["vf_instances"])) for g in answered["gpus"]]
        assert set(vf_numbers(doc, domain).values()) == {
            ("NVIDIA A10-6Q", None, 6144, None, None, None)}
        assert vf_numbers(doc, domain)[lspci(f"{domain}:04:00.2")] == \
            ("NVIDIA A10-6Q", None, 6144, None, None, None)
    assert [r.levelname for r in caplog.records if UNKNOWN in r.getMessage()] == ["WARNING"]
    assert host.nvidia_smi_calls() == ["vgpu -s -v"] * 2  # the answering run, the failing one


def test_the_hooks_never_run_the_tool(host: FakeHost, monkeypatch: pytest.MonkeyPatch,
                                      capfd: pytest.CaptureFixture[str]) -> None:
    vf = PciAddress.parse("0000:04:00.4")
    code, _out, err = transform(host.root, pci_xml(NEW_VM, NEW_UUID, vf.libvirt(), "no"),
                                monkeypatch, capfd)
    assert (code, err) == (0, "")
    assert host.nvidia_smi_calls() == []
    assert not os.path.exists(host.p(nvidiasmi.CACHE_FILE))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2 ** 40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({"version": st.just(nvidiasmi.CACHE_VERSION)}, optional={
    "driver": json_values, "incomplete_at": json_values,
    "gpus": json_values | st.dictionaries(
        st.sampled_from(["0000:04:00.0", "00000001:04:00.0", "zz", ""]),
        json_values | st.dictionaries(st.sampled_from(["594", "0x252", "-1", "9999999999"]),
                                      json_values | st.fixed_dictionaries(
                                          {}, optional={k: json_values for k in (
                                              "name", "max_instances", "framebuffer_mb",
                                              "num_heads", "max_resolution",
                                              "gi_profile")}),
                                      max_size=3), max_size=3)}))
def test_any_cache_file_loads_as_numbers_in_range_or_not_at_all(data: dict[str, Any]) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
        fh.write(json.dumps(data))
        fh.flush()
        cache = nvidiasmi.Cache.load(fh.name)
    assert cache is not None
    assert cache.driver is None or isinstance(cache.driver, str)
    for types in cache.gpus.values():
        for tid, n in types.items():
            assert 0 <= tid < 10 ** 9
            assert n.name is None or isinstance(n.name, str)
            for v in (n.max_instances, n.framebuffer_mb, n.num_heads, n.gi_profile,
                      *(n.max_resolution or ())):
                assert v is None or (type(v) is int and 0 <= v <= nvidiasmi.NUMBER_MAX)
