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
from gpulib.context import (
    Context,
)
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


class Distro(Slotted):
    """The distribution from `etc/os-release`, for the commands in fixes."""

    __slots__ = ("id", "id_like", "name")
    _fields = ("id", "id_like", "name")

    def __init__(self, id: str = "", id_like: Optional[list[str]] = None,
                 name: str = "") -> None:
        self.id = id
        self.id_like: list[str] = [] if id_like is None else id_like
        self.name = name

    @classmethod
    def read(cls, ctx: Context) -> Distro:
        text = ctx.sysfs.read(OS_RELEASE) or ctx.sysfs.read("usr/lib/os-release") or ""
        values: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key and not key.startswith("#"):
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                values[key] = value
        return cls(values.get("ID", "").lower(), values.get("ID_LIKE", "").lower().split(),
                   values.get("PRETTY_NAME", values.get("NAME", "")))

    @property
    def family(self) -> str:
        """debian, rhel, suse or unknown."""
        ids = [self.id, *self.id_like]
        if any(i in ("debian", "ubuntu") for i in ids):
            return "debian"
        if any(i in ("rhel", "fedora", "centos", "rocky", "almalinux", "ol") for i in ids):
            return "rhel"
        if any("suse" in i for i in ids):
            return "suse"
        return "unknown"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id or None, "id_like": self.id_like, "name": self.name or None,
                "family": self.family}

    # -- commands for fixes -------------------------------------------------------------
    def kernel_args_fix(self, add: str = "", remove: str = "",
                        where: str = "/etc/default/grub") -> str:
        """How to change the kernel command line for good, on this distribution
        (the variable and file gpulib setup edits: `where` is the file the
        effective value comes from)."""
        key = self.grub_key
        if remove and add:
            edit = f'replace "{remove}" with "{add}" in {key}'
        elif remove:
            edit = f'remove "{remove}" from {key}'
        else:
            edit = f'add "{add}" to {key}'
        edit += f" in {where}"
        family = self.family
        if family == "debian":
            return f"{edit}, then: update-grub && reboot"
        if family == "rhel":
            args = (f' --remove-args="{remove}"' if remove else "") + \
                (f' --args="{add}"' if add else "")
            return (f"grubby --update-kernel=ALL{args} && reboot\n"
                    f"(or {edit}, then: grub2-mkconfig -o /boot/grub2/grub.cfg && reboot)")
        if family == "suse":
            return f"{edit}, then: grub2-mkconfig -o /boot/grub2/grub.cfg && reboot"
        return (f"{edit}, then: update-grub (Debian/Ubuntu) or "
                "grub2-mkconfig -o /boot/grub2/grub.cfg (RHEL/Fedora/SUSE), and reboot")

    def _by_family(self, debian: str, rhel: str, either: str) -> str:
        if self.family == "debian":
            return debian
        if self.family in ("rhel", "suse"):
            return rhel
        return either

    def grub_update(self) -> str:
        return self._by_family("update-grub", "grub2-mkconfig -o /boot/grub2/grub.cfg",
                               "update-grub or grub2-mkconfig -o /boot/grub2/grub.cfg")

    # -- commands for gpulib setup (argv, run without a shell) --------------------------
    @property
    def grub_key(self) -> str:
        """The /etc/default/grub variable setup edits: Debian's is for normal boots only."""
        return "GRUB_CMDLINE_LINUX_DEFAULT" if self.family == "debian" else "GRUB_CMDLINE_LINUX"

    def boot_config_commands(self, add: tuple[str, ...] = (),
                             remove: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        """What makes an edited /etc/default/grub reach the boot entries ([] if unknown)."""
        if self.family == "debian":
            return [("update-grub",)]
        if self.family == "rhel":
            # BLS entries keep their own options: grubby edits every installed kernel's,
            # /etc/default/grub is for kernels installed later.
            argv = ["grubby", "--update-kernel=ALL"]
            if add:
                argv.append(f"--args={' '.join(add)}")
            if remove:
                argv.append(f"--remove-args={' '.join(remove)}")
            return [tuple(argv)]
        if self.family == "suse":
            return [("grub2-mkconfig", "-o", "/boot/grub2/grub.cfg")]
        return []



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
