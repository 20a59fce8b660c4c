"""`gpulib`: the administrator's command line (click).

Every subcommand lives in its own module of this package; nothing outside the
CLI imports it, and the hook paths never import click. Nor does the agent's
`gpulib discover --format cloudstack`: its plain forms are served by
`gpulib.cli.inventory` before click is loaded (the group, `gpulib.cli.cli`, is
in `gpulib.cli.commands` and loaded when asked for).

Exit codes: see gpulib.errors (0 ok, 1 failed, 2 bad input, 3 busy, 4 state).
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn, Optional


def main(argv: Optional[list[str]] = None) -> int:
    import gc

    # A command lives for a fraction of a second, as a hook does
    # (gpulib.hooks.common): the cyclic collector's passes over every object
    # made (a large host's inventory, thousands of samples) cost `gpulib
    # metrics` 4 ms and discovery 3, to free what the process's end frees.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except ImportError as exc:  # one of gpulib's modules is gone or not there yet
        from gpulib.installation import incomplete

        incomplete("gpulib", exc)
    finally:
        if collecting:
            gc.enable()


def _main(args: list[str]) -> int:
    # Before any other import: a run that meets a package upgrade waits for it.
    from gpulib.installation import hold

    hold("gpulib")
    from gpulib.cli import inventory

    code = inventory.main(args)
    if code is not None:
        return code
    if "metrics" in args:  # its plain forms without click too (gpulib.cli.metrics)
        from gpulib.cli import metrics

        code = metrics.main(args)
        if code is not None:
            return code
    from gpulib.cli.commands import cli
    from gpulib.cli.common import run_main

    return run_main(cli, args)


def run() -> NoReturn:
    """The `gpulib` command: main(), then the process ends without the
    interpreter's teardown (gpulib.process.exit_now)."""
    from gpulib.process import exit_now

    exit_now(main())


def __getattr__(name: str) -> Any:
    # `gpulib.cli.cli`, the click group, without loading click on import.
    if name == "cli":
        from gpulib.cli.commands import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
