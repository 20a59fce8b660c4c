"""`libvirt-vm-xml-transformer transform <xml>`: the CloudStack agent's XML hook.

The agent runs it before a VM starts (no shell, 30 s limit), merges stderr
into stdout and uses every output line as the new domain XML. So on success:
the complete XML on stdout, nothing on stderr, exit 0; never exit 0 with empty
output. On failure: exit non-zero with one line on stderr (the agent logs it
and keeps its own XML). With the XML argument missing or `-`, the XML is read
from stdin (administrators pipe it in).

Exit codes: 0 ok, 1 devices could not be made ready, 2 bad input or usage,
3 state lock busy, 4 state file unusable.
"""

from __future__ import annotations

import sys

PROGRAM = "libvirt-vm-xml-transformer"
USAGE = f"usage: {PROGRAM} transform [<domain xml> | -]"


def main(argv: list[str]) -> int:
    # Deliberately light: a domain without GPUs must cost no more than the
    # interpreter's own start, so nothing else is imported on that path.
    from gpulib.hooks.common import HookInputError, error_line, read_stdin
    from gpulib.xmlns import looks_whole, may_concern_gpulib

    if len(argv) < 2 or argv[1] != "transform" or len(argv) > 3:
        error_line(PROGRAM, USAGE)
        return 2
    try:
        xml = argv[2] if len(argv) == 3 and argv[2] != "-" else read_stdin()
    except HookInputError as exc:
        error_line(PROGRAM, str(exc))
        return 2
    if not xml.strip():
        error_line(PROGRAM, "empty domain XML")
        return 2
    if looks_whole(xml) and not may_concern_gpulib(xml):
        return _answer(xml)
    return _transform(xml)


def _answer(text: str) -> int:
    """The new XML on stdout: 0, or 1 after one line when it cannot be written."""
    from gpulib.process import write_stdout

    try:
        write_stdout(text)
    except Exception as exc:  # gpulib's error is imported only when one came
        from gpulib.errors import GpulibError
        from gpulib.hooks.common import error_line

        if not isinstance(exc, GpulibError):
            raise
        error_line(PROGRAM, exc.message)
        return 1
    return 0


def _transform(xml: str) -> int:
    from gpulib.hooks.common import run_guarded, start

    out: list[str] = []

    def body() -> int:
        from gpulib.domain import parse_domain
        from gpulib.hooks.prepare import Preparer, StartMode

        ctx, config = start(PROGRAM)
        dom = parse_domain(xml)
        Preparer(ctx, config, dom, StartMode.transformer(ctx, config)).run()
        result = dom.to_xml()
        if not result.strip():
            raise RuntimeError("produced an empty XML")
        out.append(result)
        return 0

    code = run_guarded(PROGRAM, body)
    return _answer(out[0]) if code == 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
