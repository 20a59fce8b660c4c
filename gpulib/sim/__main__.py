"""`python -m gpulib.sim build NAME DIR`: lay out a sample host (demo, large, large-16,
large-32, large-64, large-nvidia, pool64, mig).

`python -m gpulib.sim fault DIR PATH KIND`: make PATH (relative to the host
DIR) fail the way a real file does (see `gpulib.sim.faults`).

`python -m gpulib.sim launch DIR XMLFILE`, `python -m gpulib.sim shutdown DIR
NAME`: what libvirt does on the host DIR when a domain starts (its status file,
holding the domain XML as started) and when it stops (the file goes).
"""

from __future__ import annotations

import os
import sys

from gpulib.sim import faults
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import SAMPLE_HOSTS, build

USAGE = ("usage: python -m gpulib.sim build {hosts} DIR\n"
         "       python -m gpulib.sim fault DIR PATH {kinds}\n"
         "       python -m gpulib.sim launch DIR XMLFILE\n"
         "       python -m gpulib.sim shutdown DIR NAME")


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[1] == "fault":
        try:
            faults.inject(argv[2], argv[3], argv[4])
        except (ValueError, OSError) as exc:
            print(f"gpulib.sim: {exc}", file=sys.stderr)
            return 1
        return 0
    if len(argv) == 4 and argv[1] in ("launch", "shutdown"):
        if not os.path.isdir(os.path.join(argv[2], "run/libvirt/qemu")):
            print(f"gpulib.sim: {argv[2]}: no simulated host there", file=sys.stderr)
            return 1
        host = FakeHost(argv[2])
        try:
            if argv[1] == "launch":
                with open(argv[3], encoding="utf-8") as fh:
                    host.launch_domain(fh.read())
            elif "/" in argv[3] or not argv[3]:
                raise ValueError(f"not a domain name: {argv[3]!r}")
            else:
                host.stop_domain(argv[3])
        except (ValueError, OSError) as exc:
            print(f"gpulib.sim: {exc}", file=sys.stderr)
            return 1
        return 0
    if len(argv) != 4 or argv[1] != "build":
        print(USAGE.format(hosts="{" + ",".join(SAMPLE_HOSTS) + "}",
                           kinds="{" + ",".join(faults.KINDS) + "}"), file=sys.stderr)
        return 2
    try:
        build(argv[2], argv[3])
    except (ValueError, OSError) as exc:
        print(f"gpulib.sim: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
