"""`libvirt-vm-state-change onStart|onStop <vm>`: the CloudStack agent's start/stop hook.

Run after a VM started (`onStart`, also `start`) and after it stopped
(`onStop`, also `stop`). onStart turns the VM's pending allocation active;
onStop releases it (vGPUs made on demand are destroyed, pool vGPUs return to
their pool), unless it is pending: the agent's onStop is asynchronous, and a
pending allocation is a newer start of the VM (ARCHITECTURE.md, Liveness).
A VM gpulib knows nothing of is not an error. The agent ignores
the output; the exit code is 0 unless something is really broken.

Exit codes: 0 ok (also: nothing to do), 1 release failed, 2 bad usage or VM
name, 3 state lock busy, 4 state file unusable.
"""

from __future__ import annotations

import sys

PROGRAM = "libvirt-vm-state-change"
STARTS = ("onStart", "start")
STOPS = ("onStop", "stop")


def main(argv: list[str]) -> int:
    from gpulib.hooks.common import error_line, run_guarded

    if len(argv) != 3 or argv[1] not in STARTS + STOPS:
        error_line(PROGRAM, f"usage: {PROGRAM} onStart|onStop <vm-name>")
        return 2
    method, vm_arg = argv[1], argv[2]

    def body() -> int:
        from gpulib import logger
        from gpulib.hooks.vmstate import change

        # onStop names the VM only, late or not: it never ends a newer start.
        outcome = change(PROGRAM, vm_arg, started=method in STARTS, ends_run=False)
        logger.get("gpulib.hooks.statechange").info("%s %s: %s", method, vm_arg, outcome)
        return 0

    return run_guarded(PROGRAM, body)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
