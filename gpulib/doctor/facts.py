"""The facts every check reads, each read once (the loop that runs the
checks is `gpulib.doctor.runner`, above the checks).

The doctor never writes: discovery runs without learning names, the state
file is read without the lock, and the lock is only tried.
"""

from __future__ import annotations

import json
import os
import re
import time

from gpulib import logger
from gpulib.bootconfig import DEFAULT_GRUB, GPULIB_DROP_IN
from gpulib.bootstate import NextBoot, RunningBoot, initramfs_argv
from gpulib.config import Config
from gpulib.context import SNAPSHOT_MANIFEST, STATE_DIR, STATE_FILE, Context
from gpulib.discovery import Gpu, Inventory
from gpulib.doctor.actions import render
from gpulib.doctor.core import (
    AMD_VENDOR,
    BOOT_ID,
    FAIL,
    PROC_CPUINFO,
    PROC_STAT,
    SETUP_JOURNAL,
    Distro,
    Result,
    host_path,
)
from gpulib.hostview import discover_host
from gpulib.nvidia import NVIDIA_VENDOR
from gpulib.pci import BRIDGE_BASE_CLASS, PciAddress, PciFunction
from gpulib.state import CorruptStateError, State, StateVersionError
from gpulib.sysfs import DOCUMENT_MAX, ReadFailure, read_file
from gpulib.validate import decimal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.actions import Action

log = logger.get(__name__)

# How long the `state` check waits for gpulib's lock before it calls the lock
# stuck: one figure for `gpulib doctor` and `gpulib metrics`, so
# the same host gets the same answer from each (a hook holds it for far less).
STATE_LOCK_WAIT = 2.0


class Facts:
    """What the checks read of the host below `ctx`'s root, each read once;
    never writes. The checks are run by `gpulib.doctor.runner.Doctor`."""

    def __init__(self, ctx: Context, config: Optional[Config] = None,
                 lock_timeout: float = STATE_LOCK_WAIT, clock_ticks: Optional[int] = None,
                 inventory: Optional[Inventory] = None) -> None:
        self.ctx = ctx
        self.sysfs = ctx.sysfs
        self.lock_timeout = lock_timeout
        self.clock_ticks = clock_ticks
        self.distro = Distro.read(ctx)
        # A configuration handed over (`gpulib metrics` read it leniently)
        # carries its problems and warnings: the `config` check reports them.
        self._config = config
        self._state: Optional[State] = None
        self._state_error: Optional[tuple[str, str, str]] = None  # (status, message, fix)
        self._state_loaded = False
        self._inventory: Optional[Inventory] = inventory  # given: the caller read the host
        self._running: Optional[RunningBoot] = None
        self._next_boot: Optional[NextBoot] = None
        self._journal: Optional[dict[str, object]] = None

    # -- facts, read once -----------------------------------------------------------
    @property
    def config(self) -> Config:
        if self._config is None:
            # Lenient: the other checks run with what can be read; the
            # problems are the `config` check's finding.
            self._config = Config.load(self.ctx.config_path, lenient=True)
        return self._config

    @property
    def state(self) -> State:
        """The state file's content (empty when missing or unusable)."""
        if not self._state_loaded:
            self._state_loaded = True
            self._state = self._load_state()
        return self._state or State()

    def _load_state(self) -> Optional[State]:
        raw = read_file(self.ctx.state_path, DOCUMENT_MAX)
        if isinstance(raw, ReadFailure):
            if raw.missing:
                return None
            self._state_error = (
                FAIL, f"cannot read the state file: {raw.reason}",
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
    def running(self) -> RunningBoot:
        """The running boot (its kernel command line): setup's reading too."""
        if self._running is None:
            self._running = RunningBoot(self.sysfs)
        return self._running

    @property
    def next_boot(self) -> NextBoot:
        """What the next boot gets (command line, modprobe options, initramfs tool):
        setup plans from the same reading."""
        if self._next_boot is None:
            self._next_boot = NextBoot(self.sysfs, self.distro.family)
        return self._next_boot

    @property
    def cmdline(self) -> list[str]:
        """The running kernel's command line."""
        return self.running.args

    def params(self, name: str) -> list[str]:
        """Every value of `name=` on the running kernel's command line."""
        return self.running.params(name)

    def initramfs_argv(self) -> Optional[tuple[str, ...]]:
        """The installed initramfs tool's command for every installed kernel."""
        return initramfs_argv(self.next_boot.initramfs_tool())

    def initramfs_update(self) -> str:
        """That command as text, or both where none is known."""
        argv = self.initramfs_argv()
        if argv:
            return " ".join(argv)
        return ("update-initramfs -u -k all (initramfs-tools) or dracut -f --regenerate-all "
                "(dracut)")

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
        """The GPUs offered whole: not shared as vGPU, not the host's console."""
        return [g for g in self.inventory.gpus if not self.is_vgpu_gpu(g) and not g.console]

    @staticmethod
    def label(gpu: Gpu) -> str:
        return f"{gpu.address} ({gpu.device_name or gpu.fn.class_name})"

    def rebind_fix(self, address: PciAddress) -> str:
        """The fix for a device on the wrong driver: vfio-pci from the next boot on,
        never a live rebind (the device may be in use: a vGPU parent, the console).
        driverctl's override file, which its udev rule applies when the device appears
        at boot: `driverctl set-override`, even with --noprobe, unbinds it at once."""
        return (f"printf 'vfio-pci\\n' > /etc/driverctl.d/pci-{address}\n"
                "(driverctl's record, applied at the next boot; nothing is rebound now; "
                "needs driverctl installed)")

    # -- running ------------------------------------------------------------------------
    # -- what gpulib setup changed, and whether the host booted since -------------------
    @property
    def configured_args(self) -> list[str]:
        """The kernel arguments the boot configuration gives (what the next boot gets):
        /etc/default/grub and the drop-ins grub-mkconfig reads after it, and EL's
        /etc/kernel/cmdline (`NextBoot.args`)."""
        return self.next_boot.args()

    def snapshot_ctime(self, rel: str) -> Optional[float]:
        """The ctime `rel` had on the host of which the root is a replay
        (`gpulib snapshot`'s manifest; None on a host itself)."""
        text = self.sysfs.read(SNAPSHOT_MANIFEST)
        if not text:
            return None
        try:
            ctimes = json.loads(text).get("ctimes")
        except (ValueError, AttributeError):
            return None
        value = ctimes.get(rel) if isinstance(ctimes, dict) else None
        return float(value) if isinstance(value, (int, float)) and \
            not isinstance(value, bool) else None

    def boot_id(self) -> Optional[str]:
        text = self.sysfs.read(BOOT_ID)
        return text.strip() if text else None

    def btime(self) -> Optional[int]:
        for line in (self.sysfs.read(PROC_STAT) or "").splitlines():
            if line.startswith("btime "):
                value = line.split()[1]
                return decimal(value, 20)
        return None

    @property
    def journal(self) -> dict[str, object]:
        """gpulib setup's record of its last apply ({} when none or unreadable)."""
        if self._journal is None:
            self._journal = {}
            text = self.sysfs.read(SETUP_JOURNAL)
            if text:
                try:
                    doc = json.loads(text)
                except ValueError:
                    doc = None
                if isinstance(doc, dict):
                    self._journal = doc
        return self._journal

    def setup_pending(self, check: str) -> Optional[str]:
        """When gpulib setup applied `check`'s fix during this boot: its time, else None.

        None too while a command that serves `check` is outstanding (a later apply's
        initramfs that failed): the fix waits for that step, not for a reboot, whatever
        an earlier apply of this boot completed."""
        j = self.journal
        pending = j.get("pending_reboot")
        if not isinstance(pending, list) or check not in pending:
            return None
        if self.setup_outstanding(check):
            return None
        applied = j.get("applied_at")
        current = self.boot_id()
        if current and isinstance(j.get("boot_id"), str):
            same_boot = j.get("boot_id") == current
        else:
            btime = self.btime()
            same_boot = btime is not None and isinstance(applied, (int, float)) and \
                applied >= btime
        if not same_boot:
            return None
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(applied))) \
            if isinstance(applied, (int, float)) else "an earlier run"

    def setup_unfinished(self) -> str:
        """The commands gpulib setup's last apply left undone (as text, "" if none): what
        it changed waits for them, not for a reboot."""
        items = self.journal.get("outstanding")
        shown = [" ".join(str(a) for a in item["argv"]) for item in
                 (items if isinstance(items, list) else [])
                 if isinstance(item, dict) and isinstance(item.get("argv"), list)]
        return "; ".join(shown)

    def args_where(self) -> str:
        """The file a kernel argument goes to (as shown), as gpulib setup edits it: the
        file whose value wins if it is /etc/default/grub or gpulib's own drop-in, else
        (another drop-in supersedes /etc/default/grub's value: a cloud image's) gpulib's
        drop-in, sourced last (`bootconfig.owned_edit`)."""
        grub = self.next_boot.grub
        if grub is None:
            return "/" + DEFAULT_GRUB
        where = grub.where(self.distro.grub_key)
        if where in (DEFAULT_GRUB, GPULIB_DROP_IN) or not self.next_boot.drop_ins:
            return "/" + where
        return "/" + GPULIB_DROP_IN

    def setup_outstanding(self, check: str) -> str:
        """The commands gpulib setup planned for `check` and did not complete, as text
        ("" if none)."""
        items = self.journal.get("outstanding")
        shown = [" ".join(str(a) for a in item["argv"]) for item in
                 (items if isinstance(items, list) else [])
                 if isinstance(item, dict) and isinstance(item.get("argv"), list)
                 and isinstance(item.get("checks"), list) and check in item["checks"]]
        return "; ".join(dict.fromkeys(shown))

    def vfio_pending(self, ids: set[tuple[int, int]]) -> Optional[str]:
        """gpulib setup configured vfio-pci for these ids in this boot: when, else None."""
        configured: set[tuple[int, int]] = set()
        for key in self.next_boot.vfio_ids():
            parts = key.split(":")
            try:
                configured.add((int(parts[0], 16), int(parts[1], 16)))
            except (IndexError, ValueError):
                continue
        if not ids <= configured:
            return None
        return self.setup_pending("driver-binding")

    def result(self, check: str, status: str, subject: str, message: str,
               actions: list[Action], pending: Optional[str] = None) -> Result:
        """A finding whose fix text is its actions, rendered for this distribution."""
        return Result(check, status, subject, message, render(actions, self.distro) or None,
                      actions=actions, pending=pending)
