"""Pools, restore, reconcile, release and the CLI verbs of the lifecycle."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpulib.cli import main
from gpulib.sim.fakehost import FakeHost
from tests.hosts import a10_host, reboot, t4_farm, tree_contents


def cli(monkeypatch: pytest.MonkeyPatch, root: str, *args: str) -> int:
    monkeypatch.setenv("GPULIB_ROOT", root)
    monkeypatch.setenv("GPULIB_SIMULATE", "1")
    return main(list(args))


def state_of(root: str) -> dict[str, Any]:
    return json.loads(Path(root, "var/lib/gpulib/state.json").read_text())


def live(root: str) -> set[str]:
    d = os.path.join(root, "sys/bus/mdev/devices")
    return set(os.listdir(d)) if os.path.isdir(d) else set()


def test_pool_apply_twice_then_reboot_and_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    host = t4_farm(str(tmp_path), gpus=2, per_parent=3)
    assert cli(monkeypatch, host.root, "pool", "apply", "--dry-run") == 0
    assert capsys.readouterr().out.count("would create nvidia-222") == 6
    assert live(host.root) == set()
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    first = capsys.readouterr().out
    assert first.count("create nvidia-222") == 6
    made = live(host.root)
    assert len(made) == 6 and set(state_of(host.root)["vgpus"]) == made
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    assert "nothing to do" in capsys.readouterr().out
    assert live(host.root) == made
    # mdevctl sees the pool too
    assert sum(len(os.listdir(os.path.join(host.root, "etc/mdevctl.d", p)))
               for p in os.listdir(os.path.join(host.root, "etc/mdevctl.d"))) == 6

    host = reboot(host, lambda root: t4_farm(os.path.dirname(root), gpus=2, per_parent=3))
    assert live(host.root) == set()
    assert cli(monkeypatch, host.root, "restore") == 0
    assert live(host.root) == made
    assert cli(monkeypatch, host.root, "restore") == 0
    assert "nothing to do" in capsys.readouterr().out.splitlines()[-1]


def test_pool_shrinks_only_free_members(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = t4_farm(str(tmp_path), gpus=1, per_parent=4)
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    st = state_of(host.root)
    held = sorted(st["vgpus"])[0]
    st["allocations"] = {"vm-holding": {
        "vm": "vm-holding", "domain_uuid": None, "status": "active",
        "since": "2026-01-01T00:00:00Z",
        "devices": [{"kind": "mdev", "id": held, "on_demand": False}]}}
    Path(host.root, "var/lib/gpulib/state.json").write_text(json.dumps(st))
    # It runs (an active allocation without a status file is a stop that did
    # not complete: its run is over, it holds nothing).
    host.add_running_domain("vm-holding", "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53", mdevs=(held,))
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool desktops]\nparents = all\nprofile = GRID T4-1B\nper_parent = 0\n")
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    assert live(host.root) == {held}


def test_vendor_vf_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = a10_host(str(tmp_path), numvfs=4)
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool a10]\nparents = 0000:41:00.0\nprofile = NVIDIA A10-6Q\ncount = 2\n")
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    types = {a: r["type_id"] for a, r in state_of(host.root)["vf_types"].items()}
    assert types == {"0000:41:00.4": 594, "0000:41:00.5": 594}
    before = tree_contents(host.root)
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    assert tree_contents(host.root) == before


def test_mdev_cli_round_trip_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    host = t4_farm(str(tmp_path), gpus=1)
    assert cli(monkeypatch, host.root, "mdev", "create", "--parent", "0000:3b:00.0",
               "--type", "nvidia-223") == 0
    uuid = capsys.readouterr().out.strip()
    assert uuid in live(host.root)
    assert cli(monkeypatch, host.root, "mdev", "types", "--parent", "0000:3b:00.0",
               "--json") == 0
    types = {t["type_id"]: t for t in json.loads(capsys.readouterr().out)}
    assert types["nvidia-223"]["available_instances"] == 7
    assert types["nvidia-231"]["available_instances"] == 0
    assert cli(monkeypatch, host.root, "mdev", "create", "--parent", "0000:3b:00.0",
               "--type", "nvidia-231") == 1
    err = capsys.readouterr().err
    assert err.strip() == ("gpulib: error: No available instances of nvidia-231 (GRID T4-2Q) "
                           "on 0000:3b:00.0")
    assert cli(monkeypatch, host.root, "mdev", "remove", uuid) == 0
    assert live(host.root) == set()


BAD_CLI = [
    ("mdev", "create", "--parent", "0000:3b:00.0", "--type", "nvidia-222", "--uuid", "xyz"),
    ("mdev", "create", "--parent", "0000:3b:00.0", "--type", "../nvidia-222"),
    ("mdev", "create", "--parent", "0000:3b:20.0", "--type", "nvidia-222"),
    ("mdev", "create", "--parent", "100000000:3b:00.0", "--type", "nvidia-222"),
    ("mdev", "remove", "not-a-uuid"),
    ("vf", "set-type", "0000:3b:00.0", "../1"),
    ("release", "a/b"),
    ("release", "a\nb"),
    ("device", "unmanage", "0000:3b:00.9"),
]


@pytest.mark.parametrize("args", BAD_CLI, ids=[" ".join(a) for a in BAD_CLI])
def test_bad_cli_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str], args: tuple[str, ...]) -> None:
    host = t4_farm(str(tmp_path), gpus=1)
    before = tree_contents(host.root)
    code = cli(monkeypatch, host.root, *args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gpulib: error:")
    assert tree_contents(host.root) == before


def test_unmanaged_device_is_never_pooled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = t4_farm(str(tmp_path), gpus=2, per_parent=2)
    assert cli(monkeypatch, host.root, "device", "unmanage", "0000:3b:00.0") == 0
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    parents = {r["parent"] for r in state_of(host.root)["vgpus"].values()}
    assert parents == {"0000:4b:00.0"}


def test_reconcile_releases_vms_that_are_not_running(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    host = t4_farm(str(tmp_path), gpus=1, per_parent=2)
    assert cli(monkeypatch, host.root, "pool", "apply") == 0
    st = state_of(host.root)
    u1, u2 = sorted(st["vgpus"])
    st["allocations"] = {
        "gone-vm": {"vm": "gone-vm", "domain_uuid": None, "status": "active",
                    "since": "2026-01-01T00:00:00Z",
                    "devices": [{"kind": "mdev", "id": u1, "on_demand": False}]},
        "running-vm": {"vm": "running-vm", "domain_uuid": None, "status": "active",
                       "since": "2026-01-01T00:00:00Z",
                       "devices": [{"kind": "mdev", "id": u2, "on_demand": False}]}}
    Path(host.root, "var/lib/gpulib/state.json").write_text(json.dumps(st))
    FakeHost(host.root).add_running_domain("running-vm", "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53",
                                           mdevs=(u2,))
    stray = "99999999-2222-4333-8444-555555555555"
    FakeHost(host.root).add_mdev(stray, "0000:3b:00.0", "nvidia-222")
    # the stray vGPU (made outside gpulib) is the administrator's: reported, not an error
    assert cli(monkeypatch, host.root, "reconcile") == 0
    st = state_of(host.root)
    assert set(st["allocations"]) == {"running-vm"}
    assert u1 in st["vgpus"]  # a pool member: back in its pool, still known
