"""`python -m gpulib.sim build NAME DIR`: lay out a sample host (demo, large, large-16,
large-32, large-64, large-nvidia, pool64, mig).

`python -m gpulib.sim fault DIR PATH KIND`: make PATH (relative to the host
DIR) fail the way a real file does (see `gpulib.sim.faults`).
"""

from __future__ import annotations

import sys

from gpulib.sim import faults
from gpulib.sim.hosts import SAMPLE_HOSTS, build


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[1] == "fault":
        try:
            faults.inject(argv[2], argv[3], argv[4])
        except (ValueError, OSError) as exc:
            print(f"gpulib.sim: {exc}", file=sys.stderr)
            return 1
        return 0
    if len(argv) != 4 or argv[1] != "build":
        print(f"usage: python -m gpulib.sim build {{{','.join(SAMPLE_HOSTS)}}} DIR\n"
              f"       python -m gpulib.sim fault DIR PATH {{{','.join(faults.KINDS)}}}",
              file=sys.stderr)
        return 2
    try:
        build(argv[2], argv[3])
    except (ValueError, OSError) as exc:
        print(f"gpulib.sim: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
