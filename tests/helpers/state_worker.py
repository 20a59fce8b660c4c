"""Child-process programs for tests/test_state.py (run with the test interpreter).

    state_worker.py append STATE LOCK ID READY_DIR GO_FILE HOLD_MS
        Create READY_DIR/ID, wait for GO_FILE, then in one transaction add the
        allocation `vm-ID`; sleep HOLD_MS inside the transaction to widen any
        race. Exit 0, or print the error and exit with its exit code.
    state_worker.py claim STATE LOCK ID READY_DIR GO_FILE HOLD_MS
        As append, through StateStore.update: take the lowest device of
        0000:00..3f:00.0 no allocation holds (every racer wants the same one),
        sleeping HOLD_MS while working it out; print the device.
    state_worker.py hold STATE LOCK
        Take the state lock, print "locked", and sleep until killed.
"""

from __future__ import annotations

import os
import sys
import time

from gpulib.errors import GpulibError
from gpulib.state import Allocation, Device, State, StateStore


def _ready_then_go(ready_dir: str, ident: str, go: str) -> bool:
    """Say this process is ready, then wait for the go signal (False: none came)."""
    with open(os.path.join(ready_dir, ident), "w"):
        pass
    deadline = time.monotonic() + 30
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            print("no go signal", file=sys.stderr)
            return False
        time.sleep(0.002)
    return True


def append(state: str, lock: str, ident: str, ready_dir: str, go: str, hold_ms: str) -> int:
    store = StateStore(state, lock, timeout=30.0)
    if not _ready_then_go(ready_dir, ident, go):
        return 1
    try:
        with store.transaction() as s:
            vm = f"vm-{ident}"
            s.allocations[vm] = Allocation(
                vm=vm, status="active", since="2024-01-01T00:00:00Z",
                devices=[Device("pci", f"0000:{int(ident) % 256:02x}:00.0")])
            time.sleep(int(hold_ms) / 1000.0)
    except GpulibError as e:
        print(e.message, file=sys.stderr)
        return e.exit_code
    return 0


def claim(state: str, lock: str, ident: str, ready_dir: str, go: str, hold_ms: str) -> int:
    store = StateStore(state, lock, timeout=30.0)
    if not _ready_then_go(ready_dir, ident, go):
        return 1

    def change(s: State) -> str:
        taken = {d.id for a in s.allocations.values() for d in a.devices}
        free = next(f"0000:{i:02x}:00.0" for i in range(64)
                    if f"0000:{i:02x}:00.0" not in taken)
        time.sleep(int(hold_ms) / 1000.0)
        vm = f"vm-{ident}"
        s.allocations[vm] = Allocation(vm=vm, status="pending", since="2024-01-01T00:00:00Z",
                                       devices=[Device("pci", free)])
        return free

    try:
        print(store.update(change))
    except GpulibError as e:
        print(e.message, file=sys.stderr)
        return e.exit_code
    return 0


def hold(state: str, lock: str) -> int:
    store = StateStore(state, lock, timeout=10.0)
    with store.transaction():
        print("locked", flush=True)
        while True:
            time.sleep(3600)
    return 0  # not reached


def main(argv: list[str]) -> int:
    if len(argv) == 8 and argv[1] == "append":
        return append(*argv[2:])
    if len(argv) == 8 and argv[1] == "claim":
        return claim(*argv[2:])
    if len(argv) == 4 and argv[1] == "hold":
        return hold(argv[2], argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
