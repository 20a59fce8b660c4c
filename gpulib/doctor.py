"""`gpulib doctor`: the host readiness checklist, automated.

Every check looks at the host below the context's root and reports results
with a status (ok, warn, fail), a subject (a device address or a file as the
host sees it), a one-line message and, for warn and fail, a fix: the exact
commands for the distribution found in `etc/os-release`.

Check ids (stable: scripts and the JSON depend on them):

* `iommu`          the IOMMU is enabled on the kernel command line and active
                   (`sys/class/iommu/*`, populated `sys/kernel/iommu_groups`)
* `nouveau`        nouveau is not loaded and is blacklisted (hosts with NVIDIA GPUs)
* `driver-binding` passthrough GPUs are on vfio-pci (or no driver), vGPU GPUs on
                   their vendor driver; `vfio-pci.ids=`/`pci-stub.ids=` are shown
* `iommu-group`    every other endpoint in a passthrough GPU's group can go with it
* `sriov`          VFs are enabled where the card's vGPU needs them
* `mdev`           mdev types offered, instances left, pools name offered types
* `hooks`          gpulib's hooks are installed and executable (libvirt's qemu.d,
                   the CloudStack agent's hook directory)
* `libvirt`        libvirtd was (re)started after the qemu hook appeared (the
                   link's ctime: packages set its mtime to their build time)
* `config`         gpulib.conf parses without errors or unknown keys
* `state`          the state file is readable and consistent, the lock works
* `discovery`      the CloudStack discovery JSON is valid for the agent
* `logging`        no hook or command lost log records since boot (a full log
                   disk, a broken syslog: `run/gpulib/log-failures`)

A check emits one `ok` result summing up what it saw, or one result per
problem. The report's status is the worst status; the exit code is 0 when
everything is ok, 1 when anything failed, 2 for warnings only.

The doctor never writes: discovery runs without learning names, the state
file is read without the lock, and the lock is only tried (flock on the
existing lock file, released at once).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gpulib import cloudstack, mdev
from gpulib.config import Config
from gpulib.context import (
    CLOUDSTACK_AGENT_DIR,
    CONFIG_FILE,
    LOCK_FILE,
    LOG_DIR,
    MODPROBE_DIR,
    PROC_CMDLINE,
    STATE_DIR,
    STATE_FILE,
    Context,
)
from gpulib.discovery import BRIDGE_BASE_CLASS, Gpu, Inventory
from gpulib.errors import GpulibError
from gpulib.nvidia import NVIDIA_VENDOR
from gpulib.pci import PCI_DEVICES, PciAddress, PciFunction
from gpulib.runtime import discover_host
from gpulib.state import CorruptStateError, State, StateVersionError

log = logging.getLogger(__name__)

OK = "ok"
WARN = "warn"
FAIL = "fail"
_RANK = {OK: 0, WARN: 1, FAIL: 2}
EXIT_CODES = {OK: 0, FAIL: 1, WARN: 2}
SCHEMA = 1

CHECK_IDS = ("iommu", "nouveau", "driver-binding", "iommu-group", "sriov", "mdev", "hooks",
             "libvirt", "config", "state", "discovery", "logging")

AMD_VENDOR = 0x1002
# Drivers that make a GPU the host's: a passthrough GPU must not be on one.
HOST_DISPLAY_DRIVERS = frozenset({"nvidia", "nouveau", "amdgpu", "radeon", "i915", "xe"})
# The libvirt qemu hook (DESIGN 2.3) and the executables the package installs.
LIBVIRT_HOOKS_DIR = "etc/libvirt/hooks/qemu.d"
LIBVIRT_HOOK = LIBVIRT_HOOKS_DIR + "/50-gpulib"
QEMU_HOOK_EXECUTABLE = "gpulib-qemu-hook"
AGENT_HOOK_EXECUTABLES = {
    cloudstack.TRANSFORMER_HOOK: "libvirt-vm-xml-transformer",
    cloudstack.STATE_CHANGE_HOOK: "libvirt-vm-state-change",
}
AGENT_PROPERTIES = CLOUDSTACK_AGENT_DIR + "/agent.properties"
MODPROBE_DIRS = (MODPROBE_DIR, "run/modprobe.d", "usr/lib/modprobe.d", "lib/modprobe.d")
# (daemon, pid file): libvirtd's default pid file, then the modular qemu daemon's.
LIBVIRT_DAEMONS = (("libvirtd", "run/libvirtd.pid"), ("virtqemud", "run/virtqemud.pid"))
PROC_STAT = "proc/stat"
PROC_CPUINFO = "proc/cpuinfo"
DEFAULT_GRUB = "etc/default/grub"
OS_RELEASE = "etc/os-release"
# libvirtd's start time is known to a clock tick, the boot time to a second.
_START_SLACK = 1.0

_BLACKLIST_NOUVEAU = re.compile(r"^\s*blacklist\s+nouveau\s*(#.*)?$", re.M)


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


def agent_hooks_dir(ctx: Context) -> str:
    """`agent.hooks.basedir` from agent.properties (root-relative), else the default."""
    text = ctx.sysfs.read(AGENT_PROPERTIES) or ""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "agent.hooks.basedir" and value.strip():
            rel = posixpath.normpath(value.strip().lstrip("/"))
            if rel != ".." and not rel.startswith("../"):
                return rel
    return cloudstack.AGENT_HOOKS_DIR


# -- results ---------------------------------------------------------------------------


@dataclass
class Result:
    """One finding of one check."""

    check: str
    status: str
    subject: str
    message: str
    fix: Optional[str] = None
    details: Optional[list[dict[str, Any]]] = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.check, "status": self.status,
                               "subject": self.subject, "message": self.message,
                               "fix": self.fix}
        if self.details is not None:
            doc["details"] = self.details
        return doc


def worst(statuses: list[str]) -> str:
    return max(statuses, key=lambda s: _RANK[s], default=OK)


@dataclass
class Distro:
    """The distribution from `etc/os-release`, for the commands in fixes."""

    id: str = ""
    id_like: list[str] = field(default_factory=list)
    name: str = ""

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
    def kernel_args_fix(self, add: str = "", remove: str = "") -> str:
        """How to change the kernel command line for good, on this distribution."""
        if remove and add:
            edit = f'replace "{remove}" with "{add}" in GRUB_CMDLINE_LINUX'
        elif remove:
            edit = f'remove "{remove}" from GRUB_CMDLINE_LINUX'
        else:
            edit = f'add "{add}" to GRUB_CMDLINE_LINUX'
        edit += " in /etc/default/grub"
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

    def initramfs_update(self) -> str:
        return self._by_family("update-initramfs -u", "dracut -f",
                               "update-initramfs -u (Debian/Ubuntu) or dracut -f "
                               "(RHEL/Fedora/SUSE)")


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
        counts = {s: sum(1 for r in self.results if r.status == s) for s in (OK, WARN, FAIL)}
        return {
            "schema": SCHEMA,
            "status": self.status,
            "exit_code": self.exit_code,
            "distribution": self.distro.to_json(),
            "summary": self.summary(),
            "counts": counts,
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


# -- the CloudStack agent's rules for the discovery JSON -------------------------------

_LIBVIRT_KEYS = {"domain", "bus", "slot", "function"}
_NUMBER_KEYS = ("max_instances", "video_ram", "max_heads", "max_resolution_x",
                "max_resolution_y")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _address_problem(a: Any, where: str) -> Optional[str]:
    if not isinstance(a, dict) or set(a) != _LIBVIRT_KEYS:
        return f"{where}: libvirt_address must have domain, bus, slot, function"
    for k in sorted(_LIBVIRT_KEYS):
        if not (isinstance(a[k], str) and a[k].startswith("0x")):
            return f"{where}: libvirt_address {k} must be a 0x.. string, not {a[k]!r}"
    return None


def agent_document_problems(doc: Any) -> list[tuple[str, str]]:
    """What the CloudStack agent would choke on: [(subject, problem)]."""
    if not isinstance(doc, dict) or set(doc) != {"gpus"} or not isinstance(doc["gpus"], list):
        return [("discovery", 'the document must be {"gpus": [...]}')]
    out: list[tuple[str, str]] = []
    for g in doc["gpus"]:
        if not isinstance(g, dict):
            out.append(("discovery", "a GPU entry is not an object"))
            continue
        subject = str(g.get("pci_address", "?"))
        problems: list[Optional[str]] = []
        for key in ("pci_address", "vendor_id", "device_id", "vendor", "device", "driver",
                    "pci_class", "iommu_group", "pci_root"):
            if not isinstance(g.get(key), str):
                problems.append(f"{key} must be a string, not {g.get(key)!r}")
        for key in ("vendor_id", "device_id"):
            v = g.get(key)
            if isinstance(v, str) and not re.fullmatch(r"[0-9a-f]{4}", v):
                problems.append(f"{key} must be 4 lowercase hex digits, not {v!r}")
        for key in ("numa_node", "sriov_totalvfs", "sriov_numvfs"):
            if not _is_int(g.get(key)):
                problems.append(f"{key} must be a number, not {g.get(key)!r}")
        for key in _NUMBER_KEYS:
            if g.get(key) is not None and not _is_int(g.get(key)):
                problems.append(f"{key} must be a number or null, not {g.get(key)!r}")
        fp = g.get("full_passthrough")
        vgpus = g.get("vgpu_instances")
        vfs = g.get("vf_instances")
        if not isinstance(vgpus, list) or not isinstance(vfs, list):
            problems.append("vgpu_instances and vf_instances must be lists")
            vgpus, vfs = [], []
        if not isinstance(fp, dict):
            problems.append("full_passthrough must be an object")
        else:
            enabled = fp.get("enabled")
            if type(enabled) is not int or enabled not in (0, 1):
                problems.append(f"full_passthrough.enabled must be the number 0 or 1 "
                                f"(the agent reads it with getAsInt), not {enabled!r}")
            elif enabled != (1 if not vgpus and not vfs else 0):
                problems.append("full_passthrough.enabled must be 1 exactly when the GPU has "
                                "no vGPU and no VF instances")
            problems.append(_address_problem(fp.get("libvirt_address"), "full_passthrough"))
            if fp.get("used_by_vm") is not None and not isinstance(fp.get("used_by_vm"), str):
                problems.append("full_passthrough.used_by_vm must be a string or null")
        for v in vgpus:
            where = f"vGPU {v.get('mdev_uuid')}" if isinstance(v, dict) else "vGPU"
            if not isinstance(v, dict):
                problems.append(f"{where}: not an object")
                continue
            if not isinstance(v.get("mdev_uuid"), str) or not isinstance(v.get("profile_name"),
                                                                         str):
                problems.append(f"{where}: mdev_uuid and profile_name must be strings")
            for key in _NUMBER_KEYS:
                if v.get(key) is not None and not _is_int(v.get(key)):
                    problems.append(f"{where}: {key} must be a number or null")
            problems.append(_address_problem(v.get("libvirt_address"), where))
        for vf in vfs:
            where = f"VF {vf.get('vf_pci_address')}" if isinstance(vf, dict) else "VF"
            if not isinstance(vf, dict):
                problems.append(f"{where}: not an object")
                continue
            if not isinstance(vf.get("vf_pci_address"), str):
                problems.append(f"{where}: vf_pci_address must be a string")
            if not isinstance(vf.get("vf_profile"), str) or not vf.get("vf_profile"):
                problems.append(f"{where}: vf_profile must be a non-empty string, not "
                                f"{vf.get('vf_profile')!r}")
            problems.append(_address_problem(vf.get("libvirt_address"), where))
        out.extend((subject, p) for p in problems if p)
    return out


# -- the checks ------------------------------------------------------------------------


class _Collect(logging.Handler):
    """Collects the warnings a module logs while the doctor calls it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Doctor:
    """Runs the checks against the host below `ctx`'s root; never writes."""

    def __init__(self, ctx: Context, config: Optional[Config] = None,
                 lock_timeout: float = 2.0, clock_ticks: Optional[int] = None) -> None:
        self.ctx = ctx
        self.sysfs = ctx.sysfs
        self.lock_timeout = lock_timeout
        self.clock_ticks = clock_ticks
        self.distro = Distro.read(ctx)
        self._config = config
        self._config_error: Optional[str] = None
        self._config_warnings: list[str] = []
        self._config_loaded = config is not None
        self._state: Optional[State] = None
        self._state_error: Optional[tuple[str, str, str]] = None  # (status, message, fix)
        self._state_loaded = False
        self._inventory: Optional[Inventory] = None
        self._cmdline: Optional[list[str]] = None

    # -- facts, read once -----------------------------------------------------------
    @property
    def config(self) -> Config:
        if not self._config_loaded:
            self._config_loaded = True
            collect = _Collect()
            config_log = logging.getLogger("gpulib.config")
            level = config_log.level
            config_log.addHandler(collect)
            config_log.setLevel(min(level or logging.WARNING, logging.WARNING))
            try:
                self._config = Config.load(self.ctx.config_path)
            except GpulibError as exc:
                self._config_error = exc.message
                self._config = Config()
            finally:
                config_log.removeHandler(collect)
                config_log.setLevel(level)
            self._config_warnings = collect.messages
        assert self._config is not None
        return self._config

    @property
    def state(self) -> State:
        """The state file's content (empty when missing or unusable)."""
        if not self._state_loaded:
            self._state_loaded = True
            self._state = self._load_state()
        return self._state or State()

    def _load_state(self) -> Optional[State]:
        path = self.ctx.state_path
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._state_error = (
                FAIL, f"cannot read the state file: {exc.strerror}",
                f"run gpulib doctor as root; check the permissions: ls -ld {host_path(STATE_DIR)} "
                f"{host_path(STATE_FILE)}")
            return None
        try:
            doc = json.loads(raw.decode("utf-8"))
            return State.from_json(doc)
        except StateVersionError as exc:
            self._state_error = (FAIL, exc.message,
                                 "upgrade gpulib to the version that wrote the state file")
        except CorruptStateError as exc:
            self._state_error = (
                FAIL, f"the state file is corrupt: {exc.message}",
                "gpulib reconcile (moves the corrupt file aside and rebuilds it from sysfs "
                "and libvirt's files)")
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._state_error = (
                FAIL, f"the state file is not JSON: {reason}",
                "gpulib reconcile (moves the corrupt file aside and rebuilds it from sysfs "
                "and libvirt's files)")
        return None

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = discover_host(self.ctx, self.config, state=self.state,
                                            learn=False)
        return self._inventory

    @property
    def cmdline(self) -> list[str]:
        if self._cmdline is None:
            self._cmdline = (self.sysfs.read(PROC_CMDLINE) or "").split()
        return self._cmdline

    def params(self, name: str) -> list[str]:
        """Every value of `name=` on the kernel command line."""
        prefix = name + "="
        return [t[len(prefix):] for t in self.cmdline if t.startswith(prefix)]

    def cpu_vendor(self) -> Optional[str]:
        """intel, amd or None, from proc/cpuinfo, else from the IOMMU units' names."""
        text = self.sysfs.read(PROC_CPUINFO) or ""
        m = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
        if m:
            if m.group(1) == "GenuineIntel":
                return "intel"
            if m.group(1) in ("AuthenticAMD", "HygonGenuine"):
                return "amd"
        units = self.sysfs.listdir("sys/class/iommu")
        if any(u.startswith("dmar") for u in units):
            return "intel"
        if any(u.startswith("ivhd") for u in units):
            return "amd"
        return None

    def stub_ids(self) -> tuple[list[str], set[tuple[int, int]]]:
        """`vfio-pci.ids=`/`pci-stub.ids=` tokens on the command line and their ids."""
        tokens: list[str] = []
        ids: set[tuple[int, int]] = set()
        for name in ("vfio-pci.ids", "vfio_pci.ids", "pci-stub.ids", "pci_stub.ids"):
            for value in self.params(name):
                tokens.append(f"{name}={value}")
                for item in value.split(","):
                    parts = item.strip().split(":")
                    if len(parts) >= 2:
                        try:
                            ids.add((int(parts[0], 16), int(parts[1], 16)))
                        except ValueError:
                            continue
        return tokens, ids

    def stat_in_root(self, rel: str, follow: bool = True) -> Optional[os.stat_result]:
        """lstat/stat of a root-relative path; symlinks are followed inside the root."""
        path = self.ctx.sysfs.resolve_in_root(rel) if follow else rel.lstrip("/")
        if path is None:
            return None
        try:
            return os.lstat(self.ctx.path(path))
        except OSError:
            return None

    def group_peers(self, gpu: Gpu) -> list[PciFunction]:
        """The other endpoints of a GPU's IOMMU group (bridges stay with the host)."""
        out = []
        for member in gpu.group_members:
            if member == gpu.address:
                continue
            fn = PciFunction.read_ids(self.sysfs, member)
            if fn.class_code >> 8 != BRIDGE_BASE_CLASS:
                out.append(fn)
        return out

    def group_ids(self, gpu: Gpu) -> list[str]:
        """vendor:device of the GPU and the other endpoints of its IOMMU group."""
        out = [f"{gpu.fn.vendor_id:04x}:{gpu.fn.device_id:04x}"]
        for fn in self.group_peers(gpu):
            key = f"{fn.vendor_id:04x}:{fn.device_id:04x}"
            if key not in out:
                out.append(key)
        return out

    def is_vgpu_gpu(self, gpu: Gpu) -> bool:
        """The GPU is (or is meant to be) shared as vGPU, not passed through whole."""
        return gpu.mode != "passthrough" or self.needs_vfs(gpu)

    def needs_vfs(self, gpu: Gpu) -> bool:
        """On its vendor's vGPU driver, SR-IOV capable, but no VFs and no mdev types."""
        if gpu.sriov_totalvfs <= 0 or gpu.sriov_numvfs > 0 or gpu.mdev_parent:
            return False
        fn = gpu.fn
        return (fn.vendor_id == NVIDIA_VENDOR and fn.driver == "nvidia") or \
            (fn.vendor_id == AMD_VENDOR and fn.driver == "gim")

    def passthrough_gpus(self) -> list[Gpu]:
        return [g for g in self.inventory.gpus if not self.is_vgpu_gpu(g)]

    @staticmethod
    def _label(gpu: Gpu) -> str:
        return f"{gpu.address} ({gpu.device_name or gpu.fn.class_name})"

    def _rebind_fix(self, address: PciAddress) -> str:
        dev = f"/sys/bus/pci/devices/{address}"
        return (f"driverctl set-override {address} vfio-pci\n"
                f"(without driverctl: echo vfio-pci > {dev}/driver_override && "
                f"echo {address} > {dev}/driver/unbind && "
                f"echo {address} > /sys/bus/pci/drivers_probe)")

    # -- running ------------------------------------------------------------------------
    def checks(self) -> list[tuple[str, Callable[[], list[Result]]]]:
        return [
            ("iommu", self.check_iommu),
            ("nouveau", self.check_nouveau),
            ("driver-binding", self.check_driver_binding),
            ("iommu-group", self.check_iommu_group),
            ("sriov", self.check_sriov),
            ("mdev", self.check_mdev),
            ("hooks", self.check_hooks),
            ("libvirt", self.check_libvirt),
            ("config", self.check_config),
            ("state", self.check_state),
            ("discovery", self.check_discovery),
            ("logging", lambda: check_logging(self.ctx)),
        ]

    def run(self, only: Optional[list[str]] = None) -> Report:
        results: list[Result] = []
        for check_id, check in self.checks():
            if only and check_id not in only:
                continue
            try:
                found = check()
            except Exception as exc:  # one broken check must not hide the others
                log.exception("doctor check %s failed", check_id)
                reason = " ".join(str(exc).split()) or type(exc).__name__
                found = [Result(check_id, FAIL, "gpulib", f"the check could not run: {reason}",
                                "report this as a gpulib bug, with the tarball of "
                                "`gpulib snapshot` attached")]
            results.extend(found)
        return Report(results, self.distro)

    # -- iommu --------------------------------------------------------------------------
    def check_iommu(self) -> list[Result]:
        cid, subject = "iommu", host_path(PROC_CMDLINE)
        vendor = self.cpu_vendor()
        units = sorted(self.sysfs.listdir("sys/class/iommu"))
        groups = [g for g in self.sysfs.listdir("sys/kernel/iommu_groups") if g.isdigit()]
        intel = [v for value in self.params("intel_iommu") for v in value.split(",")]
        amd = [v for value in self.params("amd_iommu") for v in value.split(",")]
        generic = [v for value in self.params("iommu") for v in value.split(",")]
        shown = " ".join(t for t in self.cmdline
                         if t.split("=", 1)[0] in ("intel_iommu", "amd_iommu", "iommu"))
        if vendor == "intel":
            on_args, on_cmdline = "intel_iommu=on iommu=pt", "on" in intel
        elif vendor == "amd":
            on_args, on_cmdline = "iommu=pt", "off" not in amd
        else:
            on_args = "intel_iommu=on iommu=pt"
            on_cmdline = "on" in intel or "on" in amd or "pt" in generic
        off = [f"{name}=off" for name, values in (("intel_iommu", intel), ("amd_iommu", amd),
                                                 ("iommu", generic)) if "off" in values]
        active = bool(units) and bool(groups)
        what = (f"{len(units)} IOMMU unit(s) in /sys/class/iommu" if units else
                "no IOMMU unit in /sys/class/iommu") + ", " + \
            (f"{len(groups)} IOMMU groups" if groups else "/sys/kernel/iommu_groups is empty")
        if off:
            return [Result(cid, FAIL, subject,
                           f"the IOMMU is switched off on the kernel command line "
                           f"({' '.join(off)}); {what}",
                           self.distro.kernel_args_fix(add=on_args, remove=" ".join(off)))]
        if not active:
            if on_cmdline and (shown or vendor == "amd"):
                firmware = {"intel": "VT-d", "amd": "AMD-Vi/IOMMU"}.get(vendor or "",
                                                                        "VT-d or AMD-Vi/IOMMU")
                return [Result(cid, FAIL, subject,
                               f"the IOMMU is not active although the command line allows it "
                               f"({shown or 'AMD: on by default'}); {what}",
                               f"enable {firmware} (and SR-IOV) in the firmware setup, "
                               f"then reboot")]
            grub = self.sysfs.read(DEFAULT_GRUB) or ""
            if re.search(r"^\s*GRUB_CMDLINE_LINUX\w*=.*\b(intel|amd)_iommu=on", grub, re.M):
                return [Result(cid, FAIL, subject,
                               "the IOMMU is configured in /etc/default/grub but the running "
                               f"kernel was booted without it; {what}",
                               f"{self.distro.grub_update()} && reboot")]
            if vendor is None:
                fix = (self.distro.kernel_args_fix(add="intel_iommu=on iommu=pt") +
                       "\n(on AMD CPUs: amd_iommu=on iommu=pt instead; also enable VT-d or "
                       "AMD-Vi in the firmware setup)")
            else:
                fix = self.distro.kernel_args_fix(add=on_args)
            return [Result(cid, FAIL, subject,
                           f"the IOMMU is not enabled: no {on_args.split()[0]} on the kernel "
                           f"command line; {what}", fix)]
        if not on_cmdline:
            return [Result(cid, WARN, subject,
                           f"the IOMMU is active by the kernel's default but not enabled on "
                           f"the command line ({what}): another kernel may boot without it",
                           self.distro.kernel_args_fix(add=on_args))]
        how = shown or "AMD: on by default"
        return [Result(cid, OK, subject, f"the IOMMU is enabled ({how}) and active: {what}")]

    # -- nouveau ------------------------------------------------------------------------
    def _nouveau_blacklist(self) -> list[str]:
        found: list[str] = []
        seen: set[str] = set()
        for directory in MODPROBE_DIRS:
            real = os.path.realpath(self.ctx.path(directory))
            if real in seen:
                continue
            seen.add(real)
            for name in sorted(self.sysfs.listdir(directory)):
                if not name.endswith(".conf"):
                    continue
                text = self.sysfs.read(f"{directory}/{name}")
                if text and _BLACKLIST_NOUVEAU.search(text):
                    found.append(host_path(f"{directory}/{name}"))
        for name in ("modprobe.blacklist", "rd.driver.blacklist", "module_blacklist"):
            if any("nouveau" in v.split(",") for v in self.params(name)):
                found.append(f"{name}=nouveau on the kernel command line")
        return found

    def check_nouveau(self) -> list[Result]:
        cid = "nouveau"
        loaded = self.sysfs.isdir("sys/module/nouveau")
        nvidia = [g for g in self.inventory.gpus if g.fn.vendor_id == NVIDIA_VENDOR]
        blacklisted = self._nouveau_blacklist()
        write_blacklist = ("printf 'blacklist nouveau\\noptions nouveau modeset=0\\n' > "
                           "/etc/modprobe.d/blacklist-nouveau.conf")
        if not nvidia:
            return [Result(cid, OK, "/sys/module/nouveau",
                           "no NVIDIA GPU on this host" + ("; nouveau is loaded" if loaded
                                                           else ""))]
        if loaded:
            bound = [str(g.address) for g in nvidia if g.fn.driver == "nouveau"]
            msg = "nouveau is loaded"
            if bound:
                msg += f" and drives {', '.join(bound)}"
            if blacklisted:
                msg += (f" although blacklisted ({', '.join(blacklisted)}): the initramfs or an "
                        "earlier boot still loads it")
                fix = f"{self.distro.initramfs_update()} && reboot"
            else:
                msg += " and not blacklisted"
                fix = f"{write_blacklist}\n{self.distro.initramfs_update()} && reboot"
            return [Result(cid, FAIL, "/sys/module/nouveau",
                           msg + f"; it must not claim this host's {len(nvidia)} NVIDIA GPU(s)",
                           fix)]
        if not blacklisted:
            return [Result(cid, WARN, host_path(MODPROBE_DIR),
                           "nouveau is not loaded but not blacklisted either: it may claim the "
                           "NVIDIA GPUs at the next boot",
                           f"{write_blacklist}\n{self.distro.initramfs_update()}")]
        return [Result(cid, OK, "/sys/module/nouveau",
                       f"nouveau is not loaded and is blacklisted ({', '.join(blacklisted)})")]

    # -- driver-binding -----------------------------------------------------------------
    def check_driver_binding(self) -> list[Result]:
        cid = "driver-binding"
        tokens, stub = self.stub_ids()
        on_cmdline = (f"the kernel command line has {' '.join(tokens)}" if tokens else
                      "no vfio-pci.ids= or pci-stub.ids= on the kernel command line")
        problems: list[Result] = []
        passthrough = vgpu = 0
        for gpu in self.inventory.gpus:
            drv = gpu.fn.driver
            ids = (gpu.fn.vendor_id, gpu.fn.device_id)
            if self.is_vgpu_gpu(gpu):
                vgpu += 1
                if drv is None:
                    problems.append(Result(
                        cid, WARN, str(gpu.address),
                        f"{self._label(gpu)} offers vGPU ({gpu.mode}) but has no driver",
                        "load the vendor's vGPU host driver (NVIDIA vGPU manager, AMD gim)"))
                elif ids in stub and not is_free_for_vfio(drv):
                    problems.append(Result(
                        cid, WARN, str(gpu.address),
                        f"vGPU GPU {self._label(gpu)} on {drv} matches "
                        f"{ids[0]:04x}:{ids[1]:04x} in {' '.join(tokens)}: at the next boot "
                        "vfio-pci or pci-stub may claim it and its vGPUs disappear",
                        self.distro.kernel_args_fix(remove=' '.join(tokens)) +
                        "\n(keep the passthrough GPUs away from the host per device instead: "
                        "driverctl set-override <address> vfio-pci)"))
                continue
            passthrough += 1
            if is_free_for_vfio(drv):
                continue
            group_ids = ",".join(self.group_ids(gpu))
            if drv in HOST_DISPLAY_DRIVERS:
                if ids in stub:
                    msg = (f"{self._label(gpu)} is offered for passthrough but bound to the host "
                           f"driver {drv}, although {on_cmdline}: {drv} claimed it first")
                    fix = (self._rebind_fix(gpu.address) +
                           f"\nor load vfio-pci first at boot: echo 'softdep {drv} pre: "
                           f"vfio-pci' > /etc/modprobe.d/gpulib-vfio.conf && "
                           f"{self.distro.initramfs_update()} && reboot")
                else:
                    msg = (f"{self._label(gpu)} is offered for passthrough but bound to the host "
                           f"driver {drv}; {on_cmdline}")
                    fix = (self._rebind_fix(gpu.address) +
                           "\nor keep it from the host from boot on: " +
                           self.distro.kernel_args_fix(add=f"vfio-pci.ids={group_ids}"))
                fix += ("\n(or, if the host needs this GPU, exclude it: [discovery] exclude = "
                        f"{gpu.address} in /etc/gpulib/gpulib.conf)")
                problems.append(Result(cid, FAIL, str(gpu.address), msg, fix))
            else:
                problems.append(Result(
                    cid, WARN, str(gpu.address),
                    f"{self._label(gpu)} is offered for passthrough but bound to {drv}, not "
                    "vfio-pci: starting a VM with it takes it from that driver",
                    self._rebind_fix(gpu.address)))
        if problems:
            return problems
        msg = (f"{passthrough} passthrough GPU(s) on vfio-pci or free, {vgpu} vGPU GPU(s) on "
               f"their vendor driver; {on_cmdline}")
        return [Result(cid, OK, "GPUs", msg)]

    # -- iommu-group --------------------------------------------------------------------
    def check_iommu_group(self) -> list[Result]:
        cid = "iommu-group"
        problems: list[Result] = []
        gpus = self.passthrough_gpus()
        for gpu in gpus:
            group = gpu.fn.iommu_group
            if group is None:
                problems.append(Result(
                    cid, FAIL, str(gpu.address),
                    f"passthrough GPU {self._label(gpu)} has no IOMMU group: it cannot be "
                    "given to a VM", "enable the IOMMU: see the iommu check"))
                continue
            for fn in self.group_peers(gpu):
                member = fn.address
                drv = self.sysfs.link_name(f"{PCI_DEVICES}{member}/driver")
                if is_free_for_vfio(drv):
                    continue
                other = "" if member.slot_key == gpu.address.slot_key else (
                    "; it is another device, so it goes to the same VM (or the slot lacks "
                    "ACS isolation)")
                problems.append(Result(
                    cid, FAIL, str(member),
                    f"{member} ({fn.class_name}) shares IOMMU group {group} with passthrough "
                    f"GPU {gpu.address} and is bound to {drv}: every endpoint of the group "
                    f"must be on vfio-pci or free before the GPU can go to a VM{other}",
                    self._rebind_fix(member)))
        if problems:
            return problems
        if not gpus:
            return [Result(cid, OK, "IOMMU groups", "no GPU is offered for passthrough")]
        return [Result(cid, OK, "IOMMU groups",
                       f"{len(gpus)} passthrough GPU group(s): every other endpoint is on "
                       "vfio-pci or free")]

    # -- sriov --------------------------------------------------------------------------
    def check_sriov(self) -> list[Result]:
        cid = "sriov"
        problems: list[Result] = []
        enabled = 0
        for gpu in self.inventory.gpus:
            if gpu.sriov_totalvfs > 0 and gpu.sriov_numvfs > 0:
                enabled += 1
            if not self.needs_vfs(gpu):
                continue
            addr = gpu.address
            if gpu.fn.vendor_id == NVIDIA_VENDOR:
                msg = (f"{self._label(gpu)} is on the NVIDIA vGPU host driver and supports "
                       f"{gpu.sriov_totalvfs} VFs, but none is enabled (sriov_numvfs 0) and it "
                       "has no mdev types: it offers no vGPU")
                if not self.sysfs.isdir("sys/module/nvidia_vgpu_vfio"):
                    msg += ("; nvidia_vgpu_vfio is not loaded (is the vGPU host driver "
                            "installed? for passthrough, bind the GPU to vfio-pci instead)")
                fix = (f"/usr/lib/nvidia/sriov-manage -e {addr}\n"
                       "(VFs do not survive a reboot: run it at every boot, e.g. "
                       "`sriov-manage -e ALL` from a systemd unit)")
            else:
                msg = (f"{self._label(gpu)} is on {gpu.fn.driver} and supports "
                       f"{gpu.sriov_totalvfs} VFs, but none is enabled (sriov_numvfs 0): it "
                       "offers no VF")
                fix = (f"echo {gpu.sriov_totalvfs} > /sys/bus/pci/devices/{addr}/sriov_numvfs\n"
                       "(at every boot, e.g. from a systemd unit or udev rule)")
            problems.append(Result(cid, FAIL, str(addr), msg, fix))
        if problems:
            return problems
        if enabled:
            return [Result(cid, OK, "GPUs", f"{enabled} GPU(s) have their SR-IOV VFs enabled; "
                                            "no vGPU GPU is missing its VFs")]
        return [Result(cid, OK, "GPUs", "no GPU needs SR-IOV VFs")]

    # -- mdev ---------------------------------------------------------------------------
    def check_mdev(self) -> list[Result]:
        cid = "mdev"
        types: dict[PciAddress, list[mdev.MdevType]] = {}
        for gpu in self.inventory.gpus:
            if gpu.mdev_types:
                types[gpu.address] = list(gpu.mdev_types)
            for vf in gpu.vfs:
                if vf.mdev_types:
                    types[vf.address] = list(vf.mdev_types)
        for parent in mdev.list_parents(self.sysfs):
            if parent not in types:
                types[parent] = mdev.list_types(self.sysfs, parent)
        problems: list[Result] = []
        all_types = [t for ts in types.values() for t in ts]
        for name, pool in sorted(self.config.pools.items()):
            if pool.type_id and not any(t.type_id == pool.type_id for t in all_types):
                what = f"type {pool.type_id}"
            elif pool.profile and not any(t.profile_name == pool.profile for t in all_types):
                what = f"profile {pool.profile!r}"
            else:
                continue
            problems.append(Result(
                cid, WARN, f"pool {name}",
                f"pool {name} in {host_path(CONFIG_FILE)} asks for {what}, which no mdev "
                "parent offers",
                f"list the offered types with `gpulib mdev types`, then set type (or profile) "
                f"in [pool {name}] of {host_path(CONFIG_FILE)}"))
        if not types:
            return problems or [Result(cid, OK, "/sys/class/mdev_bus",
                                       "no mdev parent: no GPU offers mediated-device vGPU "
                                       "types")]
        left = [(t, t.available_instances or 0) for t in all_types
                if (t.available_instances or 0) > 0]
        if not left:
            problems.append(Result(
                cid, WARN, "/sys/class/mdev_bus",
                f"{len(types)} mdev parent(s) offer {len(all_types)} type(s), but every type "
                "has 0 instances available: no vGPU can be created",
                "remove the vGPUs no VM uses: `gpulib mdev list`, then "
                "`gpulib mdev remove <uuid>`"))
        if problems:
            return problems
        per_type: dict[str, int] = {}
        for t, n in left:
            label = f"{t.type_id} ({t.name})" if t.name else t.type_id
            per_type[label] = per_type.get(label, 0) + n
        shown = ", ".join(f"{label} x{n}" for label, n in list(per_type.items())[:6])
        more = f", +{len(per_type) - 6} more" if len(per_type) > 6 else ""
        details = [{"parent": str(t.parent), "type_id": t.type_id, "name": t.name,
                    "available_instances": n} for t, n in left]
        return [Result(cid, OK, "/sys/class/mdev_bus",
                       f"{len(types)} mdev parent(s) offer {len(all_types)} type(s); "
                       f"{len(left)} with instances left: {shown}{more}", details=details)]

    # -- hooks --------------------------------------------------------------------------

    def _hook_problem(self, rel: str, executable: str, restart: str = "") -> Optional[Result]:
        path = host_path(rel)
        st = self.stat_in_root(rel)
        if st is None:
            if os.path.lexists(self.ctx.path(rel)):
                msg = f"{path} is a broken link"
            else:
                msg = f"{path} is missing"
            directory = posixpath.dirname(path)
            fix = (f"mkdir -p {directory} && ln -sf \"$(command -v {executable})\" {path}"
                   + (f" && {restart}" if restart else ""))
            return Result("hooks", FAIL, path, msg, fix)
        if not stat.S_ISREG(st.st_mode):
            return Result("hooks", FAIL, path, f"{path} is not a regular file",
                          f"mv {path} {path}.bak && ln -s \"$(command -v {executable})\" {path}")
        if not st.st_mode & 0o111:
            return Result("hooks", FAIL, path, f"{path} is not executable", f"chmod 0755 {path}")
        return None

    def check_hooks(self) -> list[Result]:
        cid = "hooks"
        problems: list[Result] = []
        ok: list[str] = []
        found = self._hook_problem(LIBVIRT_HOOK, QEMU_HOOK_EXECUTABLE,
                                   "systemctl restart libvirtd")
        if found:
            found.message += " (libvirt's qemu hook)"
            if self.sysfs.isdir(CLOUDSTACK_AGENT_DIR):
                # The agent starts a VM with its own XML when the transformer
                # refuses: only `prepare begin` can stop a start that would take
                # a device another VM holds.
                found.message += ("; the CloudStack agent is installed and ignores a "
                                  "refusing transformer, so without this hook nothing "
                                  "stops a VM from taking a GPU another VM holds")
            problems.append(found)
        else:
            ok.append(host_path(LIBVIRT_HOOK))
        if not self.sysfs.isdir(CLOUDSTACK_AGENT_DIR):
            problems.append(Result(
                cid, WARN, host_path(CLOUDSTACK_AGENT_DIR),
                "the CloudStack agent is not installed: its hooks were not checked",
                "on a CloudStack KVM host: install cloudstack-agent, then: " +
                _link_hooks_command(host_path(cloudstack.AGENT_HOOKS_DIR))))
        else:
            base = agent_hooks_dir(self.ctx)
            for name, executable in AGENT_HOOK_EXECUTABLES.items():
                found = self._hook_problem(f"{base}/{name}", executable)
                if found:
                    found.message += " (the CloudStack agent's hook)"
                    problems.append(found)
                else:
                    ok.append(host_path(f"{base}/{name}"))
        if problems:
            return problems
        return [Result(cid, OK, "hooks", f"installed and executable: {', '.join(ok)}")]

    # -- libvirt ------------------------------------------------------------------------
    def _daemon_start(self) -> tuple[str, Optional[float], str]:
        """(daemon, start time or None, why unknown)."""
        for daemon, pidfile in LIBVIRT_DAEMONS:
            text = self.sysfs.read(pidfile)
            if text is None:
                continue
            if not text.isdigit():
                return daemon, None, f"{host_path(pidfile)} holds no pid"
            stat_text = self.sysfs.read(f"proc/{text}/stat")
            if stat_text is None:
                return daemon, None, (f"{daemon} is not running (no process {text} from "
                                      f"{host_path(pidfile)})")
            close = stat_text.rfind(")")
            comm = stat_text[stat_text.find("(") + 1:close]
            fields = stat_text[close + 2:].split()
            if daemon not in comm and comm not in ("libvirtd", "virtqemud"):
                return daemon, None, (f"process {text} from {host_path(pidfile)} is {comm}, "
                                      f"not {daemon}")
            if len(fields) < 20 or not fields[19].isdigit():
                return daemon, None, f"cannot read the start time of {daemon} (pid {text})"
            btime = None
            for line in (self.sysfs.read(PROC_STAT) or "").splitlines():
                if line.startswith("btime "):
                    value = line.split()[1]
                    btime = int(value) if value.isdigit() else None
            if btime is None:
                return daemon, None, "cannot read the boot time (btime in /proc/stat)"
            ticks = self.clock_ticks or os.sysconf("SC_CLK_TCK")
            return daemon, btime + int(fields[19]) / ticks, ""
        return "libvirtd", None, "cannot tell when libvirtd started (no /run/libvirtd.pid)"

    def check_libvirt(self) -> list[Result]:
        cid = "libvirt"
        hook = host_path(LIBVIRT_HOOK)
        st = self.stat_in_root(LIBVIRT_HOOK, follow=False)
        if st is None:
            return [Result(cid, WARN, hook,
                           "gpulib's qemu hook is not installed (see the hooks check): "
                           "libvirtd has nothing to load",
                           "install the hook (see the hooks check), then: "
                           "systemctl restart libvirtd")]
        daemon, started, why = self._daemon_start()
        if started is None:
            return [Result(cid, WARN, hook,
                           f"{why}: libvirtd reads its hooks only when it starts, so it may "
                           "not run gpulib's hook", "systemctl restart libvirtd")]
        # When the link appeared on this host: its ctime (set when it is made,
        # renamed into place or changed). Never the mtime: dpkg and rpm give it
        # the package's build time, long before libvirtd's start.
        appeared = st.st_ctime
        if appeared > started + _START_SLACK:
            return [Result(cid, FAIL, hook,
                           f"{daemon} started at {_when(started)}, before the qemu hook "
                           f"appeared ({_when(appeared)}): it reads its hooks only when it "
                           "starts, so it does not run gpulib's hook",
                           f"systemctl restart {daemon} (running VMs keep running)")]
        return [Result(cid, OK, hook,
                       f"{daemon} started at {_when(started)}, after the qemu hook appeared "
                       f"({_when(appeared)})")]

    # -- config -------------------------------------------------------------------------
    def check_config(self) -> list[Result]:
        cid, path = "config", host_path(CONFIG_FILE)
        config = self.config
        if self._config_error:
            return [Result(cid, FAIL, path, self._config_error,
                           f"correct the value named in {path} (`gpulib` refuses to run "
                           "with it); every key and its default is in the shipped example")]
        if self._config_warnings:
            return [Result(cid, WARN, path, " ".join(m.split(": ", 1)[-1] for m in
                                                     self._config_warnings),
                           f"remove or correct the key named in {path}")]
        capped = lock_timeout_problem(config, path)
        if capped:
            return [capped]
        if not os.path.exists(self.ctx.config_path):
            return [Result(cid, OK, path, "no configuration file: defaults apply")]
        return [Result(cid, OK, path, f"valid ({len(config.pools)} pool(s))")]

    # -- state --------------------------------------------------------------------------
    def _try_lock(self) -> Optional[Result]:
        import fcntl

        path, shown = self.ctx.lock_path, host_path(LOCK_FILE)
        if not os.path.exists(path):
            directory = os.path.dirname(path)
            if os.path.isdir(directory) and not os.access(directory, os.W_OK):
                return Result("state", WARN, host_path(STATE_DIR),
                              f"the lock {shown} does not exist and {host_path(STATE_DIR)} is "
                              "not writable by this user", "run gpulib doctor as root")
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return Result("state", WARN, shown, f"cannot open the lock {shown}: {exc.strerror}",
                          "run gpulib doctor as root")
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    return None
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        return Result("state", FAIL, shown,
                                      f"cannot take the lock {shown}: {exc.strerror}",
                                      f"check the file system holding {host_path(STATE_DIR)}")
                if time.monotonic() >= deadline:
                    return Result("state", FAIL, shown,
                                  f"the state lock {shown} is held by another process for more "
                                  f"than {self.lock_timeout:g} s: hooks and gpulib commands "
                                  "will time out",
                                  f"find the holder with `fuser -v {shown}` (a hung gpulib "
                                  "process?) and stop it")
                time.sleep(0.05)
        finally:
            os.close(fd)

    def check_state(self) -> list[Result]:
        cid, path = "state", host_path(STATE_FILE)
        state = self.state
        problems: list[Result] = []
        if self._state_error:
            status, msg, fix = self._state_error
            problems.append(Result(cid, status, path, msg, fix))
        locked = self._try_lock()
        if locked:
            problems.append(locked)
        for uuid, rec in sorted(state.vgpus.items()):
            parent = f"{PCI_DEVICES}{rec.parent}"
            if not self.sysfs.exists(parent):
                problems.append(Result(
                    cid, FAIL, uuid,
                    f"the registry keeps vGPU {uuid} on {rec.parent}, which does not exist: "
                    "it cannot be recreated", "gpulib reconcile"))
            elif not self.sysfs.isdir(f"{parent}/{mdev.TYPES_DIR}/{rec.type_id}"):
                problems.append(Result(
                    cid, FAIL, uuid,
                    f"the registry keeps vGPU {uuid} as {rec.type_id} on {rec.parent}, which "
                    "does not offer that type (vGPU driver not loaded? VFs not enabled?)",
                    "check the mdev and sriov checks, then gpulib reconcile"))
        for vf, vrec in sorted(state.vf_types.items()):
            if not self.sysfs.exists(f"{PCI_DEVICES}{vf}"):
                problems.append(Result(
                    cid, WARN, vf,
                    f"the registry gives VF {vf} vGPU type {vrec.type_id}, but the VF does not "
                    "exist (VFs not enabled? see the sriov check)",
                    "enable the VFs (see the sriov check); if the VF is gone for good: "
                    "gpulib reconcile"))
        if problems:
            return problems
        if not os.path.exists(self.ctx.state_path):
            return [Result(cid, OK, path, "no state file yet (nothing recorded); the lock works")]
        return [Result(cid, OK, path,
                       f"readable and consistent: {len(state.vgpus)} registered vGPU(s), "
                       f"{len(state.vf_types)} VF type(s), {len(state.allocations)} "
                       "allocation(s); the lock works")]

    # -- discovery ----------------------------------------------------------------------
    def check_discovery(self) -> list[Result]:
        cid = "discovery"
        inventory = self.inventory
        doc = json.loads(cloudstack.dumps(inventory))
        problems = [Result(cid, FAIL, subject,
                           f"the CloudStack discovery JSON breaks the agent's rules: {problem}",
                           "report this as a gpulib bug, with the tarball of `gpulib snapshot` "
                           "attached")
                    for subject, problem in agent_document_problems(doc)]
        for gpu in inventory.gpus:
            if gpu.errors:
                problems.append(Result(
                    cid, WARN, str(gpu.address),
                    f"{self._label(gpu)} could only be read in part: {'; '.join(gpu.errors)}",
                    "run gpulib as root; check `dmesg` for errors from the GPU's driver"))
        if problems:
            return problems
        if not inventory.gpus:
            return [Result(cid, WARN, "GPUs",
                           "no GPU found: the CloudStack agent will report none",
                           "if a GPU is missing, name it in [discovery] include = <address> "
                           f"in {host_path(CONFIG_FILE)}")]
        vgpus = sum(len(g["vgpu_instances"]) for g in doc["gpus"])
        vfs = sum(len(g["vf_instances"]) for g in doc["gpus"])
        return [Result(cid, OK, "gpulib discover --format cloudstack",
                       f"valid for the CloudStack agent: {len(doc['gpus'])} GPU(s), "
                       f"{vgpus} vGPU instance(s), {vfs} VF instance(s)")]


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


def check_logging(ctx: Context) -> list[Result]:
    """`logging`: log records lost since boot (the hooks drop them silently:
    their stderr belongs to the agent's XML), from `run/gpulib/log-failures`."""
    from gpulib.logs import LOG_FAILURES_FILE, read_failures

    shown = host_path(LOG_FAILURES_FILE)
    notes = read_failures(ctx)
    if not notes:
        return [Result("logging", OK, "log", "no log record lost since boot")]
    return [Result("logging", WARN, shown,
                   f"{len(notes)} gpulib run(s) since boot could not write their log; the "
                   f"last: {notes[-1]}",
                   f"free space under {host_path(LOG_DIR)} or repair syslog (/dev/log), then "
                   f"rm {shown}")]


def _link_hooks_command(directory: str) -> str:
    links = " && ".join(f'ln -sf "$(command -v {exe})" {directory}/{name}'
                        for name, exe in AGENT_HOOK_EXECUTABLES.items())
    return f"mkdir -p {directory} && {links}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def run(ctx: Context, config: Optional[Config] = None, lock_timeout: float = 2.0,
        only: Optional[list[str]] = None) -> Report:
    """Run every check (or `only` these ids) against the host below ctx's root."""
    return Doctor(ctx, config, lock_timeout=lock_timeout).run(only)
