"""`gpulib discover`: the host's GPUs as CloudStack JSON, native JSON or a table.

The work is in `gpulib.cli.inventory`, which also serves the plain forms of
this command without click; this is the command click shows and parses.
"""

from __future__ import annotations

from typing import Optional

import click

from gpulib.cli.env import Env
from gpulib.cli.inventory import OPTIONS, chosen_format, render
from gpulib.process import write_stdout


@click.command()
@OPTIONS[0].click_option()
@OPTIONS[1].click_option()
@click.pass_obj
def discover(env: Env, fmt: Optional[str], as_json: bool) -> None:
    """List the host's GPUs, their vGPU types, instances, VFs and users.

    `--format cloudstack` prints exactly what CloudStack's gpudiscovery.sh
    prints, so the agent can use gpulib instead.
    """
    fmt = chosen_format(fmt, as_json)
    text = render(env, fmt)
    if fmt == "table":
        click.echo(text, nl=False)
    else:
        write_stdout(text)  # whatever its size, without waiting for the reader
