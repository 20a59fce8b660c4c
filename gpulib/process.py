"""The end of a gpulib process (a hook, a `gpulib` command)."""

from __future__ import annotations

import sys

# typing costs the no-GPU transformer 10 ms: names for type checkers only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End the process with `code`, without the interpreter's teardown.

    A hook or a report is a short process: the teardown frees every module,
    the parsed XML and the state one object at a time, which costs a GPU
    start 5-9 ms (about a tenth of it) for memory the exit frees at once.
    What must not be lost is flushed first: the log's handlers, stdout and
    stderr. A stdout that cannot be flushed (the reader went away) gives
    exit 120, as the interpreter's own exit would. The executables in
    hooks/ and the `gpulib` command end with this; `main(argv)` itself
    returns, so tests and callers in-process keep their interpreter."""
    import os

    logging = sys.modules.get("logging")
    if logging is not None:
        logging.shutdown()  # type: ignore[attr-defined]
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            if stream is sys.stdout and code == 0:
                code = 120
    os._exit(code)
