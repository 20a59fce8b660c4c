"""`gpulib migrate check`: could this host take an incoming VM now?"""

from __future__ import annotations

import sys

import click

from gpulib.cli.common import Env, Group, emit_json, json_option
from gpulib.domain import MAX_XML_BYTES, parse_domain
from gpulib.errors import InputError


@click.group("migrate", cls=Group)
def migrate_group() -> None:
    """Live migration of VMs with vGPUs: check on the destination, annotate on the source."""


def _read(xml: str) -> bytes:
    if xml == "-":
        return sys.stdin.buffer.read(MAX_XML_BYTES + 1)
    try:
        with open(xml, "rb") as fh:
            return fh.read(MAX_XML_BYTES + 1)
    except OSError as exc:
        raise InputError(f"cannot read {xml}: {exc.strerror}") from None


@migrate_group.command("check")
@click.argument("xml", default="-", metavar="[XML|-]")
@json_option
@click.pass_obj
def check_cmd(env: Env, xml: str, as_json: bool) -> None:
    """Whether this host can take the VM of a domain XML now, changing nothing.

    XML: a file with the domain as its source's libvirt sends it (`virsh
    dumpxml --migratable`), or - for stdin. Says which device each vGPU
    would get here (kept, a pool member, a new one) or why the migration
    would be refused. Exit 0: it can; 1: it cannot.
    """
    from gpulib.migration import check

    answer = check(env.ctx, env.config, parse_domain(_read(xml)))
    if as_json:
        emit_json(answer.as_dict())
    else:
        for line in answer.lines():
            click.echo(line)
    if not answer.ok:
        click.get_current_context().exit(1)


@migrate_group.command("annotate")
@click.argument("xml", default="-", metavar="[XML|-]")
@click.pass_obj
def annotate_cmd(env: Env, xml: str) -> None:
    """Run on the source: print the domain XML with what each vGPU is recorded.

    For a VM given its vGPUs before gpulib recorded them in its metadata:
    this host (its live vGPUs, gpulib's registry) says what they are, and
    `virsh migrate --xml FILE` sends the annotated XML (metadata is no part
    of what the guest sees). Changes nothing on the host.
    """
    from gpulib.migration import annotate

    dom = parse_domain(_read(xml))
    records = annotate(env.ctx, env.config, dom)
    named = len(dom.mdev_hostdevs()) + len(dom.pci_hostdevs())
    if len(records) < named:
        click.echo(f"note: {named - len(records)} hostdev(s) of {dom.name} are no vGPU this "
                   "host knows: not recorded", err=True)
    click.echo(dom.to_xml(), nl=False)

