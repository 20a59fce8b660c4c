"""`gpulib snapshot`: the host's GPU layout as a tarball that replays it anywhere."""

from __future__ import annotations

import sys
from typing import Optional

import click

from gpulib import snapshot as snap
from gpulib.cli.common import Env
from gpulib.errors import InputError


@click.command()
@click.option("-o", "--output", metavar="FILE", default=None,
              help="Write the tarball here ('-' for stdout; default "
                   "gpulib-snapshot-<hostname>-<UTC time>.tar.gz in the current directory). "
                   "A new or regular file is replaced whole; a FIFO or character device "
                   "(/dev/null) is written to as a shell redirect would; anything else "
                   "(a symlink to a file, a block device) is refused.")
@click.pass_obj
def snapshot(env: Env, output: Optional[str]) -> None:
    """Capture what gpulib reads on this host (GPU sysfs, kernel command line,
    modprobe, gpulib's config and state, libvirt's domain files) as a .tar.gz,
    secrets scrubbed.

    Unpacked, it works unchanged as GPULIB_ROOT (with GPULIB_SIMULATE=1 to try
    vGPU changes), so anyone can replay this host's layout on a laptop.
    """
    if output == "-":
        if sys.stdout.isatty():
            raise InputError("refusing to write a tarball to a terminal: use -o FILE or a pipe")
        snap.create(env.ctx, "-", stdout=sys.stdout.buffer)
        return
    path, summary = snap.create(env.ctx, output)
    click.echo(f"{path}: {summary.functions} PCI functions, {summary.files} files, "
               f"{summary.links} links")
