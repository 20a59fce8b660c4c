"""`gpulib metrics [--output FILE]`: the host's GPU facts for Prometheus.

A timer runs it every minute for node_exporter's textfile collector, and
importing click would cost it about as much as reading a large host's sysfs.
So `gpulib.cli.main` serves its plain forms here (`main`) without click, as
it does for `discover`; help and anything unusual go to the click command,
which this module makes only when asked for (`metrics`).
"""

from __future__ import annotations

from gpulib.cli import plain
from gpulib.cli.env import Env
from gpulib.process import write_stdout

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

HELP = """Print the host's GPU facts in Prometheus' text format.

vGPU capacity and use per GPU, parent and type, NVIDIA vendor VFs,
allocations, stray vGPUs, pools, the doctor's checks, the state file's
health and the hooks' counters. With --output, FILE is replaced atomically
(for node_exporter's textfile collector, e.g.
/var/lib/prometheus/node-exporter/gpulib.prom).
"""


def run(env: Env, output: Optional[str]) -> None:
    from gpulib import metrics

    # Reports on the host: a problem in gpulib.conf must not hide it (the
    # `config` check's series says what is wrong).
    text = metrics.render(env.ctx, env.readable_config)
    if output is None or output == "-":
        write_stdout(text)  # whatever its size, without waiting for the reader
    else:
        metrics.write(output, text)


# The options of `gpulib metrics`, once: the plain parser and click's read them.
OPTIONS = (
    plain.Option(("-o", "--output"), "output",
                 "Replace FILE atomically instead of printing (- prints).", metavar="FILE"),
)


def parse_args(args: list[str]) -> Optional[tuple[int, Optional[str]]]:
    """(verbosity, output) of `[-v...] metrics [--output FILE | -o FILE]`, or
    None for anything else (click then parses it, errors and help included)."""
    parsed = plain.parse(args, "metrics", OPTIONS)
    if parsed is None:
        return None
    verbose, values = parsed
    return verbose, values["output"]


def main(args: list[str]) -> Optional[int]:
    """Run `gpulib metrics` if `args` are one of its plain forms; the exit
    code, or None when click must handle `args`."""
    parsed = parse_args(args)
    if parsed is None:
        return None
    verbose, output = parsed
    return plain.run(lambda: run(Env.from_environment(verbose), output))


def _command() -> Any:
    import click

    @click.command("metrics", help=HELP)
    @OPTIONS[0].click_option()
    @click.pass_obj
    def metrics(env: Env, output: Optional[str]) -> None:
        run(env, output)

    return metrics


def __getattr__(name: str) -> Any:
    # `gpulib.cli.metrics.metrics`, the click command, made when first asked for.
    if name == "metrics":
        command = _command()
        globals()["metrics"] = command
        return command
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
