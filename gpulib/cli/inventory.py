"""`gpulib discover`'s work, without click.

The CloudStack agent runs `gpulib discover --format cloudstack` (its budget
in ARCHITECTURE.md: under 100 ms on a large host), and importing click costs about as
much as reading a large host's sysfs. So `gpulib.cli.main` serves the plain
forms of `discover` here, parsed by `parse_args`; everything else (help,
unknown or misspelt options, other commands) goes to click, which prints
and exits exactly as before.
"""

from __future__ import annotations

import sys

from gpulib.cli.env import Env
from gpulib.cli.plain import Option, parse, run
from gpulib.process import write_stdout

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

FORMATS = ("cloudstack", "json", "table")


def default_format() -> str:
    return "table" if sys.stdout.isatty() else "json"


def render(env: Env, fmt: str) -> str:
    """The report in `fmt` (one of FORMATS), ending in a newline."""
    # Imported here: `gpulib --help` and the other commands need none of it.
    from gpulib.hostview import discover_host

    # A problem in gpulib.conf must not empty the agent's report (it would
    # mark every GPU failed): what is bad is left at its defaults and logged.
    config = env.readable_config
    inventory = discover_host(env.ctx, config, keep_domains=True)
    timeout = config.get_float("discovery", "nvidia_smi_timeout")
    if fmt != "cloudstack":
        # MIG mode and GPU instances, from NVIDIA's tool (cached; asked only
        # on hosts with NVIDIA vendor VFs).
        from gpulib import migtool

        migtool.attach(inventory, env.ctx.root, timeout)
    if fmt != "table":
        # The numbers of NVIDIA vendor-specific VF types, from NVIDIA's tool
        # (cached; asked only on hosts with such VFs).
        from gpulib.hostview import attach_type_numbers

        attach_type_numbers(inventory, env.ctx.root, timeout)
    if fmt == "cloudstack":
        from gpulib import cloudstack

        return cloudstack.dumps(inventory)
    from gpulib import report

    if fmt == "json":
        from gpulib import jsontext

        return jsontext.dumps(report.document(inventory)) + "\n"
    return report.table(inventory)


# The options of `gpulib discover`, once: the plain parser and click's read them.
OPTIONS = (
    Option(("-f", "--format"), "fmt", "Output format (default: table on a terminal, else json).",
           choices=FORMATS),
    Option(("--json",), "as_json", "Same as --format json.", flag=True),
)


def chosen_format(fmt: Optional[str], as_json: bool) -> str:
    return "json" if as_json else fmt or default_format()


def parse_args(args: list[str]) -> Optional[tuple[int, str]]:
    """(verbosity, format) of `[-v...] discover [--format F | -f F | --json]`, or
    None for anything else (click then parses it, errors and help included)."""
    parsed = parse(args, "discover", OPTIONS)
    if parsed is None:
        return None
    verbose, values = parsed
    return verbose, chosen_format(values["fmt"], values["as_json"])


def main(args: list[str]) -> Optional[int]:
    """Run `gpulib discover` if `args` are one of its plain forms; the exit
    code, or None when click must handle `args`."""
    parsed = parse_args(args)
    if parsed is None:
        return None
    verbose, fmt = parsed
    if fmt == "table":
        return None  # for a person at a terminal: click's echo, as every listing

    def body() -> None:
        # The whole report, then one write that never waits for the reader:
        # the agent reads only after the exit (gpulib.process.write_stdout).
        write_stdout(render(Env.from_environment(verbose), fmt))

    return run(body)
