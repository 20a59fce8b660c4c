"""What the commands served without click share (`gpulib discover` in its
plain forms, `gpulib metrics`): the leading `-v` options, and the run that
turns an error into one line and its exit code, as click's wrapper does."""

from __future__ import annotations

import errno
import os
import sys

from gpulib.errors import EXIT_BUSY, EXIT_FAILED, GpulibError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, TypeVar

    Decorated = TypeVar("Decorated", bound=Callable[..., Any])


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


class Option:
    """One option of a command served both without click and by click, written
    once: `parse` reads its plain forms, `click_option` makes click's."""

    __slots__ = ("choices", "dest", "flag", "help", "metavar", "names")

    def __init__(self, names: tuple[str, ...], dest: str, help: str, flag: bool = False,
                 choices: tuple[str, ...] = (), metavar: Optional[str] = None) -> None:
        self.names = names
        self.dest = dest
        self.help = help
        self.flag = flag
        self.choices = choices
        self.metavar = metavar

    def click_option(self) -> Callable[[Decorated], Decorated]:
        import click

        if self.flag:
            return click.option(*self.names, self.dest, is_flag=True, help=self.help)
        kind = click.Choice(list(self.choices)) if self.choices else None
        return click.option(*self.names, self.dest, type=kind, default=None,
                            metavar=self.metavar, help=self.help)


def parse(args: list[str], command: str, options: tuple[Option, ...]
          ) -> Optional[tuple[int, dict[str, Any]]]:
    """(verbosity, option values by `dest`) of `[-v...] command [options]`,
    or None for anything else: an unknown option, a value missing, empty,
    looking like an option or not among the choices, an argument (click then
    parses it, errors and help included). An option given again wins, as in
    click."""
    leading = leading_verbosity(args, command)
    if leading is None:
        return None
    verbose, rest = leading
    by_name = {name: o for o in options for name in o.names}
    values: dict[str, Any] = {o.dest: (False if o.flag else None) for o in options}
    j = 0
    while j < len(rest):
        name, eq, value = rest[j].partition("=")
        option = by_name.get(name if eq and name.startswith("--") else rest[j])
        if option is None:
            return None
        if option.flag:
            if eq:
                return None
            values[option.dest] = True
        else:
            if not eq:
                j += 1
                if j == len(rest):
                    return None
                value = rest[j]
            if not value or value.startswith("-") or \
                    (option.choices and value not in option.choices):
                return None
            values[option.dest] = value
        j += 1
    return verbose, values


def run(body: Callable[[], None]) -> int:
    """Run a command's body: 0, or the exit code of its error after one line
    on stderr (`exit_code_of`)."""
    try:
        body()
        sys.stdout.flush()
    except (Exception, KeyboardInterrupt) as exc:
        return exit_code_of(exc)
    return 0


# What a full disk, a quota or a dead terminal says when stdout is written.
_OUTPUT_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO))


def exit_code_of(exc: BaseException) -> int:
    """The one mapping of an error that ended a command to its exit code, for
    the commands served with click (`cli.common.run_main`, which first maps
    click's own) and without: gpulib's errors are their one line and code; a
    closed pipe is no error (0); an interrupt is 130; an installation between
    files is exit 3 (`installation`); stdout that cannot be written (a full
    disk, /dev/full) is one line and 1; anything else is a bug
    (`internal_error`)."""
    if isinstance(exc, GpulibError):
        sys.stderr.write(f"gpulib: error: {exc.message}\n")
        return exc.exit_code
    if isinstance(exc, BrokenPipeError):
        return 0
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, ImportError):
        from gpulib.installation import incomplete_line

        line = incomplete_line("gpulib", exc)
        if line is not None:
            sys.stderr.write(line + "\n")
            return EXIT_BUSY
    if isinstance(exc, OSError) and exc.errno in _OUTPUT_ERRNOS and _from_stdout(exc):
        _drop_stdout()
        sys.stderr.write(f"gpulib: error: cannot write the output: {exc.strerror}\n")
        return EXIT_FAILED
    return internal_error(exc) if isinstance(exc, Exception) else EXIT_FAILED


def _from_stdout(exc: OSError) -> bool:
    """Whether the error came from writing standard output: raised by a
    write or flush of sys.stdout (through click.echo, print or gpulib's own
    writer), never by a file gpulib names (those carry a file name, or were
    made one line with their path where they are written)."""
    if exc.filename is not None:
        return False
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame
        tb = tb.tb_next
    if last is None:
        return False
    code = last.f_code
    where = code.co_filename.replace(os.sep, "/")
    return where.endswith(("/click/utils.py", "/gpulib/cli/plain.py", "/gpulib/cli/common.py")) \
        or code.co_name == "write_stdout"


def _drop_stdout() -> None:
    """Leave nothing buffered for the interpreter's exit to fail on again."""
    try:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (stays open until exit)
    except OSError:
        pass


def internal_error(exc: Exception) -> int:
    """A bug met by a command: its traceback into gpulib's log, one line on
    stderr (as every other error gets), exit 1."""
    from gpulib import logger

    logger.get("gpulib.cli").exception("gpulib failed unexpectedly")
    reason = " ".join(str(exc).split()) or "no message"
    sys.stderr.write(f"gpulib: internal error: {type(exc).__name__}: {reason} (a bug: the "
                     "traceback is in gpulib's log)\n")
    return EXIT_FAILED
