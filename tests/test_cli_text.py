"""What the command line prints for people: the listings' look, held by golden
files (tests/golden/listings, reviewed in diffs as mdevctl's testdata are), and
the lines a newcomer meets first (an empty host, a name where an id belongs,
no command at all).

Rewrite the golden files with `pytest --regen-golden` (or
GPULIB_REGEN_GOLDEN=1) and review the diff.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gpulib import mdev
from gpulib.cli import main
from gpulib.context import Context
from gpulib.lifecycle import open_store
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_T4, build_demo
from gpulib.sysfs import Sysfs
from tests.conftest import DATA, GOLDEN
from tests.hookrun import QEMU_HOOK, STATE_CHANGE, as_agent, hook_env

LISTINGS = GOLDEN / "listings"
COMMANDS = {
    "mdev-types": ["mdev", "types"],
    "mdev-list": ["mdev", "list"],
    "status": ["status"],
    "discover-table": ["discover", "--format", "table"],
}
STARTED_VM = "i-2-52-VM"
# The clock is the one thing a golden file cannot hold: the start's time, fixed.
STARTED_SINCE = "2026-01-19T08:00:00Z"


def gpulib(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], root: str,
           *args: str) -> tuple[int, str, str]:
    monkeypatch.setenv("GPULIB_ROOT", root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def demo(module_tmp: Path) -> str:
    """The demo host as built: the listings only read it."""
    return build_demo(str(module_tmp / "demo")).root


@pytest.fixture(scope="module")
def started(module_tmp: Path) -> str:
    """The demo host after CloudStack started a VM on it (transformer, libvirt's
    start, onStart), as scripts/demo shows it."""
    host = build_demo(str(module_tmp / "started"))
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    res = as_agent(host.root, xml)
    assert res.returncode == 0, res.stdout
    uuid = xml.split("<address uuid='", 1)[1].split("'", 1)[0]
    domain_uuid = xml.split("<uuid>", 1)[1].split("<", 1)[0]
    host.add_running_domain(STARTED_VM, domain_uuid, mdevs=(uuid,))
    res = subprocess.run([STATE_CHANGE, "onStart", STARTED_VM], env=hook_env(host.root),
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    with open_store(Context.for_root(host.root)).transaction() as state:
        state.allocations[STARTED_VM].since = STARTED_SINCE
    return host.root


@pytest.fixture(scope="module")
def empty(module_tmp: Path) -> str:
    return FakeHost(str(module_tmp / "empty")).root


def check_golden(name: str, text: str, regen: bool) -> None:
    path = LISTINGS / f"{name}.txt"
    if regen:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    if not path.exists():
        pytest.fail(f"golden file {path} is missing: run pytest --regen-golden and review it")
    assert text == path.read_text(), f"output differs from golden {path.name}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("host", ["demo", "started", "empty"])
def test_listing_looks_as_reviewed(host: str, command: str, request: pytest.FixtureRequest,
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str],
                                   regen_golden: bool) -> None:
    root = request.getfixturevalue(host)
    code, out, err = gpulib(monkeypatch, capsys, root, *COMMANDS[command])
    assert (code, err) == (0, "")
    check_golden(f"{host}-{command}", out, regen_golden)


def test_every_listing_has_a_header_or_says_it_is_empty(
        demo: str, empty: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["mdev", "types"], ["mdev", "list"], ["discover", "--format", "table"]):
        _, full, _ = gpulib(monkeypatch, capsys, demo, *args)
        _, none, _ = gpulib(monkeypatch, capsys, empty, *args)
        header = full.splitlines()[0]
        assert header == header.upper() and len(header.split()) >= 4, header
        assert none.strip() and "no " in none, (args, none)


def test_the_discovery_table_counts_every_vf(demo: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # The demo's A10 has 8 vendor VFs, one of them typed (gpulib's record).
    _, out, _ = gpulib(monkeypatch, capsys, demo, "discover", "--format", "table")
    a10 = next(line for line in out.splitlines() if line.startswith("0000:41:00.0"))
    assert "8 VFs (1 typed, 0 used)" in a10


def test_a_pool_member_is_not_called_transient(demo: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = gpulib(monkeypatch, capsys, demo, "mdev", "list")
    members = [line for line in out.splitlines() if "t4-desktops" in line]
    assert len(members) == 2 and not any("transient" in m or " none " in m for m in members)


def test_reconcile_on_the_fresh_demo_has_nothing_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = build_demo(str(tmp_path / "demo")).root
    code, out, err = gpulib(monkeypatch, capsys, root, "reconcile")
    assert (code, out, err) == (0, "state and host agree: nothing to do\n", "")


@pytest.mark.parametrize(("given", "named"), [
    ("GRID T4-4Q", "'GRID T4-4Q' is the name of mdev type nvidia-232 on 0000:af:00.0: "
                   "--type takes the id (--type nvidia-232)"),
    ("grid  t4-4q", "is the name of mdev type nvidia-232"),
    ("T4-4Q", "0000:af:00.0 offers no mdev type 'T4-4Q'; types whose names contain it: "
              "nvidia-232 (GRID T4-4Q)"),
    ("T4-16", "nvidia-229 (GRID T4-16A), nvidia-234 (GRID T4-16Q), nvidia-321 (GRID T4-16C)"),
])
def test_mdev_create_with_a_type_name_names_the_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        given: str, named: str) -> None:
    root = build_demo(str(tmp_path / "demo")).root
    state = Path(root, "var/lib/gpulib/state.json").read_bytes()
    before = set(mdev.live_mdevs(Sysfs(root)))
    code, out, err = gpulib(monkeypatch, capsys, root, "mdev", "create", "--parent", DEMO_T4,
                            "--type", given)
    assert code == 2 and out == "" and named in err and err.count("\n") == 1, err
    assert set(mdev.live_mdevs(Sysfs(root))) == before
    assert Path(root, "var/lib/gpulib/state.json").read_bytes() == state
    assert not os.path.exists(os.path.join(root, "etc/mdevctl.d"))


def test_an_unknown_type_id_still_lists_what_is_offered(
        demo: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = gpulib(monkeypatch, capsys, demo, "mdev", "create", "--parent", DEMO_T4,
                          "--type", "nvidia-999", "--no-keep")
    assert code == 1 and "does not offer mdev type nvidia-999 (offered: nvidia-222" in err


@pytest.mark.parametrize("args", [[], ["mdev"], ["vf"], ["migrate"], ["device"], ["pool"]])
def test_no_command_prints_the_usage_without_an_error(
        args: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], empty: str) -> None:
    code, out, err = gpulib(monkeypatch, capsys, empty, *args)
    assert code == 2 and out == ""
    assert err.startswith(" ".join(["Usage: gpulib", *args, "[OPTIONS]"])), err
    assert "error" not in err.lower() and "Commands:" in err


def test_the_qemu_hooks_usage_line_names_the_hook(empty: str) -> None:
    res = subprocess.run([QEMU_HOOK], env=hook_env(empty), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    assert res.stderr == "usage: gpulib-qemu-hook <vm> <operation> <sub-op> [<extra>]\n"


def test_listings_as_json_are_unchanged_by_the_headers(
        demo: str, empty: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = gpulib(monkeypatch, capsys, empty, "mdev", "list", "--json")
    assert json.loads(out) == []
    _, out, _ = gpulib(monkeypatch, capsys, demo, "mdev", "types", "--json")
    assert len(json.loads(out)) == len(
        gpulib(monkeypatch, capsys, demo, "mdev", "types")[1].splitlines()) - 1
