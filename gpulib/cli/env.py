"""The host a CLI run works on, read once from the environment (no click here:
`gpulib discover` runs without importing it)."""

from __future__ import annotations

import logging
from typing import Optional

from gpulib import logs
from gpulib.config import Config
from gpulib.context import Context

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
