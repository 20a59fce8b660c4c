"""The command group and its subcommands, loaded only when used: a command
must not pay for importing every other command."""

from __future__ import annotations

import importlib
from typing import Optional

import click

from gpulib import version
from gpulib.cli.common import Group
from gpulib.cli.env import Env

# name -> (module, attribute); one module per concern.
COMMANDS = {
    "discover": ("gpulib.cli.discover", "discover"),
    "status": ("gpulib.cli.status", "status"),
    "doctor": ("gpulib.cli.doctor", "doctor"),
    "mdev": ("gpulib.cli.vgpu", "mdev_group"),
    "vf": ("gpulib.cli.vgpu", "vf_group"),
    "pool": ("gpulib.cli.pool", "pool_group"),
    "restore": ("gpulib.cli.pool", "restore_cmd"),
    "release": ("gpulib.cli.pool", "release_cmd"),
    "reconcile": ("gpulib.cli.pool", "reconcile_cmd"),
    "device": ("gpulib.cli.device", "device_group"),
    "snapshot": ("gpulib.cli.snapshot", "snapshot"),
    "attach": ("gpulib.cli.attach", "attach_cmd"),
    "detach": ("gpulib.cli.attach", "detach_cmd"),
    "setup": ("gpulib.cli.setup", "setup"),
    "metrics": ("gpulib.cli.metrics", "metrics"),
    "migrate": ("gpulib.cli.migrate", "migrate_group"),
}


class LazyGroup(Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        command = getattr(importlib.import_module(spec[0]), spec[1])
        assert isinstance(command, click.Command)
        return command


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
