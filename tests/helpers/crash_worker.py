"""Run one hook in this process, dying like SIGKILL at the N-th write.

Usage: python -m tests.helpers.crash_worker N <hook module> <argv...>
       python -m tests.helpers.crash_worker N gpulib.cli <command...>

With CRASH_WORKER_MODE=enospc the N-th write is not a kill but a full disk:
that write (and every state write after it) fails with ENOSPC, and the hook
goes on as it would on a host whose /var/lib is full.

Counts every sysfs write (`Sysfs.write`) and every state write
(`atomicfile.write_atomic`, and the rename of the state file prepared before
the lock, `PreparedFile.commit`) and every change NVIDIA's tool is told to
make (a MIG GPU instance made or destroyed: `migtool.Tool.create`,
`create_compute`, `destroy`) in the order they happen; the N-th one is not
made: the process ends at once with os._exit(137), as a kill would leave it
(no cleanup, no rollback, no lock release other than the kernel's). Prints
nothing of its own; exit 0 from the hook means N was past the last write.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from typing import Any

from gpulib import atomicfile, migtool
from gpulib.sysfs import Sysfs


def main() -> int:
    limit = int(sys.argv[1])
    module = sys.argv[2]
    full_disk = os.environ.get("CRASH_WORKER_MODE") == "enospc"
    count = [0]

    def counted(real: Any, on_disk: bool) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] >= limit and full_disk and on_disk:
                raise OSError(errno.ENOSPC, "No space left on device")
            if count[0] == limit and not full_disk:
                os._exit(137)
            return real(*args, **kwargs)
        return wrapper

    Sysfs.write = counted(Sysfs.write, False)  # type: ignore[method-assign]
    atomicfile.write_atomic = counted(atomicfile.write_atomic, True)
    atomicfile.PreparedFile.commit = counted(  # type: ignore[method-assign]
        atomicfile.PreparedFile.commit, True)
    for name in ("create", "create_compute", "destroy"):
        setattr(migtool.Tool, name, counted(getattr(migtool.Tool, name), False))
    hook = importlib.import_module(module)
    if module == "gpulib.cli":  # a command: its arguments without the program's name
        return int(hook.main(sys.argv[3:]))
    return int(hook.main(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
