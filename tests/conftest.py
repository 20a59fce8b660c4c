"""Session-wide test setup.

The guard below fails any test that opens, lists or writes anything under the
real /sys (or the real /var/lib/gpulib): every test works on a fake host
below a temporary root. A test that needs the real machine (the libvirtd
test reading libvirt's schema, say) never needs /sys.
"""

from __future__ import annotations

import builtins
import copy
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from gpulib.config import Config
from gpulib.context import Context
from gpulib.entry import context_for_root
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import build_demo

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
GOLDEN = REPO / "tests" / "golden"

_FORBIDDEN = ("/sys/", "/var/lib/gpulib", "/proc/cmdline")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "guard_selftest: checks the real-/sys guard itself")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--regen-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output instead of comparing")


@pytest.fixture(scope="session")
def simulated_hosts(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every simulated host of `tests.simhosts`, each built when first asked
    for and kept for the session (the large ones take a while)."""
    from tests.simhosts import Built

    return Built(tmp_path_factory)


@pytest.fixture
def regen_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regen-golden")) or \
        os.environ.get("GPULIB_REGEN_GOLDEN") == "1"


def _forbidden(path: Any) -> bool:
    try:
        text = os.fsdecode(path) if not isinstance(path, int) else ""
    except TypeError:
        return False
    if not text.startswith("/"):
        return False
    text = os.path.normpath(text)
    return text == "/sys" or any(text.startswith(p.rstrip("/") + "/") or text == p.rstrip("/")
                                 for p in _FORBIDDEN)


@pytest.fixture(autouse=True)
def _no_real_sys(monkeypatch: pytest.MonkeyPatch,
                 request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test the moment it touches the real /sys."""
    touched: list[str] = []

    def guard(name: str, real: Any) -> Any:
        def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
            if _forbidden(path):
                touched.append(f"{name}({os.fsdecode(path)!r})")
                raise AssertionError(f"test touched the real host: {name}({path!r})")
            return real(path, *args, **kwargs)
        return wrapper

    for name in ("open", "listdir", "readlink", "scandir", "stat", "lstat", "access"):
        monkeypatch.setattr(os, name, guard(f"os.{name}", getattr(os, name)))
    monkeypatch.setattr(builtins, "open", guard("open", builtins.open))
    # Tests that spawn gpulib processes get a root that is not "/" by default.
    monkeypatch.setenv("GPULIB_ROOT", "/nonexistent-gpulib-test-root")
    yield
    # Also when the test swallowed the AssertionError (the guard's own test may).
    if request.node.get_closest_marker("guard_selftest") is None:
        assert not touched, f"real host touched: {touched}"


# -- fake hosts: small or shared -------------------------------------------------------
# A demo host is about 1,700 files and 5 MB on disk, the large one 26,000
# and 84 MB: built for every test, they made a whole run write gigabytes.
# pytest removes a passing test's tmp_path when it ends (pyproject.toml,
# tmp_path_retention_policy); what follows keeps the rest small.


class SharedHost:
    """One fake host for the tests of a module that leave it as it was.

    A test takes it and gives it back; a tree the test changed (a file
    written, created, removed, renamed or retyped: every entry's inode,
    size, mode, mtime and link target are compared) is removed then, and the
    next test gets a new one. So a test sees a host as built, whatever the
    tests before it did, and only the tests that change it pay for a new one.
    """

    def __init__(self, base: Path, build: Callable[[str], FakeHost]) -> None:
        self.base, self.build = base, build
        self.built = 0
        self._host: Optional[FakeHost] = None
        self._object: dict[str, Any] = {}
        self._tree: dict[str, tuple[int, ...]] = {}

    def take(self) -> FakeHost:
        if self._host is None:
            self.built += 1
            self._host = self.build(str(self.base / f"host{self.built}"))
            self._object = copy.deepcopy(self._host.__dict__)
            self._tree = tree_signature(self._host.root)
        else:  # what the builder keeps in memory (pci.ids names, group numbers) too
            self._host.__dict__ = copy.deepcopy(self._object)
        return self._host

    def give_back(self, failed: bool = False) -> None:
        """After the test: a tree it changed goes (left in place for a look
        when the test `failed`), so the next test gets a new one."""
        if self._host is not None and tree_signature(self._host.root) != self._tree:
            if not failed:
                shutil.rmtree(self._host.root, ignore_errors=True)
            self._host = None

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def tree_signature(root: str) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            out[path] = (st.st_ino, st.st_size, st.st_mode, st.st_mtime_ns, hash(target))
    return out


@pytest.fixture(scope="module")
def module_tmp(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory for what a module's tests share, removed after its last
    test when none of them failed (what the retention policy does for a
    test's own tmp_path; pytest would keep a module's until the next run)."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    failed = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_demo(module_tmp: Path) -> SharedHost:
    return SharedHost(module_tmp / "demo", build_demo)


# The demo host, its context and configuration: the fixtures of the test
# modules that start VMs on it in-process (a module may define its own `host`).
@pytest.fixture
def host(shared_demo: SharedHost, request: pytest.FixtureRequest) -> Iterator[FakeHost]:
    yield from shared(shared_demo, request)


def shared(hosts: SharedHost, request: pytest.FixtureRequest) -> Iterator[FakeHost]:
    """The body of a fixture handing out a module's shared host (see SharedHost)."""
    failed = request.session.testsfailed
    yield hosts.take()
    # The test's own outcome is counted before its fixtures are torn down.
    hosts.give_back(failed=request.session.testsfailed > failed)


@pytest.fixture
def ctx(host: FakeHost) -> Context:
    return context_for_root(host.root, simulate=True)


@pytest.fixture
def config(ctx: Context) -> Config:
    return Config.load(ctx.config_path)
