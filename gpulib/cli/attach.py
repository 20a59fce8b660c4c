"""`gpulib attach` and `gpulib detach`: GPUs in a plain-libvirt VM's definition."""

from __future__ import annotations

from typing import Optional

import click

from gpulib.attach import Change, Wanted, attach, detach
from gpulib.cli.common import Env
from gpulib.virsh import Virsh

connect_option = click.option(
    "-c", "--connect", "uri", metavar="URI",
    help="libvirt connection (virsh -c); default: $LIBVIRT_DEFAULT_URI, then virsh's own.")
dry_run_option = click.option("--dry-run", is_flag=True,
                              help="Print the change as a unified diff; change nothing.")
force_option = click.option("--force", is_flag=True,
                            help="Edit even on a CloudStack host (whose management server "
                                 "owns the XML).")


def _report(change: Change, dry_run: bool, action: str) -> None:
    if dry_run:
        # The diff alone on stdout, so it can be saved as a patch.
        click.echo(change.diff(action), nl=False)
        for line in change.lines:
            click.echo(line, err=True)
    else:
        for line in change.lines:
            click.echo(line)
        if change.changed:
            click.echo(f"defined VM {change.vm}")
    if not change.changed:
        click.echo(f"VM {change.vm}: nothing to {action}", err=True)
    for note in change.notes:
        click.echo(f"note: {note}", err=True)


@click.command("attach")
@click.argument("vm")
@click.option("--profile", metavar="NAME", help="vGPUs of this profile (GRID T4-2Q).")
@click.option("--type", "type_id", metavar="TYPE", help="vGPUs of this mdev type (nvidia-231).")
@click.option("--gpu", metavar="ADDR|VENDOR:DEVICE",
              help="A whole GPU (or SR-IOV VF) by PCI address, or any free GPU of a model.")
@click.option("--count", type=int, default=1, show_default=True,
              help="How many vGPUs or GPUs.")
@dry_run_option
@force_option
@connect_option
@click.pass_obj
def attach_cmd(env: Env, vm: str, profile: Optional[str], type_id: Optional[str],
               gpu: Optional[str], count: int, dry_run: bool, force: bool,
               uri: Optional[str]) -> None:
    """Give a VM vGPUs or a GPU (plain libvirt: its persistent definition).

    vGPUs get UUIDs derived from the domain UUID and are created by gpulib's
    qemu hook when the VM starts; nothing is created or recorded now.
    """
    wanted = Wanted(profile, type_id, gpu, count)
    change = attach(env.ctx, env.config, Virsh(uri), vm, wanted, dry_run=dry_run, force=force)
    _report(change, dry_run, "attach")


@click.command("detach")
@click.argument("vm")
@click.argument("devices", nargs=-1, metavar="[DEVICE]...")
@dry_run_option
@force_option
@connect_option
@click.pass_obj
def detach_cmd(env: Env, vm: str, devices: tuple[str, ...], dry_run: bool, force: bool,
               uri: Optional[str]) -> None:
    """Take GPUs and vGPUs back from a VM's persistent definition.

    DEVICE is a vGPU UUID or a PCI address (a GPU goes with its IOMMU-group
    peers); without one, every GPU and vGPU and gpulib's request go.
    """
    change = detach(env.ctx, env.config, Virsh(uri), vm, list(devices), dry_run=dry_run,
                    force=force)
    _report(change, dry_run, "detach")
