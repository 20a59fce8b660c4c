"""The subcommands, loaded only when used: `gpulib discover` must not pay for
importing every other command (the discovery budget is 150 ms on a large host)."""

from __future__ import annotations

import importlib
from typing import Optional

import click

# name -> (module, attribute); one module per concern.
COMMANDS = {
    "discover": ("gpulib.cli.discover", "discover"),
    "status": ("gpulib.cli.device", "status"),
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
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        command = getattr(importlib.import_module(spec[0]), spec[1])
        assert isinstance(command, click.Command)
        return command
