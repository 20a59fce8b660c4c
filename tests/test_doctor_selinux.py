"""`gpulib doctor --check selinux`: SELinux's mode, gpulib's policy module and
the labels it gives, below a fake root (the labels are real extended
attributes of the files there, set as the kernel would have them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpulib import doctor as dr
from gpulib.context import Context

LABELLED = {
    "usr/libexec/gpulib/gpulib-qemu-hook": "gpulib_hook_exec_t",
    "etc/gpulib": "gpulib_conf_t",
    "var/lib/gpulib": "gpulib_var_lib_t",
    "var/log/gpulib": "gpulib_log_t",
}


def _label(path: Path, selinux_type: str) -> None:
    os.setxattr(path, "security.selinux", f"system_u:object_r:{selinux_type}:s0\0".encode())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for rel in LABELLED:
        p = root / rel
        if rel.endswith("hook"):
            p.parent.mkdir(parents=True)
            p.write_text("#!/usr/bin/python3\n")
        else:
            p.mkdir(parents=True)
    try:
        _label(root / "etc/gpulib", "etc_t")
    except OSError as exc:
        pytest.skip(f"this file system takes no security.selinux attribute: {exc}")
    return root


def _enable(root: Path, enforce: str, module: bool = True) -> None:
    (root / "sys/fs/selinux").mkdir(parents=True, exist_ok=True)
    (root / "sys/fs/selinux/enforce").write_text(enforce)
    (root / "etc/selinux").mkdir(parents=True, exist_ok=True)
    (root / "etc/selinux/config").write_text("SELINUX=enforcing\nSELINUXTYPE=targeted\n")
    if module:
        (root / "var/lib/selinux/targeted/active/modules/400/gpulib").mkdir(parents=True)


def _results(root: Path) -> list[dr.Result]:
    return dr.run(Context.for_root(str(root)), only=["selinux"]).results_for("selinux")


def test_selinux_off_is_fine(root: Path) -> None:
    (result,) = _results(root)
    assert result.status == dr.OK and "not enabled" in result.message


def test_enforcing_with_the_module_and_the_labels(root: Path) -> None:
    _enable(root, "1")
    for rel, selinux_type in LABELLED.items():
        _label(root / rel, selinux_type)
    (result,) = _results(root)
    assert result.status == dr.OK and "enforcing" in result.message


def test_enforcing_with_a_wrong_label_fails_with_restorecon(root: Path) -> None:
    _enable(root, "1")
    for rel, selinux_type in LABELLED.items():
        _label(root / rel, selinux_type)
    _label(root / "var/lib/gpulib", "var_lib_t")
    (result,) = _results(root)
    assert result.status == dr.FAIL and result.subject == "/var/lib/gpulib"
    assert "var_lib_t" in result.message and "gpulib_var_lib_t" in result.message
    assert result.fix == "restorecon -R -v /var/lib/gpulib"


def test_permissive_without_the_module_warns(root: Path) -> None:
    _enable(root, "0", module=False)
    for rel, selinux_type in LABELLED.items():
        _label(root / rel, selinux_type)
    (result,) = _results(root)
    assert result.status == dr.WARN and "permissive" in result.message
    assert "not installed" in result.message
    assert result.fix and result.fix.startswith(
        "semodule -i /usr/share/selinux/packages/targeted/gpulib.pp")


def test_a_missing_log_directory_is_no_problem(root: Path) -> None:
    _enable(root, "1")
    for rel, selinux_type in LABELLED.items():
        _label(root / rel, selinux_type)
    (root / "var/log/gpulib").rmdir()
    (result,) = _results(root)
    assert result.status == dr.OK
