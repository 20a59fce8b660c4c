"""`config`: gpulib.conf parses without errors or unknown keys."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gpulib.context import CONFIG_FILE
from gpulib.doctor.core import FAIL, OK, WARN, Result, host_path

if TYPE_CHECKING:
    from gpulib.doctor.facts import Doctor


def check(d: Doctor) -> list[Result]:
    cid, path = "config", host_path(CONFIG_FILE)
    config = d.config
    if d._config_error:
        return [Result(cid, FAIL, path, d._config_error,
                       f"correct the value named in {path} (`gpulib` refuses to run "
                       "with it); every key and its default is in the shipped example")]
    if d._config_warnings:
        return [Result(cid, WARN, path, " ".join(m.split(": ", 1)[-1] for m in
                                                 d._config_warnings),
                       f"remove or correct the key named in {path}")]
    if not os.path.exists(d.ctx.config_path):
        return [Result(cid, OK, path, "no configuration file: defaults apply")]
    return [Result(cid, OK, path, f"valid ({len(config.pools)} pool(s))")]
