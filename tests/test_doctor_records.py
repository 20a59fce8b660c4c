"""The doctor's records (hand-written, gpulib.slotted) behave as the
dataclasses they replace: equality, hashing of the immutable ones, repr;
a finding's details may be made only when asked for."""

from __future__ import annotations

from typing import Any

import pytest

from gpulib.bootconfig import Source
from gpulib.doctor.actions import KernelArgs, Manual, Reboot, RestartService, RunCommand, WriteFile
from gpulib.doctor.core import Distro, Result


def test_actions_compare_hash_and_stay_immutable() -> None:
    # `where` only says where the text points: not part of what the action is.
    a = KernelArgs(("intel_iommu=on",), where="etc/default/grub.d/50.cfg")
    b = KernelArgs(("intel_iommu=on",))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert KernelArgs(("iommu=pt",)) != b
    assert WriteFile("etc/x", "y") == WriteFile("etc/x", "y", 0o644) != WriteFile("etc/x", "z")
    assert Reboot() == Reboot() and RunCommand(("true",)) != Manual("true")
    assert RestartService("libvirtd") != RestartService("libvirtd", "note")
    with pytest.raises(AttributeError):
        a.add = ()  # type: ignore[misc]
    assert repr(b) == "KernelArgs(add=('intel_iommu=on',), remove=(), where='')"


def test_mutable_records_compare_by_fields_and_are_unhashable() -> None:
    assert Distro("debian", ["x"], "Debian") == Distro("debian", ["x"], "Debian")
    assert Distro() == Distro("", [], "") != Distro("ubuntu")
    assert Distro().id_like is not Distro().id_like  # a list of its own each
    assert Source("etc/default/grub", "x") != Source("etc/default/grub", "y")
    with pytest.raises(TypeError):
        hash(Distro())
    r = Result("mdev", "ok", "s", "m")
    assert r.actions == [] and r.actions is not Result("mdev", "ok", "s", "m").actions
    assert repr(r) == ("Result(check='mdev', status='ok', subject='s', message='m', fix=None, "
                       "details=None, actions=[], pending=None)")


def test_details_made_when_first_asked_for() -> None:
    calls: list[int] = []

    def details() -> list[dict[str, Any]]:
        calls.append(1)
        return [{"type_id": "nvidia-1", "available_instances": 2}]

    r = Result("mdev", "ok", "s", "m", details=details)
    assert calls == []
    assert r.to_json()["details"] == [{"type_id": "nvidia-1", "available_instances": 2}]
    assert r.details == r.to_json()["details"] and calls == [1]
    assert r == Result("mdev", "ok", "s", "m",
                       details=[{"type_id": "nvidia-1", "available_instances": 2}])
    assert "details" not in Result("mdev", "ok", "s", "m").to_json()
