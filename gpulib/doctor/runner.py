"""The loop that runs the doctor's checks: above them, as the checks are above
the facts they read (`gpulib.doctor.facts`)."""

from __future__ import annotations

from gpulib import logger
from gpulib.doctor.core import FAIL, Report, Result
from gpulib.doctor.facts import STATE_LOCK_WAIT, Facts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

    from gpulib.config import Config
    from gpulib.context import Context

log = logger.get(__name__)


class Doctor(Facts):
    """Runs the checks against the host below `ctx`'s root; never writes."""

    def checks(self) -> list[tuple[str, Callable[[Facts], list[Result]]]]:
        from gpulib.doctor import (
            binding,
            config,
            discovery,
            groups,
            hooks,
            iommu,
            libvirt,
            logfailures,
            mdev,
            mig,
            migration,
            nouveau,
            selinux,
            sriov,
            state,
        )

        return [
            ("iommu", iommu.check),
            ("nouveau", nouveau.check),
            ("driver-binding", binding.check),
            ("iommu-group", groups.check),
            ("sriov", sriov.check),
            ("mdev", mdev.check),
            ("mig", mig.check),
            ("hooks", hooks.check),
            ("libvirt", libvirt.check),
            ("migration", migration.check),
            ("config", config.check),
            ("state", state.check),
            ("discovery", discovery.check),
            ("logging", logfailures.check),
            ("selinux", selinux.check),
        ]

    def run(self, only: Optional[list[str]] = None) -> Report:
        results: list[Result] = []
        for check_id, check in self.checks():
            if only and check_id not in only:
                continue
            try:
                found = check(self)
            except Exception as exc:  # one broken check must not hide the others
                log.exception("doctor check %s failed", check_id)
                reason = " ".join(str(exc).split()) or type(exc).__name__
                found = [Result(check_id, FAIL, "gpulib", f"the check could not run: {reason}",
                                "report this as a gpulib bug, with the tarball of "
                                "`gpulib snapshot` attached")]
            results.extend(found)
        return Report(results, self.distro)


def run(ctx: Context, config: Optional[Config] = None, lock_timeout: float = STATE_LOCK_WAIT,
        only: Optional[list[str]] = None) -> Report:
    """Run every check (or `only` these ids) against the host below ctx's root."""
    return Doctor(ctx, config, lock_timeout=lock_timeout).run(only)
