"""`gpulib doctor` (being written)."""

from __future__ import annotations

import click


@click.command()
def doctor() -> None:
    """Not available yet."""
    raise click.ClickException("gpulib doctor is not available yet")
