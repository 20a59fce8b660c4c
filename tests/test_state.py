"""gpulib.state: the state file, its lock, atomic writes, corruption and crashes."""

from __future__ import annotations

import copy
import json
import logging
import multiprocessing
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulib.context import Context
from gpulib.errors import EXIT_BUSY, EXIT_STATE, LockTimeout, StateError
from gpulib.state import (
    SCHEMA_VERSION,
    Allocation,
    CorruptStateError,
    Device,
    State,
    StateStore,
    StateVersionError,
    VfRecord,
    VgpuRecord,
    dumps,
    render_json,
)

HELPER = Path(__file__).resolve().parent / "helpers" / "state_worker.py"
FORK = multiprocessing.get_context("fork")
STAMP = "2024-01-01T00:00:00Z"


def make_store(directory: str | os.PathLike[str], **kw: Any) -> StateStore:
    d = os.path.join(os.fspath(directory), "var", "lib", "gpulib")
    return StateStore(os.path.join(d, "state.json"), os.path.join(d, "state.lock"), **kw)


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return make_store(tmp_path)


def read_bytes(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def written_text(path: str) -> Optional[bytes]:
    """The state file's text without the spaces a prepared write pads it with."""
    raw = read_bytes(path)
    return None if raw is None else raw.rstrip(b" ")


def write_raw(store: StateStore, data: bytes) -> None:
    os.makedirs(os.path.dirname(store.state_path), exist_ok=True)
    with open(store.state_path, "wb") as f:
        f.write(data)


def temp_files(store: StateStore) -> list[str]:
    name = os.path.basename(store.state_path)
    return sorted(n for n in os.listdir(os.path.dirname(store.state_path))
                  if n.startswith(f".{name}.") and n.endswith(".tmp"))


def sample_state() -> State:
    s = State()
    s.vgpus["6f3a1c2e-0b1d-4c5e-9f00-112233445566"] = VgpuRecord(
        parent="0000:41:00.4", type_id="nvidia-558", pool="a10-4q", on_demand=False,
        created=STAMP)
    s.vgpus["00000000-0000-0000-0000-000000000001"] = VgpuRecord(
        parent="0000:81:00.0", type_id="i915-GVTg_V5_4", on_demand=True, created=STAMP)
    s.vf_types["0000:41:00.5"] = VfRecord(type_id=558, name="NVIDIA A10-4Q", pool="p")
    s.vf_types["0001:c1:1f.7"] = VfRecord(type_id=0, name=None)
    s.type_names["10de:2236"] = {"558": "NVIDIA A10-4Q", "559": "NVIDIA A10-6Q"}
    s.allocations["i-2-10-VM"] = Allocation(
        vm="i-2-10-VM", domain_uuid="a1b2c3d4-0000-4000-8000-000000000000", status="active",
        since=STAMP, devices=[Device("mdev", "6f3a1c2e-0b1d-4c5e-9f00-112233445566"),
                              Device("vf", "0000:41:00.5", on_demand=True)])
    s.allocations["vm with ünïcode"] = Allocation(vm="vm with ünïcode", domain_uuid=None,
                                                  status="pending", since=STAMP, devices=[])
    s.unmanaged = {"0000:03:00.0", "0000:01:00.0"}
    return s


# ---------------------------------------------------------------------------
# Hypothesis strategies for states and mutations.

uuids = st.uuids().map(str)
pci_addrs = st.builds(lambda d, b, s, f: f"{d:04x}:{b:02x}:{s:02x}.{f}",
                      st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F),
                      st.integers(0, 7))
vm_names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"),
                           blacklist_characters="/\u2028\u2029"),
    min_size=1, max_size=24).filter(lambda s: s not in (".", ".."))
any_text = st.text(max_size=16)  # anything JSON can carry, lone surrogates included
opt_text = st.none() | any_text
components = st.from_regex(r"[A-Za-z0-9_.:-]{1,16}", fullmatch=True).filter(
    lambda s: s not in (".", ".."))
models = st.from_regex(r"[0-9a-f]{4}:[0-9a-f]{4}", fullmatch=True)
# mdev type ids are sysfs directory names, <driver>-<name> (gpulib.validate).
type_ids = st.from_regex(r"[A-Za-z0-9_.:+]{1,8}-[A-Za-z0-9_.:+-]{1,8}", fullmatch=True).filter(
    lambda s: ".." not in s)
type_numbers = st.integers(0, 100000).map(str)

vgpu_records = st.builds(VgpuRecord, parent=components, type_id=type_ids, pool=opt_text,
                         on_demand=st.booleans(), created=any_text)
vf_records = st.builds(VfRecord, type_id=st.integers(0, 2**31), name=opt_text, pool=opt_text,
                       on_demand=st.booleans())
devices = (st.builds(Device, kind=st.just("mdev"), id=uuids, on_demand=st.booleans())
           | st.builds(Device, kind=st.sampled_from(["vf", "pci"]), id=pci_addrs,
                       on_demand=st.booleans()))
allocations = st.builds(Allocation, vm=vm_names, domain_uuid=st.none() | uuids,
                        status=st.sampled_from(["pending", "active"]), since=any_text,
                        devices=st.lists(devices, max_size=4), boot_id=opt_text,
                        uptime=st.none() | st.floats(0, 1e9))


def _state(vgpus: dict[str, VgpuRecord], vfs: dict[str, VfRecord],
           names: dict[str, dict[str, str]], allocs: list[Allocation],
           unmanaged: set[str]) -> State:
    return State(vgpus=vgpus, vf_types=vfs, type_names=names,
                 allocations={a.vm: a for a in allocs}, unmanaged=unmanaged)


states = st.builds(
    _state,
    st.dictionaries(uuids, vgpu_records, max_size=4),
    st.dictionaries(pci_addrs, vf_records, max_size=4),
    st.dictionaries(models, st.dictionaries(type_numbers, any_text, max_size=3), max_size=3),
    st.lists(allocations, max_size=4),
    st.sets(pci_addrs, max_size=4),
)

index = st.integers(0, 50)
ops = st.one_of(
    st.tuples(st.just("vgpu"), uuids, vgpu_records),
    st.tuples(st.just("del_vgpu"), index),
    st.tuples(st.just("vf"), pci_addrs, vf_records),
    st.tuples(st.just("del_vf"), index),
    st.tuples(st.just("type_name"), models, type_numbers, any_text),
    st.tuples(st.just("alloc"), allocations),
    st.tuples(st.just("del_alloc"), index),
    st.tuples(st.just("add_device"), index, devices),
    st.tuples(st.just("activate"), index),
    st.tuples(st.just("unmanage"), pci_addrs),
    st.tuples(st.just("manage"), index),
)


def _pick(keys: Any, i: int) -> Optional[str]:
    ordered = sorted(keys)
    return ordered[i % len(ordered)] if ordered else None


def apply_op(s: State, op: tuple[Any, ...]) -> None:
    """Apply one mutation; ops are deep-copied so two states never share records."""
    name, *args = copy.deepcopy(op)
    if name == "vgpu":
        s.vgpus[args[0]] = args[1]
    elif name == "vf":
        s.vf_types[args[0]] = args[1]
    elif name == "type_name":
        s.type_names.setdefault(args[0], {})[args[1]] = args[2]
    elif name == "alloc":
        s.allocations[args[0].vm] = args[0]
    elif name == "unmanage":
        s.unmanaged.add(args[0])
    else:
        table: dict[str, Any] = {"del_vgpu": s.vgpus, "del_vf": s.vf_types,
                                 "del_alloc": s.allocations, "add_device": s.allocations,
                                 "activate": s.allocations, "manage": s.unmanaged}
        target = table[name]
        key = _pick(target, args[0])
        if key is None:
            return
        if name == "add_device":
            s.allocations[key].devices.append(args[1])
        elif name == "activate":
            s.allocations[key].status = "active"
        elif name == "manage":
            s.unmanaged.discard(key)
        else:
            del target[key]


class Boom(Exception):
    pass


HYPOTHESIS = settings(max_examples=60, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------
# Round trip, determinism, missing file, modes.


def test_round_trip_through_the_file(store: StateStore) -> None:
    with store.transaction() as s:
        assert s == State()
        new = sample_state()
        s.vgpus, s.vf_types, s.type_names = new.vgpus, new.vf_types, new.type_names
        s.allocations, s.unmanaged = new.allocations, new.unmanaged
    assert store.load() == sample_state()
    assert make_store(Path(store.state_path).parents[3]).load() == sample_state()
    doc = json.loads(read_bytes(store.state_path) or b"")
    assert doc["version"] == SCHEMA_VERSION == 4
    assert doc["unmanaged"] == ["0000:01:00.0", "0000:03:00.0"]
    assert doc["allocations"]["i-2-10-VM"]["devices"][1] == {
        "kind": "vf", "id": "0000:41:00.5", "on_demand": True}
    with store.transaction() as s:
        assert s == sample_state()


@HYPOTHESIS
@given(states)
def test_json_round_trip_property(s: State) -> None:
    text = dumps(s)
    back = State.from_json(json.loads(text))
    assert back == s
    assert dumps(back) == text


json_scalars = (st.none() | st.booleans() | st.integers() | st.text()
                | st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=25)


@HYPOTHESIS
@given(json_values)
def test_the_state_text_is_what_json_dumps_gives(doc: Any) -> None:
    assert render_json(doc) == json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True,
                                          allow_nan=False) + "\n"


def test_the_state_text_refuses_what_json_dumps_refuses() -> None:
    assert render_json({1: [2]}) == json.dumps({1: [2]}, sort_keys=True, indent=1) + "\n"
    with pytest.raises(ValueError):
        render_json({"a": float("nan")})
    with pytest.raises(TypeError):
        render_json({"a": object()})


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A record field: mostly a valid value, sometimes anything a hand edit leaves."""
    return valid | valid | st.none() | st.booleans() | st.integers(-1, 2) | \
        st.floats() | st.text(max_size=4) | st.sampled_from([".", "..", "a/b", "A" * 36])


def record_of(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """A dict with some of `fields` (each maybe missing), or something else."""
    return st.fixed_dictionaries({}, optional={k: field(v) for k, v in fields.items()}) | \
        st.sampled_from([None, [], "x"])


uuids_text = st.uuids().map(str)
vm_texts = st.sampled_from(["i-2-10-VM", "vm", "v\u00e9", "v m", "\x7fvm", "v\u2028"])
pci_texts = st.sampled_from(["0000:41:00.5", "10000:01:00.0", "0000:41:00.8", "41:00.5"])
device_records = record_of({"kind": st.sampled_from(["mdev", "vf", "pci"]),
                            "id": uuids_text | pci_texts, "on_demand": st.booleans()})
allocation_records = record_of({
    "vm": vm_texts, "domain_uuid": uuids_text | st.none(),
    "status": st.sampled_from(["pending", "active"]), "since": st.just(STAMP),
    "boot_id": st.text(max_size=3) | st.none(), "uptime": st.floats() | st.none(),
    "devices": st.lists(device_records, max_size=3)})
vgpu_records = record_of({"parent": pci_texts, "type_id": st.just("nvidia-558"),
                          "pool": st.none() | st.text(max_size=3), "on_demand": st.booleans(),
                          "created": st.just(STAMP)})


@settings(max_examples=300, deadline=None)
@given(vgpu_records, allocation_records, vm_texts, device_records)
def test_the_quick_parse_accepts_only_what_the_checked_parse_accepts(
        vgpu: Any, alloc: Any, key: str, device: Any) -> None:
    """The common shape is parsed without the per-field checks; whatever that
    accepts, the checked parser accepts too and reads the same record."""
    from gpulib import records as mod

    quick = mod._vgpu_fast(vgpu)
    if quick is not None:
        assert mod._vgpu_from_json(vgpu, "v") == quick
    quick_a = mod._allocation_fast(alloc, key)
    if quick_a is not None:
        assert mod._allocation_from_json(alloc, "a", key) == quick_a
    quick_d = mod._device_fast(device)
    if quick_d is not None:
        assert mod._device_from_json(device, "d") == quick_d


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=8) | st.text(alphabet=st.characters(max_codepoint=0xA0), max_size=300))
def test_the_quick_vm_name_check_accepts_only_good_names(name: str) -> None:
    from gpulib import validate

    if validate.is_plain_vm_name(name):
        assert validate.vm_name_checks(name) == name


def test_bad_records_in_a_state_file_are_still_named(store: StateStore) -> None:
    doc = json.loads(dumps(sample_state()))
    doc["allocations"]["i-2-10-VM"]["devices"][0]["on_demand"] = 1
    with pytest.raises(CorruptStateError, match=r"allocations\['i-2-10-VM'\]\['devices'\]\[0\]"):
        State.from_json(doc)
    doc = json.loads(dumps(sample_state()))
    uuid_key = "6f3a1c2e-0b1d-4c5e-9f00-112233445566"
    doc["vgpus"][uuid_key.upper()] = doc["vgpus"].pop(uuid_key)
    # Every entry point takes a UUID in either case (gpulib.validate): the
    # checked parser reads it, and keeps it lowercase.
    assert set(State.from_json(doc).vgpus) == set(sample_state().vgpus)
    doc["vgpus"]["6f3a1c2e-0b1d-4c5e-9f00-11223344556"] = doc["vgpus"].pop(uuid_key.upper())
    with pytest.raises(CorruptStateError, match=r"vgpus"):
        State.from_json(doc)


def test_a_file_in_another_layout_is_left_until_the_state_changes(store: StateStore) -> None:
    os.makedirs(os.path.dirname(store.state_path))
    compact = json.dumps(sample_state().to_json()).encode()
    with open(store.state_path, "wb") as fh:
        fh.write(compact)
    with store.transaction() as s:
        assert s == sample_state()
    assert read_bytes(store.state_path) == compact
    # Nor is one that leaves out fields at their defaults.
    sparse = json.loads(compact)
    del sparse["intents"]
    for record in sparse["vgpus"].values():
        if record["pool"] is None:
            del record["pool"]
    sparse_text = json.dumps(sparse).encode()
    with open(store.state_path, "wb") as fh:
        fh.write(sparse_text)
    with store.transaction() as s:
        assert s == sample_state()
    assert read_bytes(store.state_path) == sparse_text
    with store.transaction() as s:
        s.unmanaged.add("0000:05:00.0")
    text = written_text(store.state_path)
    assert text is not None and text != compact
    # The deterministic text (then the spaces of a prepared write, stripped).
    assert text.decode() == dumps(store.load())


def test_output_is_deterministic(tmp_path: Path) -> None:
    a = sample_state()
    b = State()
    # Same content, every mapping filled in the opposite order.
    for k in reversed(list(a.vgpus)):
        b.vgpus[k] = a.vgpus[k]
    for k in reversed(list(a.vf_types)):
        b.vf_types[k] = a.vf_types[k]
    b.type_names = {"10de:2236": {"559": "NVIDIA A10-6Q", "558": "NVIDIA A10-4Q"}}
    for k in reversed(list(a.allocations)):
        b.allocations[k] = a.allocations[k]
    b.unmanaged = set(sorted(a.unmanaged, reverse=True))
    assert dumps(a) == dumps(b)

    texts = []
    for name, s in (("a", a), ("b", b)):
        st_ = make_store(tmp_path / name)
        with st_.transaction() as cur:
            cur.assign(s.copy())
        texts.append(written_text(st_.state_path))
    assert texts[0] == texts[1] == dumps(a).encode("ascii")
    text = texts[0] or b""
    assert text.endswith(b"}\n") and text.count(b"\n") > 20  # indented, one item a line

    def keys_sorted(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert keys == sorted(keys)
        return dict(pairs)

    json.loads(text, object_pairs_hook=keys_sorted)


def test_missing_file_is_empty_and_not_written(store: StateStore) -> None:
    assert not store.exists()
    assert store.load() == State()
    with store.transaction() as s:
        assert s == State()
    assert not store.exists()  # nothing changed, nothing written
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    assert store.exists()
    assert store.load().unmanaged == {"0000:01:00.0"}
    # A transaction that changes nothing does not rewrite the file.
    before = os.stat(store.state_path)
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    after = os.stat(store.state_path)
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_modes_even_with_umask_zero(store: StateStore) -> None:
    old = os.umask(0)
    try:
        with store.transaction() as s:
            s.unmanaged.add("0000:01:00.0")
    finally:
        os.umask(old)
    directory = os.path.dirname(store.state_path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.state_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.lock_path).st_mode) == 0o600
    # Every rewrite keeps 0600 (a new temp file each time).
    os.umask(0)
    try:
        with store.transaction() as s:
            s.unmanaged.add("0000:02:00.0")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(store.state_path).st_mode) == 0o600


def test_for_context_uses_the_root(tmp_path: Path) -> None:
    ctx = Context.for_root(str(tmp_path))
    s = StateStore.for_context(ctx, timeout=1.5)
    assert s.state_path == str(tmp_path / "var/lib/gpulib/state.json")
    assert s.lock_path == str(tmp_path / "var/lib/gpulib/state.lock")
    assert s.timeout == 1.5


# ---------------------------------------------------------------------------
# Newer versions and corrupt files.


NEWER = json.dumps({"version": SCHEMA_VERSION + 1, "vgpus": {"x": 1}, "whatever": [1, 2]}).encode()


def test_newer_version_refused_by_load(store: StateStore) -> None:
    write_raw(store, NEWER)
    with pytest.raises(StateVersionError) as e:
        store.load()
    assert e.value.message == (f"state file {store.state_path} is version "
                               f"{SCHEMA_VERSION + 1}, this gpulib understands up to "
                               f"{SCHEMA_VERSION}: upgrade gpulib")
    assert isinstance(e.value, StateError) and e.value.exit_code == EXIT_STATE


def test_newer_version_refused_by_transaction_file_untouched(store: StateStore) -> None:
    write_raw(store, NEWER)
    past = time.time() - 1000
    os.utime(store.state_path, (past, past))
    before = os.stat(store.state_path)
    listing = sorted(os.listdir(os.path.dirname(store.state_path)))
    rebuilt: list[int] = []

    def rebuild() -> State:
        rebuilt.append(1)
        return State()

    ran = False
    other = make_store(Path(store.state_path).parents[3], rebuild=rebuild)
    match = f"is version {SCHEMA_VERSION + 1}, this gpulib understands up to {SCHEMA_VERSION}"
    with pytest.raises(StateVersionError, match=match), other.transaction():
        ran = True
    assert not ran and not rebuilt
    after = os.stat(store.state_path)
    assert read_bytes(store.state_path) == NEWER
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    listing_after = sorted(os.listdir(os.path.dirname(store.state_path)))
    assert [n for n in listing_after if n != "state.lock"] == listing


VALID = dumps(sample_state()).encode()
CORRUPT = {
    "empty": b"",
    "not-json": b"this is not json\n",
    "truncated": VALID[: len(VALID) // 2],
    "truncated-end": VALID[:-3],
    "array": b"[]\n",
    "string": b'"state"\n',
    "null": b"null",
    "no-version": b'{"vgpus": {}}',
    "version-string": b'{"version": "1"}',
    "version-bool": b'{"version": true}',
    "version-zero": b'{"version": 0}',
    "vgpus-list": b'{"version": 1, "vgpus": []}',
    "type-id-bool": json.dumps({"version": 1, "vf_types": {"0000:41:00.5": {
        "type_id": True, "name": None}}}).encode(),
    "bad-uuid-key": json.dumps({"version": 1, "vgpus": {"not-a-uuid": {
        "parent": "0000:41:00.0", "type_id": "nvidia-1", "created": STAMP}}}).encode(),
    "path-in-type": json.dumps({"version": 1, "vgpus": {str(uuid.UUID(int=1)): {
        "parent": "0000:41:00.0", "type_id": "../../x", "created": STAMP}}}).encode(),
    "bad-vm-name": json.dumps({"version": 1, "allocations": {"a/b": {
        "vm": "a/b", "status": "active", "since": STAMP, "devices": []}}}).encode(),
    "bad-status": json.dumps({"version": 1, "allocations": {"a": {
        "vm": "a", "status": "running", "since": STAMP, "devices": []}}}).encode(),
    "not-utf8": b'{"version": 1, "x": "\xff\xfe"}',
    "deep": b"[" * 200000,
    "nan": b'{"version": 1, "vf_types": {"0000:01:00.1": {"type_id": NaN}}}',
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_file_moved_aside_and_rebuilt(store: StateStore, name: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    raw = CORRUPT[name]
    write_raw(store, raw)
    rebuilt_state = sample_state()
    calls: list[int] = []

    def rebuild() -> State:
        calls.append(1)
        return rebuilt_state.copy()

    s2 = make_store(Path(store.state_path).parents[3], rebuild=rebuild)
    with caplog.at_level(logging.ERROR, logger="gpulib.state"), s2.transaction() as s:
        assert s == rebuilt_state
        s.unmanaged.add("0000:09:00.0")
    assert calls == [1]
    directory = os.path.dirname(store.state_path)
    aside = [n for n in os.listdir(directory) if n.startswith("state.json.corrupt-")]
    assert len(aside) == 1
    assert len(aside[0]) == len("state.json.corrupt-20240101T000000Z")
    with open(os.path.join(directory, aside[0]), "rb") as f:
        assert f.read() == raw
    expected = rebuilt_state.copy()
    expected.unmanaged.add("0000:09:00.0")
    assert store.load() == expected
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and store.state_path in errors[-1].getMessage()
    assert "corrupt" in errors[-1].getMessage() and aside[0] in errors[-1].getMessage()


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_load_of_corrupt_file_is_empty_and_moves_nothing(
        store: StateStore, name: str, caplog: pytest.LogCaptureFixture) -> None:
    write_raw(store, CORRUPT[name])
    directory = os.path.dirname(store.state_path)
    listing = sorted(os.listdir(directory))
    with caplog.at_level(logging.ERROR, logger="gpulib.state"):
        assert store.load() == State()
    assert sorted(os.listdir(directory)) == listing
    assert read_bytes(store.state_path) == CORRUPT[name]
    assert any(r.levelno >= logging.ERROR and "corrupt" in r.getMessage()
               for r in caplog.records)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_every_truncation_is_detected(data: st.DataObject) -> None:
    text = dumps(sample_state()).encode()
    cut = data.draw(st.integers(0, len(text) - 3))  # the last two bytes are "}\n"
    with pytest.raises(CorruptStateError):
        StateStore("/nonexistent/s.json", "/nonexistent/s.lock")._parse(text[:cut])


U1 = str(uuid.UUID(int=1))


def _with_device(kind: str, ident: str) -> dict[str, Any]:
    return {"version": SCHEMA_VERSION, "allocations": {"a": {
        "vm": "a", "status": "active", "since": STAMP,
        "devices": [{"kind": kind, "id": ident, "on_demand": False}]}}}


def _with_intent(action: str, ident: str) -> dict[str, Any]:
    return {"version": SCHEMA_VERSION, "intents": [
        {"action": action, "id": ident, "vm": "a", "parent": None, "type_id": None,
         "on_demand": False}]}


@pytest.mark.parametrize("doc,where,problem", [
    (_with_device("gpu", "0000:41:00.0"), "devices'][0]['kind']", "unknown device kind 'gpu'"),
    (_with_device("mdev", "0000:41:00.0"), "devices'][0]['id']", ""),
    (_with_device("pci", U1), "devices'][0]['id']", ""),
    (_with_device("vf", U1), "devices'][0]['id']", ""),
    (_with_intent("destroy-mdev", U1), "intents[0]['action']", "unknown intent 'destroy-mdev'"),
    (_with_intent("create-mdev", "0000:41:00.4"), "intents[0]['id']", ""),
    (_with_intent("set-vf-type", U1), "intents[0]['id']", ""),
])
def test_device_and_intent_ids_are_checked_by_their_kind(doc: dict[str, Any], where: str,
                                                         problem: str) -> None:
    """The kind (or action) is one gpulib knows; the id is an mdev's UUID or a
    PCI address as the kind says, the error naming where it is."""
    with pytest.raises(CorruptStateError) as err:
        State.from_json(doc)
    assert where + ": " + problem in str(err.value)


@pytest.mark.parametrize("kind,ident", [("mdev", U1), ("pci", "0000:41:00.0"),
                                        ("vf", "0000:41:00.4")])
def test_devices_of_their_kind_are_kept(kind: str, ident: str) -> None:
    [dev] = State.from_json(_with_device(kind, ident)).allocations["a"].devices
    assert (dev.kind, dev.id) == (kind, ident)


@pytest.mark.parametrize("action,ident", [("create-mdev", U1), ("set-vf-type", "0000:41:00.4")])
def test_intents_of_their_kind_are_kept(action: str, ident: str) -> None:
    [intent] = State.from_json(_with_intent(action, ident)).intents
    assert (intent.action, intent.id) == (action, ident)


def test_corrupt_file_with_a_collision_in_the_aside_name(store: StateStore) -> None:
    write_raw(store, b"junk")
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    write_raw(store, b"junk again")
    with store.transaction():
        pass
    directory = os.path.dirname(store.state_path)
    aside = sorted(n for n in os.listdir(directory) if ".corrupt-" in n)
    contents = set()
    for n in aside:
        with open(os.path.join(directory, n), "rb") as f:
            contents.add(f.read())
    assert contents == {b"junk", b"junk again"}
    assert store.load() == State()  # default rebuild: empty
    assert store.exists()  # the rebuilt state is written even if empty


def test_rebuild_failure_leaves_the_corrupt_file(store: StateStore) -> None:
    write_raw(store, b"{broken")

    def rebuild() -> State:
        raise OSError("libvirt state unreadable")

    s2 = make_store(Path(store.state_path).parents[3], rebuild=rebuild)
    match = r"corrupt .* rebuilding it failed: libvirt state"
    with pytest.raises(StateError, match=match), s2.transaction():
        pass
    assert read_bytes(store.state_path) == b"{broken"
    assert not [n for n in os.listdir(os.path.dirname(store.state_path)) if "corrupt" in n]


def test_rebuilt_state_survives_a_failing_transaction(store: StateStore) -> None:
    write_raw(store, b"{broken")
    s2 = make_store(Path(store.state_path).parents[3], rebuild=sample_state)
    with pytest.raises(Boom), s2.transaction() as s:
        s.unmanaged.clear()
        raise Boom
    assert store.load() == sample_state()


# ---------------------------------------------------------------------------
# Transactions.


@HYPOTHESIS
@given(st.lists(st.lists(ops, max_size=5), min_size=1, max_size=6))
def test_committed_mutations_reload_equal(batches: list[list[tuple[Any, ...]]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        s1 = make_store(d)
        model = State()
        for batch in batches:
            with s1.transaction() as s:
                for op in batch:
                    apply_op(s, op)
            for op in batch:
                apply_op(model, op)
            assert s1.load() == model
            assert make_store(d).load() == model
            if s1.exists():
                assert written_text(s1.state_path) == dumps(model).encode()
            else:
                assert model == State()


@HYPOTHESIS
@given(states, st.lists(ops, min_size=1, max_size=6))
def test_raising_transaction_leaves_file_byte_identical(
        initial: State, batch: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        s1 = make_store(d)
        with s1.transaction() as s:
            s.assign(initial.copy())
        before = read_bytes(s1.state_path)
        st_before = os.stat(s1.state_path) if before is not None else None
        with pytest.raises(Boom), s1.transaction() as s:
            for op in batch:
                apply_op(s, op)
            s.unmanaged.add("0000:00:00.0")  # a change for sure
            raise Boom
        assert read_bytes(s1.state_path) == before
        if st_before is not None:
            st_after = os.stat(s1.state_path)
            assert (st_after.st_ino, st_after.st_mtime_ns) == (st_before.st_ino,
                                                                st_before.st_mtime_ns)
        assert s1.load() == initial
        assert temp_files(s1) == []


@pytest.mark.parametrize("mutate", [
    lambda s: s.allocations.__setitem__("a/b", Allocation(vm="a/b", since=STAMP)),
    lambda s: s.allocations.__setitem__("a", Allocation(vm="b", since=STAMP)),
    lambda s: s.vgpus.__setitem__("X", VgpuRecord(parent="p", type_id="t")),
    lambda s: s.unmanaged.add(7),
    lambda s: s.vf_types.__setitem__("0000:01:00.1", VfRecord(type_id="3")),  # type: ignore
    lambda s: s.type_names.__setitem__("10de:2236", {"x": "y"}),
])
def test_invalid_state_is_never_written(store: StateStore,
                                        mutate: Callable[[State], None]) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    before = read_bytes(store.state_path)
    with pytest.raises(StateError, match="refusing to write an invalid state"), \
            store.transaction() as s:
        mutate(s)
    assert read_bytes(store.state_path) == before


@pytest.mark.parametrize("mutate", [
    lambda s: setattr(s.vgpus["6f3a1c2e-0b1d-4c5e-9f00-112233445566"], "type_id", "../x"),
    lambda s: setattr(s.allocations["i-2-10-VM"], "status", "paused"),
    lambda s: s.allocations["i-2-10-VM"].devices.append(Device("mdev", "not-a-uuid")),
    lambda s: s.type_names["10de:2236"].__setitem__("5x9", "NVIDIA A10-4Q"),
    lambda s: s.vf_types.__setitem__("0000:41:00.5", VfRecord(type_id=-1, name=None)),
])
def test_a_changed_record_among_checked_ones_is_checked(
        store: StateStore, mutate: Callable[[State], None]) -> None:
    """Only what differs from the file as read is checked again before the
    write: a bad change to one record of a full state is still refused."""
    with store.transaction() as s:
        s.assign(sample_state())
    before = read_bytes(store.state_path)
    with pytest.raises(StateError, match="refusing to write an invalid state"), \
            store.transaction() as s:
        mutate(s)
    assert read_bytes(store.state_path) == before


def test_transaction_is_not_reentrant(store: StateStore) -> None:
    with store.transaction(), pytest.raises(RuntimeError, match="not reentrant"), \
            store.transaction():
        pass
    with store.transaction(), pytest.raises(RuntimeError, match="inside a transaction"):
        store.update(lambda s: None)
    with store.transaction():  # usable again afterwards
        pass


def test_stale_temp_files_are_cleaned(store: StateStore) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    directory = os.path.dirname(store.state_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    names = {
        "dead": f".state.json.{dead_pid}.aaaa.tmp",
        "old": f".state.json.{os.getpid()}.bbbb.tmp",
        "fresh-live": f".state.json.{os.getppid()}.cccc.tmp",
        "fresh-self": f".state.json.{os.getpid()}.dddd.tmp",
        "unrelated": ".other.json.1.eeee.tmp",
        # No writer of gpulib's names a temp file so ("\u00b2".isdigit() is true)
        "no-pid": ".state.json.\u00b2.ffff.tmp",
    }
    for n in names.values():
        with open(os.path.join(directory, n), "w") as f:
            f.write("{")
    past = time.time() - 120
    os.utime(os.path.join(directory, names["old"]), (past, past))
    with store.transaction():
        pass
    left = set(os.listdir(directory))
    assert names["dead"] not in left and names["old"] not in left
    assert names["no-pid"] not in left
    assert {names["fresh-live"], names["fresh-self"], names["unrelated"]} <= left


# ---------------------------------------------------------------------------
# Crashes and concurrency with real processes.


def crash_content(n: int) -> State:
    """What the n-th write of the crash test stores: size varies with n."""
    s = State()
    s.type_names["10de:0001"] = {"1": f"counter-{n}"}
    for i in range(n % 13):
        vm = f"vm-{i}"
        s.allocations[vm] = Allocation(vm=vm, status="active", since=STAMP,
                                       devices=[Device("pci", f"0000:{i:02x}:00.0")] * (n % 5))
    return s


def _crash_child(state_path: str, lock_path: str, start: int, attempting: Any) -> None:
    store = StateStore(state_path, lock_path, timeout=10.0)
    n = start
    while True:
        attempting.value = n  # transaction n-1 has committed
        with store.transaction() as s:
            s.assign(crash_content(n))
        n += 1


@pytest.mark.slow  # many processes: once per CI, not per interpreter
def test_sigkill_at_random_instants_never_breaks_the_file(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with store.transaction() as s:
        s.assign(crash_content(0))
    rng = random.Random(1234)
    attempting = FORK.Value("q", 0, lock=False)
    last = 0
    leftovers_seen = 0
    kills = 0
    # Until 200 commits have survived: on a loaded machine a kill often lands
    # before the child's write, so a fixed number of kills may commit too few.
    while last < 200 and kills < 2000:
        kills += 1
        attempting.value = last
        child = FORK.Process(target=_crash_child,
                             args=(store.state_path, store.lock_path, last + 1, attempting))
        child.start()
        deadline = time.monotonic() + 10
        while attempting.value <= last and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert attempting.value > last, "child never started writing"
        time.sleep(rng.uniform(0, 0.012))
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        n = attempting.value
        raw = written_text(store.state_path)
        assert raw is not None
        if raw == dumps(crash_content(n)).encode():
            last = n
        else:
            assert raw == dumps(crash_content(n - 1)).encode(), f"file is neither {n - 1} nor {n}"
            last = n - 1
        assert store.load() == crash_content(last)
        leftovers = temp_files(store)
        assert len(leftovers) <= 1, leftovers
        leftovers_seen += len(leftovers)
    assert last >= 200, f"{kills} kills committed only {last} times: the test tested little"
    with store.transaction():
        pass
    assert temp_files(store) == []
    print(f"crash test: {kills} kills, {last} commits, {leftovers_seen} temp leftovers seen")


def _die_before_rename(state_path: str, lock_path: str) -> None:
    def killed(*_a: Any, **_k: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    os.replace = killed  # in this child only
    store = StateStore(state_path, lock_path)
    with store.transaction() as s:
        s.unmanaged.add("0000:02:00.0")


def test_sigkill_between_temp_write_and_rename(store: StateStore) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    before = read_bytes(store.state_path)
    child = FORK.Process(target=_die_before_rename, args=(store.state_path, store.lock_path))
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL
    assert read_bytes(store.state_path) == before
    leftovers = temp_files(store)
    assert len(leftovers) == 1 and leftovers[0].startswith(f".state.json.{child.pid}.")
    tmp = os.path.join(os.path.dirname(store.state_path), leftovers[0])
    with open(tmp, "rb") as f:  # the temp file was complete: written and fsynced
        assert State.from_json(json.loads(f.read())).unmanaged == {"0000:01:00.0",
                                                                   "0000:02:00.0"}
    with store.transaction() as s:  # the lock died with the child; the leftover goes
        assert s.unmanaged == {"0000:01:00.0"}
    assert temp_files(store) == []


def _64_at_once(store: StateStore, tmp_path: Path, mode: str) -> list[str]:
    """Run state_worker MODE in 64 processes released at one instant; their outputs."""
    ready = tmp_path / "ready"
    ready.mkdir()
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    hold_ms = {"append": "2", "claim": "1"}[mode]
    procs = [subprocess.Popen(
        [sys.executable, str(HELPER), mode, store.state_path, store.lock_path, str(i),
         str(ready), str(go), hold_ms],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for i in range(64)]
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(ready)) < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir(ready)) == 64
        go.touch()
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_out, err) in zip(procs, results):
        assert p.returncode == 0, err.decode()
    return [out.decode().strip() for out, _err in results]


@pytest.mark.slow  # many processes: once per CI, not per interpreter
def test_64_processes_at_once_lose_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    _64_at_once(store, tmp_path, "append")
    final = store.load()
    assert sorted(final.allocations) == sorted(f"vm-{i}" for i in range(64))
    assert all(a.status == "active" and len(a.devices) == 1 for a in final.allocations.values())
    assert written_text(store.state_path) == dumps(final).encode()
    assert temp_files(store) == []


@pytest.fixture
def lock_holder(store: StateStore) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, str(HELPER), "hold", store.state_path,
                             store.lock_path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "locked\n"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_lock_timeout(store: StateStore, lock_holder: subprocess.Popen[str]) -> None:
    waiting = make_store(Path(store.state_path).parents[3], timeout=0.5)
    start = time.monotonic()
    with pytest.raises(LockTimeout) as e, waiting.transaction():
        pytest.fail("got the lock while another process held it")
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 5, elapsed
    assert e.value.message == (f"state lock busy: {store.lock_path} held by another gpulib "
                               f"process for 0.5 s")
    assert e.value.exit_code == EXIT_BUSY
    # Its prepared file went with it (the holder's own is still there).
    assert [t for t in temp_files(waiting) if t.startswith(f".state.json.{os.getpid()}.")] == []
    # Reading needs no lock.
    assert waiting.load() == State()


def test_default_timeout_is_20_seconds() -> None:
    assert StateStore("/x/state.json", "/x/state.lock").timeout == 20.0


def test_killed_holder_releases_the_lock(store: StateStore,
                                         lock_holder: subprocess.Popen[str]) -> None:
    lock_holder.send_signal(signal.SIGKILL)
    lock_holder.wait()
    waiting = make_store(Path(store.state_path).parents[3], timeout=5)
    start = time.monotonic()
    with waiting.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    assert time.monotonic() - start < 1
    assert store.load().unmanaged == {"0000:01:00.0"}


def test_failed_write_leaves_old_file_and_no_temp(store: StateStore,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    before = read_bytes(store.state_path)

    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StateError) as e, store.transaction() as s:
        s.unmanaged.add("0000:02:00.0")
    assert e.value.message == (f"cannot write state file {store.state_path}: "
                               f"No space left on device")
    monkeypatch.undo()
    assert read_bytes(store.state_path) == before
    assert temp_files(store) == []


# ---------------------------------------------------------------------------
# Upgrades: the schema-1 files the previous release wrote.

V1_DIR = Path(__file__).resolve().parent / "data" / "state-v1"


def test_v1_state_migrates_losing_nothing(store: StateStore) -> None:
    raw = (V1_DIR / "state.json").read_bytes()
    v1 = json.loads(raw)
    assert v1["version"] == 1
    write_raw(store, raw)
    with store.transaction() as state:
        pass  # the first use writes the upgrade even when nothing else changes
    doc = json.loads(read_bytes(store.state_path) or b"{}")
    assert doc["version"] == SCHEMA_VERSION == 4
    state = store.load()
    # Every vGPU, with its parent, type, pool (pool members) and on-demand flag.
    assert set(state.vgpus) == set(v1["vgpus"])
    for u, rec in v1["vgpus"].items():
        got = state.vgpus[u]
        assert (got.parent, got.type_id, got.pool, got.on_demand, got.created) == (
            rec["parent"], rec["type_id"], rec["pool"], rec["on_demand"], rec["created"])
    # Every VF type.
    assert set(state.vf_types) == set(v1["vf_types"])
    for a, rec in v1["vf_types"].items():
        got_vf = state.vf_types[a]
        assert (got_vf.type_id, got_vf.name, got_vf.pool, got_vf.on_demand) == (
            rec["type_id"], rec["name"], rec["pool"], rec["on_demand"])
    # Every allocation with its devices, status and domain UUID.
    assert set(state.allocations) == set(v1["allocations"])
    for vm, alloc in v1["allocations"].items():
        got_a = state.allocations[vm]
        assert (got_a.status, got_a.domain_uuid, got_a.since) == (
            alloc["status"], alloc["domain_uuid"], alloc["since"])
        assert [(d.kind, d.id, d.on_demand) for d in got_a.devices] == [
            (d["kind"], d["id"], d["on_demand"]) for d in alloc["devices"]]
    # Who used what lives in allocations only, and says the same as v1's records did.
    for section, kind in (("vgpus", "mdev"), ("vf_types", "vf")):
        for ident, rec in v1[section].items():
            if rec["vm"] is not None:
                assert (kind, ident) in {(d.kind, d.id) for d in
                                         state.allocations[rec["vm"]].devices}
            assert "vm" not in doc[section][ident]
    assert state.type_names == v1["type_names"] and state.unmanaged == set(v1["unmanaged"])


def test_v1_record_naming_a_vm_without_allocation_becomes_active_allocation(
        store: StateStore) -> None:
    u = "6f3a1c2e-0b1d-4c5e-9f00-112233445566"
    write_raw(store, json.dumps({"version": 1, "vgpus": {u: {
        "parent": "0000:3b:00.0", "type_id": "nvidia-232", "pool": "p", "on_demand": False,
        "vm": "i-2-3-VM", "created": STAMP}}, "vf_types": {"0000:41:00.4": {
            "type_id": 594, "name": None, "pool": None, "on_demand": True, "vm": "i-2-3-VM"}},
        "allocations": {}}).encode())
    state = store.load()
    alloc = state.allocations["i-2-3-VM"]
    assert alloc.status == "active"
    assert [(d.kind, d.id, d.on_demand) for d in alloc.devices] == [
        ("mdev", u, False), ("vf", "0000:41:00.4", True)]


def test_newer_state_refused_by_a_hook_with_exit_4_file_untouched(tmp_path: Path) -> None:
    from tests.hookrun import TRANSFORMER, run

    root = tmp_path / "h"
    store = make_store(root)
    write_raw(store, NEWER)
    before = read_bytes(store.state_path)
    xml = (Path(__file__).resolve().parent / "data" / "cloudstack-xml" /
           "passthrough-1gpu.xml").read_bytes()
    res = run([TRANSFORMER, "transform", "-"], str(root), stdin=xml)
    assert res.returncode == 4, res.stderr
    assert f"is version {SCHEMA_VERSION + 1}".encode() in res.stderr and res.stdout == b""
    assert read_bytes(store.state_path) == before


# ---------------------------------------------------------------------------
# The prepared file: the state's temp file made before the lock is taken.


def test_under_the_lock_a_prepared_write_only_fdatasyncs(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpulib.state as state_module

    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    events: list[str] = []
    real_fsync, real_fdatasync, real_release = os.fsync, os.fdatasync, state_module._Lock.release

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        events.append("fdatasync")
        real_fdatasync(fd)

    def release(lock: Any) -> None:
        events.append("release")
        real_release(lock)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(state_module._Lock, "release", release)
    with store.transaction() as s:
        events.append("locked")
        s.unmanaged.add("0000:02:00.0")
    # The temp file's fsync before the lock; under it one fdatasync; the
    # directory's fsync after it.
    assert events == ["fsync", "locked", "fdatasync", "release", "fsync"]
    assert store.load().unmanaged == {"0000:01:00.0", "0000:02:00.0"}
    assert temp_files(store) == []


def test_a_state_that_outgrows_its_prepared_file_is_written_whole(store: StateStore) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    small = os.path.getsize(store.state_path)
    with store.transaction() as s:  # far more than the prepared file's room
        for bus in range(1, 250):
            for fn in range(8):
                s.unmanaged.add(f"0000:{bus:02x}:00.{fn}")
    text = read_bytes(store.state_path)
    assert text is not None and len(text) > 4 * small
    assert text == dumps(store.load()).encode()  # write_atomic's own, unpadded
    assert len(store.load().unmanaged) == 249 * 8
    assert temp_files(store) == []


def test_a_prepared_file_removed_while_its_writer_waited_is_not_needed(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process may remove a waiting writer's prepared file as stale
    (older than STALE_TEMP_AGE); the write then takes write_atomic's way."""
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    real_prepare = StateStore._prepare

    def prepare_then_lose(self: StateStore) -> Any:
        prepared = real_prepare(self)
        assert prepared is not None
        os.unlink(prepared.tmp)
        return prepared

    monkeypatch.setattr(StateStore, "_prepare", prepare_then_lose)
    with store.transaction() as s:
        s.unmanaged.add("0000:02:00.0")
    assert store.load().unmanaged == {"0000:01:00.0", "0000:02:00.0"}
    assert read_bytes(store.state_path) == dumps(store.load()).encode()
    assert temp_files(store) == []


@pytest.mark.parametrize("failing", ["lseek", "write", "fdatasync", "replace"])
def test_a_failing_prepared_write_leaves_the_old_file(
        store: StateStore, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    import gpulib.atomicfile as atomicfile

    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    before = read_bytes(store.state_path)
    real = getattr(os, failing)
    armed = []

    def fail(*args: Any) -> Any:
        if armed:
            raise OSError(5, "Input/output error")
        return real(*args)

    monkeypatch.setattr(atomicfile.os, failing, fail)
    with pytest.raises(StateError, match=r"cannot write state file .*Input/output error"), \
            store.transaction() as s:
        armed.append(True)  # only under the lock: the prepared file is made
        s.unmanaged.add("0000:02:00.0")
    monkeypatch.undo()
    assert read_bytes(store.state_path) == before
    assert temp_files(store) == []


def test_no_space_for_a_prepared_file_still_writes_under_the_lock(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpulib.atomicfile as atomicfile

    real_init = atomicfile.PreparedFile.__init__

    def full(self: Any, *args: Any, **kw: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomicfile.PreparedFile, "__init__", full)
    with store.transaction() as s:
        s.unmanaged.add("0000:02:00.0")
    monkeypatch.setattr(atomicfile.PreparedFile, "__init__", real_init)
    assert store.load().unmanaged == {"0000:02:00.0"}
    assert temp_files(store) == []


@given(st.one_of(st.text(max_size=12),
                 st.from_regex(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\n?", fullmatch=True),
                 st.from_regex(r"[0-9]{1,6}", fullmatch=True)))
def test_type_name_keys_are_checked_as_the_regexes_say(text: str) -> None:
    import re

    from gpulib.records import _is_model, _is_type_number

    assert _is_model(text) == bool(re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{4}", text))
    assert _is_type_number(text) == bool(re.fullmatch(r"[0-9]+", text, re.ASCII))
    digits = text.strip("\n")
    assert _is_type_number(digits) == bool(re.fullmatch(r"[0-9]+", digits, re.ASCII))


# ---------------------------------------------------------------------------
# update(): one locked read-change-write.


def _unmanage(address: str) -> Callable[[State], str]:
    def change(s: State) -> str:
        s.unmanaged.add(address)
        return address
    return change


def _lock_events(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Record fsync, fdatasync, rename, the lock's take and release and the
    priority changes in `events`."""
    import gpulib.state as state_module

    real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "replace",
                                                  "setpriority")}
    real_acquire, real_release = StateStore._acquire, state_module._Lock.release

    def recorded(name: str) -> Callable[..., Any]:
        def call(*a: Any) -> Any:
            events.append(name)
            return real[name](*a)
        return call

    def acquire(self: StateStore) -> Any:
        lock = real_acquire(self)
        events.append("lock")
        return lock

    def release(lock: Any) -> None:
        events.append("release")
        real_release(lock)

    for name in real:
        monkeypatch.setattr(os, name, recorded(name))
    monkeypatch.setattr(StateStore, "_acquire", acquire)
    monkeypatch.setattr(state_module._Lock, "release", release)


def test_update_changes_under_the_lock_in_the_design_write_order(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    events: list[str] = []
    _lock_events(monkeypatch, events)

    def change(s: State) -> str:
        events.append("change")
        s.unmanaged.add("0000:02:00.0")
        return "done"

    assert store.update(change) == "done"
    # The temp file is made and synced before the lock; under it the change,
    # the data sync, the rename and the copy's rename (not synced); the
    # directory's fsync after it (ARCHITECTURE.md, "The state file").
    locked = events[events.index("lock"):events.index("release") + 1]
    assert events[:events.index("lock")] == ["fsync"]
    assert [e for e in locked if e != "setpriority"] == \
        ["lock", "change", "fdatasync", "replace", "replace", "release"]
    assert events[events.index("release") + 1:] in (["fsync"], ["setpriority", "fsync"])
    assert store.load().unmanaged == {"0000:01:00.0", "0000:02:00.0"}
    assert Path(store.backup_path).read_bytes() == written_text(store.state_path)
    assert temp_files(store) == []


def test_the_replaced_files_are_freed_after_the_lock_is_released(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # The state file and its copy that a write replaces are closed (their
    # blocks freed, perhaps discarded on the disk) once other writers may go on.
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    old = {os.stat(store.state_path).st_ino: "old state", os.stat(store.backup_path).st_ino:
           "old copy"}
    events: list[str] = []
    _lock_events(monkeypatch, events)
    real_close = os.close

    def close(fd: int) -> None:
        try:
            found = old.get(os.fstat(fd).st_ino)
        except OSError:
            found = None
        if found is not None:
            events.append(f"close {found}")
        real_close(fd)

    monkeypatch.setattr(os, "close", close)
    store.update(_unmanage("0000:02:00.0"))
    # (Reading the state under the lock opens and closes it too: what counts
    # is the last close, the one that frees the file.)
    released = events.index("release")
    assert sorted(e for e in events[released:] if e.startswith("close")) == \
        ["close old copy", "close old state"]


def test_the_priority_is_raised_only_while_the_lock_is_held(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    _lock_events(monkeypatch, events)
    monkeypatch.setattr(os, "getpriority", lambda *a: 0)
    raised: list[tuple[int, ...]] = []
    monkeypatch.setattr(os, "setpriority", lambda *a: (events.append("setpriority"),
                                                      raised.append(a)))
    store.update(_unmanage("0000:01:00.0"))
    first, last = events.index("setpriority"), len(events) - events[::-1].index("setpriority")
    assert events.index("lock") < first and last - 1 > events.index("release")
    assert [a[2] for a in raised] == [-20, 0]


def test_update_that_changes_nothing_writes_nothing(store: StateStore,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    before = os.stat(store.state_path)
    events: list[str] = []
    _lock_events(monkeypatch, events)
    assert store.update(lambda s: sorted(s.unmanaged)) == ["0000:01:00.0"]
    assert "replace" not in events and "fdatasync" not in events
    after = os.stat(store.state_path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert temp_files(store) == []


def test_update_without_a_file_runs_under_the_lock(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    _lock_events(monkeypatch, events)
    store.update(_unmanage("0000:01:00.0"))  # no file yet: the transaction makes it
    assert events.index("lock") < events.index("replace") < events.index("release")
    assert store.load().unmanaged == {"0000:01:00.0"}


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def __call__(self, path: str, data: str) -> None:
        self.writes.append((path, data))


def test_a_change_runs_once_and_makes_its_sysfs_write_once(tmp_path: Path) -> None:
    from gpulib.sysfs import Sysfs

    store = make_store(tmp_path)
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    kernel = _Recorder()
    host = Sysfs(str(tmp_path), kernel_write=kernel)
    runs = [0]

    def change(s: State) -> None:
        runs[0] += 1
        host.write("sys/bus/mdev/devices/x/remove", "1")
        s.unmanaged.discard("0000:01:00.0")

    store.update(change)
    assert runs == [1]
    assert kernel.writes == [(host.root + "sys/bus/mdev/devices/x/remove", "1")]
    assert store.load().unmanaged == set()


def test_a_checkpoint_inside_an_update_is_on_disk_at_once(store: StateStore) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")

    def change(s: State) -> None:
        s.unmanaged.add("0000:02:00.0")
        store.checkpoint(s)  # a write-ahead intent must be on disk before its sysfs write
        assert store.load().unmanaged == {"0000:01:00.0", "0000:02:00.0"}

    store.update(change)
    assert store.load().unmanaged == {"0000:01:00.0", "0000:02:00.0"}


def test_a_change_that_raises_changes_nothing(store: StateStore) -> None:
    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    before = read_bytes(store.state_path)
    runs = [0]

    def change(s: State) -> None:
        runs[0] += 1
        s.unmanaged.add("0000:02:00.0")
        raise Boom("refused")

    with pytest.raises(Boom):
        store.update(change)
    assert runs == [1]
    assert read_bytes(store.state_path) == before
    assert temp_files(store) == []


def _claim(s: State, vm: str) -> str:
    """Take the lowest free device of 0000:00..3f:00.0 for `vm` (every racer wants
    the same one first)."""
    taken = {d.id for a in s.allocations.values() for d in a.devices}
    free = next(f"0000:{i:02x}:00.0" for i in range(64) if f"0000:{i:02x}:00.0" not in taken)
    s.allocations[vm] = Allocation(vm=vm, status="pending", since=STAMP,
                                   devices=[Device("pci", free)])
    return free


@HYPOTHESIS
@given(plan=st.lists(st.booleans(), min_size=1, max_size=12))
def test_updates_and_other_writers_never_lose_or_double_a_claim(plan: list[bool]) -> None:
    """Updates and other writers' transactions, in any order: every claim
    lands once, on a device nobody else holds."""
    with tempfile.TemporaryDirectory() as tmp:
        store, other = make_store(tmp), make_store(tmp)
        got: dict[str, str] = {}
        for i, by_update in enumerate(plan):
            vm = f"vm-{i}"
            if not by_update:
                with other.transaction() as o:
                    got[vm] = _claim(o, vm)
                continue
            got[vm] = store.update(lambda s, vm=vm: _claim(s, vm))
        final = store.load()
        held = {vm: a.devices[0].id for vm, a in final.allocations.items()}
        assert held == got
        assert len(set(held.values())) == len(held)
        assert written_text(store.state_path) == dumps(final).encode()
        assert temp_files(store) == []


@pytest.mark.slow  # many processes: once per CI, not per interpreter
def test_64_processes_updating_at_once_each_get_their_own_device(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with store.transaction():
        pass
    outputs = _64_at_once(store, tmp_path, "claim")
    said = {f"vm-{i}": out for i, out in enumerate(outputs)}
    final = store.load()
    assert {vm: a.devices[0].id for vm, a in final.allocations.items()} == said
    assert len(set(said.values())) == 64
    assert written_text(store.state_path) == dumps(final).encode()
    assert temp_files(store) == []


def test_an_update_waits_for_the_lock_its_timeout_and_no_longer(
        store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook must answer inside the agent's 30 s: a busy lock ends the wait
    after the store's timeout, with nothing changed."""
    import fcntl

    with store.transaction() as s:
        s.unmanaged.add("0000:01:00.0")
    store.timeout = 0.3
    fd = os.open(store.lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process holds the lock
        start = time.monotonic()
        with pytest.raises(LockTimeout):
            store.update(_unmanage("0000:02:00.0"))
        assert 0.25 < time.monotonic() - start < 2.0
    finally:
        os.close(fd)
    assert "0000:02:00.0" not in store.load().unmanaged
    assert temp_files(store) == []
