"""One rule each for UUIDs, mdev type ids, PCI addresses and VM names: every
entry point (domain XML, the CLI, the state file, mdevctl definitions) accepts
and refuses the same strings, and they agree with gpulib.validate, whose
checks agree with the rules written as regular expressions."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, Callable, Optional
from xml.sax.saxutils import quoteattr

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpulib.cli import main
from gpulib.context import Context
from gpulib.domain import DomainXmlError, parse_domain
from gpulib.errors import InputError
from gpulib.mdevctl import read_definitions
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.state import CorruptStateError, State
from gpulib.validate import (
    check_domain_uuid,
    check_pci_address,
    check_type_id,
    check_uuid,
    check_vm_name,
    decimal,
    is_canonical_pci_address,
    is_canonical_uuid,
    is_type_id,
    is_uuid,
    libvirt_uuid,
    pci_address_parts,
)
from tests.hosts import t4_farm

PARENT = "0000:3b:00.0"
GOOD_UUID = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d"
# Characters any of the four entry points can carry: an XML attribute or text,
# a file name, a JSON string, an argv word (no NUL, no '/', no controls).
_SAFE = st.characters(min_codepoint=0x20, max_codepoint=0x2FF, blacklist_characters="/\x7f")


def _mutations(valid: st.SearchStrategy[str], alphabet: str) -> st.SearchStrategy[str]:
    """Valid strings, and strings one edit away from valid ones."""
    def edit(text: str, where: int, ch: str, how: int) -> str:
        i = where % (len(text) + 1)
        if how == 0:
            return text[:i] + ch + text[i:]  # insert
        if how == 1:
            return text[:i] + text[i + 1:]  # delete
        if how == 2:
            return text[:i] + ch + text[i + 1:]  # replace
        if how == 3:
            return text.upper()
        if how == 4:
            return f" {text}"
        return "{" + text + "}"

    near = st.builds(edit, valid, st.integers(0, 64), st.sampled_from(alphabet),
                     st.integers(0, 5))
    return st.one_of(valid, near, st.text(st.sampled_from(alphabet), max_size=40),
                     st.text(_SAFE, max_size=12))


def _accepts(check: Callable[[str], Any], text: str) -> bool:
    try:
        check(text)
    except InputError:
        return False
    return True


uuids = _mutations(st.uuids().map(str), "0123456789abcdefABCDEFgx-: .{}")
type_ids = _mutations(
    st.from_regex(r"[a-z0-9]{1,6}-[A-Za-z0-9_]{1,8}", fullmatch=True),
    "abcAZ019_.:+-/ ")
pci_addresses = _mutations(
    st.builds(lambda d, b, s, f: f"{d:04x}:{b:02x}:{s:02x}.{f}", st.integers(0, 0xFFFFFFFF),
              st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7)),
    "0123456789abcdefABCDEFg:. ")
vm_names = _mutations(st.from_regex(r"[ir]-[0-9]{1,4}-VM", fullmatch=True),
                      "ab-_.\n\t/\u2028 \u00e9")


def strings(strategy: st.SearchStrategy[str], *examples: str, runs: int = 150
            ) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A property test of `text`: drawn from `strategy`, and each of `examples`
    every time."""
    def wrap(test: Callable[..., None]) -> Callable[..., None]:
        for text in reversed(examples):
            test = example(text=text)(test)
        return settings(max_examples=runs, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture]
                        )(given(text=strategy)(test))
    return wrap


# The rules as regular expressions, an independent statement of the languages
# gpulib.validate decides with string methods.
REF_UUID = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
REF_STORED_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
REF_HEX32 = re.compile(r"[0-9a-fA-F]{32}")
REF_TYPE_ID = re.compile(r"[A-Za-z0-9_.:+]+-[A-Za-z0-9_.:+-]+")
REF_PCI = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")
# As sysfs names a device: a domain of four digits, or of up to eight without
# a leading zero; a slot up to 1f.
REF_STORED_PCI = re.compile(
    r"(?:[0-9a-f]{4}|[1-9a-f][0-9a-f]{4,7}):[0-9a-f]{2}:[01][0-9a-f]\.[0-7]")


def ref_pci_parts(text: str) -> Optional[tuple[int, int, int, int]]:
    m = REF_PCI.fullmatch(text)
    if m is None or int(m.group(3), 16) > 0x1F:
        return None
    return (int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16),
            int(m.group(4)))


# libvirt's virUUIDParse: white space around, '-' and ' ' between pairs of hex digits.
REF_LIBVIRT_UUID = re.compile(r"[ \t\n\v\f\r]*(?:[- ]*[0-9A-Fa-f]{2}){16}[ \t\n\v\f\r]*")


def ref_domain_uuid(text: str) -> bool:
    return bool(REF_LIBVIRT_UUID.fullmatch(text))


def ref_type_id(text: str) -> bool:
    return len(text) <= 128 and ".." not in text and bool(REF_TYPE_ID.fullmatch(text))


any_ids = st.one_of(
    uuids, type_ids, pci_addresses,
    st.from_regex(REF_UUID, fullmatch=True), st.from_regex(REF_PCI, fullmatch=True),
    st.from_regex(REF_STORED_PCI, fullmatch=True), st.from_regex(REF_TYPE_ID, fullmatch=True),
    st.text(alphabet="0123456789abcdefAF-:. g\n+_/\u0660", max_size=40),
    st.uuids().map(lambda u: str(u)[:8] + str(u)[9:] + "-"),
    st.uuids().map(lambda u: f" {u.hex.upper()}\t"))


def _parts(text: str) -> Optional[tuple[int, int, int, int]]:
    try:
        return pci_address_parts(text)
    except InputError:
        return None


@strings(any_ids, "0:0.0", "ffffffff:ff:1f.7", "0ffff:00:00.0", "0000:3b:00.0\n",
         "a-" + "b" * 126, "a-" + "b" * 127, "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5\u0661",
         runs=500)
def test_the_checks_accept_what_the_regular_expressions_accept(text: str) -> None:
    assert is_uuid(text) == bool(REF_UUID.fullmatch(text))
    assert _accepts(check_uuid, text) == is_uuid(text)
    assert is_canonical_uuid(text) == bool(REF_STORED_UUID.fullmatch(text))
    assert _accepts(check_domain_uuid, text) == ref_domain_uuid(text)
    assert is_type_id(text) == ref_type_id(text) == _accepts(check_type_id, text)
    parts = ref_pci_parts(text)
    assert _parts(text) == parts
    assert is_canonical_pci_address(text) == bool(REF_STORED_PCI.fullmatch(text))
    # What gpulib stores is exactly what its checks return unchanged.
    assert is_canonical_uuid(text) == (is_uuid(text) and check_uuid(text) == text)
    assert is_canonical_pci_address(text) == (parts is not None
                                              and check_pci_address(text) == text)


@pytest.mark.parametrize("value", [None, 1, b"0000:3b:00.0", ["nvidia-1"]])
def test_the_checks_refuse_what_is_not_text(value: Any) -> None:
    assert not (is_uuid(value) or is_canonical_uuid(value) or is_type_id(value)
                or is_canonical_pci_address(value))
    for check in (check_uuid, check_domain_uuid, check_type_id, check_pci_address):
        with pytest.raises(InputError):
            check(value)


def test_the_stored_forms_are_the_common_ones() -> None:
    assert is_canonical_uuid("6f3a1c2e-0b1d-4c5e-9f00-112233445566")
    assert not is_canonical_uuid("6F3A1C2E-0B1D-4C5E-9F00-112233445566")
    assert is_canonical_pci_address("0000:41:1f.7")
    assert is_canonical_pci_address("10000:01:00.0")
    assert not is_canonical_pci_address("0000:41:20.0")
    assert not is_canonical_pci_address("41:00.0")
    assert not is_canonical_pci_address("00000:41:00.0")


@pytest.fixture(scope="module")
def host() -> Iterator[FakeHost]:
    root = tempfile.mkdtemp(prefix="gpulib-validate-")
    yield t4_farm(root, gpus=1, per_parent=1)
    shutil.rmtree(root)


class Cli:
    """The `gpulib` command in this process, on the fake host."""

    def __init__(self, root: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self.capsys = capsys

    def refuses(self, args: list[str], problem: str) -> bool:
        """Whether the command refuses its argument as bad input (exit 2 naming
        `problem`); other failures (no such device) are not about the string."""
        saved = {k: os.environ.get(k) for k in ("GPULIB_ROOT", "GPULIB_SIMULATE")}
        os.environ.update(GPULIB_ROOT=self.root, GPULIB_SIMULATE="1")
        try:
            self.capsys.readouterr()
            code = main(args)
            err = self.capsys.readouterr().err
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return code == 2 and problem in err


@pytest.fixture
def cli(host: FakeHost, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(host.root, capsys)


def _state_accepts(doc: dict[str, Any]) -> bool:
    try:
        State.from_json({"version": 2, **doc})
    except CorruptStateError:
        return False
    return True


def _definition_uuids(parent: str, name: str, type_id: str = "nvidia-222"
                      ) -> Optional[dict[str, Any]]:
    """What mdevctl's records at etc/mdevctl.d/<parent>/<name> read as."""
    root = tempfile.mkdtemp(prefix="gpulib-mdevctl-")
    try:
        directory = os.path.join(root, "etc/mdevctl.d", parent)
        try:
            os.makedirs(directory)
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                json.dump({"mdev_type": type_id, "start": "manual", "attrs": []}, f)
        except (OSError, ValueError):
            return None  # not a file name at all: no definition can carry it
        return dict(read_definitions(Context.for_root(root)))
    finally:
        shutil.rmtree(root)


def _file_name_ok(text: str) -> bool:
    return text not in ("", ".", "..") and "/" not in text and "\x00" not in text \
        and len(text.encode("utf-8", "surrogatepass")) < 255




@strings(uuids, GOOD_UUID.upper(), GOOD_UUID.replace("-", ""), f"urn:uuid:{GOOD_UUID}")
def test_uuids_agree(cli: Cli, text: str) -> None:
    valid = _accepts(check_uuid, text)
    xml = ("<domain><name>vm</name><devices><hostdev mode='subsystem' type='mdev'>"
           f"<source><address uuid={quoteattr(text)}/></source></hostdev></devices></domain>")
    (h,) = parse_domain(xml).mdev_hostdevs()
    # Domain XML is read as libvirt reads it (which then writes it canonical).
    assert _accepts(lambda _: h.uuid_checked(), text) == ref_domain_uuid(text)
    if valid:
        assert h.uuid_checked() == check_uuid(text)
    assert _state_accepts({"vgpus": {text: {"parent": PARENT, "type_id": "nvidia-222",
                                            "created": "x"}}}) == valid
    assert _state_accepts({"allocations": {"vm": {
        "vm": "vm", "status": "active", "since": "x",
        "devices": [{"kind": "mdev", "id": text}]}}}) == valid
    assert cli.refuses(["mdev", "remove", "--", text], "not a UUID") != valid
    if _file_name_ok(text):
        # mdevctl names its files by the canonical (lowercase) UUID: a file
        # named otherwise is not its record, whatever the string.
        found = _definition_uuids(PARENT, text)
        assert found is not None
        assert bool(found) == (valid and text == check_uuid(text))
    if valid:
        assert check_uuid(text) == text.lower()
        # The domain's own <uuid> takes libvirt's forms too (it names no device).
        assert check_domain_uuid(text) == text.lower()


@strings(type_ids, "nvidia-231", "i915-GVTg_V5_4", "nvidia", "-231", "nvidia-..", "a-" + "b" * 127)
def test_type_ids_agree(cli: Cli, text: str) -> None:
    valid = _accepts(check_type_id, text)
    xml = ("<domain><name>vm</name><metadata><gpulib:gpus "
           "xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
           f"<gpulib:vgpu type={quoteattr(text)}/></gpulib:gpus></metadata></domain>")
    dom = parse_domain(xml)
    assert _accepts(lambda _: dom.metadata_request(), text) == valid
    assert _state_accepts({"vgpus": {GOOD_UUID: {"parent": PARENT, "type_id": text,
                                                 "created": "x"}}}) == valid
    # A parent this host does not have: an accepted type id is then refused
    # for the parent, never created.
    assert cli.refuses(["mdev", "create", "--parent=0000:ff:1f.7", f"--type={text}"],
                       "not a vGPU type id") != valid
    found = _definition_uuids(PARENT, GOOD_UUID, type_id=text)
    assert found is not None and (GOOD_UUID in found) == valid
    if valid:
        assert check_type_id(text) == text


@strings(pci_addresses, "000f:00:00.0", "10000:01:00.0", "ffffffff:ff:1f.7", "100000000:00:00.0",
         "0000:00:20.0", "3b:00.0", "0000:3B:00.0")
def test_pci_addresses_agree(cli: Cli, text: str) -> None:
    valid = _accepts(check_pci_address, text)
    assert _accepts(PciAddress.parse, text) == valid
    assert _state_accepts({"vf_types": {text: {"type_id": 1}}}) == valid
    assert _state_accepts({"unmanaged": [text]}) == valid
    assert cli.refuses(["mdev", "types", f"--parent={text}"], "PCI address") != valid
    if _file_name_ok(text):
        # The directory is named as sysfs names the parent (canonical form).
        found = _definition_uuids(text, GOOD_UUID)
        assert found is not None
        assert (GOOD_UUID in found) == (valid and text == check_pci_address(text))
    if valid:
        canonical = check_pci_address(text)
        assert str(PciAddress.parse(text)) == canonical == check_pci_address(canonical)
        doc = State.from_json({"version": 2, "unmanaged": [text]})
        assert doc.unmanaged == {canonical}


@strings(vm_names, "a/b", "..", "line\nbreak", "x" * 256)
def test_vm_names_agree(cli: Cli, text: str) -> None:
    valid = _accepts(check_vm_name, text)
    if text.strip() and "\n" not in text and "\t" not in text and "\r" not in text:
        # XML text normalises no characters here, so the element carries the string.
        xml = f"<domain><name>{quoteattr(text)[1:-1]}</name></domain>"
        dom = parse_domain(xml)
        assert dom.name == text
        try:
            dom.name_checked()
            assert valid
        except DomainXmlError:
            assert not valid
    assert _state_accepts({"allocations": {text: {
        "vm": text, "status": "active", "since": "x", "devices": []}}}) == valid
    assert cli.refuses(["release", "--", text], "VM name") != valid


# -- the rules' own cases ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["i-2-10-VM", "a", "x" * 255, "vm with spaces", "ünï-côdé",
                                  "r-1.2_3"])
def test_valid_vm_names(name: str) -> None:
    assert check_vm_name(name) == name


@pytest.mark.parametrize("name,problem", [
    ("", "empty"),
    ("a/b", "'/'"),
    ("../etc", "'/'"),
    ("vm\nname", "newline"),
    ("vm\r", "newline"),
    ("vm\x00", "NUL"),
    ("vm\x1b[31m", "control"),
    ("vm\x85", "control"),
    ("vm\u2028x", "control"),
    ("x" * 256, "longer than 255 characters"),
    ("é" * 200, "longer than 255 bytes"),
    ("vm\udcff", "not valid UTF-8"),
    (".", "cannot be"),
    ("..", "cannot be"),
    ("x" * 50_000_000, "longer than 255"),
])
def test_bad_vm_names(name: str, problem: str) -> None:
    with pytest.raises(InputError) as e:
        check_vm_name(name)
    assert problem in e.value.message
    assert "\n" not in e.value.message and len(e.value.message) < 300


def test_vm_name_not_text() -> None:
    with pytest.raises(InputError, match="must be text"):
        check_vm_name(b"vm")  # type: ignore[arg-type]


@given(st.uuids())
def test_check_uuid_canonicalises(u: uuid.UUID) -> None:
    assert check_uuid(str(u)) == str(u)
    assert check_uuid(str(u).upper()) == str(u)


@pytest.mark.parametrize("text", [
    "", "not-a-uuid", "6f3a1c2e0b1d4c5e9f00112233445566",
    "{6f3a1c2e-0b1d-4c5e-9f00-112233445566}", "urn:uuid:6f3a1c2e-0b1d-4c5e-9f00-112233445566",
    "6f3a1c2e-0b1d-4c5e-9f00-11223344556", "6f3a1c2e-0b1d-4c5e-9f00-1122334455667",
    "6f3a1c2e-0b1d-4c5e-9f00-11223344556g", " 6f3a1c2e-0b1d-4c5e-9f00-112233445566",
    "6f3a1c2e-0b1d-4c5e-9f00-112233445566\n", "../../../../etc/passwd", "x" * 1_000_000,
])
def test_bad_uuids(text: str) -> None:
    with pytest.raises(InputError, match="not a UUID") as e:
        check_uuid(text)
    assert len(e.value.message) < 300


def _virUUIDParse(text: str) -> Optional[str]:
    """libvirt's reading of a UUID, written out as a pattern: white space
    around it, then 16 pairs of hex digits with any '-' and ' ' before and
    between them (never inside a pair, never after the last)."""
    body = text.strip(" \t\n\v\f\r")
    if not re.fullmatch(r"[- ]*(?:[0-9a-fA-F]{2}[- ]*){15}[0-9a-fA-F]{2}", body):
        return None
    h = "".join(c for c in body if c not in "- ").lower()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(alphabet="0123456789abcdefABCDEF- \t\ng", max_size=40),
    st.uuids().map(str),
    st.uuids().map(lambda u: str(u).upper()),
    st.uuids().map(lambda u: u.hex),
    st.builds(lambda u, i, c: str(u)[:i] + c + str(u)[i + 1:], st.uuids(),
              st.integers(0, 35), st.sampled_from("-gG ABf0"))))
def test_uuids_are_read_as_libvirt_reads_them(text: str) -> None:
    assert libvirt_uuid(text) == _virUUIDParse(text)


@given(st.text(max_size=12), st.integers(min_value=1, max_value=12))
@example("\u00b2", 9)
@example("\u0665\u0669\u0664", 9)
@example("0594", 4)
def test_a_decimal_is_ascii_digits_and_no_more_of_them(text: str, digits: int) -> None:
    expected = int(text) if re.fullmatch(f"[0-9]{{1,{digits}}}", text, re.ASCII) else None
    assert decimal(text, digits) == expected


def test_a_decimal_is_text() -> None:
    assert [decimal(v, 9) for v in (5, b"5", None, 5.0)] == [None] * 4
