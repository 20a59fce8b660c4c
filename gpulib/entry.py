"""An entry point's Context, from its environment: the one place that honours
`GPULIB_SIMULATE`, and so the one place the simulator plugs in.

`GPULIB_ROOT` (default `/`) puts every path gpulib touches under one root;
`GPULIB_SIMULATE=1` (honoured only when that root is not `/`) makes writes to
sysfs also do what the kernel would (`gpulib.sim.plug`). The hooks and the
CLI start here; `gpulib.context` itself never names the simulator
(ARCHITECTURE.md, Layers).
"""

from __future__ import annotations

import os

from gpulib import logger
from gpulib.context import Context

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Optional

log = logger.get(__name__)


def context_from_env(environ: Optional[Mapping[str, str]] = None) -> Context:
    env = os.environ if environ is None else environ
    root = env.get("GPULIB_ROOT") or "/"
    simulate = env.get("GPULIB_SIMULATE", "") == "1"
    return context_for_root(root, simulate=simulate)


def context_for_root(root: str, simulate: bool = False) -> Context:
    if simulate and os.path.realpath(root) == "/":
        # Never pretend on a real host: a simulated write there would
        # leave the real kernel and gpulib's state disagreeing.
        log.warning("GPULIB_SIMULATE ignored: GPULIB_ROOT is the real root")
        simulate = False
    if simulate:
        # The simulator's one plug-in point (tests/test_imports.py holds it
        # so): a real host's run never imports gpulib.sim.
        from gpulib.sim.plug import simulated_sysfs

        return Context(simulated_sysfs(root))
    return Context.for_root(root)
