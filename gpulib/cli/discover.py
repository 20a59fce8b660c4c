"""`gpulib discover`: the host's GPUs as CloudStack JSON, native JSON or a table."""

from __future__ import annotations

import sys
from typing import Optional

import click

from gpulib import cloudstack, report
from gpulib.cli.common import Env, emit_json
from gpulib.runtime import discover_host


@click.command()
@click.option("-f", "--format", "fmt", type=click.Choice(["cloudstack", "json", "table"]),
              default=None, help="Output format (default: table on a terminal, else json).")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.pass_obj
def discover(env: Env, fmt: Optional[str], as_json: bool) -> None:
    """List the host's GPUs, their vGPU types, instances, VFs and users.

    `--format cloudstack` prints exactly what CloudStack's gpudiscovery.sh
    prints, so the agent can use gpulib instead.
    """
    if as_json:
        fmt = "json"
    if fmt is None:
        fmt = "table" if sys.stdout.isatty() else "json"
    # A problem in gpulib.conf must not empty the agent's report (it would
    # mark every GPU failed): what is bad is left at its defaults and logged.
    inventory = discover_host(env.ctx, env.readable_config)
    if fmt == "cloudstack":
        sys.stdout.write(cloudstack.dumps(inventory))
    elif fmt == "json":
        emit_json(report.document(inventory))
    else:
        click.echo(report.table(inventory), nl=False)
