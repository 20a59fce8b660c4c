"""gpulib.logger: a module's logger that loads Python's logging only for a kept record.

Whether `logging` is imported is a fact of a whole interpreter, and pytest
imports it: those tests run a fresh interpreter each.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpulib import logger
from gpulib.context import LOG_DIR
from tests.hookrun import BIN, hook_env
from tests.hosts import demo_host


def run_fresh(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, env=env)


def test_records_below_the_threshold_never_import_logging() -> None:
    r = run_fresh("""
        import sys
        from gpulib import logger
        installed = []
        log = logger.get("gpulib.example")
        logger.configure_later(logger.INFO, lambda: installed.append(1))
        log.debug("dropped %s", 1)
        print("after debug:", "logging" in sys.modules, installed)
        log.info("kept %s", 2)
        print("after info:", "logging" in sys.modules, installed)
        log.info("kept again")
        print("after another:", installed)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["after debug: False []", "after info: True [1]",
                                     "after another: [1]"]


def run_with_log_on_stdout(log_format: str, code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter where `install()` sets logging up as
    gpulib.logs would, to stdout in `log_format`, at warning and above."""
    prelude = f"""
        import sys, warnings
        from gpulib import logger

        def install():
            import logging
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter({log_format!r}))
            logging.getLogger().addHandler(handler)
            logging.getLogger().setLevel(logging.WARNING)
            logging.captureWarnings(True)
    """
    return run_fresh(textwrap.dedent(prelude) + textwrap.dedent(code))


def test_the_first_kept_record_reaches_the_handlers_install_sets_up() -> None:
    r = run_with_log_on_stdout("%(name)s %(levelname)s %(message)s", """
        log = logger.get("gpulib.example")
        logger.configure_later(logger.WARNING, install)
        log.info("dropped")
        log.warning("first %d", 1)
        log.info("below logging's own level now")
        log.error("second")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("third")
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:3] == ["gpulib.example WARNING first 1", "gpulib.example ERROR second",
                         "gpulib.example ERROR third"]
    assert lines[-1] == "ValueError: boom"  # exception() keeps the traceback


def test_without_configuration_every_record_goes_to_logging(
        caplog: pytest.LogCaptureFixture) -> None:
    # pytest has imported logging: its levels decide, as for a library user.
    caplog.set_level(logging.DEBUG, logger="gpulib.example")
    logger.get("gpulib.example").debug("seen %s", "here")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("gpulib.example", logging.DEBUG, "seen here")]


def test_held_records_are_replayed_in_order_or_forgotten(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gpulib.example")
    log = logger.get("gpulib.example")
    logger.hold()
    try:
        log.warning("one")
        log.debug("two %d", 2)
        assert caplog.records == []
    finally:
        logger.release()
    assert [r.getMessage() for r in caplog.records] == ["one", "two 2"]
    caplog.clear()
    logger.hold()
    log.warning("never")
    logger.release(replay=False)
    log.warning("after")
    assert [r.getMessage() for r in caplog.records] == ["after"]


def test_python_warnings_set_the_log_up_and_go_into_it() -> None:
    r = run_with_log_on_stdout("%(name)s: %(message)s", """
        logger.configure_later(logger.INFO, install)
        logger.configure_later(logger.INFO, install)  # a second call wraps nothing again
        warnings.warn("careful", UserWarning)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert r.stdout.startswith("py.warnings: ") and "UserWarning: careful" in r.stdout


def test_a_report_that_logs_writes_its_log_file(tmp_path: Path) -> None:
    """A problem in gpulib.conf is logged as a warning before the log is set
    up: it still reaches the log file, and never the agent's stdout."""
    host = demo_host(str(tmp_path))
    conf = Path(host.root, "etc/gpulib/gpulib.conf")
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("[discovery]\nno_such_key = 1\n", encoding="utf-8")
    r = subprocess.run([str(BIN / "gpulib"), "discover", "--format", "cloudstack"],
                       capture_output=True, text=True, env=hook_env(host.root), timeout=60)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)
    assert r.stderr == ""
    text = Path(host.root, LOG_DIR, "gpulib.log").read_text(encoding="utf-8")
    assert "gpulib.config: WARNING" in text and "no_such_key" in text, text
    # -v: the same warning on stderr too.
    r = subprocess.run([str(BIN / "gpulib"), "-v", "discover", "--format", "cloudstack"],
                       capture_output=True, text=True, env=hook_env(host.root), timeout=60)
    assert r.returncode == 0 and "no_such_key" in r.stderr, r.stderr
