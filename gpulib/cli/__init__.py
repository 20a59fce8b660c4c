"""`gpulib`: the administrator's command line (click).

Every subcommand lives in its own module of this package; nothing outside the
CLI imports it, and the hook paths never import click.

Exit codes: see gpulib.errors (0 ok, 1 failed, 2 bad input, 3 busy, 4 state).
"""

from __future__ import annotations

import sys
from typing import Optional

import click

from gpulib import version
from gpulib.cli.commands import LazyGroup
from gpulib.cli.common import Env, run_main


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    # Looked up only when asked: importlib.metadata costs more than discovery.
    if value and not ctx.resilient_parsing:
        click.echo(f"gpulib {version()}")
        ctx.exit(0)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-V", "--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Show the version and exit.")
@click.option("-v", "--verbose", count=True, help="Also log to stderr (-v info, -vv debug).")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """GPUs, vGPUs and SR-IOV functions for virtual machines on this KVM host.

    Every path is below $GPULIB_ROOT (default /); with GPULIB_SIMULATE=1 and
    another root, writes to sysfs also do what the kernel would.
    """
    ctx.obj = Env.from_environment(verbose)



def main(argv: Optional[list[str]] = None) -> int:
    return run_main(cli, sys.argv[1:] if argv is None else argv)
