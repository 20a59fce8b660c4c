"""Session-wide test setup.

The guard below fails any test that opens, lists or writes anything under the
real /sys (or the real /var/lib/gpulib): every test works on a fake host
below a temporary root. A test that needs the real machine (the libvirtd
test reading libvirt's schema, say) never needs /sys.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulib.config import Config
from gpulib.context import Context
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


# The demo host, its context and configuration: the fixtures of the test
# modules that start VMs on it in-process (a module may define its own `host`).
@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return build_demo(str(tmp_path / "demo"))


@pytest.fixture
def ctx(host: FakeHost) -> Context:
    return Context.for_root(host.root, simulate=True)


@pytest.fixture
def config(ctx: Context) -> Config:
    return Config.load(ctx.config_path)
