"""gpulib's version (packaging/version): a release number and a development
serial from the git history, greater for every landed commit, ordered the
same by PEP 440, dpkg and rpm; carried by the build (gpulib/_version.py),
shown by `gpulib --version` and written into the state file."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import gpulib
from gpulib.records import State

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "packaging" / "version"


def _script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("packaging_version", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


VERSION = _script()
RELEASE = VERSION.RELEASE


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


def _printed(top: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args, str(top)], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    top = tmp_path / "tree"
    (top / "gpulib").mkdir(parents=True)
    (top / ".gitignore").write_text("gpulib/_version.py\n")
    _git(top, "init", "-q")
    for n in range(3):
        (top / "file").write_text(str(n))
        _git(top, "add", "-A")
        _git(top, "commit", "-q", "-m", f"change {n}")
    return top


def test_the_serial_counts_the_history_and_a_change_not_committed(tree: Path) -> None:
    assert _printed(tree).stdout == f"{RELEASE}.3\n"
    (tree / "file").write_text("changed")
    assert _printed(tree).stdout == f"{RELEASE}.4\n"   # the commit it would become
    _git(tree, "commit", "-q", "-am", "change 3")
    assert _printed(tree).stdout == f"{RELEASE}.4\n"
    # A merge: the landed commit has both sides' history and itself.
    _git(tree, "checkout", "-q", "-b", "side", "HEAD~2")
    (tree / "side").write_text("x")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "side")
    _git(tree, "checkout", "-q", "-")
    _git(tree, "merge", "-q", "--no-edit", "side")
    assert _printed(tree).stdout == f"{RELEASE}.6\n"


def test_written_into_the_tree_and_read_back_without_history(tree: Path, tmp_path: Path) -> None:
    r = _printed(tree, "--write")
    assert r.stdout == f"{RELEASE}.3\n" and r.stderr == ""
    text = (tree / "gpulib" / "_version.py").read_text(encoding="utf-8")
    assert f'\nVERSION = "{RELEASE}.3"\n' in text
    assert _git(tree, "status", "--porcelain") == ""  # not in git: the tree stays clean
    # An export (git archive), a tarball: no history, the file it carries.
    export = tmp_path / "export"
    shutil.copytree(tree, export, ignore=shutil.ignore_patterns(".git"))
    assert _printed(export).stdout == f"{RELEASE}.3\n"
    # Neither: RELEASE.0, older than every build from a checkout, and said so.
    (export / "gpulib" / "_version.py").unlink()
    r = _printed(export)
    assert r.stdout == f"{RELEASE}.0\n"
    assert r.stderr.startswith("packaging/version: no git history and no gpulib/_version.py")
    # A tree inside another repository is not that repository's commit.
    inner = tree / "inner"
    shutil.copytree(export, inner)
    assert _printed(inner).stdout == f"{RELEASE}.0\n"


def test_a_shallow_clone_does_not_count(tree: Path, tmp_path: Path) -> None:
    """Its count is the depth, not the history: a version older than the
    commit's. It falls back to what the tree carries."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{tree}", str(clone)],
                   check=True, capture_output=True)
    r = _printed(clone)
    assert r.stdout == f"{RELEASE}.0\n" and "shallow" in r.stderr


def test_this_repositorys_landed_commits_have_growing_versions() -> None:
    """Along main's history (first parents), each commit's serial is greater
    than its parent's: whatever landed later is newer to a package manager."""
    if _git(REPO, "rev-parse", "--is-shallow-repository") != "false":
        pytest.skip("no whole git history here")
    commits = _git(REPO, "rev-list", "--first-parent", "--max-count=25", "HEAD").split()
    serials = [int(_git(REPO, "rev-list", "--count", c)) for c in commits]
    assert len(serials) > 1
    assert serials == sorted(serials, reverse=True) and len(set(serials)) == len(serials)


# --- the three orderings ------------------------------------------------------
# Builds before the scheme were all "0.1.0"; then releases and serials move
# on. (PEP 440 pads with zeros, 0.1.0 == 0.1.0.0, dpkg and rpm do not: a
# release of the scheme is never 0.1.0.)
SEQUENCE = ["0.1.0", f"{RELEASE}.0", f"{RELEASE}.1", f"{RELEASE}.9", f"{RELEASE}.10",
            f"{RELEASE}.99", f"{RELEASE}.100", f"{RELEASE}.433", f"{RELEASE}.1000",
            "0.2.1.1001", "0.3.0.1002", "0.10.0.1003", "1.0.0.1004"]


def test_the_release_has_three_numbers() -> None:
    parts = RELEASE.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts)
    assert SEQUENCE[1:3] == [f"{RELEASE}.0", f"{RELEASE}.1"] and RELEASE == "0.2.0"


def _pep440_cmp(a: str, b: str) -> int:
    from packaging.version import Version

    return (Version(a) > Version(b)) - (Version(a) < Version(b))


def _dpkg_cmp(a: str, b: str) -> int:
    def holds(op: str) -> bool:
        return subprocess.run(["dpkg", "--compare-versions", a, op, b]).returncode == 0
    return 1 if holds("gt") else -1 if holds("lt") else 0


def _rpm_cmps(pairs: list[tuple[str, str]]) -> list[int]:
    """rpm's own rpmvercmp, through its Lua interface (rpmdev-vercmp where
    rpmdevtools is installed)."""
    if shutil.which("rpmdev-vercmp"):
        out = []
        for a, b in pairs:
            rc = subprocess.run(["rpmdev-vercmp", a, b], capture_output=True).returncode
            out.append({0: 0, 11: 1, 12: -1}[rc])
        return out
    lua = " ".join(f'print(rpm.vercmp("{a}", "{b}") .. " ")' for a, b in pairs)
    r = subprocess.run(["rpm", "--eval", f"%{{lua: {lua}}}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.split()]


def test_pep440_dpkg_and_rpm_order_the_versions_alike() -> None:
    pytest.importorskip("packaging.version")
    pairs = [(a, b) for a in SEQUENCE for b in SEQUENCE]
    expected = [(i > j) - (i < j) for i in range(len(SEQUENCE)) for j in range(len(SEQUENCE))]
    assert [_pep440_cmp(a, b) for a, b in pairs] == expected
    if shutil.which("dpkg"):
        assert [_dpkg_cmp(a, b) for a, b in pairs] == expected
    if shutil.which("rpm") or shutil.which("rpmdev-vercmp"):
        assert _rpm_cmps(pairs) == expected


# --- what the build's version is used for -------------------------------------
def test_gpulib_version_and_the_state_file_say_the_builds_version(tmp_path: Path) -> None:
    built = (REPO / "gpulib" / "_version.py")
    if not built.exists():
        pytest.skip("this source tree was never built (scripts/setup, setup.py)")
    assert f'VERSION = "{gpulib.version()}"' in built.read_text(encoding="utf-8")
    r = subprocess.run([str(Path(sys.executable).parent / "gpulib"), "--version"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GPULIB_ROOT": str(tmp_path)})
    assert (r.returncode, r.stdout) == (0, f"gpulib {gpulib.version()}\n")
    doc = State().to_json()
    assert doc["writer"] == f"gpulib {gpulib.version()}"
    assert State.from_json(json.loads(json.dumps(doc))).extra == {}


def test_a_newer_state_is_refused_naming_its_writer() -> None:
    from gpulib.records import SCHEMA_VERSION, StateVersionError

    with pytest.raises(StateVersionError, match=rf"state is version {SCHEMA_VERSION + 1} "
                       r"\(written by gpulib 9\.9\.9\.9\), this gpulib \(.*\) understands up to"):
        State.from_json({"version": SCHEMA_VERSION + 1, "writer": "gpulib 9.9.9.9"})
