"""What every doctor check shares: ids, statuses, results, the distribution, the report."""

from __future__ import annotations

from gpulib import cloudstack, logger
from gpulib.cloudstack import agent_hooks_dir as agent_hooks_dir

# The locations the checks read, defined once in gpulib.context; the doctor
# package still exports them for its checks.
from gpulib.context import (
    AGENT_PROPERTIES as AGENT_PROPERTIES,
)
from gpulib.context import (
    BOOT_ID as BOOT_ID,
)
from gpulib.context import (
    DEFAULT_GRUB as DEFAULT_GRUB,
)
from gpulib.context import (
    LIBVIRT_DAEMONS as LIBVIRT_DAEMONS,
)
from gpulib.context import (
    LIBVIRT_HOOK as LIBVIRT_HOOK,
)
from gpulib.context import (
    LIBVIRT_HOOKS_DIR as LIBVIRT_HOOKS_DIR,
)
from gpulib.context import (
    MODPROBE_DIRS as MODPROBE_DIRS,
)
from gpulib.context import (
    OS_RELEASE as OS_RELEASE,
)
from gpulib.context import (
    PROC_CPUINFO as PROC_CPUINFO,
)
from gpulib.context import (
    PROC_STAT as PROC_STAT,
)
from gpulib.context import (
    SETUP_JOURNAL as SETUP_JOURNAL,
)
from gpulib.distro import Distro as Distro
from gpulib.slotted import Slotted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Union

    from gpulib.doctor.actions import Action

    Details = list[dict[str, Any]]

log = logger.get(__name__)

OK = "ok"
WARN = "warn"
FAIL = "fail"
_RANK = {OK: 0, WARN: 1, FAIL: 2}
# The doctor's exit status: 2 is a usage error (as for every gpulib command),
# so warnings only is a code of its own that no other outcome gives.
EXIT_WARNINGS = 5
EXIT_CODES = {OK: 0, FAIL: 1, WARN: EXIT_WARNINGS}
SCHEMA = 1

CHECK_IDS = ("iommu", "nouveau", "driver-binding", "iommu-group", "sriov", "mdev", "mig",
             "hooks", "libvirt", "migration", "config", "state", "discovery", "logging",
             "selinux")

AMD_VENDOR = 0x1002
# Drivers that make a GPU the host's: a passthrough GPU must not be on one.
HOST_DISPLAY_DRIVERS = frozenset({"nvidia", "nouveau", "amdgpu", "radeon", "i915", "xe"})
# The executables the package installs.
QEMU_HOOK_EXECUTABLE = "gpulib-qemu-hook"
AGENT_HOOK_EXECUTABLES = {
    cloudstack.TRANSFORMER_HOOK: "libvirt-vm-xml-transformer",
    cloudstack.STATE_CHANGE_HOOK: "libvirt-vm-state-change",
}


def host_path(rel: str) -> str:
    """A root-relative path as the host sees it (`/proc/cmdline`)."""
    return "/" + rel.lstrip("/")


def is_vfio_driver(driver: Optional[str]) -> bool:
    """vfio-pci or a vendor's vfio-pci variant driver."""
    return bool(driver) and (driver == "vfio-pci" or str(driver).endswith(("-vfio-pci",
                                                                          "_vfio_pci")))


def is_free_for_vfio(driver: Optional[str]) -> bool:
    """No driver, vfio-pci, or pci-stub (held away from the host)."""
    return driver is None or driver == "pci-stub" or is_vfio_driver(driver)


# -- results ---------------------------------------------------------------------------




class Result(Slotted):
    """One finding of one check (a hand-written record: see gpulib.slotted)."""

    __slots__ = ("_details", "actions", "check", "fix", "message", "pending", "status",
                 "subject")
    _fields = ("check", "status", "subject", "message", "fix", "details", "actions",
               "pending")

    def __init__(self, check: str, status: str, subject: str, message: str,
                 fix: Optional[str] = None,
                 details: Union[Details, Callable[[], Details], None] = None,
                 actions: Optional[list[Action]] = None, pending: Optional[str] = None
                 ) -> None:
        self.check = check
        self.status = status
        self.subject = subject
        self.message = message
        self.fix = fix
        # A function is called for the list when it is first asked for: a
        # large host's check lists thousands of items, which `gpulib
        # metrics` (every minute, only the status) never asks for.
        self._details: Union[Details, Callable[[], Details], None] = details
        # What the fix text says, as data (gpulib setup applies these).
        self.actions: list[Action] = [] if actions is None else actions
        # "reboot" when the fix is made and only waits for the next boot.
        self.pending = pending

    @property
    def details(self) -> Optional[Details]:
        details = self._details
        if callable(details):
            details = self._details = details()
        return details

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.check, "status": self.status,
                               "subject": self.subject, "message": self.message,
                               "fix": self.fix}
        if self.details is not None:
            doc["details"] = self.details
        if self.actions:
            doc["actions"] = [a.to_json() for a in self.actions]
        if self.pending:
            doc["pending"] = self.pending
        return doc


def worst(statuses: list[str]) -> str:
    return max(statuses, key=lambda s: _RANK[s], default=OK)


class Report:
    def __init__(self, results: list[Result], distro: Distro) -> None:
        self.results = results
        self.distro = distro

    @property
    def status(self) -> str:
        return worst([r.status for r in self.results])

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def summary(self) -> dict[str, str]:
        """The worst status of every check id, in check order."""
        out: dict[str, str] = {}
        for r in self.results:
            out[r.check] = worst([out.get(r.check, OK), r.status])
        return out

    def results_for(self, check: str) -> list[Result]:
        return [r for r in self.results if r.check == check]

    def to_json(self) -> dict[str, Any]:
        # Counted as the text counts them: a check by its worst result (one
        # check may give several results, one a device).
        checks = list(self.summary().values())
        counts = {s: checks.count(s) for s in (OK, WARN, FAIL)}
        results = {s: sum(1 for r in self.results if r.status == s) for s in (OK, WARN, FAIL)}
        return {
            "schema": SCHEMA,
            "status": self.status,
            "exit_code": self.exit_code,
            "distribution": self.distro.to_json(),
            "summary": self.summary(),
            "counts": counts,
            "result_counts": results,
            "checks": [r.to_json() for r in self.results],
        }

    def text(self) -> str:
        lines = []
        if self.distro.name or self.distro.id:
            lines.append(f"gpulib doctor on {self.distro.name or self.distro.id}")
        width = max((len(r.check) for r in self.results), default=8)
        for r in self.results:
            label = r.status.upper() if r.status != OK else "ok"
            lines.append(f"{label:<5} {r.check:<{width}}  {r.subject}: {r.message}")
            if r.fix:
                fix_lines = r.fix.splitlines()
                pad = " " * (6 + width + 2)
                lines.append(f"{pad}fix: {fix_lines[0]}")
                lines.extend(f"{pad}     {line}" for line in fix_lines[1:])
        checks = list(self.summary().values())
        lines.append(f"{len(checks)} checks: {checks.count(OK)} ok, {checks.count(WARN)} warn, "
                     f"{checks.count(FAIL)} fail")
        return "\n".join(lines) + "\n"
