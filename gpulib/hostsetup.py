"""`gpulib setup`: the doctor's fixes as a plan, then applied safely and idempotently.

The plan comes from the doctor's findings (one place decides what is wrong):
the typed actions of the `iommu`, `nouveau` and `sriov` checks, plus the GPUs
the operator asks to keep from the host for passthrough (`--passthrough`,
`[setup] passthrough`, planned by `gpulib.doctor.passthrough`, whose actions
are also the doctor's fix text), plus the steps an earlier apply did not
complete (setup's journal). Planning changes nothing.

A plan with a file setup refuses to edit (a value it cannot know) applies
nothing: its parts hang together (the vfio-pci ids in gpulib's modprobe file
lose to an administrator's later file unless the command line gives them too),
so no file is written, no command runs and the plan promises nothing for the
next boot.

Applying is a plan that survives a failed step. Every step is checked before
the first change (the file is not a symbolic link, not immutable, on a
writable file system, unchanged since the plan; the command is installed);
then files are edited (each with a timestamped backup; both keep the file's
owner, group and mode), the effective kernel command line is read back as
grub-mkconfig will read it, and the commands that make the boot entries and
every installed kernel's initramfs see the files run, each one's outcome
written to `var/lib/gpulib/setup.json` as it happens; the boot entries they
made are read back too. A step that failed or was never reached stays in the
journal and is planned again by the next run, and what was not read back is
read back again; what waits for a reboot is kept for the whole boot (a second
apply adds to it), so the doctor says "pending" rather than "broken" until
the host boots again. A run that failed promises no reboot.

What it reads of the host is the doctor's reading (`gpulib.bootstate`: the
next boot's command line, modprobe options and initramfs tool; the running
one's command line). It edits only what is gpulib's or made to be edited by
the administrator: /etc/default/grub, its own grub.d drop-in, EL's
/etc/kernel/cmdline, its own modprobe.d, modules-load.d and dracut.conf.d
files (keeping the lines an administrator added), driverctl's override files
of the devices it was asked for, initramfs-tools' module list; never another
package's drop-in.

Nothing is rebound or started while the host runs: every change takes effect
at the next boot, and the plan says, per device, how and how to see it.

Below a `GPULIB_ROOT` other than `/`, files are edited below that root and
commands are listed, not run.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from gpulib import bootconfig, logger
from gpulib.atomicfile import write_atomic
from gpulib.bootstate import KERNEL_CMDLINE
from gpulib.config import Config
from gpulib.context import SETUP_JOURNAL, Context
from gpulib.discovery import Gpu
from gpulib.doctor import (
    HOST_DISPLAY_DRIVERS,
    Doctor,
    Report,
    host_path,
)
from gpulib.doctor import passthrough as pt
from gpulib.doctor.actions import (
    KernelArgs,
    Manual,
    Reboot,
    RestartService,
    RunCommand,
    WriteFile,
)
from gpulib.errors import GpulibError, InputError, LockTimeout
from gpulib.lazyre import lazy
from gpulib.pci import PciAddress
from gpulib.sysfs import ReadFailure, Sysfs

if TYPE_CHECKING:
    from gpulib.doctor.actions import Action

log = logger.get(__name__)

SCHEMA = 1
JOURNAL_VERSION = 2
# The checks whose actions setup applies; `driver-binding` stands for --passthrough.
SETUP_CHECKS = ("iommu", "nouveau", "driver-binding", "sriov")
VFIO_CONF = pt.VFIO_CONF
HOST_NEEDED = pt.HOST_NEEDED
DRIVERCTL = pt.DRIVERCTL
SETUP_LOCK = "var/lib/gpulib/setup.lock"
_VENDOR_DEVICE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\Z")
# The failing command's own output shown: its last lines, enough for a hook's message.
OUTPUT_LINES = 20
NEXT_BOOT = "at the next boot"
NOT_APPLIED = "never: not applied while a file is refused"
# Linux inode flags (FS_IOC_GETFLAGS): a file the kernel will not let root replace.
_FS_IOC_GETFLAGS = 0x80086601
_FS_IMMUTABLE_FL = 0x10
_FS_APPEND_FL = 0x20


class SetupError(GpulibError):
    """A step of the plan failed (or would fail) while applying it."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


def _current_text(sysfs: Sysfs, rel: str) -> Optional[str]:
    """The text of a file setup may edit, None when there is none.

    SetupError when it is there but cannot be read (a FIFO, a directory, a
    file too large): setup never plans over what it cannot read, and never
    waits on it while applying (the reading layer's rules).
    """
    got = sysfs.read_result(rel)
    if isinstance(got, ReadFailure):
        if got.missing:
            return None
        raise SetupError(f"cannot read {host_path(rel)}: {got.reason}")
    return got.decode("utf-8", "replace")


@dataclass
class Step:
    """One change: a file edit (path, old, new) or a command (argv)."""

    check: str
    why: str
    path: Optional[str] = None  # root-relative
    old: Optional[str] = None  # None: the file does not exist yet
    new: Optional[str] = None
    mode: int = 0o644
    argv: Optional[tuple[str, ...]] = None
    done: str = ""  # after apply: "edited", "ran", "listed", or why it failed
    also: list[str] = field(default_factory=list)  # other checks this step serves
    effect: str = NEXT_BOOT  # when the host sees the change
    resumed: bool = False  # an earlier apply's step that did not complete

    @property
    def checks(self) -> list[str]:
        return [self.check, *self.also]

    @property
    def kind(self) -> str:
        return "edit" if self.path is not None else "command"

    @property
    def completed(self) -> bool:
        return self.done in ("edited", "created", "ran", "listed, not run")

    def diff(self) -> str:
        if self.path is None:
            return ""
        shown = host_path(self.path)
        return "".join(difflib.unified_diff(
            (self.old or "").splitlines(keepends=True), (self.new or "").splitlines(keepends=True),
            fromfile=shown if self.old is not None else "/dev/null", tofile=shown))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "check": self.check, "why": self.why,
                               "takes_effect": self.effect}
        if self.path is not None:
            doc.update(path=host_path(self.path), new_file=self.old is None, diff=self.diff())
        else:
            doc["argv"] = list(self.argv or ())
        if self.resumed:
            doc["resumed"] = True
        if self.done:
            doc["done"] = self.done
        return doc


@dataclass
class Refusal:
    """A GPU not taken from the host, or a file setup will not edit."""

    device: str
    why: str
    kind: str = "device"  # or "file"

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "device": self.device, "why": self.why}

    @property
    def shown(self) -> str:
        label = "not taken from the host" if self.kind == "device" else "not edited"
        return f"{label}: {self.device}: {self.why}"


@dataclass
class Expectation:
    """What the effective kernel command line must say once the files are edited, and
    the boot entries once they are made again (kept in the journal until it does)."""

    key: str
    add: list[str]
    remove: list[str]
    drop_ins: bool
    kernel_cmdline: bool = False  # EL's /etc/kernel/cmdline is read back too

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "add": self.add, "remove": self.remove,
                "drop_ins": self.drop_ins, "kernel_cmdline": self.kernel_cmdline}

    @classmethod
    def from_json(cls, doc: Any) -> Optional[Expectation]:
        if not isinstance(doc, dict):
            return None
        key, add, remove = doc.get("key"), doc.get("add"), doc.get("remove")
        if not isinstance(key, str) or not isinstance(add, list) or \
                not isinstance(remove, list):
            return None
        return cls(key, [str(a) for a in add], [str(r) for r in remove],
                   bool(doc.get("drop_ins")), bool(doc.get("kernel_cmdline")))


@dataclass
class Plan:
    root: str
    distro: str
    steps: list[Step] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    todo: list[str] = field(default_factory=list)  # what only the operator can do
    pending: list[str] = field(default_factory=list)  # check ids a reboot completes
    notes: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    expect: Optional[Expectation] = None
    verified: bool = False  # after apply: `expect` was read back from files and boot entries
    error: str = ""  # after a failed apply: the one-line reason
    error_output: str = ""  # the failing command's own output (its last lines)

    run_commands: Optional[bool] = None  # None: decided by the root

    @property
    def runs_commands(self) -> bool:
        """Commands run only on the real root; below another root they are listed."""
        if self.run_commands is not None:
            return self.run_commands
        return os.path.realpath(self.root) == "/"

    def add_todo(self, text: str) -> None:
        if text not in self.todo:
            self.todo.append(text)

    @property
    def blocked(self) -> list[Refusal]:
        """The files setup refused to edit: the plan's changes hang together (vfio-pci's
        ids in a modprobe file and on the command line, the initramfs that holds them),
        so while one is refused nothing is applied."""
        return [r for r in self.refusals if r.kind == "file"]

    def block(self) -> None:
        """A refused file: no step takes effect, no reboot is promised, and no GPU is
        said to leave the host."""
        if not self.blocked:
            return
        for step in self.steps:
            step.effect = NOT_APPLIED
        self.todo = [t for t in self.todo if t != "reboot the host"]
        self.notes = [n for n in self.notes if NEXT_BOOT not in n]
        shown = self.blocked[0].device
        self.notes.append(f"nothing is applied while {shown} is refused: no file is written, "
                          "no command is run, and nothing changes at the next boot; edit it "
                          "as said, then run gpulib setup again")

    def failed(self, error: SetupError) -> None:
        """After a failed apply: no reboot promised; the rest is planned again."""
        self.error, self.error_output = error.message, error.output
        self.todo = [t for t in self.todo if t != "reboot the host"]
        self.add_todo("fix what failed, then run gpulib setup --apply again (what did not "
                      "complete is planned again)")

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "root": self.root, "distribution": self.distro,
                "commands_run": self.runs_commands,
                "steps": [s.to_json() for s in self.steps],
                "refused": [r.to_json() for r in self.refusals],
                "still_to_do": self.todo, "pending_reboot": self.pending, "notes": self.notes,
                "backups": [host_path(b) for b in self.backups]}

    def text(self) -> str:
        out: list[str] = []
        where = "" if self.runs_commands else f" below {self.root}"
        out.append(f"gpulib setup on {self.distro or 'an unknown distribution'}{where}")
        if not self.runs_commands:
            out.append(f"GPULIB_ROOT is {self.root}: files are edited below it; commands are "
                       "listed, not run")
        if not self.steps:
            out.append("nothing to change")
        for n, step in enumerate(self.steps, 1):
            state = f" [{step.done}]" if step.done else ""
            when = f"; takes effect {step.effect}"
            again = "; not completed by an earlier run" if step.resumed else ""
            if step.path is not None:
                verb = "create" if step.old is None else "edit"
                out.append(f"{n}. {verb} {host_path(step.path)}{state}  ({step.check}: "
                           f"{step.why}{when})")
                out.extend("   " + line for line in step.diff().rstrip("\n").splitlines())
            else:
                shown = RunCommand(step.argv or ()).shown
                out.append(f"{n}. run: {shown}{state}  ({step.check}: {step.why}{when}"
                           f"{again})")
        out.extend(r.shown for r in self.refusals)
        out.extend(f"note: {n}" for n in self.notes)
        for b in self.backups:
            out.append(f"backup: {host_path(b)}")
        if self.todo:
            out.append("still to do by hand:")
            out.extend(f"  - {t}" for t in self.todo)
        return "\n".join(out) + "\n"


# -- planning -------------------------------------------------------------------------


def _parse_selector(word: str) -> tuple[Optional[PciAddress], Optional[tuple[int, int]]]:
    if _VENDOR_DEVICE.match(word):
        v, d = word.split(":")
        return None, (int(v, 16), int(d, 16))
    try:
        return PciAddress.parse(word), None
    except Exception:
        raise InputError(f"--passthrough {word!r}: neither a PCI address nor "
                         "vendor:device") from None


def _select(doctor: Doctor, words: list[str], from_config: list[str]
            ) -> tuple[list[Gpu], set[PciAddress]]:
    """The GPUs named, and those of them named by address; a name on the command line
    that matches none is bad input."""
    chosen: list[Gpu] = []
    by_address: set[PciAddress] = set()
    for word, strict in [(w, True) for w in words] + [(w, False) for w in from_config]:
        address, ids = _parse_selector(word)
        found = [g for g in doctor.inventory.gpus
                 if g.address == address or (g.fn.vendor_id, g.fn.device_id) == ids]
        if not found:
            if strict:
                raise InputError(f"--passthrough {word}: no such GPU on this host "
                                 "(see gpulib discover)")
            log.warning("[setup] passthrough %s: no such GPU on this host", word)
            continue
        if address is not None:
            by_address.add(address)
        chosen.extend(g for g in found if g not in chosen)
    return chosen, by_address


class Planner:
    def __init__(self, ctx: Context, config: Optional[Config] = None,
                 passthrough: tuple[str, ...] = (), include_boot_vga: bool = False,
                 only: Optional[list[str]] = None, include_vgpu: bool = False) -> None:
        self.ctx = ctx
        self.doctor = Doctor(ctx, config, lock_timeout=0.1)
        self.config = self.doctor.config
        self.passthrough = list(passthrough)
        self.include_boot_vga = include_boot_vga
        self.include_vgpu = include_vgpu
        self.only = only
        distro = self.doctor.distro
        self.plan = Plan(ctx.root.rstrip("/") or "/", distro.name or distro.id)
        self.add: list[str] = []
        self.remove: list[str] = []
        self.files: dict[str, Step] = {}
        self.commands: list[Step] = []
        self.reboot_for: list[str] = []  # checks whose changes wait for the next boot
        self.args_for: list[str] = []  # checks that change the kernel command line

    def wanted(self, check: str) -> bool:
        return not self.only or check in self.only

    def make(self) -> Plan:
        checks = [c for c in SETUP_CHECKS if c != "driver-binding" and self.wanted(c)]
        if not self.only:
            # not changed by setup, but part of what the operator must still do
            checks.append("libvirt")
        report = self.doctor.run(checks) if checks else Report([], self.doctor.distro)
        for result in report.results:
            if result.pending:
                self.plan.pending.append(result.check)
            for action in result.actions:
                self._take(result.check, result.message, action)
        if self.wanted("driver-binding"):
            self._binding()
        elif self.passthrough:
            raise InputError("--passthrough needs the driver-binding check (it was left out "
                             "with --check)")
        self._kernel_args()
        self._resume()
        plan = self.plan
        # Safe order: files first, then what makes the boot see them (boot entries, then
        # the initramfs), then the rest; nothing runs before every file is in place.
        plan.steps = list(self.files.values()) + sorted(
            self.commands, key=lambda s: _command_rank(s.argv or ()))
        plan.block()
        return plan

    # -- from the doctor's actions ------------------------------------------------------
    def _take(self, check: str, why: str, action: Action) -> None:
        if isinstance(action, KernelArgs):
            self.add += [a for a in action.add if a not in self.add]
            self.remove += [a for a in action.remove if a not in self.remove]
            self.args_for.append(check)
            self.reboot_for.append(check)
        elif isinstance(action, WriteFile):
            self._write(check, why, action)
        elif isinstance(action, RunCommand):
            self._command(check, why, action.argv)
        elif isinstance(action, Reboot):
            self.plan.add_todo("reboot the host")
            if check not in self.reboot_for:
                self.reboot_for.append(check)
        elif isinstance(action, RestartService):
            self.plan.add_todo(f"systemctl restart {action.name}" +
                               (f" {action.note}" if action.note else ""))
        elif isinstance(action, Manual):
            self.plan.add_todo(action.text.replace("\n", " "))

    def _write(self, check: str, why: str, action: WriteFile) -> None:
        try:
            old_text = _current_text(self.doctor.sysfs, action.path)
        except SetupError as exc:
            self.plan.refusals.append(Refusal(host_path(action.path), exc.message, "file"))
            return
        if old_text == action.content:
            return
        step = self.files.get(action.path)
        if step is not None:
            if check not in step.checks:
                step.also.append(check)
            return
        self.files[action.path] = Step(check, _short(why), path=action.path, old=old_text,
                                       new=action.content, mode=action.mode)

    def _command(self, check: str, why: str, argv: tuple[str, ...],
                 resumed: bool = False) -> None:
        why = _PURPOSE.get(os.path.basename(argv[0]) if argv else "", why)
        for step in self.commands:
            if step.argv == argv:
                if check not in step.checks:
                    step.also.append(check)
                step.resumed = step.resumed or resumed
                return
        # nothing acts at once: every command is for the next boot
        self.commands.append(Step(check, _short(why), argv=argv, effect=NEXT_BOOT,
                                  resumed=resumed))

    def _resume(self) -> None:
        """The commands an earlier apply did not complete (failed, or never reached):
        their files are in place, so nothing else would plan them again. What an
        earlier apply could not read back is read back again."""
        left = Expectation.from_json(self.doctor.journal.get("expect"))
        if left is not None and any(self.wanted(c) for c in self.args_for or ["iommu"]):
            self.plan.expect = _merged(left, self.plan.expect) if self.plan.expect else left
        for item in outstanding(self.doctor):
            checks = [c for c in item["checks"] if self.wanted(c)]
            for check in checks:
                self._command(check, item["why"], tuple(item["argv"]), resumed=True)
                if check not in self.reboot_for and _command_rank(tuple(item["argv"])) < 3:
                    self.reboot_for.append(check)
            if checks and _command_rank(tuple(item["argv"])) < 3:
                self.plan.add_todo("reboot the host")

    # -- passthrough ----------------------------------------------------------------------
    def _binding(self) -> None:
        configured = self.config.get("setup", "passthrough")
        from_config = [w for w in re.split(r"[\s,]+", configured.strip()) if w]
        chosen, by_address = _select(self.doctor, self.passthrough, from_config)
        for gpu in self.doctor.inventory.gpus:
            if gpu in chosen or gpu.fn.driver not in HOST_DISPLAY_DRIVERS:
                continue
            if pt.kept_for_passthrough(self.doctor, gpu):
                self.plan.notes.append(f"{gpu.address} is kept for passthrough from the next "
                                       "boot on (vfio-pci is configured for it)")
            elif not pt.vgpu_use(self.doctor, gpu):
                self.plan.notes.append(
                    f"{gpu.address} stays with the host (on {gpu.fn.driver}): setup takes "
                    "a GPU from the host only when named with --passthrough or in "
                    "[setup] passthrough")
        if not chosen:
            return
        found = pt.plan(self.doctor, chosen, by_address, self.include_boot_vga,
                        self.include_vgpu)
        for address, why in found.refusals:
            self.plan.refusals.append(Refusal(address, why))
        why = "keep " + ", ".join(str(a) for a in found.taken) + " from the host for passthrough"
        for action in found.actions:
            if isinstance(action, WriteFile) and action.path.startswith(pt.DRIVERCTL_DIR + "/"):
                device = action.path.rsplit("/pci-", 1)[-1]
                self._write("driver-binding", f"keep {device} for passthrough (per device: "
                            "its id is shared with a device the host keeps)", action)
            else:
                self._take("driver-binding", why, action)
        # Per device: when and how it leaves the host, and how to see that it did.
        for taken in found.taken:
            address = str(taken)
            self.plan.notes.append(
                f"{address}: nothing is rebound now; vfio-pci takes it at the next boot through "
                f"{found.how.get(taken, pt.BY_IDS)}; after the reboot, "
                f"readlink /sys/bus/pci/devices/{address}/driver ends in vfio-pci")
        kept = [g for g in chosen if g.console and g.address in found.taken]
        for gpu in kept:
            self.plan.notes.append(
                f"{gpu.address} is the boot VGA device: gpulib offers it to VMs whole only "
                "with [discovery] allow_boot_vga = yes in gpulib.conf")

    # -- the kernel command line ----------------------------------------------------------
    def _kernel_args(self) -> None:
        if not self.add and not self.remove:
            return
        doctor = self.doctor
        distro = doctor.distro
        drop_ins = doctor.next_boot.drop_ins
        key = distro.grub_key
        try:
            sources = bootconfig.read_sources(
                lambda rel: _current_text(doctor.sysfs, rel), doctor.sysfs.listdir, drop_ins)
            config = bootconfig.BootConfig(sources)
            configured = config.args()
            remove = [r for r in self.remove if r in configured]
            # An argument already there goes again after one it must supersede (an
            # intel_iommu=off another package's drop-in gives after it).
            again = [a for a in self.add if any(_same_name(a, r) for r in remove)]
            add = [a for a in self.add if a not in configured or a in again]
            # only /etc/default/grub and gpulib's own drop-in: the others are not gpulib's
            changes = bootconfig.owned_edit(sources, key, add, remove, drop_ins)
            texts = {s.rel: s.text for s in sources}
            kernel = doctor.next_boot.kernel_cmdline()
            if kernel is not None:
                # EL: the command line kernel-install gives kernels installed later
                text = _current_text(doctor.sysfs, KERNEL_CMDLINE) or ""
                new = edit_words(text, self.add, self.remove)
                if new != text:
                    changes[KERNEL_CMDLINE] = new
                    texts[KERNEL_CMDLINE] = text
        except SetupError as exc:
            self.plan.refusals.append(Refusal(host_path(bootconfig.DEFAULT_GRUB), exc.message,
                                              "file"))
            return
        except bootconfig.BootConfigError as exc:
            self.plan.refusals.append(Refusal(exc.path, exc.message, "file"))
            return
        checks = list(dict.fromkeys(self.args_for)) or ["iommu"]
        running = [r for r in self.remove if r in doctor.cmdline and r not in configured]
        if changes:
            places = [configured] + ([kernel] if kernel is not None else [])
            why = "kernel command line: " + " ".join(
                [f"+{a}" for a in self.add if any(a not in p for p in places)] +
                [f"-{r}" for r in self.remove if any(r in p for p in places)])
            for rel, new in changes.items():
                self.files[rel] = Step(checks[0], why, path=rel,
                                       old=texts[rel] if doctor.sysfs.exists(rel) else None,
                                       new=new, also=checks[1:])
            self.plan.expect = _merged(self.plan.expect, Expectation(
                key, list(self.add), [r for r in self.remove if r not in self.add], drop_ins,
                kernel is not None))
            target = config.where(key)
            if bootconfig.GPULIB_DROP_IN in changes and add and \
                    target != bootconfig.GPULIB_DROP_IN:
                self.plan.notes.append(
                    f"{host_path(target)} sets {key} after "
                    f"{host_path(bootconfig.DEFAULT_GRUB)} and is not gpulib's to edit: the "
                    f"arguments go to gpulib's own {host_path(bootconfig.GPULIB_DROP_IN)}, "
                    "which grub-mkconfig sources last")
        elif running and not distro.kernel_cmdline_file:
            self.plan.notes.append(f"{' '.join(running)} is on the running kernel command line "
                                   "but in none of the files grub-mkconfig reads: look in the "
                                   "boot loader's own files")
            return
        elif not running:
            return
        commands = distro.boot_config_commands(tuple(self.add), tuple(remove + running))
        for argv in commands:
            for check in checks:
                self._command(check, "make the boot entries use the new command line", argv)
        if not commands:
            self.plan.add_todo("regenerate the boot loader configuration from "
                               "/etc/default/grub (unknown distribution)")
        self.plan.add_todo("reboot the host")


def _same_name(a: str, b: str) -> bool:
    return a.partition("=")[0].replace("-", "_") == b.partition("=")[0].replace("-", "_")


def edit_words(text: str, add: list[str], remove: list[str]) -> str:
    """A one-line command line file (EL's /etc/kernel/cmdline) with `add` appended
    where missing and `remove` taken out; the rest as it was."""
    body = text.rstrip("\n")
    words = body.split()
    kept = [w for w in words if w not in remove]
    kept += [a for a in dict.fromkeys(add) if a not in kept]
    if kept == words:
        return text
    return " ".join(kept) + "\n"


def _merged(old: Optional[Expectation], new: Expectation) -> Expectation:
    """Two runs' (or two steps') expectations as one."""
    if old is None:
        return new
    add = list(dict.fromkeys(old.add + new.add))
    return Expectation(new.key, add, [r for r in dict.fromkeys(old.remove + new.remove)
                                      if r not in add], old.drop_ins or new.drop_ins,
                       old.kernel_cmdline or new.kernel_cmdline)


_PURPOSE = {
    "update-grub": "make the boot entries use the new kernel command line",
    "grub2-mkconfig": "make the boot entries use the new kernel command line",
    "grubby": "give every installed kernel's boot entry the new arguments",
    "update-initramfs": "every installed kernel's initramfs must hold the new files",
    "dracut": "every installed kernel's initramfs must hold the new files",
    "systemctl": "start the vendor's unit at every boot, from the next one on",
}


def _short(message: str) -> str:
    return message if len(message) <= 160 else message[:157] + "..."


def _command_rank(argv: tuple[str, ...]) -> int:
    name = os.path.basename(argv[0]) if argv else ""
    order = {"grubby": 0, "update-grub": 0, "grub2-mkconfig": 0, "update-initramfs": 1,
             "dracut": 1}
    return order.get(name, 3)


def make_plan(ctx: Context, config: Optional[Config] = None,
              passthrough: tuple[str, ...] = (), include_boot_vga: bool = False,
              only: Optional[list[str]] = None,
              include_vgpu: bool = False) -> tuple[Plan, list[str]]:
    """The plan, and the check ids whose changes take effect at the next boot."""
    planner = Planner(ctx, config, passthrough, include_boot_vga, only, include_vgpu)
    plan = planner.make()
    return plan, planner.reboot_for


# -- the journal ----------------------------------------------------------------------


def outstanding(doctor: Doctor) -> list[dict[str, Any]]:
    """The commands an earlier apply planned and did not complete (any boot)."""
    items = doctor.journal.get("outstanding")
    out = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("argv"), list) and item["argv"] \
                and all(isinstance(a, str) for a in item["argv"]) \
                and isinstance(item.get("checks"), list):
            out.append({"argv": item["argv"], "why": str(item.get("why", "")),
                        "checks": [str(c) for c in item["checks"]]})
    return out


class Journal:
    """setup.json: this boot's applies, what waits for the reboot, what is outstanding.

    Written before the first change (every step "planned") and after each step,
    so a run killed half-way leaves its unfinished steps for the next run.
    """

    def __init__(self, ctx: Context, plan: Plan, reboot_for: list[str], now: float) -> None:
        self.ctx = ctx
        self.plan = plan
        self.reboot_for = reboot_for
        self.now = now
        doctor = Doctor(ctx)
        old = doctor.journal
        self.boot_id = doctor.boot_id()
        self.btime = doctor.btime()
        same_boot = bool(old) and (old.get("boot_id") == self.boot_id if self.boot_id else
                                   old.get("btime") == self.btime)
        pending = old.get("pending_reboot") if same_boot else None
        self.pending: list[str] = [str(c) for c in pending] if isinstance(pending, list) else []
        applied = old.get("applied_at")
        self.applied_at = applied if same_boot and self.pending and \
            isinstance(applied, (int, float)) else now
        runs = old.get("runs") if same_boot else None
        self.runs: list[Any] = list(runs)[-9:] if isinstance(runs, list) else []
        backups = old.get("backups") if same_boot else None
        self.backups: list[str] = [str(b) for b in backups] if isinstance(backups, list) else []
        self.outstanding = [o for o in outstanding(doctor)
                            if not any(s.argv == tuple(o["argv"]) for s in plan.steps)]

    def write(self, final: bool = False, failed: bool = False) -> None:
        steps = self.plan.steps
        run = {"at": self.now, "steps": [dict(s.to_json(), outcome=s.done or
                                              ("not reached" if final else "planned"))
                                         for s in steps]}
        pending = list(self.pending)
        # A run that failed promises no reboot: what it did waits for the rest.
        if final and not failed:
            for check in dict.fromkeys(self.reboot_for):
                mine = [s for s in steps if check in s.checks]
                if mine and all(s.completed for s in mine) and check not in pending:
                    pending.append(check)
        left = list(self.outstanding)
        for s in steps:
            if s.argv is not None and not s.completed:
                left.append({"argv": list(s.argv), "checks": s.checks, "why": s.why})
        # What the command line must say, until a run has read it back: the next
        # run reads it back again, whatever else it plans.
        expect = self.plan.expect
        doc = {"version": JOURNAL_VERSION, "applied_at": self.applied_at,
               "boot_id": self.boot_id, "btime": self.btime, "pending_reboot": pending,
               "outstanding": left, "steps": run["steps"],
               "expect": expect.to_json() if expect is not None and
               not self.plan.verified else None,
               "backups": self.backups + [host_path(b) for b in self.plan.backups
                                          if host_path(b) not in self.backups],
               "runs": [*self.runs, run]}
        path = self.ctx.path(SETUP_JOURNAL)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, (json.dumps(doc, indent=2) + "\n").encode("utf-8"), 0o600)
        if final:
            self.plan.pending = list(dict.fromkeys(self.plan.pending + pending))


# -- applying -------------------------------------------------------------------------


def _backup(ctx: Context, rel: str, stamp: str) -> str:
    """A copy of the file beside it, with its owner, group and mode."""
    base = f"{rel}.gpulib-{stamp}.bak"
    candidate, n = base, 1
    while os.path.lexists(ctx.path(candidate)):
        candidate = f"{base}.{n}"
        n += 1
    st = os.stat(ctx.path(rel))
    with open(ctx.path(rel), "rb") as fh:
        data = fh.read()
    write_atomic(ctx.path(candidate), data, st.st_mode & 0o7777, owner=(st.st_uid, st.st_gid))
    return candidate


def _existing_dir(path: str) -> str:
    directory = os.path.dirname(path)
    while directory and not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    return directory or "/"


def _inode_flags(path: str) -> int:
    import fcntl
    import struct

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        got = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("l", 0))
        return int(struct.unpack("l", got)[0])
    except OSError:
        return 0  # a file system without inode flags
    finally:
        os.close(fd)


def _file_problem(ctx: Context, step: Step) -> str:
    rel = step.path or ""
    path = ctx.path(rel)
    shown = host_path(rel)
    if os.path.islink(path):
        return f"{shown} is a symbolic link (to {os.readlink(path)}): edit its target by hand"
    try:
        now_text = _current_text(ctx.sysfs, rel)
    except SetupError as exc:
        return exc.message
    if now_text != step.old:
        return f"{shown} changed since the plan was made: run gpulib setup again"
    directory = _existing_dir(path)
    for target in ([path] if step.old is not None else []) + [directory]:
        flags = _inode_flags(target)
        if flags & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
            what = "immutable" if flags & _FS_IMMUTABLE_FL else "append-only"
            return (f"{host_path(os.path.relpath(target, ctx.path('')))} is {what} (chattr): "
                    "remove the flag with chattr -i, or edit it by hand")
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return f"{shown} is on a read-only file system"
    except OSError:
        pass
    if not os.access(directory, os.W_OK):
        return f"{shown}: its directory is not writable"
    return ""


def _command_problem(step: Step) -> str:
    argv = step.argv or ()
    if not argv:
        return "an empty command"
    if shutil.which(argv[0]) is None:
        return f"{argv[0]} is not installed (not found on PATH)"
    return ""


def validate(ctx: Context, plan: Plan) -> None:
    """Every step checked before the first change: SetupError naming what would fail."""
    if plan.blocked:
        raise SetupError(f"nothing was changed: {plan.blocked[0].shown}")
    problems: list[str] = []
    for step in plan.steps:
        if step.path is not None:
            why = _file_problem(ctx, step)
        elif plan.runs_commands:
            why = _command_problem(step)
        else:
            why = ""
        if why:
            step.done = "refused: " + why
            problems.append(why)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SetupError(f"nothing was changed: {problems[0]}{more}")


def apply(ctx: Context, plan: Plan, reboot_for: list[str],
          now: Optional[float] = None) -> None:
    """Apply the plan's steps in order; stop at the first failure (SetupError).

    Two setups at once would interleave their edits: the second gets LockTimeout.
    """
    import fcntl

    if plan.blocked:  # before the lock file too: nothing at all is written
        exc = SetupError(f"nothing was changed: {plan.blocked[0].shown}")
        plan.failed(exc)
        raise exc
    path = ctx.path(SETUP_LOCK)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockTimeout(f"another gpulib setup is applying ({host_path(SETUP_LOCK)} is "
                              "locked)") from None
        try:
            _apply(ctx, plan, reboot_for, now)
        except SetupError as exc:
            plan.failed(exc)
            raise
    finally:
        os.close(fd)


def _apply(ctx: Context, plan: Plan, reboot_for: list[str], now: Optional[float]) -> None:
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    validate(ctx, plan)
    journal = Journal(ctx, plan, reboot_for, now)
    journal.write()
    failed = True
    try:
        edits = [s for s in plan.steps if s.path is not None]
        for step in edits:
            _edit(ctx, plan, step, stamp)
            journal.write()
        if plan.expect is not None:
            _verify(ctx, plan)
        for step in plan.steps:
            if step.path is None:
                _run(plan, step)
                if plan.expect is not None and _command_rank(step.argv or ()) == 0:
                    _verify_entries(ctx, plan, step)
                journal.write()
        plan.verified = plan.expect is not None
        failed = False
    finally:
        journal.write(final=True, failed=failed)


def _edit(ctx: Context, plan: Plan, step: Step, stamp: str) -> None:
    rel = step.path or ""
    path = ctx.path(rel)
    try:
        if step.old is not None:
            st = os.stat(path)
            mode, owner = st.st_mode & 0o7777, (st.st_uid, st.st_gid)
            plan.backups.append(_backup(ctx, rel, stamp))
        else:
            mode, owner = step.mode, None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, (step.new or "").encode("utf-8"), mode, owner=owner)
    except OSError as exc:
        step.done = f"failed: {exc.strerror or exc}"
        raise SetupError(f"cannot write {host_path(rel)}: "
                         f"{exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))}"
                         ) from None
    step.done = "edited" if step.old is not None else "created"


def _verify(ctx: Context, plan: Plan) -> None:
    """The command line grub-mkconfig will see, read back from the edited files."""
    want = plan.expect
    assert want is not None
    sources = bootconfig.read_sources(bootconfig.text_reader(ctx.sysfs.read_bytes),
                                      ctx.sysfs.listdir, want.drop_ins)
    try:
        args = bootconfig.BootConfig(sources).words()
    except bootconfig.BootConfigError as exc:
        raise SetupError(f"after the edit: {exc.message}") from None
    if plan.runs_commands and want.drop_ins:
        args = _shell_args() or args
    what = _unlike(want, args)
    if what:
        raise SetupError(f"after the edit the kernel command line grub-mkconfig reads {what}: "
                         "the boot entries were not regenerated; see the files named above")
    if want.kernel_cmdline:
        what = _unlike(want, (ctx.sysfs.read(KERNEL_CMDLINE) or "").split())
        if what:
            raise SetupError(f"after the edit /{KERNEL_CMDLINE} {what}: kernels installed "
                             "later would boot without the change")


def _unlike(want: Expectation, args: list[str]) -> str:
    """How `args` differ from what `want` asks ("" when they do not)."""
    missing = [a for a in want.add if a not in args]
    left = [r for r in want.remove if r in args and not bootconfig.superseded(r, args,
                                                                              want.add)]
    return ", ".join([f"lacks {' '.join(missing)}"] * bool(missing) +
                     [f"still has {' '.join(left)}"] * bool(left))


def _verify_entries(ctx: Context, plan: Plan, step: Step) -> None:
    """The boot entries the command just made, read back: each normal entry's command
    line must say what `plan.expect` asks. A step whose entries do not is failed, so
    the next run plans it again and reads them back again."""
    want = plan.expect
    if want is None or not plan.runs_commands:
        return
    for where, args in boot_entries(ctx.sysfs):
        what = _unlike(want, args)
        if what:
            shown = RunCommand(step.argv or ()).shown
            step.done = f"failed: {where} {what}"
            raise SetupError(f"after {shown} the boot entry in {where} {what}: the next boot "
                             "would not have the change (is another boot loader configuration "
                             "in use?); run gpulib setup --apply again once that is fixed")


GRUB_CFGS = ("boot/grub/grub.cfg", "boot/grub2/grub.cfg")
BLS_ENTRIES = "boot/loader/entries"
_LINUX_LINE = lazy(r"^\s*linux(?:efi|16)?\s+\S*vmlinuz\S*\s*(.*)$", re.M)


def boot_entries(sysfs: Sysfs) -> list[tuple[str, list[str]]]:
    """The command line of each normal boot entry as generated (recovery entries
    aside): grub.cfg's linux lines, or EL's BLS entries' options."""
    out: list[tuple[str, list[str]]] = []
    for rel in GRUB_CFGS:
        text = sysfs.read(rel)
        if text is None:
            continue
        for m in _LINUX_LINE.finditer(text):
            args = m.group(1).split()
            if "single" not in args and "$kernelopts" not in args:
                out.append((host_path(rel), args))
    for name in sorted(sysfs.listdir(BLS_ENTRIES)):
        if not name.endswith(".conf"):
            continue
        text = sysfs.read(f"{BLS_ENTRIES}/{name}") or ""
        for line in text.splitlines():
            key, _, value = line.strip().partition(" ")
            if key == "options" and "$" not in value:
                out.append((host_path(f"{BLS_ENTRIES}/{name}"), value.split()))
    return out


_SOURCE_LIKE_GRUB_MKCONFIG = (
    'if test -f /etc/default/grub; then . /etc/default/grub; fi; '
    'for x in /etc/default/grub.d/*.cfg; do if [ -e "$x" ]; then . "$x"; fi; done; '
    'printf "%s\\n%s\\n" "$GRUB_CMDLINE_LINUX" "$GRUB_CMDLINE_LINUX_DEFAULT"')


def _shell_args() -> list[str]:
    """On the real host: the files sourced by the shell, as grub-mkconfig does."""
    try:
        proc = subprocess.run(["sh", "-c", _SOURCE_LIKE_GRUB_MKCONFIG], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    return proc.stdout.split()  # in order, repeats kept: the last of a name counts


def _run(plan: Plan, step: Step) -> None:
    if not plan.runs_commands:
        step.done = "listed, not run"
        return
    argv = list(step.argv or ())
    shown = RunCommand(tuple(argv)).shown
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace",
                              check=False)
    except OSError as exc:
        step.done = f"failed: {exc.strerror}"
        raise SetupError(f"{shown}: {exc.strerror}") from None
    if proc.returncode != 0:
        step.done = f"failed (exit {proc.returncode})"
        lines = (proc.stdout or "").rstrip().splitlines()
        raise SetupError(f"{shown} failed with exit {proc.returncode}",
                         "\n".join(lines[-OUTPUT_LINES:]))
    step.done = "ran"
