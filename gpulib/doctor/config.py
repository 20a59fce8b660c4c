"""`config`: gpulib.conf parses without errors or unknown keys."""

from __future__ import annotations

import os

from gpulib.config import Config
from gpulib.context import CONFIG_FILE
from gpulib.doctor.core import FAIL, OK, WARN, Result, host_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.facts import Facts


def check(d: Facts) -> list[Result]:
    cid, path = "config", host_path(CONFIG_FILE)
    config = d.config
    if config.problems:
        # A strict reading (every hook's, and every command that changes the
        # host) stops at the first of them.
        return [Result(cid, FAIL, path, "; ".join(config.problems),
                       "correct the file, line or value named (the hooks and the "
                       "commands that change the host refuse to run with it; discover, "
                       "metrics and doctor use the defaults for it); every key and its "
                       "default is in the shipped example")]
    if config.warnings:
        return [Result(cid, WARN, path, " ".join(m.split(": ", 1)[-1] for m in
                                                 config.warnings),
                       f"remove or correct the key named in {path}")]
    capped = lock_timeout_problem(config, path)
    if capped:
        return [capped]
    if not os.path.exists(d.ctx.config_path):
        return [Result(cid, OK, path, "no configuration file: defaults apply")]
    return [Result(cid, OK, path, f"valid ({len(config.pools)} pool(s))")]


def lock_timeout_problem(config: Config, path: str) -> Optional[Result]:
    """`[state] lock_timeout` above what the hooks wait (HOOK_LOCK_TIMEOUT_CAP)."""
    from gpulib.state import HOOK_LOCK_TIMEOUT_CAP

    value = config.get_float("state", "lock_timeout")
    if value <= HOOK_LOCK_TIMEOUT_CAP:
        return None
    return Result("config", WARN, path,
                  f"[state] lock_timeout = {value:g} s is above the {HOOK_LOCK_TIMEOUT_CAP:g} s "
                  "the hooks wait at most (the CloudStack agent kills a hook after 30 s): "
                  "the hooks use the cap, only gpulib commands wait longer",
                  f"set lock_timeout to {HOOK_LOCK_TIMEOUT_CAP:g} or less in {path}")
