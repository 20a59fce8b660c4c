"""`gpulib snapshot`: what gpulib reads on a host, as a tarball that replays it.

The tarball holds only what gpulib (discovery, the hooks, the doctor) reads,
laid out as on the host, with every member stored relative: unpacked, the
tree works unchanged as `GPULIB_ROOT` (with `GPULIB_SIMULATE=1`, vGPUs can
even be created and removed in it). What goes in:

* for every PCI function, its identity: `class`, `vendor`, `device`,
  `subsystem_*`, `revision`, and its `driver`, `iommu_group`, `physfn` and
  `virtfnN` links (why a GPU was not found shows there);
* in full, sysfs for every PCI function of display or accelerator class, their VFs and
  PFs, audio functions in their slots, every endpoint of their IOMMU groups
  and the bridges above them: the device directories' attribute files (not
  `config`, `resource*`, `rom`; binary, unreadable and write-only files such
  as `create` and `remove` come back empty with their mode), their
  `mdev_supported_types` and `nvidia` directories and live mdev directories,
  and every symlink as it is (`driver`, `iommu_group`, `physfn`, `virtfnN`,
  `mdev_type`, `subsystem`) when its target is in the tarball too; the
  `sys/bus/pci/devices` links, the drivers' directories with their links, the
  IOMMU groups, `sys/class/mdev_bus`, `sys/bus/mdev/devices`,
  `sys/class/iommu` and `sys/module/<name>` (presence only);
* `proc/cmdline`, the CPU vendor line of `proc/cpuinfo`, the boot time of
  `proc/stat` and libvirtd's pid file and `proc/<pid>/stat`;
* `etc/os-release`, `etc/default/grub`, modprobe configuration, gpulib's
  configuration and state, libvirt's domain files (running and defined),
  gpulib's hooks, the `agent.hooks.*` lines of the CloudStack agent's
  properties, `pci.ids` and udev's entries for the functions included;
* what the reports read beyond the host's own files, so a replay reports
  the same: the numbers of NVIDIA vendor-VF types (`nvidia-vgpu-types.json`,
  for the loaded driver, whose `sys/module/nvidia/version` goes in too; the
  host's `nvidia-smi` is asked, as a report would, when they are not cached
  yet, and its answer goes into the tarball only) and the hooks' counters
  (their totals, as one folded `counters.json`: a replay's files are new
  inodes, so the event files would count again).

Secrets are scrubbed from every file outside sysfs: VNC/SPICE `passwd`
attributes, `<secret>` usage and uuid values, anything named like a password,
key or token, and PEM blocks all read `SCRUBBED`. The snapshot never writes
below the root.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import re
import socket
import stat
import tarfile
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Callable, Optional

from gpulib import atomicfile, logger, mdev
from gpulib.cloudstack import STATE_CHANGE_HOOK, TRANSFORMER_HOOK, agent_hooks_dir
from gpulib.config import Config
from gpulib.context import (
    AGENT_PROPERTIES,
    CONFIG_FILE,
    DEFAULT_GRUB,
    DEFINED_DOMAINS,
    LIBVIRT_DAEMONS,
    LIBVIRT_HOOK,
    MODPROBE_DIRS,
    OS_RELEASE,
    PROC_CPUINFO,
    PROC_STAT,
    RUNNING_DOMAINS,
    SNAPSHOT_MANIFEST,
    STATE_FILE,
    Context,
)
from gpulib.errors import GpulibError, InputError
from gpulib.pci import (
    PCI_DEVICES,
    PciAddress,
    PciFunction,
    group_number,
    has_gpu_class,
    iommu_group_members,
    list_addresses,
    virtfn_links,
)
from gpulib.pciids import PCI_IDS_PATHS
from gpulib.sysfs import ReadFailure, read_file
from gpulib.validate import decimal, is_uuid

if TYPE_CHECKING:
    from gpulib.discovery import Inventory

log = logger.get(__name__)

FORMAT = 1
MANIFEST = SNAPSHOT_MANIFEST
SCRUBBED = "SCRUBBED"
ATTR_MAX = 64 * 1024
FILE_MAX = 16 * 1024 * 1024

# Device attributes left out, and those recreated empty without reading them
# (write-only triggers, and vpd: binary and slow to read on some devices).
SKIP_ATTRS = frozenset({"config", "rom"})
EMPTY_ATTRS = frozenset({"vpd", "reset", "remove", "rescan"})
# Subdirectories of a device directory that gpulib reads (with their depth).
DEVICE_SUBDIRS = {mdev.TYPES_DIR: 2, "nvidia": 1}
# Links kept even when their target is outside the tarball (the target dir is created).
KNOWN_LINKS = frozenset({"driver", "iommu_group", "physfn", "subsystem", "mdev_type"})
# Of every other PCI function: what identifies it and says who holds it.
IDENTITY_ATTRS = frozenset({"class", "vendor", "device", "subsystem_vendor",
                            "subsystem_device", "revision"})
IDENTITY_LINKS = frozenset({"driver", "iommu_group", "physfn"})
MODULES = ("nouveau", "nvidia", "nvidia_vgpu_vfio", "nvidia_drm", "nvidia_modeset",
           "nvidia_uvm", "vfio", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1", "mdev",
           "vfio_mdev", "kvm", "kvm_intel", "kvm_amd", "kvmgt", "i915", "xe", "amdgpu",
           "radeon", "gim", "pci_stub", "snd_hda_intel")
AUDIO_BASE = 0x04


# -- scrubbing --------------------------------------------------------------------------

# A name that holds a secret: *password*, *passwd*, *passphrase*, *secret*, *token*,
# *credential(s)*, *pwd; `key` or `pass` as a whole word of the name (api_key,
# ssl.key, db-pass: not keymap, monkey, bypass).
_NAME = (r"(?<![\w.-])(?:[\w.-]*(?:passw(?:or)?d|passphrase|secret|token|credentials?|pwd)"
         r"|(?:[\w.-]*[_.-])?(?:api|private|access|auth|ssh|secret)?key"
         r"|(?:[\w.-]*[_.-])?pass)")
_QUOTED = re.compile(_NAME + r"""(\s*[=:]\s*)(['"])(.*?)\2""", re.I | re.S)
_BARE = re.compile(_NAME + r"""(\s*[=:]\s*)(?!['"\s])([^\s'"<>,;&]+)""", re.I)
_JSON = re.compile(r'"(' + _NAME[len(r"(?<![\w.-])"):] + r')"(\s*:\s*)"((?:[^"\\]|\\.)*)"',
                   re.I)
_SECRET_TAG = re.compile(r"<secret\b[^>]*>", re.I)
_SECRET_ATTR = re.compile(r"""(\b(?:uuid|usage|value)\s*=\s*)(['"])(.*?)\2""", re.I | re.S)
_ELEMENT = re.compile(r"(<(passwd|password|passphrase|secret|token|key)\b[^>/]*>)"
                      r"([^<]*)(</\2\s*>)", re.I)
_PEM = re.compile(r"(-----BEGIN [A-Z0-9 ]+-----)(.*?)(-----END [A-Z0-9 ]+-----)", re.S)


def scrub(text: str) -> str:
    """`text` with every secret it seems to hold replaced by SCRUBBED."""
    text = _PEM.sub(lambda m: f"{m.group(1)}\n{SCRUBBED}\n{m.group(3)}", text)
    text = _SECRET_TAG.sub(
        lambda m: _SECRET_ATTR.sub(lambda a: f"{a.group(1)}{a.group(2)}{SCRUBBED}{a.group(2)}",
                                   m.group(0)), text)
    text = _ELEMENT.sub(lambda m: f"{m.group(1)}{SCRUBBED}{m.group(4)}", text)
    text = _JSON.sub(lambda m: f'"{m.group(1)}"{m.group(2)}"{SCRUBBED}"', text)
    text = _QUOTED.sub(lambda m: f"{m.group(0)[:m.start(2) - m.start(0)]}{m.group(2)}"
                                 f"{SCRUBBED}{m.group(2)}", text)
    text = _BARE.sub(lambda m: f"{m.group(0)[:m.start(2) - m.start(0)]}{SCRUBBED}", text)
    return text


# -- what goes in ----------------------------------------------------------------------


@dataclass
class Entry:
    kind: str  # "dir", "file" or "link"
    mode: int
    mtime: float
    data: bytes = b""
    target: str = ""


def all_functions(ctx: Context) -> list[PciAddress]:
    """Every PCI function; [] (logged) when `sys/bus/pci/devices` cannot be
    listed: a snapshot of such a host is still worth having."""
    try:
        return list_addresses(ctx.sysfs)
    except GpulibError as exc:
        log.warning("snapshot: %s", exc.message)
        return []


def select_functions(ctx: Context, config: Optional[Config] = None) -> list[PciAddress]:
    """The PCI functions whose directories go into the snapshot in full."""
    sysfs = ctx.sysfs
    include = (config or Config()).match("discovery", "include")
    fns = {a: PciFunction.read_ids(sysfs, a) for a in all_functions(ctx)}
    selected: set[PciAddress] = set()
    for a, fn in fns.items():
        if has_gpu_class(fn.class_code) or \
                (include and include.matches(a, fn.vendor_id, fn.device_id)):
            selected.add(a)
    for a in list(selected):
        physfn = fns[a].physfn
        if physfn is not None and physfn in fns:
            selected.add(physfn)
    for a in list(selected):
        selected.update(vf for _, vf in virtfn_links(sysfs, a))
    slots = {a.slot_key for a in selected}
    selected.update(a for a, fn in fns.items()
                    if fn.class_code >> 8 == AUDIO_BASE and a.slot_key in slots)
    for a in list(selected):
        group = group_number(sysfs.link_name(f"{PCI_DEVICES}{a}/iommu_group"))
        if group is not None:
            selected.update(iommu_group_members(sysfs, group))
    chain: set[PciAddress] = set()
    for a in selected:
        try:
            canonical = sysfs.resolve(f"{PCI_DEVICES}{a}")
        except ValueError:
            continue
        for part in canonical.split("/")[:-1]:
            try:
                chain.add(PciAddress.parse(part))
            except GpulibError:
                continue
    return sorted(selected | chain)


class Collector:
    """Gathers the snapshot's entries (root-relative path -> Entry); reads only."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.sysfs = ctx.sysfs
        self.entries: dict[str, Entry] = {}
        self.functions: list[PciAddress] = []  # captured in full
        self.ctimes: dict[str, float] = {}  # what the doctor compares: see _manifest
        self.identities: list[PciAddress] = []  # the others: identity files and links only

    # -- low level ----------------------------------------------------------------------
    def _lstat(self, rel: str) -> Optional[os.stat_result]:
        try:
            return os.lstat(self.ctx.path(rel))
        except OSError:
            return None

    def _parents(self, rel: str) -> None:
        parent = posixpath.dirname(rel)
        missing = []
        while parent and parent not in self.entries:
            missing.append(parent)
            parent = posixpath.dirname(parent)
        for d in reversed(missing):
            st = self._lstat(d)
            if st is not None and stat.S_ISDIR(st.st_mode):
                self.entries[d] = Entry("dir", stat.S_IMODE(st.st_mode) | 0o700, st.st_mtime)
            else:
                self.entries[d] = Entry("dir", 0o755, time.time())

    def add_dir(self, rel: str) -> None:
        if rel in self.entries:
            return
        self._parents(rel)
        st = self._lstat(rel)
        if st is not None and stat.S_ISDIR(st.st_mode):
            self.entries[rel] = Entry("dir", stat.S_IMODE(st.st_mode) | 0o700, st.st_mtime)
        else:
            self.entries[rel] = Entry("dir", 0o755, time.time())

    def add_file(self, rel: str, data: bytes, mode: int, mtime: float) -> None:
        self._parents(rel)
        self.entries[rel] = Entry("file", mode, mtime, data=data)

    def add_link(self, rel: str) -> None:
        """A symlink as it is, made relative if it was absolute."""
        try:
            target = os.readlink(self.ctx.path(rel))
        except OSError:
            return
        st = self._lstat(rel)
        if target.startswith("/"):
            target = posixpath.relpath(posixpath.normpath(target.lstrip("/")) or ".",
                                       posixpath.dirname(rel) or ".")
        self._parents(rel)
        self.entries[rel] = Entry("link", 0o777, st.st_mtime if st else time.time(),
                                  target=target)

    def _read(self, rel: str, limit: int) -> Optional[bytes]:
        data = read_file(self.ctx.path(rel), limit)
        return None if isinstance(data, ReadFailure) else data

    def copy_attr(self, rel: str, st: os.stat_result) -> None:
        """A sysfs attribute: its text, or empty with its mode when it cannot be read."""
        name = posixpath.basename(rel)
        if name in SKIP_ATTRS or name.startswith("resource"):
            return
        mode = stat.S_IMODE(st.st_mode)
        data: Optional[bytes] = b""
        if name not in EMPTY_ATTRS and mode & 0o444:
            data = self._read(rel, ATTR_MAX)
            if data is None or b"\0" in data:
                data = b""
            else:
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError:
                    data = b""
        self.add_file(rel, data or b"", mode, st.st_mtime)

    def copy_entries(self, rel: str, on_dir: Callable[[str, str], None]) -> None:
        """A directory's attributes and links; each subdirectory goes to on_dir(name, rel)."""
        self.add_dir(rel)
        for name in sorted(self.sysfs.listdir(rel)):
            child = f"{rel}/{name}"
            st = self._lstat(child)
            if st is None:
                continue
            if stat.S_ISLNK(st.st_mode):
                self.add_link(child)
            elif stat.S_ISREG(st.st_mode):
                self.copy_attr(child, st)
            elif stat.S_ISDIR(st.st_mode):
                on_dir(name, child)

    def copy_tree(self, rel: str, depth: int) -> None:
        """A directory's attributes and links, and its subdirectories to `depth`."""
        def subdir(_name: str, child: str) -> None:
            if depth > 0:
                self.copy_tree(child, depth - 1)

        self.copy_entries(rel, subdir)

    def copy_host_file(self, rel: str, keep: Optional[Callable[[str], str]] = None) -> bool:
        """A configuration or state file: its (scrubbed) text as a regular file."""
        real = self.sysfs.resolve_in_root(rel)
        if real is None:
            return False
        st = self._lstat(real)
        own = self._lstat(rel)
        if st is None or own is None or not stat.S_ISREG(st.st_mode):
            return False
        data = self._read(real, FILE_MAX)
        if data is None:
            log.info("snapshot: %s left out (unreadable or larger than %d bytes)", rel, FILE_MAX)
            return False
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            log.info("snapshot: %s left out (not text)", rel)
            return False
        if keep is not None:
            text = keep(text)
        # The link's own mtime, as the host shows it (when a hook appeared,
        # its ctime, goes into the manifest: `Collector.ctimes`).
        self.add_file(rel, scrub(text).encode("utf-8"), stat.S_IMODE(st.st_mode), own.st_mtime)
        return True

    def copy_versions(self) -> None:
        """What tells libvirt's and QEMU's versions (the doctor's `migration`
        check): libvirt's QEMU capabilities cache, only its version lines;
        libvirt's library, by name (empty: the name is the fact); the package
        database's QEMU stanzas."""
        from gpulib.doctor import migration

        caps = migration.CAPS_CACHE
        for name in sorted(self.sysfs.listdir(caps)):
            if name.endswith(".xml"):
                self.copy_host_file(f"{caps}/{name}", keep=migration.caps_lines)
        for rel in migration.LIB_DIRS:
            for name in sorted(self.sysfs.listdir(rel)):
                if migration.is_libvirt_soname(name):
                    st = self._lstat(f"{rel}/{name}")
                    self.add_file(f"{rel}/{name}", b"", 0o644, st.st_mtime if st else time.time())
        self.copy_host_file(migration.DPKG_STATUS, keep=migration.qemu_stanzas)

    def copy_files_in(self, directory: str, suffix: str = "") -> None:
        for name in sorted(self.sysfs.listdir(directory)):
            if name.endswith(suffix) and not name.startswith("."):
                self.copy_host_file(f"{directory}/{name}")

    # -- sysfs --------------------------------------------------------------------------
    def copy_device(self, address: PciAddress, groups: set[str], drivers: set[str]) -> None:
        bus = f"{PCI_DEVICES}{address}"
        self.add_link(bus)
        try:
            canonical = self.sysfs.resolve(bus)
        except ValueError:
            return

        def subdir(name: str, child: str) -> None:
            if name in DEVICE_SUBDIRS:
                self.copy_tree(child, DEVICE_SUBDIRS[name])
            elif is_uuid(name) and self._lstat(f"{child}/mdev_type") is not None:
                self.copy_tree(child, 0)  # a live mdev
                group = self.sysfs.link_name(f"{child}/iommu_group")
                if group:
                    groups.add(group)

        self.copy_entries(canonical, subdir)
        group = self.sysfs.link_name(f"{bus}/iommu_group")
        if group:
            groups.add(group)
        driver = self.sysfs.link_name(f"{bus}/driver")
        if driver:
            drivers.add(driver)
        self.copy_host_file(f"run/udev/data/+pci:{address}")

    def copy_identity(self, address: PciAddress) -> None:
        """What tells why discovery did or did not take a function: its ids,
        class, driver, IOMMU group and SR-IOV links (no other attribute)."""
        bus = f"{PCI_DEVICES}{address}"
        self.add_link(bus)
        try:
            canonical = self.sysfs.resolve(bus)
        except ValueError:
            return
        self.add_dir(canonical)
        for name in sorted(self.sysfs.listdir(canonical)):
            if name not in IDENTITY_ATTRS and name not in IDENTITY_LINKS and \
                    not name.startswith("virtfn"):
                continue
            child = f"{canonical}/{name}"
            st = self._lstat(child)
            if st is None:
                continue
            if stat.S_ISLNK(st.st_mode):
                self.add_link(child)
            elif stat.S_ISREG(st.st_mode) and name in IDENTITY_ATTRS:
                self.copy_attr(child, st)

    def copy_sysfs(self) -> None:
        config = Config.load(self.ctx.config_path, lenient=True)
        self.functions = select_functions(self.ctx, config)
        self.add_dir(PCI_DEVICES.rstrip("/"))
        groups: set[str] = set()
        drivers: set[str] = {"vfio-pci", "pci-stub"}
        for address in self.functions:
            # One device that cannot be read is left out; the others are kept.
            try:
                self.copy_device(address, groups, drivers)
            except OSError as exc:
                log.warning("snapshot: PCI device %s left out: %s", address, exc)
        full = set(self.functions)
        for address in all_functions(self.ctx):
            if address in full:
                continue
            try:
                self.copy_identity(address)
            except OSError as exc:
                log.warning("snapshot: PCI device %s left out: %s", address, exc)
                continue
            self.identities.append(address)
        for driver in sorted(drivers):
            rel = f"sys/bus/pci/drivers/{driver}"
            if self.sysfs.isdir(rel):
                self.copy_tree(rel, 0)
        for group in sorted(groups):
            rel = f"sys/kernel/iommu_groups/{group}"
            if self.sysfs.isdir(rel):
                self.copy_tree(rel, 1)
        self.add_dir("sys/kernel/iommu_groups")
        for base in (mdev.MDEV_BUS, mdev.MDEV_DEVICES):
            if self.sysfs.isdir(base):
                self.add_dir(base)
                for name in sorted(self.sysfs.listdir(base)):
                    self.add_link(f"{base}/{name}")
        for name in sorted(self.sysfs.listdir("sys/class/iommu")):
            self.add_dir(f"sys/class/iommu/{name}")
        for module in MODULES:
            if self.sysfs.isdir(f"sys/module/{module}"):
                self.add_dir(f"sys/module/{module}")

    # -- host files ---------------------------------------------------------------------
    def copy_host(self) -> None:
        self.copy_host_file("proc/cmdline")
        self.copy_host_file(PROC_CPUINFO, keep=_first_cpu)
        self.copy_host_file(PROC_STAT, keep=lambda t: _lines(t, ("btime ",)))
        for _daemon, pidfile in LIBVIRT_DAEMONS:
            if self.copy_host_file(pidfile):
                pid = (self.sysfs.read(pidfile) or "").strip()
                if decimal(pid, 10) is not None:
                    self.copy_host_file(f"proc/{pid}/stat")
        if not self.copy_host_file(OS_RELEASE):
            self.copy_host_file("usr/lib/os-release")
        self.copy_host_file(DEFAULT_GRUB)
        self.copy_versions()
        for directory in MODPROBE_DIRS:
            self.copy_files_in(directory, ".conf")
        for root, _dirs, files in _walk(self.ctx, posixpath.dirname(CONFIG_FILE), 2):
            for name in files:
                self.copy_host_file(f"{root}/{name}")
        self.copy_host_file(STATE_FILE)
        self.copy_files_in(RUNNING_DOMAINS, ".xml")
        self.copy_files_in(DEFINED_DOMAINS, ".xml")
        if self.copy_host_file(LIBVIRT_HOOK):
            st = self._lstat(LIBVIRT_HOOK)
            if st is not None:
                self.ctimes[LIBVIRT_HOOK] = st.st_ctime
        if self.sysfs.isdir("etc/cloudstack/agent"):
            self.add_dir("etc/cloudstack/agent")
            self.copy_host_file(AGENT_PROPERTIES,
                                keep=lambda t: _lines(t, ("agent.hooks.",)))
            base = agent_hooks_dir(self.ctx)
            if self.sysfs.isdir(base):
                self.add_dir(base)
            for name in (TRANSFORMER_HOOK, STATE_CHANGE_HOOK):
                self.copy_host_file(f"{base}/{name}")
        for rel in PCI_IDS_PATHS:
            if self.copy_host_file(rel):
                break

    # -- links whose target stayed behind -----------------------------------------------
    def settle_links(self) -> None:
        for rel in sorted(r for r, e in self.entries.items() if e.kind == "link"):
            entry = self.entries[rel]
            target = posixpath.normpath(posixpath.join(posixpath.dirname(rel), entry.target))
            if target == ".." or target.startswith("../"):
                del self.entries[rel]
                continue
            if target in self.entries:
                continue
            name = posixpath.basename(rel)
            if name in KNOWN_LINKS or name.startswith("virtfn"):
                self.add_dir(target)
            else:
                del self.entries[rel]

    # -- what gpulib's reports keep beside the host's files -----------------------------
    def copy_gpulib_caches(self) -> None:
        from gpulib import counters, nvidiasmi
        from gpulib.hostview import discover_host

        now = time.time()
        config = Config.load(self.ctx.config_path, lenient=True)
        inventory = None
        try:
            inventory = discover_host(self.ctx, config, learn=False)
        except GpulibError as exc:
            log.warning("snapshot: NVIDIA vGPU type numbers left out: %s", exc.message)
            gpus = []
        else:
            gpus = inventory.vendor_vf_gpus()
        version = nvidiasmi.DRIVER_VERSION
        st = self._lstat(version)
        if st is not None and stat.S_ISREG(st.st_mode):
            self.copy_attr(version, st)
        if gpus:
            _, cache, _ = nvidiasmi.lookup(
                self.ctx.root, gpus, config.get_float("discovery", "nvidia_smi_timeout"))
            self.add_file(nvidiasmi.CACHE_FILE, cache.dumps(), 0o644, now)
        if inventory is not None:
            self.copy_mig_layouts(inventory, config, now)
        totals = counters.read(self.ctx.root)
        if totals:
            self.add_file(counters.TOTALS_FILE, counters.Totals(totals).to_bytes(), 0o644, now)

    def copy_mig_layouts(self, inventory: Inventory, config: Config, now: float) -> None:
        """The MIG layouts of the GPUs with vendor VFs (MIG mode, profiles,
        GPU and compute instances), as the reports read them (the cache, else
        the host's nvidia-smi, nothing written on the host), held in the
        replay while its VFs show what they show here."""
        from gpulib import migtool

        gpus = migtool.wanted(inventory)
        if not gpus:
            return
        found = migtool.layouts(self.ctx.root, gpus,
                                config.get_float("discovery", "nvidia_smi_timeout"), save=False)
        if found:
            self.add_file(migtool.CACHE_FILE, migtool.frozen_cache(self.ctx.root, gpus, found,
                                                                   now), 0o644, now)

    def collect(self) -> dict[str, Entry]:
        self.copy_sysfs()
        self.copy_host()
        self.copy_gpulib_caches()
        self.settle_links()
        return self.entries


def _lines(text: str, prefixes: tuple[str, ...]) -> str:
    kept = [line for line in text.splitlines() if line.startswith(prefixes)]
    return "\n".join(kept) + ("\n" if kept else "")


def _first_cpu(text: str) -> str:
    """The first processor's vendor and model lines (all the doctor needs)."""
    kept: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            break
        if line.split(":", 1)[0].strip() in ("processor", "vendor_id", "model name"):
            kept.append(line)
    return "\n".join(kept) + ("\n" if kept else "")


def _walk(ctx: Context, rel: str, depth: int) -> list[tuple[str, list[str], list[str]]]:
    """(dir, subdirs, files) below a root-relative directory, links not followed."""
    out: list[tuple[str, list[str], list[str]]] = []
    dirs: list[str] = []
    files: list[str] = []
    for name in sorted(ctx.sysfs.listdir(rel)):
        try:
            st = os.lstat(ctx.path(f"{rel}/{name}"))
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            dirs.append(name)
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            files.append(name)
    out.append((rel, dirs, files))
    if depth > 1:
        for d in dirs:
            out.extend(_walk(ctx, f"{rel}/{d}", depth - 1))
    return out


# -- the tarball -----------------------------------------------------------------------


def hostname(ctx: Context) -> str:
    """The snapshotted host's name, safe for a file name."""
    name = ctx.sysfs.read("proc/sys/kernel/hostname") or ctx.sysfs.read("etc/hostname") or ""
    if not name and os.path.realpath(ctx.root) == "/":
        name = socket.gethostname()
    words = name.split()
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", words[0] if words else "")
    return name.strip(".-") or "host"


def default_filename(ctx: Context, now: Optional[float] = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"gpulib-snapshot-{hostname(ctx)}-{stamp}.tar.gz"


@dataclass
class Summary:
    functions: int
    files: int
    links: int
    dirs: int


def _manifest(ctx: Context, collector: Collector, now: float) -> bytes:
    from gpulib import version

    doc = {
        "format": FORMAT,
        "gpulib": version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "hostname": hostname(ctx),
        "functions": [str(a) for a in collector.functions],
        "identity_only": [str(a) for a in collector.identities],
        # Unpacked, a file's ctime is the time it was unpacked: the doctor's
        # `libvirt` check takes the qemu hook's from here in a replay.
        "ctimes": collector.ctimes,
        "use": "unpack, then GPULIB_ROOT=<dir> GPULIB_SIMULATE=1 gpulib discover",
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


def _add_entries(tar: tarfile.TarFile, entries: dict[str, Entry]) -> None:
    """Members in path order (a directory before what it holds), owned by root."""
    for rel in sorted(entries):
        e = entries[rel]
        info = tarfile.TarInfo(rel)
        info.mtime = int(e.mtime)
        info.mode = e.mode
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        if e.kind == "dir":
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        elif e.kind == "link":
            info.type = tarfile.SYMTYPE
            info.linkname = e.target
            tar.addfile(info)
        else:
            info.size = len(e.data)
            tar.addfile(info, io.BytesIO(e.data))


def write(ctx: Context, fileobj: IO[bytes], stream: bool = False) -> Summary:
    """Write the snapshot of the host below ctx's root as a .tar.gz to `fileobj`."""
    collector = Collector(ctx)
    entries = collector.collect()
    now = time.time()
    entries[MANIFEST] = Entry("file", 0o644, now, data=_manifest(ctx, collector, now))
    if stream:
        with tarfile.open(fileobj=fileobj, mode="w|gz", format=tarfile.PAX_FORMAT) as tar:
            _add_entries(tar, entries)
    else:
        with tarfile.open(fileobj=fileobj, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
            _add_entries(tar, entries)
    kinds = [e.kind for e in entries.values()]
    return Summary(len(collector.functions), kinds.count("file"), kinds.count("link"),
                   kinds.count("dir"))


def create(ctx: Context, output: Optional[str] = None,
           stdout: Optional[IO[bytes]] = None) -> tuple[str, Summary]:
    """Write the snapshot to `output` (default name in the cwd; `-` = `stdout`).

    What `output` may be, decided before anything is written:
    * missing or a regular file: the file appears whole or not at all (an
      exclusively created temp file beside it, never following a link, then
      renamed: `atomicfile.write_atomic`);
    * a directory: the default name inside it;
    * a FIFO or a character device (`/dev/null`, `/dev/stdout`, a named
      pipe), also through a symlink: written to as a stream, as a shell
      redirect would, never replaced;
    * anything else (a symlink to a file, a block device, a socket): refused,
      nothing written.
    """
    if output == "-":
        if stdout is None:
            raise InputError("no stream to write the snapshot to")
        summary = write(ctx, stdout, stream=True)
        stdout.flush()
        return "-", summary
    path = os.path.abspath(output or default_filename(ctx))
    if os.path.isdir(path):
        path = os.path.join(path, default_filename(ctx))
    kind = _output_kind(path)
    try:
        if kind == "stream":
            return path, _write_stream(ctx, path)
        buf = io.BytesIO()
        summary = write(ctx, buf)
        atomicfile.write_atomic(path, buf.getvalue(), 0o644)
    except OSError as exc:
        raise GpulibError(f"cannot write snapshot {path}: {exc.strerror or exc}") from None
    return path, summary


def _output_kind(path: str) -> str:
    """"file" (create or replace atomically) or "stream" (write into it); refuses
    what is neither."""
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        return "file"
    except OSError as exc:
        raise GpulibError(f"cannot write snapshot {path}: {exc.strerror or exc}") from None
    if stat.S_ISREG(link.st_mode):
        return "file"
    try:
        target = os.stat(path) if stat.S_ISLNK(link.st_mode) else link
    except OSError:
        target = None
    if target is not None and (stat.S_ISFIFO(target.st_mode) or stat.S_ISCHR(target.st_mode)):
        return "stream"
    what = ("a symbolic link" if stat.S_ISLNK(link.st_mode) else
            "a block device" if stat.S_ISBLK(link.st_mode) else
            "a socket" if stat.S_ISSOCK(link.st_mode) else "not a regular file")
    raise InputError(f"refusing to write the snapshot to {path}: it is {what} (give a new "
                     "file name, a regular file, a FIFO or a character device)")


def _write_stream(ctx: Context, path: str) -> Summary:
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        # Swapped for something else since it was looked at: do not write.
        os.close(fd)
        raise InputError(f"refusing to write the snapshot to {path}: it changed while "
                         "being opened")
    if os.isatty(fd):
        os.close(fd)
        raise InputError(f"refusing to write a tarball to the terminal {path}")
    with os.fdopen(fd, "wb") as fh:
        return write(ctx, fh, stream=True)
