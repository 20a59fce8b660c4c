"""What every subcommand shares: the environment, JSON output, the error wrapper."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from gpulib.cli.env import Env
from gpulib.cli.plain import exit_code_of
from gpulib.errors import EXIT_USAGE

__all__ = ["Env", "Group", "emit_json", "json_option", "run_main"]


class Group(click.Group):
    """A command group that, called without a command, prints its help on
    stderr and exits 2 (usage) whatever click's release: 8.2 and later do so,
    8.1 (the one pip picks for EL9's Python 3.9) printed it on stdout and
    exited 0, so scripts saw success for a missing command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            # The help as --help prints it; no mistake to name but the missing command.
            click.echo(ctx.get_help(), err=True)
            ctx.exit(EXIT_USAGE)
        return super().parse_args(ctx, args)

# Every listing takes --json.
json_option = click.option("--json", "as_json", is_flag=True, help="JSON output.")


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


def run_main(group: click.Group, args: list[str]) -> int:
    """Run the CLI; one line on stderr for every error, exit code by kind."""
    try:
        # Without standalone mode click returns the code of a ctx.exit(n).
        rv = group.main(args=args, prog_name="gpulib", standalone_mode=False)
        sys.stdout.flush()
    except click.exceptions.Abort:
        click.echo("gpulib: aborted", err=True)
        return 1
    except click.ClickException as exc:
        click.echo(f"gpulib: error: {exc.format_message()}", err=True)
        return exc.exit_code if exc.exit_code else EXIT_USAGE
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except (Exception, KeyboardInterrupt) as exc:
        # Everything that is not click's: one mapping for every command.
        return exit_code_of(exc)
    return rv if isinstance(rv, int) else 0
