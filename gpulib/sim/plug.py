"""How the simulator plugs into a run: the sysfs access object of a simulated host.

Asked for by `gpulib.entry` only (GPULIB_SIMULATE's entry point), and by
tests and the demo; nothing in the core names the simulator.
"""

from __future__ import annotations

from gpulib.sysfs import Sysfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable


def simulated_sysfs(root: str) -> Sysfs:
    """A Sysfs whose writes also do what the kernel would (`gpulib.sim.kernel`),
    and whose reads and writes fail as the root's fault table says, if it has
    one (`gpulib.sim.faults`)."""
    write = _simulated_kernel_write(root)
    from gpulib.sim.faults import FaultySysfs, load_table

    faults = load_table(root)
    if faults:
        return FaultySysfs(root, faults, kernel_write=write)
    return Sysfs(root, kernel_write=write, simulated=True)


def _simulated_kernel_write(root: str) -> Callable[[str, str], None]:
    """The simulated kernel's write, the kernel loaded at the first write: a
    run that writes nothing to sysfs (most starts and stops) then imports
    no more of the simulator than this module."""
    kernel: list[Any] = []

    def write(path: str, data: str) -> None:
        if not kernel:
            from gpulib.sim.kernel import SimulatedKernel

            kernel.append(SimulatedKernel(root))
        kernel[0].write(path, data)

    return write
