"""What every subcommand shares: the environment, JSON output, the error wrapper."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from gpulib.cli.env import Env
from gpulib.cli.plain import internal_error
from gpulib.errors import EXIT_USAGE, GpulibError

__all__ = ["Env", "emit_json", "json_option", "run_main"]


# What click (8.2 and later) raises for a group called without a command; older
# releases print the group's help and exit 0 themselves.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", None)

# Every listing takes --json.
json_option = click.option("--json", "as_json", is_flag=True, help="JSON output.")


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


def run_main(group: click.Group, args: list[str]) -> int:
    """Run the CLI; one line on stderr for every error, exit code by kind."""
    try:
        # Without standalone mode click returns the code of a ctx.exit(n).
        rv = group.main(args=args, prog_name="gpulib", standalone_mode=False)
    except GpulibError as exc:
        click.echo(f"gpulib: error: {exc.message}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("gpulib: aborted", err=True)
        return 1
    except click.ClickException as exc:
        if _NO_ARGS_IS_HELP is not None and isinstance(exc, _NO_ARGS_IS_HELP):
            # `gpulib` (or `gpulib mdev`) without a command: the help, as
            # `--help` prints it, on stderr; no mistake to name but the missing command.
            click.echo(exc.format_message(), err=True)
            return EXIT_USAGE
        click.echo(f"gpulib: error: {exc.format_message()}", err=True)
        return exc.exit_code if exc.exit_code else EXIT_USAGE
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return internal_error(exc)
    sys.stdout.flush()
    return rv if isinstance(rv, int) else 0
