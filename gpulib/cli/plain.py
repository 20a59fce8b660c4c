"""What the commands served without click share (`gpulib discover` in its
plain forms, `gpulib metrics`): the leading `-v` options, and the run that
turns an error into one line and its exit code, as click's wrapper does."""

from __future__ import annotations

import sys

from gpulib.errors import EXIT_FAILED, GpulibError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional


def leading_verbosity(args: list[str], command: str) -> Optional[tuple[int, list[str]]]:
    """(verbosity, the arguments after `command`) of `[-v...] command ...`,
    or None when anything else comes first or `command` is missing."""
    verbose = 0
    i = 0
    while i < len(args) and args[i] != command:
        arg = args[i]
        if arg == "--verbose":
            verbose += 1
        elif len(arg) > 1 and arg.startswith("-") and set(arg[1:]) == {"v"}:
            verbose += len(arg) - 1
        else:
            return None
        i += 1
    if i == len(args):
        return None
    return verbose, args[i + 1:]


def run(body: Callable[[], None]) -> int:
    """Run a command's body: 0, or the exit code of its error after one line
    on stderr (a closed pipe is not an error, an interrupt is 130, a bug is
    `internal_error`)."""
    try:
        body()
    except GpulibError as exc:
        sys.stderr.write(f"gpulib: error: {exc.message}\n")
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return internal_error(exc)
    return 0


def internal_error(exc: Exception) -> int:
    """A bug met by a command: its traceback into gpulib's log, one line on
    stderr (as every other error gets), exit 1."""
    from gpulib import logger

    logger.get("gpulib.cli").exception("gpulib failed unexpectedly")
    reason = " ".join(str(exc).split()) or "no message"
    sys.stderr.write(f"gpulib: internal error: {type(exc).__name__}: {reason} (a bug: the "
                     "traceback is in gpulib's log)\n")
    return EXIT_FAILED
