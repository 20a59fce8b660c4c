"""What the hooks share: reading the XML, one-line errors, the set-up of a run.

Exit codes of the hooks: 0 success, 1 the devices could not be made ready
(the message says why), 2 bad input (malformed XML, bad VM name, bad UUID),
3 gpulib's state lock was busy, 4 gpulib's state file is unusable.
"""

from __future__ import annotations

import sys

from gpulib.installation import started_with as _installation_started_with

# typing costs the no-GPU fast path 2-3 ms: names for type checkers only
# (mypy treats any TYPE_CHECKING as true).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

    from gpulib.config import Config
    from gpulib.context import Context

# Same limit as the domain parser: nothing genuine comes close.
MAX_INPUT_BYTES = 8 * 1024 * 1024


def installation_stamp() -> tuple[int, ...]:
    """The identity of the installed build's version file (gpulib.installation)."""
    from gpulib.installation import stamp

    return stamp()


# A hook started without its executable (python3 -c, a test) has not taken
# hold of the installation: its start is now, before it imports the rest.
_installation_started_with()


def check_not_upgraded() -> None:
    """With the state lock held: refuse to go on if gpulib was upgraded since
    this hook started. Its modules would be of two versions (those loaded
    before, the new ones it would import now). The hook's executable holds the
    installation from its first line (gpulib.installation.hold), so a package
    upgrade waits for it; this still catches an install that does not (pip)."""
    if installation_stamp() != _installation_started_with():
        from gpulib.errors import LockTimeout

        raise LockTimeout("gpulib was upgraded while this hook waited for the state lock: "
                          "nothing was done; run it again")


class HookInputError(Exception):
    """Input refused before anything else ran (exit 2)."""


def read_stdin(limit: int = MAX_INPUT_BYTES) -> str:
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise HookInputError(f"domain XML on stdin is larger than {limit // (1024 * 1024)} MiB")
    return data.decode("utf-8", "surrogateescape")


def drain_stdin() -> None:
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except (OSError, ValueError, AttributeError):
        pass


def error_line(program: str, message: str) -> None:
    """One line on stderr: the agent logs it, libvirt shows it to the user."""
    text = " ".join(str(message).split())
    try:
        sys.stderr.write(f"{program}: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass  # stderr closed (None when the caller closed fd 2): nowhere to say it


def start(program: str) -> tuple[Context, Config]:
    """Context, configuration and logging for one hook run."""
    from gpulib import logger
    from gpulib.config import Config
    from gpulib.entry import context_from_env
    from gpulib.state import HOOK_LOCK_TIMEOUT_CAP

    ctx = context_from_env()
    # The agent gives a hook 30 s: no lock_timeout may make it wait longer.
    ctx.lock_wait_cap = HOOK_LOCK_TIMEOUT_CAP
    ctx.on_lock = check_not_upgraded
    config = Config.load(ctx.config_path)
    level, use_syslog = config.get("log", "level"), config.get_bool("log", "syslog")

    def install() -> None:
        from gpulib import logs

        logs.setup(ctx, program, level=level, use_syslog=use_syslog)

    # Python's logging (with traceback, threading, string, weakref) is loaded
    # for the first record kept: a start or stop that has nothing to log at
    # the configured level (a VM started again on the device it holds, most
    # stops) never imports it, a sixth of the GPU transformer's own cost.
    logger.configure_later(logger.level_number(level), install)
    return ctx, config


def run_guarded(program: str, body: Callable[[], int], unexpected_code: int = 1,
                error_code_override: Optional[int] = None) -> int:
    """Run body(); map gpulib errors to one stderr line and their exit code."""
    import gc

    # A hook lives for a fraction of a second: the cyclic collector's passes
    # over every object (imports, parsed XML and state) cost it milliseconds,
    # some of them with the state lock held, to free what the exit frees.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run_guarded(program, body, unexpected_code, error_code_override)
    finally:
        if collecting:
            gc.enable()


def _run_guarded(program: str, body: Callable[[], int], unexpected_code: int,
                 error_code_override: Optional[int]) -> int:
    from gpulib import logger
    from gpulib.errors import GpulibError

    # Until start() says where the log goes, a record is dropped: logging
    # without a handler would fall back to stderr, which the agent would read
    # as part of the XML (hooks never log to stderr). Nothing imports logging
    # for it; should anything else import it, it gets a handler that drops.
    logger.configure_later(logger.CRITICAL + 1, _drop_records)
    try:
        result = body()
        return int(result or 0)
    except HookInputError as exc:
        _log_error(program, str(exc))
        error_line(program, str(exc))
        return error_code_override if error_code_override is not None else 2
    except GpulibError as exc:
        _log_error(program, exc.message)
        error_line(program, exc.message)
        return error_code_override if error_code_override is not None else exc.exit_code
    except Exception as exc:  # a bug must still give one clear line, never a traceback
        if isinstance(exc, ImportError):
            from gpulib.installation import INCOMPLETE, incomplete_line

            if incomplete_line(program, exc):  # the package is between files
                error_line(program, INCOMPLETE)
                return 3
        logger.get("gpulib.hooks").exception("%s failed unexpectedly", program)
        error_line(program, f"internal error: {type(exc).__name__}: {exc}")
        return error_code_override if error_code_override is not None else unexpected_code


def _drop_records() -> None:
    import logging

    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.NullHandler())


def _log_error(program: str, message: str) -> None:
    # Also into gpulib's own log: a caller may not show stderr (libvirt's
    # reconnect, an exit code the agent only logs).
    from gpulib import logger

    logger.get("gpulib.hooks").error("%s: %s", program, message)
