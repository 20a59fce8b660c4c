"""`gpulib discover`: the host's GPUs as CloudStack JSON, native JSON or a table.

The work is in `gpulib.cli.inventory`, which also serves the plain forms of
this command without click; this is the command click shows and parses.
"""

from __future__ import annotations

from typing import Optional

import click

from gpulib.cli.env import Env
from gpulib.cli.inventory import FORMATS, default_format, render
from gpulib.process import write_stdout


@click.command()
@click.option("-f", "--format", "fmt", type=click.Choice(list(FORMATS)),
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
    fmt = fmt or default_format()
    text = render(env, fmt)
    if fmt == "table":
        click.echo(text, nl=False)
    else:
        write_stdout(text)  # whatever its size, without waiting for the reader
