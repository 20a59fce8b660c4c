"""mdevctl's definitions as the record of persistent vGPUs (gpulib.mdevctl),
without mdevctl itself: the file format, what is not a definition, attrs,
creating over a definition, following the operator's changes, EEXIST at boot.
The same behaviour against the real mdevctl: tests/test_mdevctl_real.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import example, find, given, settings
from hypothesis import strategies as st

from gpulib import mdev, mdevctl, validate
from gpulib.cli import main
from gpulib.context import Context
from gpulib.definitions import DEFINITIONS_MARKER
from gpulib.entry import context_for_root
from gpulib.errors import DeviceError, InputError
from gpulib.lifecycle import open_store, restore
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.kernel import SimulatedKernel
from gpulib.sysfs import Sysfs
from tests.hosts import P1, P2, U1, U2, U3
from tests.hosts import two_t4_host as two_t4


def reboot(host: FakeHost) -> FakeHost:
    from tests.hosts import reboot as power_cycle

    return power_cycle(host, two_t4)


def cli(monkeypatch: pytest.MonkeyPatch, root: str, *args: str) -> int:
    monkeypatch.setenv("GPULIB_ROOT", root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    return main(list(args))


def define(host: FakeHost, uuid: str, parent: str = P1, type_id: str = "nvidia-232",
           start: str = "auto", attrs: Optional[list[dict[str, str]]] = None) -> None:
    """A definition as mdevctl writes it (its own layout: indent 2, no newline)."""
    host.write_file(f"etc/mdevctl.d/{parent}/{uuid}", json.dumps(
        {"mdev_type": type_id, "start": start, "attrs": attrs or []}, indent=2))


def live(host: FakeHost) -> dict[str, tuple[str, str]]:
    return {u: (str(m.parent), m.type_id) for u, m in mdev.live_mdevs(Sysfs(host.root)).items()}


def ctx_of(host: FakeHost) -> Context:
    return context_for_root(host.root, simulate=True)


def do_restore(host: FakeHost, **kw: Any) -> list[Any]:
    ctx = ctx_of(host)
    with open_store(ctx).transaction() as state:
        return restore(ctx, state, **kw)


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    h = two_t4(str(tmp_path / "host"))
    for sub in ("callouts", "notifiers"):
        os.makedirs(h.p(f"etc/mdevctl.d/scripts.d/{sub}"))
    return h


# -- the format -----------------------------------------------------------------------

attr_names = st.from_regex(r"[a-z][a-z0-9_]{0,8}(/[a-z][a-z0-9_]{0,8})?", fullmatch=True)
attr_values = st.text(st.characters(codec="utf-8", blacklist_characters="\x00"),
                      max_size=20)


@settings(max_examples=60, deadline=None)
@given(start=st.sampled_from(mdevctl.START_POLICIES),
       attrs=st.lists(st.tuples(attr_names, attr_values), max_size=4),
       type_id=st.from_regex(r"[a-z][a-z0-9_]{0,9}-[a-z0-9_-]{1,10}", fullmatch=True))
def test_definition_round_trips_in_mdevctls_format(start: str, attrs: list[tuple[str, str]],
                                                   type_id: str) -> None:
    d = mdevctl.Definition(U1, P1, type_id, start, attrs)
    doc = json.loads(d.to_json())
    assert list(doc) == ["mdev_type", "start", "attrs"]
    assert doc["attrs"] == [{k: v} for k, v in attrs]  # in order, one key each
    assert mdevctl.parse(U1, P1, d.to_json()) == d


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["mdev_type", "start", "attrs", "x"]), inner, max_size=4),
    max_leaves=12)
# Documents close to a definition, each field valid or not: random JSON
# alone almost never holds a valid type id and a start policy together.
type_ids = st.one_of(st.sampled_from(["nvidia-232", "i915-GVTg_V5_4"]),
                    st.from_regex(r"[a-z][a-z0-9_]{0,9}-[a-z0-9_-]{1,10}", fullmatch=True),
                    st.sampled_from(["../x", "a b", "", "nvidia-232/x"]), json_values)
starts = st.one_of(st.sampled_from(mdevctl.START_POLICIES),
                   st.sampled_from(["Auto", "always", "", "auto "]), json_values)
attr_items = st.dictionaries(attr_names | st.sampled_from(["../x", "", "a//b"]),
                             attr_values | st.integers(), max_size=2)
documents = st.fixed_dictionaries({}, optional={
    "mdev_type": type_ids, "start": starts,
    "attrs": st.lists(attr_items, max_size=3) | json_values, "x": json_values})


def is_definition(doc: object) -> bool:
    """mdevctl's rules, written out: an object naming a type id, its start
    policy `auto` or `manual` (`manual` when absent), attrs a list of
    one-name objects whose name is a path below the device and whose value is
    text without NUL."""
    if not isinstance(doc, dict) or not validate.is_type_id(doc.get("mdev_type")):
        return False
    attrs = doc.get("attrs", [])
    return doc.get("start", "manual") in ("auto", "manual") and isinstance(attrs, list) and \
        all(isinstance(a, dict) and len(a) == 1 and
            all(re.fullmatch(r"[A-Za-z0-9_.:+-]+(/[A-Za-z0-9_.:+-]+)*", k) and
                "." not in k.split("/") and ".." not in k.split("/") and
                isinstance(v, str) and "\x00" not in v for k, v in a.items())
            for a in attrs)


@settings(max_examples=300, deadline=None)
@given(doc=documents)
@example({"mdev_type": "nvidia-232"})  # start: manual when absent
@example({"mdev_type": "nvidia-232", "start": "always"})
@example({"mdev_type": "nvidia-232", "start": "auto", "attrs": [{"../x": "1"}]})
@example({"mdev_type": "nvidia-232", "start": "auto", "attrs": [{"a": "1", "b": "2"}]})
def test_a_document_is_a_definition_exactly_when_mdevctl_would_take_it(doc: object) -> None:
    d = mdevctl.parse(U1, P1, json.dumps(doc).encode())
    assert (d is not None) == is_definition(doc), doc
    if d is not None:  # and it round-trips
        assert isinstance(doc, dict) and d.type_id == doc["mdev_type"]
        assert mdevctl.parse(U1, P1, d.to_json()) == d


def test_the_documents_hold_definitions_and_others() -> None:
    # The property above can fail both ways only if both kinds are generated.
    find(documents, is_definition, settings=settings(database=None))
    find(documents, lambda d: not is_definition(d) and "mdev_type" in d,
         settings=settings(database=None))


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | documents.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_a_definition_or_nothing(raw: bytes) -> None:
    d = mdevctl.parse(U1, P1, raw)
    if d is not None:  # then it is one mdevctl would accept, and it round-trips
        assert d.start in mdevctl.START_POLICIES
        assert mdevctl.parse(U1, P1, d.to_json()) == d


def test_written_atomically_with_mdevctls_mode(host: FakeHost) -> None:
    ctx = ctx_of(host)
    mdevctl.write_definition(ctx, mdevctl.Definition(U1, P1, "nvidia-232", "manual",
                                                     [("weight", "3")]))
    directory = host.p(f"etc/mdevctl.d/{P1}")
    assert os.listdir(directory) == [U1]  # no temp file left
    assert os.stat(os.path.join(directory, U1)).st_mode & 0o777 == 0o644
    assert mdevctl.read_definitions(ctx)[U1].attrs == [("weight", "3")]


def test_keys_gpulib_does_not_know_survive_a_rewrite(host: FakeHost) -> None:
    host.write_file(f"etc/mdevctl.d/{P1}/{U1}", json.dumps(
        {"mdev_type": "nvidia-232", "start": "auto", "attrs": [], "comment": "rack 4"}))
    ctx = ctx_of(host)
    d = mdevctl.read_definitions(ctx)[U1]
    d.start = "manual"
    mdevctl.write_definition(ctx, d)
    assert json.loads(Path(host.p(f"etc/mdevctl.d/{P1}/{U1}")).read_text())["comment"] == \
        "rack 4"


NOT_DEFINITIONS = {
    "json list": b"[]",
    "json string": b'"x"',
    "json null": b"null",
    "deep nesting": b"[" * 100000 + b"]" * 100000,
    "deep object": b'{"a":' * 50000 + b"1" + b"}" * 50000,
    "no type": b'{"start": "auto", "attrs": []}',
    "bad start": b'{"mdev_type": "nvidia-232", "start": "always", "attrs": []}',
    "type with a slash": b'{"mdev_type": "../../x", "start": "auto", "attrs": []}',
    "attrs not a list": b'{"mdev_type": "nvidia-232", "start": "auto", "attrs": {"a": "b"}}',
    "attr with two keys":
        b'{"mdev_type": "nvidia-232", "start": "auto", "attrs": [{"a": "1", "b": "2"}]}',
    "attr climbing out": b'{"mdev_type": "nvidia-232", "start": "auto", "attrs": [{"../x": "1"}]}',
    "not UTF-8": b"\xff\xfe{",
    "empty": b"",
}


@pytest.mark.parametrize("content", list(NOT_DEFINITIONS.values()), ids=list(NOT_DEFINITIONS))
def test_what_is_not_a_definition_is_skipped_quietly(host: FakeHost, content: bytes,
                                                     caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    define(host, U1)
    Path(host.p(f"etc/mdevctl.d/{P1}/{U2}")).write_bytes(content)
    caplog.set_level(logging.DEBUG)
    assert set(mdevctl.read_definitions(ctx_of(host))) == {U1}
    assert cli(monkeypatch, host.root, "restore") == 0
    assert set(live(host)) == {U1}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert capsys.readouterr().err == ""


def test_files_and_directories_that_are_not_definitions(host: FakeHost,
                                                        caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """mdevctl's scripts.d (R5), editor backups, temp files, a directory or a FIFO
    named like a UUID, upper-case names, parents that are not PCI devices."""
    define(host, U1)
    base = host.p("etc/mdevctl.d")
    good = Path(base, P1, U1).read_text()
    for name in (f"{U1}~", f".{U1}.swp", f"{U1}.bak", f".{U1}.1234.abcd.tmp", "README",
                 U1.upper()):
        Path(base, P1, name).write_text(good)
    os.makedirs(os.path.join(base, P1, U2))
    os.mkfifo(os.path.join(base, P1, U3))
    os.makedirs(os.path.join(base, "matrix"))
    Path(base, "matrix", U2).write_text(good)  # a vfio-ap parent: not a GPU
    Path(base, "notes.txt").write_text("x")
    os.symlink("/dev/zero", os.path.join(base, P2))
    caplog.set_level(logging.DEBUG)
    assert set(mdevctl.read_definitions(ctx_of(host))) == {U1}
    assert cli(monkeypatch, host.root, "restore") == 0
    assert cli(monkeypatch, host.root, "mdev", "list", "--json") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_qemu_hook_creates_a_defined_vgpu_over_junk_in_mdevctl_d(host: FakeHost) -> None:
    """Issue 13 item 5: no "internal error" from a hook over an odd mdevctl.d;
    the definition's attrs are applied."""
    from tests.hookrun import QEMU_HOOK, run

    define(host, U1, attrs=[{"weight": "5"}])
    Path(host.p(f"etc/mdevctl.d/{P1}/{U2}")).write_bytes(NOT_DEFINITIONS["json list"])
    Path(host.p(f"etc/mdevctl.d/{P1}/{U3}")).write_bytes(NOT_DEFINITIONS["deep nesting"])
    xml = FakeHost.domain_xml("vm1", "9d6a5a8c-0c53-4a5e-9d1c-1f2e3d4c5b6a", mdevs=(U1,))
    res = run([QEMU_HOOK, "vm1", "prepare", "begin", "-"], host.root, stdin=xml.encode())
    assert res.returncode == 0, res.stderr
    assert live(host) == {U1: (P1, "nvidia-232")}
    assert Path(host.p(f"sys/bus/mdev/devices/{U1}/weight")).read_text() == "5"


# -- attrs ---------------------------------------------------------------------------------

def test_attrs_are_written_in_order_after_creation(host: FakeHost) -> None:
    writes: list[str] = []
    kernel = SimulatedKernel(host.root)

    def record(path: str, data: str) -> None:
        writes.append(os.path.basename(path) + "=" + data)
        kernel.write(path, data)

    sysfs = Sysfs(host.root, kernel_write=record, simulated=True)
    mdev.create(sysfs, PciAddress.parse(P1), "nvidia-232", U1,
                attrs=[("weight", "7"), ("nvidia/vgpu_params", "frl_config=60")])
    assert writes == [f"create={U1}", "weight=7", "vgpu_params=frl_config=60"]
    assert Path(host.p(f"sys/bus/mdev/devices/{U1}/nvidia/vgpu_params")).read_text() == \
        "frl_config=60"


@pytest.mark.parametrize(("attr", "why"), [(("weight", "heavy"), "Invalid argument"),
                                           (("no_such_file", "1"), "No such file")])
def test_a_failed_attr_removes_the_device_and_names_the_attr(host: FakeHost,
                                                             attr: tuple[str, str],
                                                             why: str) -> None:
    sysfs = ctx_of(host).sysfs
    avail = host.p(f"sys/class/mdev_bus/{P1}/mdev_supported_types/nvidia-232/"
                   "available_instances")
    before = Path(avail).read_text()
    with pytest.raises(DeviceError) as err:
        mdev.create(sysfs, PciAddress.parse(P1), "nvidia-232", U1,
                    attrs=[("weight", "1"), attr])
    assert f"attribute {attr[0]} = {attr[1]!r}" in err.value.message
    assert why in err.value.message and "removed the device" in err.value.message
    assert live(host) == {}
    assert Path(avail).read_text() == before


def test_restore_applies_a_definitions_attrs_and_reports_a_bad_one(host: FakeHost) -> None:
    define(host, U1, attrs=[{"weight": "4"}])
    define(host, U2, attrs=[{"weight": "4"}, {"weight": "lots"}])
    outcomes = {o.ident: o for o in do_restore(host)}
    assert outcomes[U1].ok and Path(host.p(f"sys/bus/mdev/devices/{U1}/weight")).read_text() \
        == "4"
    assert not outcomes[U2].ok and "attribute weight = 'lots'" in outcomes[U2].detail
    assert set(live(host)) == {U1}


# -- creating over a definition (R3) ------------------------------------------------------

def test_create_over_a_definition_keeps_policy_and_attrs(host: FakeHost,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    define(host, U1, start="manual", attrs=[{"weight": "9"}])
    before = Path(host.p(f"etc/mdevctl.d/{P1}/{U1}")).read_bytes()
    assert cli(monkeypatch, host.root, "mdev", "create", "--parent", P1, "--type",
               "nvidia-232", "--uuid", U1) == 0
    assert Path(host.p(f"etc/mdevctl.d/{P1}/{U1}")).read_bytes() == before
    assert Path(host.p(f"sys/bus/mdev/devices/{U1}/weight")).read_text() == "9"
    # asked otherwise: changed
    assert cli(monkeypatch, host.root, "mdev", "remove", U1) == 0
    assert cli(monkeypatch, host.root, "mdev", "create", "--parent", P1, "--type",
               "nvidia-232", "--uuid", U1, "--start", "auto", "--attr", "weight=2") == 0
    d = mdevctl.read_definitions(ctx_of(host))[U1]
    assert (d.start, d.attrs) == ("auto", [("weight", "2")])


def test_create_refuses_a_uuid_defined_on_another_parent(host: FakeHost,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    define(host, U1, parent=P2)
    assert cli(monkeypatch, host.root, "mdev", "create", "--parent", P1, "--type",
               "nvidia-232", "--uuid", U1) != 0
    err = capsys.readouterr().err
    assert P1 in err and P2 in err and len(err.strip().splitlines()) == 1
    assert live(host) == {} and not os.path.exists(host.p(f"etc/mdevctl.d/{P1}/{U1}"))


# -- following the operator's changes (R1) -----------------------------------------------

def test_state_follows_undefine_modify_type_and_manual(host: FakeHost,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for u in (U1, U2, U3):
        assert cli(monkeypatch, host.root, "mdev", "create", "--parent", P1, "--type",
                   "nvidia-232", "--uuid", u) == 0
    host = reboot(host)
    os.unlink(host.p(f"etc/mdevctl.d/{P1}/{U1}"))  # mdevctl undefine
    define(host, U2, type_id="nvidia-231")  # mdevctl modify -t (same GPU: one type)
    define(host, U3, type_id="nvidia-231", start="manual")  # mdevctl modify --manual
    assert cli(monkeypatch, host.root, "restore") == 0
    assert live(host) == {U2: (P1, "nvidia-231")}
    state = json.loads(Path(host.p("var/lib/gpulib/state.json")).read_text())
    assert set(state["vgpus"]) == {U2, U3}
    assert state["vgpus"][U2]["type_id"] == "nvidia-231"


def test_a_v1_state_gets_definitions_once_then_follows_them(host: FakeHost) -> None:
    """Upgrade: a state written before definitions were the record (R6)."""
    v1 = {
        "version": 1, "vgpus": {
            U1: {"parent": P1, "type_id": "nvidia-232", "pool": "desk", "on_demand": False,
                 "vm": None, "created": "2026-01-01T00:00:00Z"},
            U2: {"parent": P1, "type_id": "nvidia-232", "pool": None, "on_demand": True,
                 "vm": "i-2-3-VM", "created": "2026-01-01T00:00:00Z"}},
        "vf_types": {"0000:41:00.4": {"type_id": 594, "name": "NVIDIA A10-6Q", "pool": None,
                                      "on_demand": False, "vm": None}},
        "type_names": {"10de:2236": {"594": "NVIDIA A10-6Q"}},
        "allocations": {"i-2-3-VM": {"vm": "i-2-3-VM", "domain_uuid": None,
                                     "status": "active", "since": "2026-01-01T00:00:00Z",
                                     "devices": [{"kind": "mdev", "id": U2,
                                                  "on_demand": True}]}},
        "unmanaged": ["0000:5e:00.0"]}
    host.write_file("var/lib/gpulib/state.json", json.dumps(v1))
    # The VM runs (its status file names its vGPU): its allocation is a live
    # run's, not a stop that did not complete, which restore would end.
    host.add_running_domain("i-2-3-VM", "7b1c2d3e-4f50-4a6b-8c7d-9e0f1a2b3c4d", mdevs=(U2,))
    outcomes = do_restore(host)
    after = json.loads(Path(host.p("var/lib/gpulib/state.json")).read_text())
    # Nothing lost in the schema-2 migration (owners live in allocations only).
    assert after["version"] >= 2
    for key in ("vgpus", "vf_types"):
        for ident, rec in v1[key].items():
            kept = {k: v for k, v in rec.items() if k != "vm"}
            assert {k: after[key][ident].get(k) for k in kept} == kept, (key, ident)
    assert after["type_names"] == v1["type_names"]
    assert after["unmanaged"] == v1["unmanaged"]
    (alloc,) = after["allocations"].values()
    assert alloc["vm"] == "i-2-3-VM" and alloc["status"] == "active"
    assert [(d["kind"], d["id"], d["on_demand"]) for d in alloc["devices"]] == \
        [("mdev", U2, True)]
    assert [(o.ident, o.action) for o in outcomes if o.action == "defined for mdevctl"] == \
        [(U1, "defined for mdevctl")]
    defs = mdevctl.read_definitions(ctx_of(host))
    assert set(defs) == {U1} and defs[U1].auto  # the on-demand one stays transient
    assert set(live(host)) == {U1, U2}
    state = open_store(ctx_of(host)).load()
    assert state.extra[DEFINITIONS_MARKER] == "mdevctl" and state.vgpus[U1].pool == "desk"


# -- boot with both tools (R4) ----------------------------------------------------------

def test_eexist_of_the_same_device_is_already_live(host: FakeHost) -> None:
    """The other tool wins the race between gpulib's look and its write."""
    define(host, U1)
    kernel = SimulatedKernel(host.root)

    def racing(path: str, data: str) -> None:
        if path.endswith("/create"):
            kernel.write(path, data)  # the other tool's write lands first
        kernel.write(path, data)

    ctx = Context(Sysfs(host.root, kernel_write=racing, simulated=True))
    with open_store(ctx).transaction() as state:
        outcomes = restore(ctx, state)
    assert [(o.action, o.ok) for o in outcomes] == [("already live", True)]
    assert live(host) == {U1: (P1, "nvidia-232")}


def test_eexist_of_another_device_names_both(host: FakeHost) -> None:
    kernel = SimulatedKernel(host.root)

    def racing(path: str, data: str) -> None:
        if path.endswith("nvidia-232/create"):
            kernel.write(path.replace("nvidia-232", "nvidia-231"), data)
        kernel.write(path, data)

    sysfs = Sysfs(host.root, kernel_write=racing, simulated=True)
    with pytest.raises(DeviceError, match=r"nvidia-231.*nvidia-232"):
        mdev.create(sysfs, PciAddress.parse(P1), "nvidia-232", U1)


def test_udev_autostart_detection(host: FakeHost) -> None:
    ctx = ctx_of(host)
    assert not mdevctl.udev_autostart(ctx)
    rule = ('ACTION=="add", TEST=="/etc/mdevctl.d/$kernel", RUN+="/bin/sh -c '
            "'{ /usr/sbin/mdevctl start-parent-mdevs %k 2>&3 | logger -t mdevctl; }'\"\n")
    host.write_file("lib/udev/rules.d/60-mdevctl.rules", rule)
    assert not mdevctl.udev_autostart(ctx)  # Debian 12: the rule's mdevctl is not shipped
    host.write_file("usr/sbin/mdevctl", "#!/bin/sh\n", 0o755)
    assert mdevctl.udev_autostart(ctx)  # EL9, Fedora
    os.makedirs(host.p("etc/udev/rules.d"))
    os.symlink("/dev/null", host.p("etc/udev/rules.d/60-mdevctl.rules"))
    assert not mdevctl.udev_autostart(ctx)  # masked


def test_restore_leaves_auto_vgpus_to_mdevctls_autostart(host: FakeHost) -> None:
    """Where mdevctl's udev rule starts definitions, restore waits for it: one
    tool starts each vGPU, and neither reports the other's work as an error."""
    import threading

    host.write_file("lib/udev/rules.d/60-mdevctl.rules",
                    'ACTION=="add", RUN+="/usr/sbin/mdevctl start-parent-mdevs %k"\n')
    host.write_file("usr/sbin/mdevctl", "#!/bin/sh\n", 0o755)
    define(host, U1)
    writes: list[str] = []
    kernel = SimulatedKernel(host.root)

    def gpulib_write(path: str, data: str) -> None:
        writes.append(path)
        kernel.write(path, data)

    autostart = threading.Timer(0.3, lambda: kernel.write(
        host.p(f"sys/class/mdev_bus/{P1}/mdev_supported_types/nvidia-232/create"), U1))
    autostart.start()
    ctx = Context(Sysfs(host.root, kernel_write=gpulib_write, simulated=True))
    try:
        with open_store(ctx).transaction() as state:
            outcomes = restore(ctx, state, autostart_wait=5.0)
    finally:
        autostart.join()
    assert writes == []
    assert [(o.action, o.ok) for o in outcomes] == [("already live", True)]


def test_restore_starts_what_autostart_did_not(host: FakeHost) -> None:
    host.write_file("lib/udev/rules.d/60-mdevctl.rules",
                    'ACTION=="add", RUN+="/usr/sbin/mdevctl start-parent-mdevs %k"\n')
    host.write_file("usr/sbin/mdevctl", "#!/bin/sh\n", 0o755)
    define(host, U1)
    outcomes = do_restore(host, autostart_wait=0.2)
    assert [(o.action, o.ok) for o in outcomes] == [("recreated", True)]


def test_check_attr_refuses_paths_out_of_the_device() -> None:
    for bad in ("../remove", "/etc/passwd", "a//b", "", "a/../../b", "."):
        with pytest.raises(InputError):
            mdevctl.check_attr(bad, "1")
    with pytest.raises(InputError):
        mdevctl.parse_attr("novalue")
    assert mdevctl.parse_attr("nvidia/vgpu_params=a=1") == ("nvidia/vgpu_params", "a=1")


def test_remove_of_an_unknown_attr_file_is_enoent(host: FakeHost) -> None:
    sysfs = ctx_of(host).sysfs
    mdev.create(sysfs, PciAddress.parse(P1), "nvidia-232", U1)
    with pytest.raises(OSError) as err:
        sysfs.write(f"sys/bus/mdev/devices/{U1}/nope", "1")
    assert err.value.errno == errno.ENOENT


def test_restore_unit_runs_after_udev_coldplug() -> None:
    """Ordered after the coldplug that runs mdevctl's udev autostart (see the unit)."""
    from tests.conftest import REPO

    unit = (REPO / "etc" / "systemd" / "gpulib-restore.service").read_text()
    after = {v for line in unit.splitlines() if line.startswith("After=")
             for v in line.split("=", 1)[1].split()}
    assert "systemd-udev-trigger.service" in after
    before = {v for line in unit.splitlines() if line.startswith("Before=")
              for v in line.split("=", 1)[1].split()}
    assert "libvirtd.service" in before and "virtqemud.service" in before


def test_a_state_from_a_newer_gpulib_is_refused_and_nothing_defined(
        host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    newer = json.dumps({"version": 99, "vgpus": {U1: {"parent": P1, "type_id": "nvidia-232",
                                                       "created": "x"}}})
    host.write_file("var/lib/gpulib/state.json", newer)
    assert cli(monkeypatch, host.root, "restore") == 4
    assert Path(host.p("var/lib/gpulib/state.json")).read_text() == newer
    assert not os.path.exists(host.p(f"etc/mdevctl.d/{P1}"))
