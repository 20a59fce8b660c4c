"""What every subcommand shares: the environment, JSON output, the error wrapper."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Optional

import click

from gpulib import logs
from gpulib.config import Config
from gpulib.context import Context
from gpulib.errors import EXIT_USAGE, GpulibError

log = logging.getLogger(__name__)


class _Held(logging.Handler):
    """Keeps records until logging is set up."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Env:
    """The host the CLI works on, read once from the environment."""

    def __init__(self, ctx: Context, verbose: int = 0) -> None:
        self.ctx = ctx
        self.verbose = verbose
        self._config: Optional[Config] = None
        self._readable_config: Optional[Config] = None

    @classmethod
    def from_environment(cls, verbose: int = 0) -> Env:
        env = cls(Context.from_env(), verbose)
        # Logging is set up from what can be read: a bad gpulib.conf must not
        # stop the commands that still work with it (discover, doctor). What
        # reading it logs is held until logging is set up (else it would go
        # to stderr, into the output the CloudStack agent reads).
        held = _Held()
        root = logging.getLogger()
        root.addHandler(held)
        try:
            cfg = env.readable_config
        finally:
            root.removeHandler(held)
        stderr_level = {0: None, 1: "info"}.get(verbose, "debug")
        logs.setup(env.ctx, "gpulib", level=cfg.get("log", "level"),
                   use_syslog=cfg.get_bool("log", "syslog"), stderr_level=stderr_level)
        for record in held.records:
            logging.getLogger(record.name).handle(record)
        for problem in cfg.problems:
            log.warning("%s", problem)
        return env

    @property
    def config(self) -> Config:
        """The configuration; a problem in it is an error (ConfigError)."""
        if self._config is None:
            readable = self.readable_config
            # Without problems the lenient reading is the strict one.
            self._config = readable if not readable.problems else \
                Config.load(self.ctx.config_path)
        return self._config

    @property
    def readable_config(self) -> Config:
        """The configuration with what is bad left at its defaults (problems
        logged): for commands that report on the host and change nothing."""
        if self._readable_config is None:
            self._readable_config = Config.load(self.ctx.config_path, lenient=True)
        return self._readable_config


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
        click.echo(f"gpulib: error: {exc.format_message()}", err=True)
        return exc.exit_code if exc.exit_code else EXIT_USAGE
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
    sys.stdout.flush()
    return rv if isinstance(rv, int) else 0
