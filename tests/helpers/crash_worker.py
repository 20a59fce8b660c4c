"""Run one hook in this process, dying like SIGKILL at the N-th write.

Usage: python -m tests.helpers.crash_worker N <hook module> <argv...>

Counts every sysfs write (`Sysfs.write`) and every state write
(`atomicfile.write_atomic`, and the rename of a state file written before
the lock, `PreparedFile.commit`) in the order they happen; the N-th one is not
made: the process ends at once with os._exit(137), as a kill would leave it
(no cleanup, no rollback, no lock release other than the kernel's). Prints
nothing of its own; exit 0 from the hook means N was past the last write.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from gpulib import atomicfile
from gpulib.sysfs import Sysfs


def main() -> int:
    limit = int(sys.argv[1])
    module = sys.argv[2]
    count = [0]

    def counted(real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == limit:
                os._exit(137)
            return real(*args, **kwargs)
        return wrapper

    Sysfs.write = counted(Sysfs.write)  # type: ignore[method-assign]
    atomicfile.write_atomic = counted(atomicfile.write_atomic)
    atomicfile.PreparedFile.commit = counted(  # type: ignore[method-assign]
        atomicfile.PreparedFile.commit)
    hook = importlib.import_module(module)
    return int(hook.main(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
