"""Each module's logger, without Python's logging until a record is kept.

`logging` and what it imports (traceback, tokenize, threading, string,
weakref) cost `gpulib discover` and `gpulib metrics` a sixth of their run,
and in an ordinary run those commands log nothing at the configured level.
So a module takes `log = logger.get(__name__)`, whose calls hand the record
to `logging` only when it would be kept:

* until a process says how it logs, every record goes to `logging` as it
  would without this module (tests with caplog, a library user's handlers);
* a process that calls `configure_later(threshold, install)` drops, without
  importing anything, the records below `threshold`; the first record kept
  runs `install` (which sets up logging's handlers) and is then logged. Once
  `logging` is imported, by `install` or anything else, every record goes to
  it and its own levels decide;
* between `hold()` and `release()` records are kept in memory (a command
  reads its configuration before it knows where its log goes), and
  `release()` hands them on by the rules above;

Only `sys` is imported here. The hooks and the commands alike set up
`logging` (`gpulib.logs.setup`) through `configure_later`.
"""

from __future__ import annotations

import sys

# typing costs the commands this module serves milliseconds: names for type checkers only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

# logging's numbers, without logging.
DEBUG, INFO, WARNING, ERROR, CRITICAL = 10, 20, 30, 40, 50
LEVELS = {"debug": DEBUG, "info": INFO, "warning": WARNING, "error": ERROR}

# Records below it are dropped while `logging` is not imported (0: none).
_threshold = 0
# Sets up logging's handlers before the first record kept (configure_later).
_install: Optional[Callable[[], None]] = None
# Records kept between hold() and release(): (name, level, msg, args, kwargs).
_held: Optional[list[tuple[str, int, object, tuple[object, ...], dict[str, Any]]]] = None
# Python's warnings are sent through _load() (configure_later, once a process).
_warnings_routed = False


def level_number(name: Optional[str]) -> int:
    """The number of a configured level name (`[log] level`); info if unknown."""
    return LEVELS.get((name or "info").lower(), INFO)


class Logger:
    """The calls gpulib makes on a `logging.Logger`, for the logger `name`."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        _emit(self.name, DEBUG, msg, args, kwargs)

    def info(self, msg: object, *args: object, **kwargs: Any) -> None:
        _emit(self.name, INFO, msg, args, kwargs)

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        _emit(self.name, WARNING, msg, args, kwargs)

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        _emit(self.name, ERROR, msg, args, kwargs)

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        kwargs.setdefault("exc_info", True)
        _emit(self.name, ERROR, msg, args, kwargs)

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        _emit(self.name, level, msg, args, kwargs)


def get(name: str) -> Logger:
    return Logger(name)


def _emit(name: str, level: int, msg: object, args: tuple[object, ...],
          kwargs: dict[str, Any]) -> None:
    if _held is not None:
        if kwargs.get("exc_info") is True:  # the exception is gone by release()
            kwargs = {**kwargs, "exc_info": sys.exc_info()}
        _held.append((name, level, msg, args, kwargs))
        return
    if level < _threshold and "logging" not in sys.modules:
        return
    if _install is not None:
        _load()
    import logging

    logging.getLogger(name).log(level, msg, *args, **kwargs)


def _load() -> None:
    global _install
    install, _install = _install, None
    if install is not None:
        install()


def configure_later(threshold: int, install: Callable[[], None]) -> None:
    """Drop records below `threshold` until `logging` is needed; run
    `install` before the first record that is kept."""
    global _threshold, _install, _warnings_routed
    _threshold = threshold
    _install = install
    if _warnings_routed:
        return
    _warnings_routed = True
    # Python's warnings go to the log too (logging.captureWarnings in
    # gpulib.logs.setup), not to stderr: the first one sets the log up.
    import warnings

    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Optional[str] = None) -> None:
        _load()
        target = warnings.showwarning
        if target is show or file is not None:  # logging's hands those back to the old one
            target = shown
        target(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def hold() -> None:
    """Keep every record in memory until `release()`."""
    global _held
    if _held is None:
        _held = []


def release(replay: bool = True) -> None:
    """Hand the records kept since `hold()` on, as if they were logged now
    (or, `replay` False, forget them)."""
    global _held
    held, _held = _held, None
    for name, level, msg, args, kwargs in held if held and replay else ():
        _emit(name, level, msg, args, kwargs)
