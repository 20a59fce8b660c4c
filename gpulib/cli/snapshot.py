"""`gpulib snapshot` (being written)."""

from __future__ import annotations

import click


@click.command()
def snapshot() -> None:
    """Not available yet."""
    raise click.ClickException("gpulib snapshot is not available yet")
