"""Registration of the subcommands beyond `discover` (one module each)."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    from gpulib.cli import doctor, snapshot

    group.add_command(doctor.doctor)
    group.add_command(snapshot.snapshot)
