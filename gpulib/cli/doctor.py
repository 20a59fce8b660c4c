"""`gpulib doctor`: is this host ready to give GPUs to VMs, and if not, what to do."""

from __future__ import annotations

import click

from gpulib import doctor as checks
from gpulib.cli.common import Env, emit_json


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--check", "only", multiple=True, type=click.Choice(list(checks.CHECK_IDS)),
              help="Run only this check (repeatable).")
@click.pass_obj
def doctor(env: Env, as_json: bool, only: tuple[str, ...]) -> None:
    """Check the host's readiness: IOMMU, drivers, IOMMU groups, VFs, vGPU types,
    hooks, libvirt, gpulib's config and state, and the CloudStack JSON.

    Every problem comes with the exact fix for this distribution. Exit status:
    0 all ok, 1 something failed, 5 warnings only (2: a usage error).
    """
    report = checks.run(env.ctx, only=list(only) or None)
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(report.text(), nl=False)
    raise click.exceptions.Exit(report.exit_code)
