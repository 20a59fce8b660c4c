"""`python -m gpulib.sim build NAME DIR`: lay out a sample host (demo, large)."""

from __future__ import annotations

import sys

from gpulib.sim.hosts import SAMPLE_HOSTS, build


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] != "build":
        print(f"usage: python -m gpulib.sim build {{{','.join(SAMPLE_HOSTS)}}} DIR",
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
