"""`gpulib setup`: the doctor's fixes as a plan, then applied safely and idempotently.

The plan comes from the doctor's findings (one place decides what is wrong):
the typed actions of the `iommu`, `nouveau` and `sriov` checks, plus the GPUs
the operator asks to keep from the host for passthrough (`--passthrough`,
`[setup] passthrough`). Planning changes nothing. Applying edits files first
(each with a timestamped backup), then runs the commands that make the boot
configuration and the initramfs see them, then records in
`var/lib/gpulib/setup.json` what waits for a reboot, so the doctor can say
"pending" rather than "broken" until the host boots again.

A GPU is never taken from the host unasked: only named devices, never the
boot VGA device without `--include-boot-vga`, never a device whose IOMMU group
holds storage or network the host needs, and never by vendor:device id when
that id would also take a device nobody named.

Below a `GPULIB_ROOT` other than `/`, files are edited below that root and
commands are listed, not run.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from gpulib import bootconfig
from gpulib.atomicfile import write_atomic
from gpulib.config import Config
from gpulib.context import MODPROBE_DIR, Context
from gpulib.discovery import BRIDGE_BASE_CLASS, Gpu
from gpulib.doctor import (
    HOST_DISPLAY_DRIVERS,
    SETUP_JOURNAL,
    Doctor,
    Report,
    host_path,
    is_free_for_vfio,
    is_vfio_driver,
)
from gpulib.doctor.actions import (
    Action,
    KernelArgs,
    Manual,
    Reboot,
    RestartService,
    RunCommand,
    WriteFile,
)
from gpulib.errors import GpulibError, InputError, LockTimeout
from gpulib.pci import PCI_DEVICES, PciAddress, PciFunction
from gpulib.sysfs import ReadFailure, Sysfs

log = logging.getLogger(__name__)

SCHEMA = 1
# The checks whose actions setup applies; `driver-binding` stands for --passthrough.
SETUP_CHECKS = ("iommu", "nouveau", "driver-binding", "sriov")
VFIO_CONF = MODPROBE_DIR + "/gpulib-vfio.conf"
# PCI base classes the host cannot lose with a GPU's IOMMU group.
HOST_NEEDED = {0x01: "storage", 0x02: "network"}
DRIVERCTL = ("usr/sbin/driverctl", "usr/bin/driverctl", "sbin/driverctl")
_VENDOR_DEVICE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\Z")


class SetupError(GpulibError):
    """A step of the plan failed while applying it."""


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

    @property
    def checks(self) -> list[str]:
        return [self.check, *self.also]

    @property
    def kind(self) -> str:
        return "edit" if self.path is not None else "command"

    def diff(self) -> str:
        if self.path is None:
            return ""
        shown = host_path(self.path)
        return "".join(difflib.unified_diff(
            (self.old or "").splitlines(keepends=True), (self.new or "").splitlines(keepends=True),
            fromfile=shown if self.old is not None else "/dev/null", tofile=shown))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "check": self.check, "why": self.why}
        if self.path is not None:
            doc.update(path=host_path(self.path), new_file=self.old is None, diff=self.diff())
        else:
            doc["argv"] = list(self.argv or ())
        if self.done:
            doc["done"] = self.done
        return doc


@dataclass
class Refusal:
    device: str
    why: str

    def to_json(self) -> dict[str, str]:
        return {"device": self.device, "why": self.why}


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
            if step.path is not None:
                verb = "create" if step.old is None else "edit"
                out.append(f"{n}. {verb} {host_path(step.path)}{state}  ({step.check}: "
                           f"{step.why})")
                out.extend("   " + line for line in step.diff().rstrip("\n").splitlines())
            else:
                shown = RunCommand(step.argv or ()).shown
                out.append(f"{n}. run: {shown}{state}  ({step.check}: {step.why})")
        for r in self.refusals:
            out.append(f"not taken from the host: {r.device}: {r.why}")
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


def _select(doctor: Doctor, words: list[str], from_config: list[str]) -> list[Gpu]:
    """The GPUs named; a name on the command line that matches none is bad input."""
    chosen: list[Gpu] = []
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
        chosen.extend(g for g in found if g not in chosen)
    return chosen


def _all_functions(doctor: Doctor) -> list[PciFunction]:
    out = []
    for name in sorted(doctor.sysfs.listdir(PCI_DEVICES.rstrip("/"))):
        try:
            fn = PciFunction.read_ids(doctor.sysfs, PciAddress.parse(name))
        except Exception:
            continue
        fn.driver = doctor.sysfs.link_name(f"{PCI_DEVICES}{name}/driver")
        out.append(fn)
    return out


def _ids(fn: PciFunction) -> str:
    return f"{fn.vendor_id:04x}:{fn.device_id:04x}"


class Planner:
    def __init__(self, ctx: Context, config: Optional[Config] = None,
                 passthrough: tuple[str, ...] = (), include_boot_vga: bool = False,
                 only: Optional[list[str]] = None) -> None:
        self.ctx = ctx
        self.doctor = Doctor(ctx, config, lock_timeout=0.1)
        self.config = self.doctor.config
        self.passthrough = list(passthrough)
        self.include_boot_vga = include_boot_vga
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
            configured = self.config.get("setup", "passthrough")
            from_config = [w for w in re.split(r"[\s,]+", configured.strip()) if w]
            chosen = _select(self.doctor, self.passthrough, from_config)
            for gpu in self.doctor.inventory.gpus:
                if gpu not in chosen and not self.doctor.is_vgpu_gpu(gpu) and \
                        gpu.fn.driver in HOST_DISPLAY_DRIVERS:
                    self.plan.notes.append(
                        f"{gpu.address} stays with the host (on {gpu.fn.driver}): setup takes "
                        "a GPU from the host only when named with --passthrough or in "
                        "[setup] passthrough")
            self._passthrough(chosen)
        elif self.passthrough:
            raise InputError("--passthrough needs the driver-binding check (it was left out "
                             "with --check)")
        self._kernel_args()
        plan = self.plan
        # Safe order: files first, then what makes the boot see them (boot entries, then
        # the initramfs), then the rest; nothing runs before every file is in place.
        plan.steps = list(self.files.values()) + sorted(
            self.commands, key=lambda s: _command_rank(s.argv or ()))
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
            self.plan.refusals.append(Refusal(host_path(action.path), exc.message))
            return
        if old_text == action.content:
            return
        self.files[action.path] = Step(check, _short(why), path=action.path, old=old_text,
                                       new=action.content, mode=action.mode)

    def _command(self, check: str, why: str, argv: tuple[str, ...]) -> None:
        why = _PURPOSE.get(os.path.basename(argv[0]) if argv else "", why)
        for step in self.commands:
            if step.argv == argv:
                if check not in step.checks:
                    step.also.append(check)
                return
        self.commands.append(Step(check, _short(why), argv=argv))

    # -- the kernel command line ----------------------------------------------------------
    def _kernel_args(self) -> None:
        if not self.add and not self.remove:
            return
        distro = self.doctor.distro
        try:
            old = _current_text(self.doctor.sysfs, bootconfig.DEFAULT_GRUB)
        except SetupError as exc:
            self.plan.refusals.append(Refusal(host_path(bootconfig.DEFAULT_GRUB), exc.message))
            return
        text = old if old is not None else ""
        try:
            configured = bootconfig.configured_args(text)
            add = [a for a in self.add if a not in configured]
            remove = [r for r in self.remove if r in configured]
            new = bootconfig.edit_cmdline(text, distro.grub_key, add, remove)
            for key in bootconfig.CMDLINE_KEYS:
                if key != distro.grub_key:  # an argument to remove may sit in either
                    new = bootconfig.edit_cmdline(new, key, (), remove)
        except bootconfig.BootConfigError as exc:
            self.plan.refusals.append(Refusal(host_path(bootconfig.DEFAULT_GRUB), exc.message))
            return
        for name in sorted(self.doctor.sysfs.listdir("etc/default/grub.d")):
            other = self.doctor.sysfs.read(f"etc/default/grub.d/{name}") or ""
            if name.endswith(".cfg") and re.search(rf"^\s*{distro.grub_key}=", other, re.M):
                self.plan.notes.append(
                    f"/etc/default/grub.d/{name} sets {distro.grub_key} too and is read after "
                    "/etc/default/grub: check that it keeps the arguments")
        checks = list(dict.fromkeys(self.args_for)) or ["iommu"]
        running = [r for r in self.remove if r in self.doctor.cmdline and r not in configured]
        if new != text:
            why = "kernel command line: " + " ".join(
                [f"+{a}" for a in add] + [f"-{r}" for r in remove])
            self.files[bootconfig.DEFAULT_GRUB] = Step(
                checks[0], why, path=bootconfig.DEFAULT_GRUB,
                old=old, new=new, also=checks[1:])
        elif running and distro.family != "rhel":
            self.plan.notes.append(f"{' '.join(running)} is on the running kernel command line "
                                   f"but not in {host_path(bootconfig.DEFAULT_GRUB)}: look in "
                                   "/etc/default/grub.d/ and the boot loader's own files")
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

    # -- passthrough ----------------------------------------------------------------------
    def _refuse(self, gpu: Gpu, why: str) -> None:
        self.plan.refusals.append(Refusal(str(gpu.address), why))

    def _passthrough(self, gpus: list[Gpu]) -> None:
        if not gpus:
            return
        doctor = self.doctor
        functions = _all_functions(doctor)
        named = {g.address for g in gpus}
        take: list[PciFunction] = []
        per_device: list[PciFunction] = []
        driverctl = next((p for p in DRIVERCTL if doctor.sysfs.exists(p)), None)
        for gpu in gpus:
            rel = f"{PCI_DEVICES}{gpu.address}"
            if doctor.sysfs.read(f"{rel}/boot_vga") == "1" and not self.include_boot_vga:
                self._refuse(gpu, "it is the boot VGA device (the host's console); name it "
                                  "with --include-boot-vga as well to take it")
                continue
            if gpu.fn.iommu_group is None:
                self._refuse(gpu, "it has no IOMMU group (enable the IOMMU first, then run "
                                  "gpulib setup again after the reboot)")
                continue
            members = [PciFunction.read_ids(doctor.sysfs, m) for m in gpu.group_members
                       if m != gpu.address]
            for fn in members:
                fn.driver = doctor.sysfs.link_name(f"{PCI_DEVICES}{fn.address}/driver")
            members = [fn for fn in members if fn.class_code >> 8 != BRIDGE_BASE_CLASS]
            needed = [f"{fn.address} ({HOST_NEEDED[fn.class_code >> 8]})" for fn in members
                      if fn.class_code >> 8 in HOST_NEEDED]
            if needed:
                self._refuse(gpu, f"its IOMMU group {gpu.fn.iommu_group} also holds "
                                  f"{', '.join(needed)}, which the host needs: the whole group "
                                  "would go to the VM")
                continue
            gpu_fn = PciFunction.read_ids(doctor.sysfs, gpu.address)
            gpu_fn.driver = gpu.fn.driver
            group = [gpu_fn, *members]
            ids = {_ids(fn) for fn in group}
            mine = {fn.address for fn in group} | named
            others = [fn for fn in functions if _ids(fn) in ids and fn.address not in mine
                      and not is_free_for_vfio(fn.driver)]
            if others:
                shown = ", ".join(f"{fn.address} ({_ids(fn)})" for fn in others)
                if driverctl is None:
                    self._refuse(gpu, f"vfio-pci.ids= binds by vendor:device and would also "
                                      f"take {shown} from the host; install driverctl to bind "
                                      "per device")
                    continue
                per_device.extend(group)
            else:
                take.extend(group)
        for fn in per_device:
            if not is_vfio_driver(fn.driver):
                self._command("driver-binding", f"keep {fn.address} for passthrough (per "
                              "device: its id is shared with a device the host keeps)",
                              ("driverctl", "set-override", str(fn.address), "vfio-pci"))
        if take:
            self._vfio_ids(take)

    def _vfio_ids(self, take: list[PciFunction]) -> None:
        ids: list[str] = []
        drivers: list[str] = []
        for fn in take:
            if _ids(fn) not in ids:
                ids.append(_ids(fn))
            if fn.driver and not is_free_for_vfio(fn.driver) and fn.driver not in drivers:
                drivers.append(fn.driver)
        # What earlier runs configured stays: the union, in a stable order.
        existing_arg = [a for a in self.doctor.configured_args if a.startswith("vfio-pci.ids=")]
        old_ids = [i for a in existing_arg for i in a.split("=", 1)[1].split(",") if i]
        conf = self.doctor.sysfs.read(VFIO_CONF) or ""
        for m in re.finditer(r"^options\s+vfio[-_]pci\s+ids=(\S+)", conf, re.M):
            old_ids += [i for i in m.group(1).split(",") if i]
        old_drivers = re.findall(r"^softdep\s+(\S+)\s+pre:\s+vfio-pci", conf, re.M)
        all_ids = list(dict.fromkeys(old_ids + ids))
        all_drivers = list(dict.fromkeys(old_drivers + drivers))
        arg = "vfio-pci.ids=" + ",".join(all_ids)
        why = f"keep {', '.join(str(fn.address) for fn in take)} from the host for passthrough"
        changed = False
        if arg not in existing_arg:
            self.remove += [a for a in existing_arg if a not in self.remove]
            self.add.append(arg)
            self.args_for.append("driver-binding")
            self.reboot_for.append("driver-binding")
            changed = True
        content = ("# gpulib setup: these devices go to virtual machines, not to the host\n"
                   f"options vfio-pci ids={','.join(all_ids)}\n" +
                   "".join(f"softdep {d} pre: vfio-pci\n" for d in all_drivers))
        before = len(self.files)
        self._write("driver-binding", why, WriteFile(VFIO_CONF, content))
        if len(self.files) != before or changed:
            argv = self.doctor.distro.initramfs_argv()
            if argv:
                self._command("driver-binding", "the initramfs must load vfio-pci first", argv)
            self.plan.add_todo("reboot the host")
            if "driver-binding" not in self.reboot_for:
                self.reboot_for.append("driver-binding")


_PURPOSE = {
    "update-grub": "make the boot entries use /etc/default/grub's command line",
    "grub2-mkconfig": "make the boot entries use /etc/default/grub's command line",
    "grubby": "give every installed kernel's boot entry the new arguments",
    "update-initramfs": "the initramfs must hold the new modprobe.d files",
    "dracut": "the initramfs must hold the new modprobe.d files",
}


def _short(message: str) -> str:
    return message if len(message) <= 160 else message[:157] + "..."


def _command_rank(argv: tuple[str, ...]) -> int:
    name = os.path.basename(argv[0]) if argv else ""
    order = {"grubby": 0, "update-grub": 0, "grub2-mkconfig": 0, "update-initramfs": 1,
             "dracut": 1, "driverctl": 2}
    return order.get(name, 3)


def make_plan(ctx: Context, config: Optional[Config] = None,
              passthrough: tuple[str, ...] = (), include_boot_vga: bool = False,
              only: Optional[list[str]] = None) -> tuple[Plan, list[str]]:
    """The plan, and the check ids whose changes take effect at the next boot."""
    planner = Planner(ctx, config, passthrough, include_boot_vga, only)
    plan = planner.make()
    return plan, planner.reboot_for


# -- applying -------------------------------------------------------------------------


def _backup(ctx: Context, rel: str, stamp: str) -> str:
    base = f"{rel}.gpulib-{stamp}.bak"
    candidate, n = base, 1
    while os.path.lexists(ctx.path(candidate)):
        candidate = f"{base}.{n}"
        n += 1
    shutil.copy2(ctx.path(rel), ctx.path(candidate))
    return candidate


SETUP_LOCK = "var/lib/gpulib/setup.lock"


def apply(ctx: Context, plan: Plan, reboot_for: list[str],
          now: Optional[float] = None) -> None:
    """Apply the plan's steps in order; stop at the first failure (SetupError).

    Two setups at once would interleave their edits: the second gets LockTimeout.
    """
    import fcntl

    path = ctx.path(SETUP_LOCK)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockTimeout(f"another gpulib setup is applying ({host_path(SETUP_LOCK)} is "
                              "locked)") from None
        _apply(ctx, plan, reboot_for, now)
    finally:
        os.close(fd)


def _apply(ctx: Context, plan: Plan, reboot_for: list[str], now: Optional[float]) -> None:
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    applied: list[Step] = []
    try:
        for step in plan.steps:
            if step.path is not None:
                path = ctx.path(step.path)
                if os.path.islink(path):
                    raise SetupError(f"{host_path(step.path)} is a symbolic link: edit its "
                                     "target by hand")
                try:
                    now_text = _current_text(ctx.sysfs, step.path)
                except SetupError:
                    step.done = "cannot read"
                    raise
                if now_text != step.old:
                    # someone edited it while the plan waited for the operator's yes
                    step.done = "changed since the plan"
                    raise SetupError(f"{host_path(step.path)} changed since the plan was made: "
                                     "run gpulib setup again")
                mode = step.mode
                if step.old is not None:
                    mode = os.stat(path).st_mode & 0o7777
                    plan.backups.append(_backup(ctx, step.path, stamp))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_atomic(path, (step.new or "").encode("utf-8"), mode)
                step.done = "edited" if step.old is not None else "created"
            elif not plan.runs_commands:
                step.done = "listed, not run"
            else:
                argv = list(step.argv or ())
                try:
                    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                          text=True, check=False)
                except OSError as exc:
                    step.done = f"failed: {exc.strerror}"
                    raise SetupError(f"{argv[0]}: {exc.strerror}") from None
                if proc.returncode != 0:
                    last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
                    step.done = f"failed (exit {proc.returncode})"
                    raise SetupError(f"{RunCommand(tuple(argv)).shown} failed with exit "
                                     f"{proc.returncode}: {last[0]}")
                step.done = "ran"
            applied.append(step)
    finally:
        if applied:
            _record(ctx, plan, reboot_for, applied, now)


def _record(ctx: Context, plan: Plan, reboot_for: list[str], applied: list[Step],
            now: float) -> None:
    """What waits for the next boot, for the doctor (see Doctor.setup_pending)."""
    doctor = Doctor(ctx)
    # A check waits only for the reboot when every step it needed was applied.
    pending = [c for c in dict.fromkeys(reboot_for)
               if all(s in applied for s in plan.steps if c in s.checks)
               and any(c in s.checks for s in applied)]
    doc = {"version": 1, "applied_at": now, "boot_id": doctor.boot_id(),
           "btime": doctor.btime(), "pending_reboot": pending,
           "steps": [s.to_json() for s in applied],
           "backups": [host_path(b) for b in plan.backups]}
    path = ctx.path(SETUP_JOURNAL)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, (json.dumps(doc, indent=2) + "\n").encode("utf-8"), 0o600)
    plan.pending = list(dict.fromkeys(plan.pending + pending))
