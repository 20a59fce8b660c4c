"""The end of a gpulib process (a hook, a `gpulib` command): its answer on
stdout, which never waits for the reader, and its exit."""

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


def write_stdout(text: str) -> None:
    """The process's answer on stdout, without making the exit wait for the reader.

    The CloudStack agent reads a script's output only after the process has
    exited (its `Script` waits for the exit, then hands the pipe to an
    `OutputInterpreter`): an answer larger than the pipe's buffer (64 KiB on Linux) would
    block the write, and the exit, until the agent's 30 s timeout killed the
    run. So on a pipe as much as fits is written at once and the rest is
    handed to a child process that outlives this one; this one exits at once
    and the reader, reading to the end, gets every byte. The text is whole
    before its first byte is written: a run that fails prints nothing.
    Every executable that answers on stdout (the hooks, `gpulib discover`,
    `gpulib metrics`) writes through this one function. (What stays limited:
    an XML passed as argv is at most 128 KiB, the kernel's limit on one
    argument.)
    """
    import os

    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
        # Not a file (a caller in the same process that captures the text):
        # nothing there waits for a reader.
        sys.stdout.write(text)
        return
    data = text.encode("utf-8", "surrogateescape")
    written = 0
    if _is_pipe(fd):
        written = _write_without_blocking(fd, data)
        if written == len(data) or _hand_to_child(fd, data[written:]):
            return
    view = memoryview(data)[written:]
    try:
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        raise  # the reader went away: no error of the answer's, each caller's own exit
    except OSError as exc:
        # A full disk, a quota, a terminal gone: one line, as every error.
        from gpulib.errors import GpulibError

        raise GpulibError(f"cannot write the output: {exc.strerror or exc}") from None


def _is_pipe(fd: int) -> bool:
    import os
    import stat

    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _write_without_blocking(fd: int, data: bytes) -> int:
    """Write what the pipe takes now; the number of bytes written."""
    import fcntl
    import os

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    view = memoryview(data)
    done = 0
    try:
        while done < len(data):
            try:
                done += os.write(fd, view[done:])
            except BlockingIOError:
                break
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done


def _hand_to_child(fd: int, rest: bytes) -> bool:
    """Fork a child that writes `rest` to `fd` and exits; False if it cannot."""
    import os

    try:
        pid = os.fork()
    except OSError:
        return False
    if pid:
        return True
    # The child: nothing but the bytes. No stderr (the agent merges it into
    # the answer), no Python exit handlers (logging, the lock: the parent
    # owns those), and no other descriptor: a reader slow to read must not
    # keep the installation's or the state's lock held through this child.
    code = 0
    try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 2)
        _close_all_but(0, 1, 2, fd)
        view = memoryview(rest)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        code = 1
    os._exit(code)


def _close_all_but(*keep: int) -> None:
    import os

    try:
        # The descriptors open now (listing the directory opens one more,
        # already closed when the close below meets it).
        open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):
        open_fds = list(range(3, 1024))
    for fd in open_fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
