"""gpulib and the real mdevctl (Debian 12's 1.2.0) on one host: one persistent
record of vGPUs, and what either tool changes, the other honours.

mdevctl runs in a private mount namespace with the fake host's `sys/` and
`etc/mdevctl.d` bound over the real ones (tests/helpers/mdevctl_env.py);
gpulib runs on the same tree through GPULIB_ROOT. A reboot is a fresh `sys/`
with the same `etc/` and `var/lib/gpulib`. Every test is skipped, with the
reason, where mdevctl, unshare or root is missing (GPULIB_SKIP_MDEVCTL=1
skips them too).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulib.cli import main
from gpulib.context import Context
from gpulib.lifecycle import open_store, restore
from gpulib.sim.kernel import SimulatedKernel
from gpulib.sysfs import Sysfs
from tests.helpers.mdevctl_env import Mdevctl, skip_reason
from tests.hosts import P1, P2, U1, U2, U3, two_t4_host
from tests.hosts import reboot as power_cycle

_REASON = skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"real mdevctl test: {_REASON}")

U4 = "44444444-5555-4666-8777-888888888888"
U5 = "55555555-6666-4777-8888-999999999999"


class Host:
    """A fake host both tools work on."""

    def __init__(self, root: str, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> None:
        self.fake = two_t4_host(root)
        self.mdevctl = Mdevctl(root)
        self.mdevctl.prepare()
        self.monkeypatch = monkeypatch
        self.capsys = capsys
        self.last_out = ""

    @property
    def root(self) -> str:
        return self.fake.root

    def gpulib(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        self.monkeypatch.setenv("GPULIB_ROOT", self.root)
        self.monkeypatch.setenv("GPULIB_SIMULATE", "1")
        code = main(list(args))
        out = self.capsys.readouterr()
        self.last_out = out.out + out.err
        return code, out.out, out.err

    def reboot(self) -> None:
        self.fake = power_cycle(self.fake, two_t4_host)

    def live(self) -> dict[str, tuple[str, str]]:
        return self.mdevctl.active()

    def gpulib_defined(self) -> dict[str, dict[str, Any]]:
        code, out, err = self.gpulib("mdev", "list", "--json")
        assert code == 0, err
        return {r["uuid"]: r["definition"] for r in json.loads(out) if r["definition"]}

    def attr(self, uuid: str, name: str) -> str:
        return Path(self.root, f"sys/bus/mdev/devices/{uuid}/{name}").read_text()

    def assert_agree(self) -> None:
        assert self.gpulib_defined() == self.mdevctl.defined()


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> Host:
    return Host(str(tmp_path / "host"), monkeypatch, capsys)


# -- R1: the operator's mdevctl changes are honoured at boot ----------------------------

def test_r1_undefine_modify_type_and_manual_in_mdevctl_are_honoured_at_boot(host: Host) -> None:
    for uuid, parent in ((U1, P1), (U2, P2), (U3, P1)):
        code, _, err = host.gpulib("mdev", "create", "--parent", parent, "--type",
                                   "nvidia-232", "--uuid", uuid)
        assert code == 0, err
    host.assert_agree()
    host.mdevctl.run("undefine", "-u", U1)
    host.mdevctl.run("modify", "-u", U2, "-t", "nvidia-231")
    host.mdevctl.run("modify", "-u", U3, "--manual")
    host.reboot()
    code, out, err = host.gpulib("restore")
    assert code == 0, out + err
    assert host.live() == {U2: (P2, "nvidia-231")}  # the new type; U1 gone; U3 manual
    assert "different type" not in host.mdevctl.run("start", "-u", U2, check=False).stderr
    host.mdevctl.run("start", "-u", U3)  # the operator starts a manual one by hand
    assert host.live()[U3] == (P1, "nvidia-232")
    host.assert_agree()
    state = json.loads(Path(host.root, "var/lib/gpulib/state.json").read_text())
    assert U1 not in state["vgpus"] and state["vgpus"][U2]["type_id"] == "nvidia-231"
    host.reboot()
    assert host.gpulib("restore")[0] == 0
    assert host.live() == {U2: (P2, "nvidia-231")}


def test_r1_gpulibs_changes_are_mdevctls(host: Host) -> None:
    assert host.gpulib("mdev", "create", "--parent", P1, "--type", "nvidia-232", "--uuid", U1,
                       "--start", "manual")[0] == 0
    assert host.mdevctl.defined()[U1] == {"parent": P1, "type_id": "nvidia-232",
                                          "start": "manual", "attrs": []}
    assert host.live() == {U1: (P1, "nvidia-232")}
    assert host.gpulib("mdev", "remove", U1)[0] == 0
    assert host.mdevctl.defined() == {} and host.live() == {}


# -- R2: attrs ------------------------------------------------------------------------------

def test_r2_attrs_defined_in_mdevctl_are_applied_by_gpulib(host: Host) -> None:
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232", "--auto")
    host.mdevctl.run("modify", "-u", U1, "--addattr", "nvidia/vgpu_params",
                     "--value", "frl_config=60")
    host.mdevctl.run("modify", "-u", U1, "--addattr", "weight", "--value", "6")
    host.reboot()
    code, out, err = host.gpulib("restore")
    assert code == 0, out + err
    assert host.live() == {U1: (P1, "nvidia-232")}
    assert host.attr(U1, "nvidia/vgpu_params") == "frl_config=60"
    assert host.attr(U1, "weight") == "6"
    host.assert_agree()


def test_r2_a_bad_attr_fails_naming_it_and_leaves_no_device(host: Host) -> None:
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232", "--auto")
    host.mdevctl.run("modify", "-u", U1, "--addattr", "weight", "--value", "heavy")
    code, out, _ = host.gpulib("restore")
    assert code == 1
    assert "attribute weight = 'heavy'" in out and "removed the device" in out
    assert host.live() == {}


def test_r2_attrs_set_with_gpulib_are_mdevctls(host: Host) -> None:
    code, _, err = host.gpulib("mdev", "create", "--parent", P1, "--type", "nvidia-232",
                               "--uuid", U1, "--attr", "weight=3",
                               "--attr", "nvidia/vgpu_params=frl_config=45")
    assert code == 0, err
    assert host.mdevctl.defined()[U1]["attrs"] == [{"weight": "3"},
                                                   {"nvidia/vgpu_params": "frl_config=45"}]
    assert host.attr(U1, "weight") == "3"
    host.reboot()
    assert host.gpulib("restore")[0] == 0
    assert host.attr(U1, "nvidia/vgpu_params") == "frl_config=45"


# -- R3: creating over an existing definition -------------------------------------------

def test_r3_create_over_an_mdevctl_definition_keeps_policy_and_attrs(host: Host) -> None:
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232")  # manual
    host.mdevctl.run("modify", "-u", U1, "--addattr", "weight", "--value", "2")
    before = host.mdevctl.defined()
    assert host.gpulib("mdev", "create", "--parent", P1, "--type", "nvidia-232",
                       "--uuid", U1)[0] == 0
    assert host.mdevctl.defined() == before and before[U1]["start"] == "manual"
    assert host.attr(U1, "weight") == "2"
    code, _, err = host.gpulib("mdev", "create", "--parent", P2, "--type", "nvidia-232",
                               "--uuid", U1)
    assert code != 0 and P1 in err and P2 in err
    assert host.mdevctl.defined() == before and host.live() == {U1: (P1, "nvidia-232")}


def test_r3_mdevctls_changes_to_a_gpulib_vgpu_survive_gpulib_create(host: Host) -> None:
    assert host.gpulib("mdev", "create", "--parent", P1, "--type", "nvidia-232",
                       "--uuid", U1)[0] == 0
    host.mdevctl.run("stop", "-u", U1)
    host.mdevctl.run("modify", "-u", U1, "--manual")
    host.mdevctl.run("modify", "-u", U1, "--addattr", "weight", "--value", "8")
    assert host.gpulib("mdev", "create", "--parent", P1, "--type", "nvidia-232",
                       "--uuid", U1)[0] == 0
    assert host.mdevctl.defined()[U1] == {"parent": P1, "type_id": "nvidia-232",
                                          "start": "manual", "attrs": [{"weight": "8"}]}
    assert host.attr(U1, "weight") == "8"


# -- R4: boot with both tools ---------------------------------------------------------------

def test_r4_mdevctl_started_it_first_is_already_live(host: Host) -> None:
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232", "--auto")
    host.mdevctl.run("start", "-u", U1)
    code, out, err = host.gpulib("restore")
    assert code == 0, out + err
    assert "FAILED" not in out


def test_r4_mdevctl_wins_the_race_between_gpulibs_look_and_its_write(
        host: Host, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232", "--auto")
    kernel = SimulatedKernel(host.root)

    def racing(path: str, data: str) -> None:
        if path.endswith("/create"):
            host.mdevctl.run("start", "-u", U1)  # mdevctl's udev autostart, just now
        kernel.write(path, data)

    ctx = Context(Sysfs(host.root, kernel_write=racing, simulated=True))
    with open_store(ctx).transaction() as state:
        outcomes = restore(ctx, state)
    assert [(o.ident, o.action, o.ok) for o in outcomes] == [(U1, "already live", True)]
    assert host.live() == {U1: (P1, "nvidia-232")}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_r4_where_udev_autostart_works_only_mdevctl_starts_auto_vgpus(host: Host) -> None:
    """EL9, Fedora: mdevctl's udev rule starts `auto` definitions when the
    parent appears; restore waits for it, so mdevctl never finds the device
    already there ("Device already exists") and gpulib writes nothing."""
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232", "--auto")
    host.mdevctl.run("define", "-u", U2, "-p", P2, "-t", "nvidia-232", "--auto")
    host.fake.write_file("usr/lib/udev/rules.d/60-mdevctl.rules",
                         'ACTION=="add", RUN+="/usr/sbin/mdevctl start-parent-mdevs %k"\n')
    host.fake.write_file("usr/sbin/mdevctl", "#!/bin/sh\n", 0o755)
    results: list[Any] = []

    def udev() -> None:
        results.extend(host.mdevctl.run("start-parent-mdevs", p) for p in (P1, P2))

    writes: list[str] = []
    kernel = SimulatedKernel(host.root)

    def gpulib_write(path: str, data: str) -> None:
        writes.append(path)
        kernel.write(path, data)

    ctx = Context(Sysfs(host.root, kernel_write=gpulib_write, simulated=True))
    timer = threading.Timer(0.5, udev)
    timer.start()
    try:
        with open_store(ctx).transaction() as state:
            outcomes = restore(ctx, state, autostart_wait=20.0)
    finally:
        timer.join()
    assert writes == []
    assert [r.stderr for r in results] == ["", ""]
    assert sorted((o.ident, o.action, o.ok) for o in outcomes) == [
        (U1, "already live", True), (U2, "already live", True)]


def test_r4_debian_rule_never_runs_so_gpulib_starts_them(host: Host) -> None:
    """Debian 12's rule names /usr/sbin/mdevctl, which its package does not ship."""
    host.fake.write_file("lib/udev/rules.d/60-mdevctl.rules",
                         Path("/lib/udev/rules.d/60-mdevctl.rules").read_text()
                         if os.path.exists("/lib/udev/rules.d/60-mdevctl.rules") else
                         'ACTION=="add", RUN+="/usr/sbin/mdevctl start-parent-mdevs %k"\n')
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232", "--auto")
    code, out, _ = host.gpulib("restore")
    assert code == 0 and "recreated" in out
    assert host.live() == {U1: (P1, "nvidia-232")}


# -- R5: mdevctl's own directories are not definitions ----------------------------------

def test_r5_restore_is_quiet_about_mdevctls_scripts_d(host: Host,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    host.mdevctl.run("define", "-u", U1, "-p", P1, "-t", "nvidia-232", "--auto")
    assert os.path.isdir(os.path.join(host.root, "etc/mdevctl.d/scripts.d/callouts"))
    caplog.set_level(logging.DEBUG)
    for _ in range(2):
        code, _, err = host.gpulib("restore")
        assert code == 0 and err == ""
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# -- R6: pool members are persistent for mdevctl ------------------------------------------

POOL_CONF = "[pool desk]\nparents = all\ntype = nvidia-232\nper_parent = 2\n"


def test_r6_pool_members_have_definitions_across_reboots(host: Host) -> None:
    host.fake.write_file("etc/gpulib/gpulib.conf", POOL_CONF)
    assert host.gpulib("pool", "apply")[0] == 0
    members = set(host.live())
    assert len(members) == 4
    assert {u for u, d in host.mdevctl.defined().items() if d["start"] == "auto"} == members
    host.reboot()
    assert host.gpulib("pool", "apply")[0] == 0  # recreates them from gpulib's records
    assert set(host.live()) == members
    host.assert_agree()
    host.reboot()
    assert host.gpulib("restore")[0] == 0
    assert set(host.live()) == members
    # an operator's undefine takes a member out; the pool makes another
    gone = sorted(members)[0]
    host.mdevctl.run("stop", "-u", gone)
    host.mdevctl.run("undefine", "-u", gone)
    assert host.gpulib("pool", "apply")[0] == 0
    assert gone not in host.mdevctl.defined() and len(host.mdevctl.defined()) == 4
    host.assert_agree()


def test_r6_a_state_from_before_gets_definitions_on_first_use(host: Host) -> None:
    host.fake.write_file("etc/gpulib/gpulib.conf", POOL_CONF)
    vgpu = {"type_id": "nvidia-232", "pool": "desk", "on_demand": False, "vm": None,
            "created": "2026-01-01T00:00:00Z"}
    host.fake.write_file("var/lib/gpulib/state.json", json.dumps({
        "version": 1, "vgpus": {U1: {"parent": P1, **vgpu}, U2: {"parent": P1, **vgpu},
                                U3: {"parent": P2, **vgpu}, U4: {"parent": P2, **vgpu}},
        "vf_types": {}, "type_names": {}, "allocations": {}, "unmanaged": []}))
    assert host.gpulib("pool", "apply")[0] == 0
    assert set(host.mdevctl.defined()) == {U1, U2, U3, U4}
    assert set(host.live()) == {U1, U2, U3, U4}
    host.assert_agree()


# -- the property: both listings agree after anything either tool does ------------------

UUIDS = (U1, U2, U3, U4, U5)
PARENTS = (P1, P2)
TYPES = ("nvidia-232", "nvidia-231")
ops = st.one_of(
    st.tuples(st.just("gpulib create"), st.sampled_from(UUIDS), st.sampled_from(PARENTS),
              st.sampled_from(("auto", "manual")), st.booleans()),
    st.tuples(st.just("gpulib remove"), st.sampled_from(UUIDS)),
    st.tuples(st.just("gpulib restore")),
    st.tuples(st.just("gpulib pool apply")),
    st.tuples(st.just("mdevctl define"), st.sampled_from(UUIDS), st.sampled_from(PARENTS),
              st.sampled_from(TYPES), st.sampled_from(("auto", "manual"))),
    st.tuples(st.just("mdevctl undefine"), st.sampled_from(UUIDS)),
    st.tuples(st.just("mdevctl modify -t"), st.sampled_from(UUIDS), st.sampled_from(TYPES)),
    st.tuples(st.just("mdevctl modify start"), st.sampled_from(UUIDS),
              st.sampled_from(("--auto", "--manual"))),
    st.tuples(st.just("mdevctl addattr"), st.sampled_from(UUIDS), st.sampled_from("123")),
    st.tuples(st.just("mdevctl start"), st.sampled_from(UUIDS)),
    st.tuples(st.just("mdevctl stop"), st.sampled_from(UUIDS)),
    st.tuples(st.just("reboot")),
)


def apply_op(host: Host, op: tuple[Any, ...]) -> None:
    """One operation; either tool may refuse it (a conflict), which is fine."""
    kind = op[0]
    defined = host.mdevctl.defined()
    if kind == "gpulib create":
        _, uuid, parent, start, attr = op
        args = ["mdev", "create", "--parent", parent, "--type", "nvidia-232", "--uuid", uuid,
                "--start", start] + (["--attr", "weight=5"] if attr else [])
        host.gpulib(*args)
    elif kind == "gpulib remove":
        host.gpulib("mdev", "remove", op[1], "--force")
    elif kind == "gpulib restore":
        host.gpulib("restore")
    elif kind == "gpulib pool apply":
        host.gpulib("pool", "apply")
    elif kind == "mdevctl define":
        _, uuid, parent, type_id, start = op
        if uuid not in defined:  # mdevctl would define one UUID on two parents
            host.mdevctl.run("define", "-u", uuid, "-p", parent, "-t", type_id, f"--{start}",
                             check=False)
    elif kind == "mdevctl undefine":
        host.mdevctl.run("undefine", "-u", op[1], check=False)
    elif kind == "mdevctl modify -t":
        host.mdevctl.run("modify", "-u", op[1], "-t", op[2], check=False)
    elif kind == "mdevctl modify start":
        host.mdevctl.run("modify", "-u", op[1], op[2], check=False)
    elif kind == "mdevctl addattr":
        host.mdevctl.run("modify", "-u", op[1], "--addattr", "weight", "--value", op[2],
                         check=False)
    elif kind == "mdevctl start":
        # mdevctl writes attrs before the simulated kernel makes the device
        # (see mdevctl_env): those definitions are started by gpulib only.
        if op[1] in defined and not defined[op[1]]["attrs"]:
            host.mdevctl.run("start", "-u", op[1], check=False)
    elif kind == "mdevctl stop":
        host.mdevctl.run("stop", "-u", op[1], check=False)
    elif kind == "reboot":
        host.reboot()


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sequence=st.lists(ops, min_size=1, max_size=8))
def test_gpulib_and_mdevctl_agree_on_every_persistent_vgpu(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], sequence: list[tuple[Any, ...]]) -> None:
    host = Host(str(tmp_path_factory.mktemp("agree") / "host"), monkeypatch, capsys)
    host.fake.write_file("etc/gpulib/gpulib.conf",
                         "[pool desk]\nparents = 0000:5e:00.0\ntype = nvidia-232\n"
                         "per_parent = 1\n")
    for op in sequence:
        apply_op(host, op)
        host.assert_agree()
        if op[0].startswith("gpulib"):
            # gpulib's state follows the definitions: no persistent record without one
            state = json.loads(Path(host.root, "var/lib/gpulib/state.json").read_text()) \
                if os.path.exists(os.path.join(host.root, "var/lib/gpulib/state.json")) else {}
            defined = host.mdevctl.defined()
            for uuid, rec in state.get("vgpus", {}).items():
                assert rec["on_demand"] or defined[uuid]["type_id"] == rec["type_id"]
        if op[0] == "gpulib restore":
            # every auto definition is live as defined, unless restore said why not
            live = host.live()
            for uuid, d in host.mdevctl.defined().items():
                if d["start"] == "auto" and uuid in live:
                    continue
                assert d["start"] == "manual" or uuid in host.last_out, (uuid, host.last_out)


# -- libvirt (item 7): its node device driver reads and writes the same record ---------

@pytest.mark.libvirtd
def test_libvirt_lists_gpulibs_vgpus_and_gpulib_follows_libvirts(host: Host,
                                                                  tmp_path: Path) -> None:
    """libvirt 9.0 with mdevctl support, in the same namespace over the fake host."""
    from tests.helpers.mdevctl_env import add_pci_config, libvirt_skip_reason, virsh_in_namespace

    reason = libvirt_skip_reason()
    if reason:
        pytest.skip(f"libvirt node device test: {reason}")
    assert host.gpulib("mdev", "create", "--parent", P1, "--type", "nvidia-232",
                       "--uuid", U1, "--attr", "weight=3")[0] == 0  # persistent, auto
    assert host.gpulib("mdev", "create", "--parent", P2, "--type", "nvidia-232",
                       "--uuid", U2, "--no-keep")[0] == 0  # transient
    code, _, err = host.gpulib("mdev", "create", "--parent", P2, "--type", "nvidia-232",
                               "--uuid", U3, "--start", "manual")
    assert code == 0, err
    host.mdevctl.run("stop", "-u", U3)  # defined, not live
    add_pci_config(host.root)
    xml = tmp_path / "mdev.xml"
    xml.write_text(f"<device><parent>pci_0000_5e_00_0</parent><capability type='mdev'>"
                   f"<type id='nvidia-232'/><uuid>{U4}</uuid>"
                   f"<attr name='weight' value='7'/></capability></device>")

    def name(uuid: str, parent: str) -> str:
        return f"mdev_{uuid.replace('-', '_')}_{parent.replace(':', '_').replace('.', '_')}"

    all_mdevs = "virsh nodedev-list --cap mdev --all"
    active = "virsh nodedev-list --cap mdev"
    info = f"virsh nodedev-info {name(U3, P2)}"
    define = f"virsh nodedev-define {xml}"
    autostart = f"virsh nodedev-autostart {name(U4, P2)}"
    res = virsh_in_namespace(host.root, str(tmp_path / "libvirt"), all_mdevs, active, info,
                             define, autostart)
    assert res[all_mdevs][0] == 0, res
    assert set(res[all_mdevs][1].split()) == {name(U1, P1), name(U2, P2), name(U3, P2)}
    assert set(res[active][1].split()) == {name(U1, P1), name(U2, P2)}
    fields = {k: v.strip() for k, v in (line.split(":", 1) for line in
                                         res[info][1].splitlines() if ":" in line)}
    assert (fields["Active"], fields["Persistent"], fields["Autostart"]) == ("no", "yes", "no")
    # ...and what libvirt defines (through mdevctl) is gpulib's record too
    assert res[define][0] == 0 and res[autostart][0] == 0, res
    assert host.gpulib_defined()[U4] == {"parent": P2, "type_id": "nvidia-232",
                                         "start": "auto", "attrs": [{"weight": "7"}]}
    host.assert_agree()


def test_handing_a_pool_member_over_to_mdevctl(host: Host) -> None:
    """The README's recipe: undefine, pool apply, define again from the live device."""
    host.fake.write_file("etc/gpulib/gpulib.conf", POOL_CONF)
    assert host.gpulib("pool", "apply")[0] == 0
    members = set(host.live())
    mine = sorted(members)[0]
    host.mdevctl.run("undefine", "-u", mine)
    assert host.gpulib("pool", "apply")[0] == 0
    host.mdevctl.run("define", "-u", mine, "--auto")
    code, out, _ = host.gpulib("pool", "list", "--json")
    pool = {m["id"] for m in json.loads(out)["desk"]}
    assert code == 0 and mine not in pool and len(pool) == 4
    assert mine in host.mdevctl.defined() and len(host.live()) == 5
    host.reboot()
    code, out, err = host.gpulib("restore")
    assert code == 0, out + err
    assert set(host.live()) == pool | {mine}, out
    host.assert_agree()


def test_a_pool_member_whose_type_mdevctl_changed_leaves_the_pool(host: Host) -> None:
    host.fake.write_file("etc/gpulib/gpulib.conf", POOL_CONF)
    assert host.gpulib("pool", "apply")[0] == 0
    on_p2 = sorted(u for u, (p, _) in host.live().items() if p == P2)
    for u in on_p2:
        host.mdevctl.run("modify", "-u", u, "-t", "nvidia-231")
    host.reboot()
    code, out, err = host.gpulib("restore")
    assert code == 0, out + err
    assert {u: host.live()[u] for u in on_p2} == {u: (P2, "nvidia-231") for u in on_p2}
    code, out, _ = host.gpulib("pool", "apply")
    assert out.count("left pool desk") == 2
    # the NVIDIA one-type rule leaves no room for nvidia-232 on P2 now: honestly failed
    code, out, _ = host.gpulib("pool", "list", "--json")
    assert not set(on_p2) & {m["id"] for m in json.loads(out)["desk"]}
    host.assert_agree()
