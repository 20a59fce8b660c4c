"""gpulib.domain: the safe parser, the in-place model, edits, metadata requests.

Inputs are copies of the CloudStack agent fixtures in tests/data/cloudstack-xml
(see the README there). Golden files live in tests/golden/domain; rewrite them
with `pytest --regen-golden` (or GPULIB_REGEN_GOLDEN=1) and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from gpulib import domain as domain_mod
from gpulib.domain import (
    DERIVED_UUID_NAMESPACE,
    GPULIB_NS,
    MAX_XML_BYTES,
    MAX_XML_NODES,
    Domain,
    DomainXmlError,
    GpuRequest,
    Hostdev,
    MdevHostdev,
    PassthroughRequest,
    PciHostdev,
    VgpuRequest,
    derive_uuid,
    parse_domain,
)
from gpulib.errors import EXIT_USAGE, InputError
from gpulib.pci import PciAddress

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "data" / "cloudstack-xml"
GOLDEN = HERE / "golden" / "domain"
SHARED_FIXTURES = Path("/work/shared/fixtures/cloudstack-xml")
SCHEMA = Path("/usr/share/libvirt/schemas/domain.rng")
VIRSH = shutil.which("virsh")

FIXTURE_NAMES = sorted(p.name for p in FIXTURES.glob("*.xml"))
TEXTS = {name: (FIXTURES / name).read_bytes().decode("utf-8") for name in FIXTURE_NAMES}

needs_virsh = pytest.mark.skipif(
    VIRSH is None, reason="virsh not installed (libvirt-clients): cannot check that "
    "libvirt's test driver accepts the edited XML")
needs_schema = pytest.mark.skipif(
    not SCHEMA.exists(), reason=f"{SCHEMA} missing (libvirt schemas not installed)")

# What the fixture README says each agent XML holds: an oracle that does not
# come from the code under test. PCI: (address, managed, display, ramfb);
# mdev: (uuid, model, display, ramfb).
EXPECTED_HOSTDEVS: dict[str, list[tuple[Any, ...]]] = {
    "no-gpu.xml": [],
    "systemvm.xml": [],
    "passthrough-1gpu.xml": [("pci", "0000:3b:00.0", True, "off", None)],
    "passthrough-2gpu-display.xml": [("pci", "0000:17:00.0", True, "on", "on"),
                                     ("pci", "0000:65:00.0", True, "on", "on")],
    "nvidia-vf-vgpu.xml": [("pci", "0000:41:00.4", False, "off", None)],
    "nvidia-vf-vgpu-managed-yes.xml": [("pci", "0000:41:00.4", True, "off", None)],
    # 4.21's rendering of 0001:d6:00.0: the slot is lost (README).
    "pcidomain-0001-agent421.xml": [("pci", "agent421 0001:d6:??.0", True, "off", None)],
    "pcidomain-0001.xml": [("pci", "0001:d6:00.0", True, "off", None)],
    "vgpu-mdev.xml": [("mdev", "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d", "vfio-pci", "off", None)],
    "vgpu-mdev-display.xml": [
        ("mdev", "a3d5f7e9-1b2c-4d6e-8f0a-2c4e6a8b0d13", "vfio-pci", "on", "on")],
}

# Which hostdevs gpulib models, written independently of the code under test.
HOSTDEV_XPATH = ("./devices/hostdev[(not(@mode) or @mode='subsystem') "
                 "and (@type='pci' or @type='mdev')]")


# --------------------------------------------------------------------------
# helpers


def _regen(request: pytest.FixtureRequest) -> bool:
    # tests/conftest.py registers --regen-golden; the variable works without it.
    return bool(request.config.getoption("--regen-golden", default=False)) or \
        os.environ.get("GPULIB_REGEN_GOLDEN") == "1"


def _check_golden(request: pytest.FixtureRequest, path: Path, actual: str) -> None:
    data = actual.encode("utf-8")
    if _regen(request):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return
    if not path.exists():
        pytest.fail(f"golden file {path} is missing: run pytest --regen-golden and review it")
    assert data == path.read_bytes(), f"output differs from golden {path.name}"


def _one_line_error(exc: BaseException, *needles: str) -> str:
    message = str(exc)
    assert isinstance(exc, DomainXmlError)
    assert isinstance(exc, InputError) and exc.exit_code == EXIT_USAGE
    assert message and "\n" not in message and "\r" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def _pci_text(h: PciHostdev) -> str:
    """The host address, or how CloudStack 4.21 mangled it (slot lost)."""
    mangled = h.agent421_mangled()
    if mangled is not None:
        with pytest.raises(DomainXmlError, match="out of range"):
            h.address  # noqa: B018  (the property raises)
        return f"agent421 {mangled[0]:04x}:{mangled[1]:02x}:??.{mangled[2]}"
    return str(h.address)


def _hostdev_summary(h: Hostdev) -> dict[str, Any]:
    if isinstance(h, PciHostdev):
        guest = h.guest_address
        return {"type": "pci", "address": _pci_text(h), "managed": h.managed,
                "display": h.display, "ramfb": h.ramfb,
                "guest_address": None if guest is None else str(guest),
                "multifunction": h.multifunction}
    return {"type": "mdev", "uuid": h.uuid_checked(), "model": h.model,
            "display": h.display, "ramfb": h.ramfb}


def _summary(dom: Domain) -> dict[str, Any]:
    return {
        "name": dom.name,
        "uuid": dom.uuid_checked(),
        "devices_elements": len(dom.devices_elements()),
        "hostdevs": [_hostdev_summary(h) for h in dom.hostdevs()],
        "graphics": [g.type for g in dom.graphics()],
        "videos": [v.type for v in dom.videos()],
        "numa_nodes": dom.numa_nodes(),
        "metadata_request": dom.metadata_request() is not None,
    }


def _edit_add_pci(dom: Domain) -> None:
    # A GPU and its HDMI audio function as one multifunction guest slot.
    dom.add_pci_hostdev(PciAddress(0, 0xAF, 0, 0), guest_address=PciAddress(0, 0, 0x10, 0),
                        multifunction=True)
    dom.add_pci_hostdev(PciAddress(0, 0xAF, 0, 1), managed=False,
                        guest_address=PciAddress(0, 0, 0x10, 1))


def _edit_add_mdev(dom: Domain) -> None:
    dom.add_mdev_hostdev(derive_uuid(dom.uuid_checked(), 0), display="on")


EDITS: dict[str, Callable[[Domain], None]] = {"add-pci": _edit_add_pci,
                                               "add-mdev": _edit_add_mdev}


def _edited(fixture: str, edit: str) -> tuple[Domain, str]:
    dom = parse_domain(TEXTS[fixture])
    EDITS[edit](dom)
    return dom, dom.to_xml()


def _c14n(elem: Any) -> str:
    # C14N 2.0 drops comments unless asked; they must survive too.
    return str(etree.canonicalize(etree.tostring(elem, encoding="unicode", with_tail=False),
                                  strip_text=True, with_comments=True))


def _with_metadata(snippet: str, fixture: str = "no-gpu.xml") -> str:
    text = TEXTS[fixture]
    assert "</metadata>" in text
    return text.replace("</metadata>", snippet + "\n</metadata>", 1)


def _gpus(body: str, prefix: str = "gpulib") -> str:
    return f'<{prefix}:gpus xmlns:{prefix}="{GPULIB_NS}">{body}</{prefix}:gpus>'


# --------------------------------------------------------------------------
# the fixtures themselves


def test_fixture_set_is_complete() -> None:
    # An empty glob would silently turn every parametrized test into nothing.
    assert set(FIXTURE_NAMES) == set(EXPECTED_HOSTDEVS)
    assert (FIXTURES / "README.md").read_text(encoding="utf-8").startswith(
        "# Copies of the shared CloudStack agent fixtures")


def test_fixture_copies_match_shared() -> None:
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(f"{SHARED_FIXTURES} not present (CI): nothing to compare the copies with")
    shared = sorted(p.name for p in SHARED_FIXTURES.glob("*.xml"))
    assert shared == FIXTURE_NAMES
    for name in shared:
        assert (SHARED_FIXTURES / name).read_bytes() == (FIXTURES / name).read_bytes(), name


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_fixture_summary_matches_golden(request: pytest.FixtureRequest, fixture: str) -> None:
    dom = parse_domain(TEXTS[fixture])
    summary = _summary(dom)
    _check_golden(request, GOLDEN / (fixture[:-4] + ".summary.json"),
                  json.dumps(summary, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_fixture_hostdevs_match_readme(fixture: str) -> None:
    dom = parse_domain(TEXTS[fixture])
    found: list[tuple[Any, ...]] = []
    for h in dom.hostdevs():
        if isinstance(h, PciHostdev):
            found.append(("pci", _pci_text(h), h.managed, h.display, h.ramfb))
            assert h.guest_address is None and not h.multifunction
        else:
            found.append(("mdev", h.uuid_checked(), h.model, h.display, h.ramfb))
            assert h.uuid == h.uuid_checked()
    assert found == EXPECTED_HOSTDEVS[fixture]
    # The agent always emits two <devices>: one for memballoon, one for the rest.
    assert len(dom.devices_elements()) == 2
    assert dom.devices_elements()[0].find("memballoon") is not None
    assert [g.type for g in dom.graphics()] == ["vnc"]
    assert dom.metadata_request() is None
    assert dom.numa_nodes() == []


def test_videos_read_the_model_type() -> None:
    dom = parse_domain(TEXTS["passthrough-2gpu-display.xml"])
    assert [v.type for v in dom.videos()] == ["none"]
    assert parse_domain(TEXTS["passthrough-1gpu.xml"]).videos() == []


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_unchanged_domain_is_byte_identical(fixture: str) -> None:
    text = TEXTS[fixture]
    dom = parse_domain(text)
    # Reading everything must not count as an edit.
    _summary(dom)
    for h in dom.hostdevs():
        if isinstance(h, PciHostdev):
            h.managed = h.managed
            h.display = h.display
            h.set_guest_address(None)
    assert not dom.changed
    assert dom.to_xml() == text
    as_bytes = parse_domain(text.encode("utf-8"))
    assert as_bytes.to_xml() == text and not as_bytes.changed


# --------------------------------------------------------------------------
# edits


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_edit_matches_golden(request: pytest.FixtureRequest, fixture: str, edit: str) -> None:
    dom, out = _edited(fixture, edit)
    assert dom.changed
    assert not out.startswith("<?xml")
    assert out.endswith("</domain>\n")
    _check_golden(request, GOLDEN / f"{fixture[:-4]}.{edit}.xml", out)


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_add_pci_goes_after_the_last_hostdev(fixture: str) -> None:
    dom = parse_domain(TEXTS[fixture])
    before = dom.hostdevs()
    new = dom.add_pci_hostdev(PciAddress(0, 0xAF, 0, 0))
    devices = dom.devices_elements()
    if before:
        assert new.element.getparent() is before[-1].element.getparent()
        assert new.element.getprevious() is before[-1].element
    else:
        # No hostdev anywhere: the first <devices>, as the contract says.
        assert new.element.getparent() is devices[0]
        assert new.element.getnext() is None
    assert dom.hostdevs()[-1] == new
    assert len(dom.devices_elements()) == 2


def test_added_pci_hostdev_in_agent_style() -> None:
    dom = parse_domain(TEXTS["nvidia-vf-vgpu.xml"])
    new = dom.add_pci_hostdev(PciAddress(0, 0x41, 0, 5), managed=False,
                              guest_address=PciAddress(0, 0, 0x11, 0), multifunction=True)
    xml = dom.to_xml()
    assert (
        '<hostdev mode="subsystem" type="pci" managed="no">\n'
        '  <driver name="vfio"/>\n'
        '  <source>\n'
        '    <address domain="0x0000" bus="0x41" slot="0x00" function="0x5"/>\n'
        '  </source>\n'
        '  <address type="pci" domain="0x0000" bus="0x00" slot="0x11" function="0x0"'
        ' multifunction="on"/>\n'
        '</hostdev>\n'
        "<watchdog ") in xml
    assert not new.managed and new.multifunction
    assert new.guest_address == PciAddress(0, 0, 0x11, 0)


def test_added_mdev_hostdev_in_agent_style() -> None:
    dom = parse_domain(TEXTS["vgpu-mdev.xml"])
    mdev = dom.add_mdev_hostdev("C5544C0A-C824-569D-914C-9EC9B1ACED28")
    assert mdev.uuid == "c5544c0a-c824-569d-914c-9ec9b1aced28"
    assert mdev.model == "vfio-pci" and mdev.display is None
    assert (
        '<hostdev mode="subsystem" type="mdev" model="vfio-pci">\n'
        '  <source>\n'
        '    <address uuid="c5544c0a-c824-569d-914c-9ec9b1aced28"/>\n'
        '  </source>\n'
        '</hostdev>\n'
        "<watchdog ") in dom.to_xml()
    # The first (agent-rendered) mdev is still first.
    assert [h.uuid for h in dom.mdev_hostdevs()] == [
        "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d", "c5544c0a-c824-569d-914c-9ec9b1aced28"]


def test_indented_layout_is_followed() -> None:
    # libvirt's own dumpxml style: 2-space steps, devices children at 4.
    text = ("<domain type='kvm'>\n  <name>v</name>\n  <devices>\n"
            "    <emulator>/usr/bin/qemu</emulator>\n  </devices>\n</domain>\n")
    dom = parse_domain(text)
    dom.add_mdev_hostdev("c5544c0a-c824-569d-914c-9ec9b1aced28")
    assert dom.to_xml() == (
        '<domain type="kvm">\n  <name>v</name>\n  <devices>\n'
        "    <emulator>/usr/bin/qemu</emulator>\n"
        '    <hostdev mode="subsystem" type="mdev" model="vfio-pci">\n'
        "      <source>\n"
        '        <address uuid="c5544c0a-c824-569d-914c-9ec9b1aced28"/>\n'
        "      </source>\n"
        "    </hostdev>\n"
        "  </devices>\n</domain>\n")


def test_compact_layout_stays_compact_and_devices_created() -> None:
    dom = parse_domain("<domain><name>v</name></domain>")
    dom.add_pci_hostdev(PciAddress(0, 1, 2, 3), guest_address=PciAddress(0, 0, 5, 0))
    assert dom.to_xml() == (
        '<domain><name>v</name><devices><hostdev mode="subsystem" type="pci" managed="yes">'
        '<driver name="vfio"/><source><address domain="0x0000" bus="0x01" slot="0x02" '
        'function="0x3"/></source><address type="pci" domain="0x0000" bus="0x00" '
        'slot="0x05" function="0x0"/></hostdev></devices></domain>')


@pytest.mark.parametrize("fixture", ["passthrough-1gpu.xml", "vgpu-mdev-display.xml"])
def test_remove_only_hostdev_leaves_exact_layout(fixture: str) -> None:
    text = TEXTS[fixture]
    dom = parse_domain(text)
    (only,) = dom.hostdevs()
    dom.remove_hostdev(only)
    assert dom.hostdevs() == [] and dom.changed
    # The same text with the agent's hostdev block cut out, as lxml writes it.
    cut = re.sub(r"<hostdev .*?</hostdev>\n", "", text, count=1, flags=re.S)
    assert cut != text
    expected = etree.tostring(etree.fromstring(cut.encode()), encoding="unicode") + "\n"
    assert dom.to_xml() == expected


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_add_then_remove_is_a_plain_reserialization(fixture: str) -> None:
    text = TEXTS[fixture]
    dom = parse_domain(text)
    dom.remove_hostdev(dom.add_pci_hostdev(PciAddress(0, 0xAF, 0, 0)))
    dom.remove_hostdev(dom.add_mdev_hostdev(derive_uuid(dom.uuid_checked(), 3)))
    expected = etree.tostring(etree.fromstring(text.encode()), encoding="unicode") + "\n"
    assert dom.changed and dom.to_xml() == expected


def test_remove_keeps_neighbours_and_closing_indent() -> None:
    # The removed hostdev is the last child: the end tag keeps its indentation,
    # and the comment and unknown element right next to it stay.
    text = ("<domain>\n  <devices>\n    <emulator>/usr/bin/qemu</emulator>\n"
            "    <!-- keep me -->\n"
            "    <hostdev mode='subsystem' type='mdev' model='vfio-pci'>\n"
            "      <source><address uuid='c5544c0a-c824-569d-914c-9ec9b1aced28'/></source>\n"
            "    </hostdev>\n"
            "  </devices>\n</domain>\n")
    dom = parse_domain(text)
    dom.remove_hostdev(dom.hostdevs()[0])
    assert dom.to_xml() == ("<domain>\n  <devices>\n    <emulator>/usr/bin/qemu</emulator>\n"
                            "    <!-- keep me -->\n  </devices>\n</domain>\n")
    between = TEXTS["passthrough-2gpu-display.xml"].replace(
        "</hostdev>\n<hostdev", "</hostdev>\n<!-- between --><zzunknown a='1'/>\n<hostdev", 1)
    dom = parse_domain(between)
    dom.remove_hostdev(dom.hostdevs()[0])
    out = dom.to_xml()
    assert '<!-- between --><zzunknown a="1"/>\n<hostdev' in out
    dom.remove_hostdev(dom.hostdevs()[0])
    assert '<!-- between --><zzunknown a="1"/>\n<watchdog' in dom.to_xml()


def test_guest_address_added_and_dropped_restores_layout() -> None:
    text = TEXTS["passthrough-1gpu.xml"]
    dom = parse_domain(text)
    (h,) = dom.pci_hostdevs()
    h.set_guest_address(PciAddress(0, 0, 0x10, 0), multifunction=True)
    assert ('    <address domain="0x0000" bus="0x3b" slot="0x00" function="0x0"/>\n'
            "  </source>\n"
            '  <address type="pci" domain="0x0000" bus="0x00" slot="0x10" function="0x0"'
            ' multifunction="on"/>\n'
            "</hostdev>\n") in dom.to_xml()
    h.set_guest_address(None)
    expected = etree.tostring(etree.fromstring(text.encode()), encoding="unicode") + "\n"
    assert dom.to_xml() == expected


def test_set_guest_address_in_place() -> None:
    dom = parse_domain(TEXTS["passthrough-2gpu-display.xml"])
    first, second = dom.pci_hostdevs()
    first.set_guest_address(PciAddress(0, 0, 0x10, 0), multifunction=True)
    second.set_guest_address(PciAddress(0, 0, 0x11, 0))
    assert first.guest_address == PciAddress(0, 0, 0x10, 0) and first.multifunction
    assert second.guest_address == PciAddress(0, 0, 0x11, 0) and not second.multifunction
    element = first.element.find("address")
    first.set_guest_address(PciAddress(0, 0, 0x12, 0))
    # Same element, rewritten: anything else on it would have survived.
    assert first.element.find("address") is element
    assert first.guest_address == PciAddress(0, 0, 0x12, 0) and not first.multifunction
    assert element.get("multifunction") is None
    first.set_guest_address(None)
    assert first.guest_address is None and first.element.find("address") is None
    reparsed = parse_domain(dom.to_xml())
    assert [h.guest_address for h in reparsed.pci_hostdevs()] == [
        None, PciAddress(0, 0, 0x11, 0)]


def test_setters_mark_changes_only_when_values_change() -> None:
    dom = parse_domain(TEXTS["passthrough-2gpu-display.xml"])
    h = dom.pci_hostdevs()[0]
    h.managed = True
    h.display = "on"
    assert not dom.changed
    h.managed = False
    assert dom.changed
    h.display = None
    h.ramfb = None
    out = parse_domain(dom.to_xml()).pci_hostdevs()[0]
    assert (out.managed, out.display, out.ramfb) == (False, None, None)
    assert out.element.get("managed") == "no"


def test_mark_changed_for_direct_lxml_edits() -> None:
    dom = parse_domain(TEXTS["no-gpu.xml"])
    dom.root.find("description").text = "edited with lxml"
    assert dom.to_xml() == TEXTS["no-gpu.xml"]  # not told: still the input
    dom.mark_changed()
    assert "<description>edited with lxml</description>" in dom.to_xml()


def test_domain_built_from_an_element() -> None:
    root = etree.fromstring("<domain><name>x</name><devices/></domain>")
    dom = Domain(root)
    assert dom.to_xml() == "<domain><name>x</name><devices/></domain>"
    dom.add_mdev_hostdev("c5544c0a-c824-569d-914c-9ec9b1aced28")
    assert len(parse_domain(dom.to_xml()).mdev_hostdevs()) == 1


def test_prolog_and_epilogue_survive_an_edit() -> None:
    # libvirt's saved configs start with a comment; admins may add a declaration.
    body = TEXTS["passthrough-1gpu.xml"]
    prolog = ('<?xml version="1.0" encoding="UTF-8"?>\n<!--\nWARNING: THIS IS AN '
              "AUTO-GENERATED FILE.\n-->\n\n")
    dom = parse_domain(prolog + body + "\n")
    _edit_add_mdev(dom)
    out = dom.to_xml()
    assert out.startswith(prolog + '<domain type="kvm">')
    assert out.endswith("</domain>\n\n")
    no_decl = parse_domain(body)
    _edit_add_mdev(no_decl)
    assert no_decl.to_xml().startswith('<domain type="kvm">')


def test_bom_and_trailing_comment() -> None:
    text = "\ufeff<domain><name>b</name></domain>\n<!-- end -->\n"
    dom = parse_domain(text.encode("utf-8"))
    assert dom.to_xml() == text
    dom.add_mdev_hostdev("c5544c0a-c824-569d-914c-9ec9b1aced28")
    out = dom.to_xml()
    assert out.startswith("\ufeff<domain>") and out.endswith("</domain>\n<!-- end -->\n")


def test_add_refuses_duplicates_and_nonsense() -> None:
    dom = parse_domain(TEXTS["passthrough-1gpu.xml"])
    with pytest.raises(DomainXmlError) as err:
        dom.add_pci_hostdev(PciAddress(0, 0x3B, 0, 0))
    _one_line_error(err.value, "0000:3b:00.0")
    mdev = parse_domain(TEXTS["vgpu-mdev.xml"])
    with pytest.raises(DomainXmlError):
        mdev.add_mdev_hostdev("6C3F9A1E2D4B4F8AB5C70E1D2A3B4C5D")  # same UUID, other spelling
    with pytest.raises(DomainXmlError) as err:
        mdev.add_mdev_hostdev("../../etc/passwd")
    _one_line_error(err.value, "mdev UUID")
    with pytest.raises(DomainXmlError):
        mdev.add_mdev_hostdev(str(uuid.uuid4()), display="maybe")
    with pytest.raises(ValueError):
        dom.add_pci_hostdev(PciAddress(0, 0x3B, 0, 1), multifunction=True)
    other = parse_domain(TEXTS["vgpu-mdev.xml"]).hostdevs()[0]
    with pytest.raises(ValueError):
        mdev.remove_hostdev(other)
    assert not dom.changed and not mdev.changed


def test_hostdev_filtering() -> None:
    text = TEXTS["no-gpu.xml"].replace("<devices>\n<emulator>", (
        "<devices>\n"
        "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1'/></source></hostdev>\n"
        "<hostdev mode='capabilities' type='storage'><source><block>/dev/sdf</block>"
        "</source></hostdev>\n"
        "<hostdev type='pci'><source><address bus='0x5' slot='0x1'/></source></hostdev>\n"
        "<interface type='hostdev'><source><address type='pci' domain='0' bus='6' slot='0' "
        "function='0'/></source></interface>\n"
        "<emulator>"), 1)
    dom = parse_domain(text)
    (pci,) = dom.hostdevs()
    # Missing mode means subsystem; missing domain and function mean 0.
    assert isinstance(pci, PciHostdev) and pci.address == PciAddress(0, 5, 1, 0)
    assert not pci.managed  # libvirt's default
    assert dom.find_pci_hostdev(PciAddress(0, 5, 1, 0)) == pci
    assert dom.find_pci_hostdev(PciAddress(0, 5, 1, 1)) is None


@pytest.mark.parametrize("address, needle", [
    ("<address domain='0x0000' bus='0x100' slot='0x00' function='0x0'/>", "out of range"),
    ("<address domain='0x0000' bus='0x3b' slot='0x20' function='0x0'/>", "out of range"),
    ("<address domain='0x0000' bus='zz' slot='0x00' function='0x0'/>", "bad PCI address"),
    ("<address domain='0x0000' slot='0x00' function='0x0'/>", "no bus="),
    ("", "without <source><address>"),
])
def test_bad_pci_source_address(address: str, needle: str) -> None:
    text = TEXTS["passthrough-1gpu.xml"].replace(
        "<address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/>", address, 1)
    (h,) = parse_domain(text).hostdevs()
    assert isinstance(h, PciHostdev)
    with pytest.raises(DomainXmlError) as err:
        _ = h.address
    _one_line_error(err.value, needle)


def test_bad_guest_address() -> None:
    text = TEXTS["passthrough-1gpu.xml"].replace(
        "  </source>\n", "  </source>\n  <address type='pci' bus='0x00' slot='0x40'/>\n", 1)
    (h,) = parse_domain(text).hostdevs()
    assert isinstance(h, PciHostdev)
    with pytest.raises(DomainXmlError) as err:
        _ = h.guest_address
    _one_line_error(err.value, "guest address")


# --------------------------------------------------------------------------
# identity: name, uuid, derived uuids


def test_uuid_checked_forms() -> None:
    dom = parse_domain("<domain><name>a</name><uuid> 8F3C6D2A41B74C6E9A0D2B5E7F1C9A34 </uuid>"
                       "</domain>")
    assert dom.uuid_checked() == "8f3c6d2a-41b7-4c6e-9a0d-2b5e7f1c9a34"
    for bad in ("not-a-uuid", "8f3c6d2a-41b7-4c6e-9a0d-2b5e7f1c9a3", "../../etc/passwd",
                "8f3c6d2a-41b74c6e-9a0d-2b5e7f1c9a34-"):
        with pytest.raises(DomainXmlError) as err:
            parse_domain(f"<domain><uuid>{bad}</uuid></domain>").uuid_checked()
        _one_line_error(err.value, "domain UUID", bad)
    missing = parse_domain("<domain><name>a</name></domain>")
    assert missing.uuid is None
    with pytest.raises(DomainXmlError) as err:
        missing.uuid_checked()
    _one_line_error(err.value, "missing")


def test_mdev_uuid_checked() -> None:
    text = TEXTS["vgpu-mdev.xml"].replace(
        "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d", "6C3F9A1E-2D4B-4F8A-B5C7-0E1D2A3B4C5D")
    (h,) = parse_domain(text).hostdevs()
    assert isinstance(h, MdevHostdev)
    assert h.uuid == h.uuid_checked() == "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d"
    bad = TEXTS["vgpu-mdev.xml"].replace("6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d", "../x")
    (h,) = parse_domain(bad).hostdevs()
    assert isinstance(h, MdevHostdev) and h.uuid == "../x"
    with pytest.raises(DomainXmlError) as err:
        h.uuid_checked()
    _one_line_error(err.value, "mdev UUID", "../x")


@pytest.mark.parametrize("name", ["a/b", "../x", "line\nbreak", "tab\there", "", "  "])
def test_name_checked_refuses(name: str) -> None:
    dom = parse_domain(f"<domain><name>{name}</name></domain>")
    with pytest.raises(DomainXmlError) as err:
        dom.name_checked()
    _one_line_error(err.value)


def test_name_checked_accepts_agent_names() -> None:
    for fixture in FIXTURE_NAMES:
        dom = parse_domain(TEXTS[fixture])
        assert dom.name_checked() == dom.name
        assert re.match(r"^[ir]-\d+(-\d+)?-VM$", dom.name_checked())


def test_derive_uuid() -> None:
    namespace = uuid.uuid5(uuid.NAMESPACE_URL, GPULIB_NS + "#derived-vgpu")
    assert str(namespace) == DERIVED_UUID_NAMESPACE
    dom_uuid = "8f3c6d2a-41b7-4c6e-9a0d-2b5e7f1c9a34"
    first = derive_uuid(dom_uuid, 0)
    # Fixed values: a change here breaks VMs that already run with these mdevs.
    assert first == str(uuid.uuid5(namespace, dom_uuid + "/0"))
    assert first == "c5544c0a-c824-569d-914c-9ec9b1aced28"
    assert derive_uuid(dom_uuid, 1) == "e927b98e-aae7-57c7-8c40-9b22329793ce"
    assert derive_uuid(dom_uuid.upper(), 0) == first
    assert derive_uuid(dom_uuid.replace("-", ""), 0) == first
    assert derive_uuid(dom_uuid, 1) != first
    assert derive_uuid("2d9e7b41-6c3a-4f85-b0e2-9a1c7d5e3f68", 0) != first
    assert uuid.UUID(first).version == 5
    with pytest.raises(DomainXmlError):
        derive_uuid("nope", 0)
    with pytest.raises(ValueError):
        derive_uuid(dom_uuid, -1)
    with pytest.raises(ValueError):
        derive_uuid(dom_uuid, True)


@given(st.uuids(), st.integers(0, 10**6))
def test_derived_uuids_are_rfc_4122_version_5(dom_uuid: uuid.UUID, index: int) -> None:
    namespace = uuid.UUID(DERIVED_UUID_NAMESPACE)
    assert derive_uuid(str(dom_uuid), index) == str(uuid.uuid5(namespace, f"{dom_uuid}/{index}"))


# --------------------------------------------------------------------------
# numa


@pytest.mark.parametrize("nodeset, expected", [
    ("0", [0]), ("0-1", [0, 1]), ("0,2", [0, 2]), ("0-3,^2", [0, 1, 3]),
    (" 1 , 3-4 ", [1, 3, 4]), ("2,2", [2]),
])
def test_numa_nodes(nodeset: str, expected: list[int]) -> None:
    text = TEXTS["no-gpu.xml"].replace(
        "<cputune>", f"<numatune><memory mode='strict' nodeset='{nodeset}'/></numatune>\n"
        "<cputune>", 1)
    assert parse_domain(text).numa_nodes() == expected


def test_numa_nodes_without_nodeset() -> None:
    text = TEXTS["no-gpu.xml"].replace(
        "<cputune>", "<numatune><memory mode='strict' placement='auto'/></numatune><cputune>")
    assert parse_domain(text).numa_nodes() == []


@pytest.mark.parametrize("nodeset", ["", "x", "3-1", "0-99999", "1-", "-1", "^0-1", "0,,1"])
def test_numa_nodes_bad(nodeset: str) -> None:
    text = TEXTS["no-gpu.xml"].replace(
        "<cputune>", f"<numatune><memory nodeset='{nodeset}'/></numatune><cputune>")
    with pytest.raises(DomainXmlError) as err:
        parse_domain(text).numa_nodes()
    _one_line_error(err.value, "nodeset")


# --------------------------------------------------------------------------
# gpulib metadata requests


def test_metadata_request_parsed() -> None:
    text = _with_metadata(_gpus(
        '<gpulib:vgpu profile="GRID T4-2Q" count="2"/>'
        "<!-- a comment is fine -->"
        '<gpulib:passthrough model="10de:1eb8" numa="1"/>'
        '<gpulib:vgpu type="nvidia-231" numa="0"/>'
        '<gpulib:passthrough model="H100" count="4"/>'))
    req = parse_domain(text).metadata_request()
    assert req == GpuRequest((
        VgpuRequest("GRID T4-2Q", None, 2, None),
        PassthroughRequest("10de:1eb8", 1, 1),
        VgpuRequest(None, "nvidia-231", 1, 0),
        PassthroughRequest("H100", 4, None),
    ))
    assert req.vgpus == [VgpuRequest("GRID T4-2Q", None, 2, None),
                         VgpuRequest(None, "nvidia-231", 1, 0)]
    assert [p.vendor_device for p in req.passthrough] == [(0x10DE, 0x1EB8), None]
    assert req.total == 8


def test_metadata_request_any_prefix_and_empty() -> None:
    text = _with_metadata(_gpus('<g:vgpu type="i915-GVTg_V5_4"/>', prefix="g"))
    req = parse_domain(text).metadata_request()
    assert req is not None and req.vgpus == [VgpuRequest(None, "i915-GVTg_V5_4", 1, None)]
    empty = parse_domain(_with_metadata(_gpus(""))).metadata_request()
    assert empty == GpuRequest(()) and empty.total == 0
    # The cloudstack namespace in every 4.22 fixture is not ours.
    assert parse_domain(TEXTS["vgpu-mdev-display.xml"]).metadata_request() is None


@pytest.mark.parametrize("body, needles", [
    ('<gpulib:vgpu profile="A" count="0"/>', ("count='0'", "1 to 16")),
    ('<gpulib:vgpu profile="A" count="17"/>', ("count='17'",)),
    ('<gpulib:vgpu profile="A" count="-1"/>', ("count='-1'",)),
    ('<gpulib:vgpu profile="A" count="two"/>', ("count='two'",)),
    ('<gpulib:vgpu profile="A" count="1.5"/>', ("count='1.5'",)),
    ('<gpulib:vgpu profile="A" count="+1"/>', ("count='+1'",)),
    ('<gpulib:passthrough model="10de:1eb8" count="100000"/>', ("count=",)),
    ('<gpulib:vgpu type="../nvidia-231"/>', ("type='../nvidia-231'",)),
    ('<gpulib:vgpu type="nvidia/231"/>', ("type='nvidia/231'",)),
    ('<gpulib:vgpu type=".."/>', ("type='..'",)),
    ('<gpulib:vgpu type="."/>', ("type='.'",)),
    ('<gpulib:vgpu type="a..b"/>', ("type='a..b'",)),
    ('<gpulib:vgpu type=""/>', ("type=''",)),
    ('<gpulib:vgpu profile="A" type="nvidia-231"/>', ("exactly one of profile= or type=",)),
    ('<gpulib:vgpu count="1"/>', ("exactly one of profile= or type=",)),
    ('<gpulib:vgpu profile=" "/>', ("profile=",)),
    ('<gpulib:vgpu profile="A" numa="-1"/>', ("numa='-1'",)),
    ('<gpulib:vgpu profile="A" numa="x"/>', ("numa='x'",)),
    ('<gpulib:vgpu profile="A" cuont="1"/>', ("unknown attribute cuont=",)),
    ('<gpulib:passthrough count="1"/>', ("needs model=",)),
    ('<gpulib:passthrough model=""/>', ("model=''",)),
    ('<gpulib:gpu profile="A"/>', ("unknown element",)),
    ('<vgpu profile="A"/>', ("unknown element",)),
])
def test_metadata_request_refused(body: str, needles: tuple[str, ...]) -> None:
    dom = parse_domain(_with_metadata(_gpus(body)))
    with pytest.raises(DomainXmlError) as err:
        dom.metadata_request()
    _one_line_error(err.value, "gpulib metadata", *needles)


def test_metadata_request_two_gpus_elements() -> None:
    dom = parse_domain(_with_metadata(_gpus("") + _gpus("", prefix="x")))
    with pytest.raises(DomainXmlError) as err:
        dom.metadata_request()
    _one_line_error(err.value, "more than one")


# --------------------------------------------------------------------------
# bad input


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE domain [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
 <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
 <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
 <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
 <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
<domain type='kvm'><name>&lol9;</name></domain>
"""

XXE = ('<!DOCTYPE domain [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>\n'
       "<domain type='kvm'><name>&xxe;</name><description>&xxe;</description></domain>\n")
XXE_PARAMETER = ('<!DOCTYPE domain [<!ENTITY % p SYSTEM "file:///etc/passwd"> %p;]>\n'
                 "<domain><name>x</name></domain>")


def _passwd_first_line() -> Optional[str]:
    try:
        with open("/etc/passwd", encoding="utf-8") as f:
            line = f.readline().strip()
    except OSError:
        return None
    return line or None


@pytest.mark.parametrize("text", [
    BILLION_LAUGHS,
    XXE,
    XXE_PARAMETER,
    "<!-- a comment first --><?pi x?>\n" + XXE,
    "\ufeff" + XXE,
    "<!DOCTYPE domain>\n<domain/>",
], ids=["billion-laughs", "xxe", "xxe-parameter", "xxe-after-comment", "xxe-bom",
        "plain-doctype"])
def test_doctype_and_entities_refused(text: str) -> None:
    for value in (text, text.encode("utf-8")):
        with pytest.raises(DomainXmlError) as err:
            parse_domain(value)
        message = _one_line_error(err.value, "DOCTYPE")
        secret = _passwd_first_line()
        assert secret is None or secret not in message


def test_parser_never_expands_external_entities() -> None:
    # Second layer: even with the DOCTYPE scan bypassed, the lxml parser
    # options keep /etc/passwd out of the tree.
    secret = _passwd_first_line()
    try:
        root = etree.fromstring(XXE.encode(), domain_mod._xml_parser())
    except etree.XMLSyntaxError:
        return  # refusing outright is fine too
    dumped = etree.tostring(root, encoding="unicode")
    assert secret is None or secret not in dumped
    assert "root:" not in (root.findtext("name") or "")


def test_too_large_refused_before_parsing() -> None:
    pad = MAX_XML_BYTES - len("<domain><!----></domain>")
    exact = "<domain><!--" + "x" * pad + "--></domain>"
    assert len(exact.encode()) == MAX_XML_BYTES
    assert parse_domain(exact).to_xml() == exact  # the limit itself is allowed
    over = exact.replace("<domain>", "<domain> ", 1)
    for value in (over, over.encode()):
        with pytest.raises(DomainXmlError) as err:
            parse_domain(value)
        _one_line_error(err.value, "too large", str(MAX_XML_BYTES))
    # Fewer characters than the limit, more bytes: bytes count.
    wide = "<domain><name>" + "\u00e9" * (MAX_XML_BYTES // 2) + "</name></domain>"
    assert len(wide) < MAX_XML_BYTES < len(wide.encode())
    with pytest.raises(DomainXmlError) as err:
        parse_domain(wide)
    _one_line_error(err.value, "too large")
    # The design's 50 MB argument.
    with pytest.raises(DomainXmlError) as err:
        parse_domain("<domain>" + " " * (50 * 1000 * 1000) + "</domain>")
    _one_line_error(err.value, "too large")


def test_too_many_nodes_refused() -> None:
    text = "<domain>" + "<a/>" * MAX_XML_NODES + "</domain>"
    assert len(text.encode()) < MAX_XML_BYTES
    with pytest.raises(DomainXmlError) as err:
        parse_domain(text)
    _one_line_error(err.value, "too many elements")


def test_too_deep_refused() -> None:
    text = "<domain>" + "<a>" * 300 + "</a>" * 300 + "</domain>"
    with pytest.raises(DomainXmlError) as err:
        parse_domain(text)
    _one_line_error(err.value, "malformed domain XML: line 1:", "depth")


@pytest.mark.parametrize("text, needles", [
    ("hello, not XML", ("malformed domain XML: line 1:", "Start tag expected")),
    ("<domain>\n<name>x</name>\n</nam></domain>", ("malformed domain XML: line 3:",
                                                   "mismatch")),
    ("<domain><name>x</name>", ("malformed domain XML: line 1:",)),
    ("<domain>&foo;</domain>", ("malformed domain XML", "foo")),
    ("<domain/><domain/>", ("malformed domain XML", "Extra content")),
    ("", ("empty",)),
    ("  \n ", ("empty",)),
    ("<domstatus><domain/></domstatus>", ("root element is <domstatus>", "expected <domain>")),
    ("<domain xmlns='urn:x'/>", ("root element is <domain xmlns='urn:x'>",)),
    ("<!-- only a comment -->", ("malformed domain XML",)),
])
def test_malformed_input(text: str, needles: tuple[str, ...]) -> None:
    with pytest.raises(DomainXmlError) as err:
        parse_domain(text)
    _one_line_error(err.value, *needles)


def test_not_utf8() -> None:
    with pytest.raises(DomainXmlError) as err:
        parse_domain(b"<domain><name>\xff</name></domain>")
    _one_line_error(err.value, "not valid UTF-8")
    # argv decoded with surrogateescape carries bad bytes as lone surrogates.
    with pytest.raises(DomainXmlError) as err:
        parse_domain("<domain><name>\udcff</name></domain>")
    _one_line_error(err.value, "not valid UTF-8")
    with pytest.raises(TypeError):
        parse_domain(42)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# properties


_PCI = st.builds(PciAddress, st.integers(0, 0xFFFF), st.integers(0, 0xFF),
                 st.integers(0, 0x1F), st.integers(0, 7))
# Host addresses the fixtures do not use (bus 0xee), so adds never collide.
_NEW_PCI = st.builds(PciAddress, st.integers(0, 0xFFFF), st.just(0xEE),
                     st.integers(0, 0x1F), st.integers(0, 7))
_NAME = st.from_regex(r"\A[a-z][a-z0-9_-]{0,7}\Z").map(lambda s: "zz" + s)
_TEXT = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs")),
                max_size=12)
_COMMENT = _TEXT.filter(lambda s: "--" not in s and not s.endswith("-"))
_INSERTION = st.tuples(
    st.sampled_from(["element", "attribute", "comment", "ns-attribute", "ns-metadata",
                     "next-to-hostdev"]),
    st.integers(0, 10_000), st.integers(0, 100), _NAME, _TEXT, _COMMENT)


def _insert_unknown(root: Any, insertions: list[tuple[str, int, int, str, str, str]]) -> None:
    for kind, target, position, name, text, comment in insertions:
        elements = [e for e in root.iter() if isinstance(e.tag, str)]
        elem = elements[target % len(elements)]
        where = position % (len(elem) + 1)
        if kind == "element":
            new = etree.Element(name, {"zzattr": text})
            new.text = text or None
            elem.insert(where, new)
        elif kind == "attribute":
            elem.set(name, text)
        elif kind == "comment":
            elem.insert(where, etree.Comment(comment))
        elif kind == "ns-attribute":
            elem.set(f"{{urn:x-test:{name}}}{name}", text)
        elif kind == "next-to-hostdev":
            # Right before or after a hostdev: where a careless removal or
            # insertion would eat or misplace a neighbour.
            hostdevs = root.findall("devices/hostdev") or root.findall("devices/*")
            anchor = hostdevs[target % len(hostdevs)]
            new = etree.Comment(comment) if position % 2 else etree.Element(name)
            if position % 4 < 2:
                anchor.addprevious(new)
            else:
                anchor.addnext(new)
        else:
            metadata = root.find("metadata")
            if metadata is None:
                metadata = etree.SubElement(root, "metadata")
            extra = etree.SubElement(metadata, f"{{http://example.org/{name}}}{name}",
                                     nsmap={"ext": f"http://example.org/{name}"})
            etree.SubElement(extra, f"{{http://example.org/{name}}}v", {"k": text}).text = text


def _drop_source(root: Any, find: str) -> None:
    for h in root.xpath(HOSTDEV_XPATH):
        if _c14n(h.find("source/address")) == find:
            h.getparent().remove(h)
            return
    raise AssertionError(f"added hostdev {find} not in output")


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(fixture=st.sampled_from(FIXTURE_NAMES),
       insertions=st.lists(_INSERTION, max_size=8),
       edit=st.sampled_from(["add-pci", "add-mdev", "remove", "add-remove"]),
       address=_NEW_PCI, remove_index=st.integers(0, 10), mdev=st.uuids())
def test_unknown_xml_survives_edits(fixture: str, insertions: Any, edit: str,
                                    address: PciAddress, remove_index: int,
                                    mdev: uuid.UUID) -> None:
    source = etree.fromstring(TEXTS[fixture].encode())
    _insert_unknown(source, insertions)
    text = etree.tostring(source, encoding="unicode") + "\n"
    dom = parse_domain(text)
    expected = etree.fromstring(text.encode())
    added: list[str] = []
    if edit == "remove" and not dom.hostdevs():
        edit = "add-remove"
    if edit == "add-pci":
        new: Hostdev = dom.add_pci_hostdev(address, guest_address=PciAddress(0, 0, 0x1E, 0))
        added.append(_c14n(new.element.find("source/address")))
    elif edit == "add-mdev":
        new = dom.add_mdev_hostdev(str(mdev), display="off")
        added.append(_c14n(new.element.find("source/address")))
    elif edit == "remove":
        victims = dom.hostdevs()
        k = remove_index % len(victims)
        dom.remove_hostdev(victims[k])
        ref = expected.xpath(HOSTDEV_XPATH)[k]
        ref.getparent().remove(ref)
    else:
        dom.remove_hostdev(dom.add_pci_hostdev(address))
    assert dom.changed
    out = etree.fromstring(dom.to_xml().encode())
    for find in added:
        _drop_source(out, find)
    assert _c14n(out) == _c14n(expected)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("pci"), _NEW_PCI, st.booleans(), st.none() | _PCI, st.booleans()),
    st.tuples(st.just("mdev"), st.uuids(), st.sampled_from([None, "on", "off"])),
    st.tuples(st.just("remove"), st.integers(0, 20)),
    st.tuples(st.just("managed"), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("guest"), st.integers(0, 20), st.none() | _PCI, st.booleans()),
), max_size=6)


def _apply_op(dom: Domain, op: tuple[Any, ...]) -> None:
    kind = op[0]
    pcis = dom.pci_hostdevs()
    if kind == "pci":
        _, addr, managed, guest, multi = op
        if dom.find_pci_hostdev(addr) is None:
            dom.add_pci_hostdev(addr, managed=managed, guest_address=guest,
                                multifunction=multi and guest is not None)
    elif kind == "mdev":
        _, mdev_uuid, display = op
        if dom.find_mdev_hostdev(str(mdev_uuid)) is None:
            dom.add_mdev_hostdev(str(mdev_uuid), display=display)
    elif kind == "remove":
        hostdevs = dom.hostdevs()
        if hostdevs:
            dom.remove_hostdev(hostdevs[op[1] % len(hostdevs)])
    elif kind == "managed" and pcis:
        pcis[op[1] % len(pcis)].managed = op[2]
    elif kind == "guest" and pcis:
        pcis[op[1] % len(pcis)].set_guest_address(op[2], multifunction=op[3])


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fixture=st.sampled_from(FIXTURE_NAMES), ops=_OPS)
def test_hostdev_list_round_trips(fixture: str, ops: list[tuple[Any, ...]]) -> None:
    dom = parse_domain(TEXTS[fixture])
    for op in ops:
        _apply_op(dom, op)
    out = dom.to_xml()
    before = [_hostdev_summary(h) for h in dom.hostdevs()]
    after = [_hostdev_summary(h) for h in parse_domain(out).hostdevs()]
    assert after == before
    if not dom.changed:
        assert out == TEXTS[fixture]
    # Independent count: what libvirt-minded XPath sees in the output.
    assert len(etree.fromstring(out.encode()).xpath(HOSTDEV_XPATH)) == len(before)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(address=_PCI, guest=_PCI, multi=st.booleans(), managed=st.booleans())
def test_pci_address_rendering_round_trips(address: PciAddress, guest: PciAddress,
                                           multi: bool, managed: bool) -> None:
    dom = parse_domain(TEXTS["no-gpu.xml"])
    dom.add_pci_hostdev(address, managed=managed, guest_address=guest, multifunction=multi)
    (h,) = parse_domain(dom.to_xml()).hostdevs()
    assert isinstance(h, PciHostdev)
    assert h.address == address and h.guest_address == guest
    assert h.managed == managed and h.multifunction == multi
    src = h.element.find("source/address")
    assert dict(src.attrib) == address.libvirt()
    assert re.fullmatch(r"0x[0-9a-f]{4}", src.get("domain"))
    assert re.fullmatch(r"0x[0-9a-f]{2}", src.get("bus"))
    assert re.fullmatch(r"0x[0-9a-f]{2}", src.get("slot"))
    assert re.fullmatch(r"0x[0-7]", src.get("function"))
    assert PciAddress.parse(str(h.address)) == address


# --------------------------------------------------------------------------
# libvirt accepts what we write


def _virsh(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    assert VIRSH is not None
    env = dict(os.environ, HOME=str(tmp_path), LC_ALL="C")
    env.pop("LIBVIRT_DEFAULT_URI", None)
    return subprocess.run([VIRSH, "-q", "-c", "test:///default", command],
                          capture_output=True, text=True, timeout=60, env=env, check=False)


def _virsh_errors(proc: subprocess.CompletedProcess[str], path: Path) -> set[str]:
    return {line.replace(str(path), "FILE").strip()
            for line in proc.stderr.splitlines() if line.strip()}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


@needs_virsh
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_virsh_defines_edited_xml(tmp_path: Path, fixture: str, edit: str) -> None:
    dom, out = _edited(fixture, edit)
    inp = _write(tmp_path, "in.xml", TEXTS[fixture])
    outp = _write(tmp_path, "out.xml", out)
    before = _virsh(tmp_path, f"define {inp}")
    after = _virsh(tmp_path, f"define {outp}; dumpxml {dom.name}")
    if before.returncode != 0:
        # The input is already refused: our edit must not add an error (the
        # define alone: dumpxml of a domain never defined adds its own).
        after = _virsh(tmp_path, f"define {outp}")
        assert _virsh_errors(after, outp) <= _virsh_errors(before, inp)
        return
    assert after.returncode == 0, after.stderr
    # And libvirt read our hostdevs as we meant them.
    dumped = etree.fromstring(after.stdout.encode())
    hostdevs = dumped.findall("devices/hostdev")
    if edit == "add-pci":
        sources = {(h.find("source/address").get("bus"), h.find("source/address").get("function"))
                   for h in hostdevs if h.get("type") == "pci"}
        assert {("0xaf", "0x0"), ("0xaf", "0x1")} <= sources
        guest = [h.find("address") for h in hostdevs
                 if h.find("source/address").get("bus") == "0xaf"]
        assert [(g.get("slot"), g.get("function"), g.get("multifunction")) for g in guest] == [
            ("0x10", "0x0", "on"), ("0x10", "0x1", None)]
        managed = [h.get("managed") for h in hostdevs
                   if h.find("source/address").get("bus") == "0xaf"]
        assert managed == ["yes", "no"]
    else:
        wanted = derive_uuid(dom.uuid_checked(), 0)
        (mdev,) = [h for h in hostdevs if h.find("source/address").get("uuid") == wanted]
        assert (mdev.get("model"), mdev.get("display")) == ("vfio-pci", "on")


@needs_virsh
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_virsh_validate_adds_no_error(tmp_path: Path, fixture: str, edit: str) -> None:
    _, out = _edited(fixture, edit)
    inp = _write(tmp_path, "in.xml", TEXTS[fixture])
    outp = _write(tmp_path, "out.xml", out)
    before = _virsh(tmp_path, f"define --validate {inp}")
    after = _virsh(tmp_path, f"define --validate {outp}")
    if before.returncode == 0:
        assert after.returncode == 0, after.stderr
    assert _virsh_errors(after, outp) <= _virsh_errors(before, inp)


@needs_virsh
def test_virsh_check_has_teeth(tmp_path: Path) -> None:
    # Control: the check above would notice a hostdev libvirt cannot take.
    dom = parse_domain(TEXTS["passthrough-1gpu.xml"])
    h = dom.add_pci_hostdev(PciAddress(0, 0xAF, 0, 0), guest_address=PciAddress(0, 0, 0x10, 0))
    h.element.find("address").set("slot", "0x40")
    dom.mark_changed()
    proc = _virsh(tmp_path, f"define {_write(tmp_path, 'bad.xml', dom.to_xml())}")
    assert proc.returncode != 0 and "slot" in proc.stderr


# Schema checks with lxml: the whole document first, then device by device,
# because CloudStack's duplicate <devices> stops whole-document validation
# at the first error and would hide anything we add.

_MINIMAL = ("<domain type='kvm'><name>t</name><memory>1048576</memory>"
            "<os><type arch='x86_64' machine='pc'>hvm</type></os><devices>{}</devices></domain>")


@pytest.fixture(scope="module")
def relaxng() -> Any:
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} missing (libvirt schemas not installed)")
    return etree.RelaxNG(etree.parse(str(SCHEMA)))


def _schema_errors(rng: Any, root: Any) -> set[str]:
    rng.validate(root)
    return {e.message for e in rng.error_log}


def _device_alone_valid(rng: Any, device: Any) -> bool:
    text = etree.tostring(device, encoding="unicode", with_tail=False)
    return bool(rng.validate(etree.fromstring(_MINIMAL.format(text))))


def _failing_devices(rng: Any, root: Any) -> set[str]:
    return {_c14n(dev) for devices in root.findall("devices") for dev in devices
            if isinstance(dev.tag, str) and not _device_alone_valid(rng, dev)}


@needs_schema
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_schema_adds_no_error(relaxng: Any, fixture: str, edit: str) -> None:
    dom, out = _edited(fixture, edit)
    before = etree.fromstring(TEXTS[fixture].encode())
    after = etree.fromstring(out.encode())
    assert _schema_errors(relaxng, after) <= _schema_errors(relaxng, before)
    assert _failing_devices(relaxng, after) <= _failing_devices(relaxng, before)
    originals = {_c14n(h) for h in before.xpath(HOSTDEV_XPATH)}
    added = [h for h in dom.hostdevs() if _c14n(h.element) not in originals]
    assert len(added) == (2 if edit == "add-pci" else 1)
    for h in added:
        assert _device_alone_valid(relaxng, h.element), etree.tostring(h.element)


@needs_schema
def test_schema_check_has_teeth(relaxng: Any) -> None:
    # Control: CloudStack's own display= on a PCI hostdev fails libvirt 9's
    # schema (see the fixture README), and the per-device check sees it.
    root = etree.fromstring(TEXTS["passthrough-1gpu.xml"].encode())
    assert len(_failing_devices(relaxng, root)) >= 1
    (hostdev,) = root.xpath(HOSTDEV_XPATH)
    assert _c14n(hostdev) in _failing_devices(relaxng, root)
    assert _device_alone_valid(relaxng, etree.fromstring(
        "<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' "
        "bus='0x3b' slot='0x00' function='0x0'/></source></hostdev>"))
