"""`gpulib setup`: prepare the host (IOMMU, nouveau, vfio-pci, VFs); a plan unless --apply."""

from __future__ import annotations

import sys

import click

from gpulib import hostsetup
from gpulib.cli.common import Env, emit_json
from gpulib.errors import EXIT_FAILED, InputError


@click.command()
@click.option("--apply", "do_apply", is_flag=True,
              help="Apply the plan (asks first on a terminal, unless --yes).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before applying.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (and result) as JSON.")
@click.option("--check", "only", multiple=True, type=click.Choice(list(hostsetup.SETUP_CHECKS)),
              help="Only the fixes of this doctor check (repeatable).")
@click.option("--passthrough", multiple=True, metavar="ADDR|VENDOR:DEVICE",
              help="Keep this GPU from the host for passthrough (vfio-pci); repeatable.")
@click.option("--include-boot-vga", is_flag=True,
              help="Allow --passthrough to take the boot VGA device (the host's console).")
@click.option("--include-vgpu-gpu", "include_vgpu", is_flag=True,
              help="Allow --passthrough ADDR to take a GPU used for vGPU (pools, vGPUs, VFs).")
@click.pass_obj
def setup(env: Env, do_apply: bool, yes: bool, as_json: bool, only: tuple[str, ...],
          passthrough: tuple[str, ...], include_boot_vga: bool, include_vgpu: bool) -> None:
    """Prepare this host for GPUs in VMs: what `gpulib doctor` finds, fixed.

    Without --apply: print the plan (each file with a diff, each command, and
    why) and change nothing. With --apply: edit the files (keeping a
    timestamped backup of each), run the commands, and say what is left
    (reboot). Every step is checked before the first change; a step that
    fails is shown with the command's own output and planned again by the
    next run. Nothing is rebound while the host runs: the changes take effect
    at the next boot. WARNING: it edits the boot configuration
    (/etc/default/grub and its grub.d drop-ins, the boot entries, every
    installed kernel's initramfs). A second run finds nothing to do.
    """
    plan, reboot_for = hostsetup.make_plan(env.ctx, env.config, passthrough,
                                           include_boot_vga, list(only) or None, include_vgpu)
    code = 0
    failure = ""
    if do_apply and plan.steps:
        if not yes and not plan.blocked:  # a refused plan applies nothing: nothing to ask
            if not sys.stdin.isatty():
                raise InputError("--apply without --yes needs a terminal to ask on")
            click.echo(plan.text(), nl=False, err=as_json)
            click.confirm(f"Apply these {len(plan.steps)} change(s)?", abort=True,
                          err=as_json)
        try:
            hostsetup.apply(env.ctx, plan, reboot_for)
        except hostsetup.SetupError:  # LockTimeout (exit 3) passes
            failure = plan.error
            code = EXIT_FAILED
        except OSError as exc:
            failure = str(exc)
            plan.failed(hostsetup.SetupError(failure))
            code = EXIT_FAILED
    if plan.refusals:
        # asked for (a GPU, an edit) and not done: the caller must look
        code = EXIT_FAILED
    report = None
    if do_apply:
        from gpulib import doctor

        report = doctor.run(env.ctx, lock_timeout=0.5)
    if as_json:
        doc = plan.to_json()
        doc["applied"] = do_apply
        if failure:
            doc["error"] = failure
            doc["error_output"] = plan.error_output
        if report is not None:
            doc["doctor"] = {"status": report.status, "summary": report.summary()}
        doc["exit_code"] = code
        emit_json(doc)
    else:
        click.echo(plan.text(), nl=False)
        if not do_apply and plan.steps:
            click.echo("nothing was changed; apply with: gpulib setup --apply")
        if failure:
            click.echo(f"gpulib: error: {failure}", err=True)
            for line in plan.error_output.splitlines():
                click.echo(f"  | {line}", err=True)
        if report is not None:
            bad = {c: s for c, s in report.summary().items() if s != "ok"}
            shown = ", ".join(f"{c} {s}" for c, s in bad.items()) or "all ok"
            click.echo(f"gpulib doctor: {report.status} ({shown})")
    raise click.exceptions.Exit(code)

