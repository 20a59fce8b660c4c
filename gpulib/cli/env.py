"""The host a CLI run works on, read once from the environment (no click here:
`gpulib discover` runs without importing it)."""

from __future__ import annotations

from gpulib import logger
from gpulib.config import Config
from gpulib.context import Context
from gpulib.entry import context_from_env

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

log = logger.get(__name__)


class Env:
    """The host the CLI works on, read once from the environment."""

    def __init__(self, ctx: Context, verbose: int = 0) -> None:
        self.ctx = ctx
        self.verbose = verbose
        self._config: Optional[Config] = None
        self._readable_config: Optional[Config] = None

    @classmethod
    def from_environment(cls, verbose: int = 0) -> Env:
        env = cls(context_from_env(), verbose)
        # Logging is set up from what can be read: a bad gpulib.conf must not
        # stop the commands that still work with it (discover, doctor). What
        # reading it logs is held until logging is set up (else it would go
        # to stderr, into the output the CloudStack agent reads).
        logger.hold()
        try:
            cfg = env.readable_config
        except BaseException:
            logger.release(replay=False)
            raise
        level, use_syslog = cfg.get("log", "level"), cfg.get_bool("log", "syslog")
        stderr_level = {0: None, 1: "info"}.get(verbose, "debug")

        def install() -> None:
            from gpulib import logs

            logs.setup(env.ctx, "gpulib", level=level, use_syslog=use_syslog,
                       stderr_level=stderr_level)

        # Python's logging is loaded for the first record kept: a plain
        # `discover` or `metrics` logs nothing, and never imports it.
        logger.configure_later(
            min(logger.level_number(level),
                logger.level_number(stderr_level) if stderr_level else logger.CRITICAL),
            install)
        logger.release()
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
