"""Property: whatever XML the transformer is given, it keeps the agent's contract.

Exit 0 means the complete XML on stdout and nothing on stderr; any other exit
means one line on stderr and nothing on stdout. Inputs: the agent fixtures
with random hostdevs (real, missing or malformed addresses and UUIDs) spliced
into either `<devices>`, random truncation, and random junk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from gpulib.hooks.transformer import main
from gpulib.sim.hosts import DEMO_POOL_MDEVS, build_demo
from tests.conftest import DATA

FIXTURES = [p.read_text() for p in sorted((DATA / "cloudstack-xml").glob("*.xml"))]

hex_byte = st.integers(0, 0x1FF).map(lambda n: f"0x{n:02x}")
pci_hostdev = st.builds(
    lambda d, b, s, f, managed: (
        f"<hostdev mode='subsystem' type='pci' managed='{managed}'><driver name='vfio'/>"
        f"<source><address domain='{d}' bus='{b}' slot='{s}' function='{f}'/></source>"
        "</hostdev>"),
    st.sampled_from(["0x0000", "0x0001", "0x10000"]),
    st.sampled_from(["0x3b", "0x41", "0x65", "0xaf", "0x17"]) | hex_byte,
    st.sampled_from(["0x00", "0x01", "0x20"]),
    st.sampled_from(["0x0", "0x1", "0x4", "0x8"]),
    st.sampled_from(["yes", "no"]))
mdev_hostdev = st.builds(
    lambda u: ("<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source>"
               f"<address uuid='{u}'/></source></hostdev>"),
    st.sampled_from([*DEMO_POOL_MDEVS, "not-a-uuid", ""]) | st.uuids().map(str))
hostdevs = st.lists(pci_hostdev | mdev_hostdev, max_size=3)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_demo(str(tmp_path_factory.mktemp("contract") / "demo")).root


def check_contract(code: int, out: str, err: str) -> None:
    if code == 0:
        assert err == "", "nothing on stderr on success"
        assert out.strip(), "never exit 0 with empty output"
        assert etree.fromstring(out.encode()).tag == "domain"
    else:
        assert out == ""
        assert len(err.splitlines()) == 1, err


def run(xml: str, capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capfd.readouterr()
    code = main(["libvirt-vm-xml-transformer", "transform", xml])
    out, err = capfd.readouterr()
    return code, out, err


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fixture=st.sampled_from(FIXTURES), extra=hostdevs, which=st.integers(0, 1),
       name=st.sampled_from([None, "i-2-1-VM", "vm/../x", "vm\nx"]))
def test_spliced_hostdevs_keep_the_contract(demo: str, capfd: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, fixture: str,
                                            extra: list[str], which: int,
                                            name: str | None) -> None:
    monkeypatch.setenv("GPULIB_ROOT", demo)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    xml = fixture
    if name is not None:
        xml = xml.replace(xml[xml.index("<name>"):xml.index("</name>")], f"<name>{name}", 1)
    parts = xml.split("<devices>")
    at = min(which + 1, len(parts) - 1)
    parts[at] = "".join(extra) + parts[at]
    xml = "<devices>".join(parts)
    code, out, err = run(xml, capfd)
    check_contract(code, out, err)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fixture=st.sampled_from(FIXTURES), cut=st.floats(0, 1),
       junk=st.text(max_size=40))
def test_truncated_or_junk_input_keeps_the_contract(demo: str,
                                                    capfd: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    fixture: str, cut: float,
                                                    junk: str) -> None:
    monkeypatch.setenv("GPULIB_ROOT", demo)
    xml = fixture[: int(len(fixture) * cut)] + junk
    code, out, err = run(xml, capfd)
    check_contract(code, out, err)
    if code == 0 and "<hostdev" not in xml and "gpulib.org" not in xml:
        assert out == xml


def test_state_untouched_by_refused_input(demo: str, capfd: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULIB_ROOT", demo)
    state = Path(demo, "var/lib/gpulib/state.json")
    before = state.read_bytes()
    code, _, _ = run(FIXTURES[0].replace("<devices>", "<devices><hostdev mode='subsystem' "
                                         "type='mdev'><source><address uuid='x'/></source>"
                                         "</hostdev>", 1), capfd)
    assert code == 2 and state.read_bytes() == before
