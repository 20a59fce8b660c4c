"""What the hooks share: reading the XML, one-line errors, the set-up of a run.

Exit codes of the hooks: 0 success, 1 the devices could not be made ready
(the message says why), 2 bad input (malformed XML, bad VM name, bad UUID),
3 gpulib's state lock was busy, 4 gpulib's state file is unusable.
"""

from __future__ import annotations

import sys

# typing costs the no-GPU fast path 2-3 ms: names for type checkers only
# (mypy treats any TYPE_CHECKING as true).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

    from gpulib.config import Config
    from gpulib.context import Context

# Same limit as the domain parser: nothing genuine comes close.
MAX_INPUT_BYTES = 8 * 1024 * 1024


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


def write_stdout(text: str) -> None:
    sys.stdout.buffer.write(text.encode("utf-8", "surrogateescape"))
    sys.stdout.buffer.flush()


def start(program: str) -> tuple[Context, Config]:
    """Context, configuration and logging for one hook run."""
    from gpulib import logs
    from gpulib.config import Config
    from gpulib.context import Context
    from gpulib.state import HOOK_LOCK_TIMEOUT_CAP

    ctx = Context.from_env()
    # The agent gives a hook 30 s: no lock_timeout may make it wait longer.
    ctx.lock_wait_cap = HOOK_LOCK_TIMEOUT_CAP
    config = Config.load(ctx.config_path)
    logs.setup(ctx, program, level=config.get("log", "level"),
               use_syslog=config.get_bool("log", "syslog"))
    return ctx, config


def run_guarded(program: str, body: Callable[[], int], unexpected_code: int = 1,
                error_code_override: Optional[int] = None) -> int:
    """Run body(); map gpulib errors to one stderr line and their exit code."""
    import logging

    from gpulib.errors import GpulibError

    # Until start() configures it, logging would fall back to stderr, which the
    # agent would read as part of the XML: hooks never log to stderr.
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.NullHandler())
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
        import logging

        logging.getLogger("gpulib.hooks").exception("%s failed unexpectedly", program)
        error_line(program, f"internal error: {type(exc).__name__}: {exc}")
        return error_code_override if error_code_override is not None else unexpected_code


def _log_error(program: str, message: str) -> None:
    # Also into gpulib's own log: a caller may not show stderr (libvirt's
    # reconnect, an exit code the agent only logs).
    import logging

    logging.getLogger("gpulib.hooks").error("%s: %s", program, message)
