"""`gpulib-qemu-hook <vm> <operation> <sub-op> <extra>`: libvirt's own qemu hook.

Installed as /etc/libvirt/hooks/qemu.d/50-gpulib. libvirt passes the domain
XML on stdin. What each operation does (ARCHITECTURE.md, "Executables"):
* prepare begin: make the devices the XML names ready (recreate a missing
  mdev, set a VF's vGPU type, create on-demand vGPUs whose UUID the XML
  fixes). Non-zero exit aborts the start; libvirt shows our stderr line.
* started begin: the VM runs; its allocation becomes active (what the
  CloudStack agent's onStart does).
* release end: release what the VM held; also runs after a failed start.
* migrate begin (on the destination of a live migration): the incoming XML
  names the source's vGPUs. For each, gpulib.migration chooses again, here,
  an equivalent one: the same vGPU type on a GPU of the same model (from
  the `<gpulib:device>` record in its metadata, or this host's registry),
  the source's own device when it exists here as that and nobody holds it,
  else a free pool member or a new vGPU; it makes them ready through the
  journal and records them pending. Only each hostdev's source is rewritten
  (the mdev UUID, the NVIDIA vendor VF's address) and the whole XML printed,
  which libvirt starts instead of the incoming one; what the guest sees
  stays the same. Whole GPUs, or no equivalent free: refused, one line,
  non-zero (libvirt cancels the migration; nothing made is left).
* restore begin: make the named devices exist here; print nothing, so
  libvirt keeps its XML.
* reconnect begin: re-learn a running VM after libvirtd restarts; always 0.
* anything else: drain stdin, exit 0.
The hook never calls back into libvirt (that would deadlock).

Exit codes: 0 ok, 1 devices could not be made ready, 2 bad input,
3 state lock busy, 4 state file unusable.
"""

from __future__ import annotations

import sys

PROGRAM = "gpulib"


def main(argv: list[str]) -> int:
    from gpulib.hooks.common import drain_stdin, error_line

    if len(argv) < 3:
        # The usage line names the executable, not gpulib (PROGRAM, which
        # libvirt's messages show the user beside the hook's path).
        error_line("usage", "gpulib-qemu-hook <vm> <operation> <sub-op> [<extra>]")
        drain_stdin()
        return 2
    vm_arg, op = argv[1], argv[2]
    sub = argv[3] if len(argv) > 3 else "-"
    if (op, sub) == ("migrate", "begin"):
        return _arrive(vm_arg)
    if (op, sub) in (("prepare", "begin"), ("restore", "begin")):
        return _prepare(vm_arg)
    if (op, sub) == ("release", "end"):
        drain_stdin()
        return _release(vm_arg)
    if (op, sub) == ("started", "begin"):
        # Plain libvirt has no agent to say onStart: the VM runs now.
        drain_stdin()
        return _activate(vm_arg)
    if (op, sub) == ("reconnect", "begin"):
        # libvirt kills the running VM when reconnect fails: 0 whatever happens
        # (stderr or stdin closed, a bug in gpulib, an interrupt).
        try:
            _reconnect(vm_arg)
        except BaseException:
            pass
        return 0
    drain_stdin()
    return 0


def _prepare(vm_arg: str) -> int:
    from gpulib.hooks.common import read_stdin, run_guarded
    from gpulib.xmlns import may_concern_gpulib

    def body() -> int:
        xml = read_stdin()
        if not may_concern_gpulib(xml):
            return 0
        from gpulib.domain import DomainXmlError, parse_domain
        from gpulib.hooks.common import start
        from gpulib.hooks.prepare import Preparer, StartMode

        dom = parse_domain(xml)
        if dom.name != vm_arg:
            raise DomainXmlError(f"hook called for {vm_arg!r} with the XML of {dom.name!r}")
        ctx, config = start("gpulib-qemu-hook")
        Preparer(ctx, config, dom, StartMode.libvirt_start(ctx, config)).run()
        return 0

    return run_guarded(PROGRAM, body)


def _arrive(vm_arg: str) -> int:
    from gpulib.hooks.common import read_stdin, run_guarded
    from gpulib.process import write_stdout
    from gpulib.xmlns import may_concern_gpulib

    def body() -> int:
        xml = read_stdin()
        if not may_concern_gpulib(xml):
            # The whole XML as it came: an earlier hook in the chain may have
            # rewritten it, and printing it keeps that rewrite whatever the
            # chain does with empty output.
            write_stdout(xml)
            return 0
        from gpulib.domain import DomainXmlError, parse_domain
        from gpulib.hooks.common import start
        from gpulib.migration import arrive

        dom = parse_domain(xml)
        if dom.name != vm_arg:
            raise DomainXmlError(f"hook called for {vm_arg!r} with the XML of {dom.name!r}")
        ctx, config = start("gpulib-qemu-hook")
        arrive(ctx, config, dom)
        write_stdout(dom.to_xml())
        return 0

    return run_guarded(PROGRAM, body)


def _release(vm_arg: str) -> int:
    from gpulib.hooks.common import run_guarded

    def body() -> int:
        from gpulib.hooks.vmstate import change

        change("gpulib-qemu-hook", vm_arg, started=False)
        return 0

    return run_guarded(PROGRAM, body)


def _activate(vm_arg: str) -> int:
    from gpulib.hooks.common import run_guarded

    def body() -> int:
        from gpulib.hooks.vmstate import change

        change("gpulib-qemu-hook", vm_arg, started=True)
        return 0

    # The VM already runs: nothing to refuse any more, never fail here.
    run_guarded(PROGRAM, body)
    return 0


def _reconnect(vm_arg: str) -> None:
    """A running VM found again after libvirtd restarted: mark what it holds active."""
    from gpulib.hooks.common import drain_stdin, read_stdin, run_guarded

    def body() -> int:
        from gpulib.hooks.common import start
        from gpulib.xmlns import may_concern_gpulib

        # Logging first: this operation's failures are not shown by libvirt.
        ctx, config = start("gpulib-qemu-hook")
        xml = read_stdin()
        if not may_concern_gpulib(xml):
            # No GPU now, but the name may still hold the allocation of another
            # domain (redefined while libvirtd was down): replaced, GPU or not.
            from gpulib.domstatus import status_uuid
            from gpulib.hooks.vmstate import replace_other_domain
            from gpulib.validate import check_vm_name

            uuid = status_uuid(xml.encode("utf-8", "surrogateescape"))
            if uuid is not None:
                replace_other_domain(ctx, config, check_vm_name(vm_arg), uuid)
            return 0
        from gpulib.domain import parse_domain
        from gpulib.hooks.prepare import record_running

        record_running(ctx, config, parse_domain(xml))
        return 0

    # A failure here would make libvirt kill the running VM: log, never fail.
    run_guarded(PROGRAM, body)
    drain_stdin()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
