"""What the host boots with: the running boot as the kernel shows it, and the next
boot as its configuration says. `gpulib setup` plans from them and the doctor judges
by them: one reading of each for both (ARCHITECTURE.md, "Host setup").

* `RunningBoot`: the kernel command line this boot started with (`/proc/cmdline`).
* `NextBoot`: what the next boot gets:
  - the kernel command line, from every place that gives it: grub's files as
    grub-mkconfig sources them (`gpulib.bootconfig`) and, on EL, the
    `/etc/kernel/cmdline` kernel-install gives kernels installed later. An
    argument is configured when every place gives it;
  - modprobe's options in modprobe's order: every `*.conf` of the modprobe.d
    directories sorted by name (a name in /etc/modprobe.d hides the same name
    further down), then the kernel command line's `vfio-pci.ids=` (kmod adds
    it last: `modprobe -n -v vfio-pci` shows `ids=<files'> ids=<command
    line's>`). `ids` is a string parameter: the last value given wins, so the
    command line's, where there is one;
  - the initramfs tool that is installed (initramfs-tools or dracut), whatever
    the distribution family: Debian 13 hosts often run dracut.
"""

from __future__ import annotations

import os

from gpulib import bootconfig
from gpulib.context import MODPROBE_DIRS, PROC_CMDLINE
from gpulib.distro import DRACUT, INITRAMFS_TOOLS, Distro
from gpulib.lazyre import lazy
from gpulib.slotted import Slotted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.sysfs import Sysfs

# EL's kernel-install (grub2's 20-grub.install) gives kernels installed later this
# command line; where it is absent, it takes the running one.
KERNEL_CMDLINE = "etc/kernel/cmdline"
VFIO_IDS_ARGS = ("vfio-pci.ids", "vfio_pci.ids")
_TOOL_PATHS = {
    INITRAMFS_TOOLS: ("usr/sbin/update-initramfs", "sbin/update-initramfs"),
    DRACUT: ("usr/bin/dracut", "usr/sbin/dracut", "sbin/dracut"),
}
# `options vfio-pci ...` or `options vfio_pci ...`: modprobe treats - and _ alike.
_VFIO_OPTIONS = lazy(r"^\s*options\s+vfio[-_]pci\s+(.*)$")


def params(args: list[str], name: str) -> list[str]:
    """Every value of `name=` among `args`."""
    prefix = name + "="
    return [a[len(prefix):] for a in args if a.startswith(prefix)]


def id_items(value: str) -> list[str]:
    """The items of an `ids=` value (`vvvv:dddd[:...]`), lower-case, in order."""
    return [i.strip().lower() for i in value.split(",") if i.strip()]


def id_key(item: str) -> str:
    """The vendor:device an `ids` item matches (its first two fields)."""
    return ":".join(item.split(":")[:2])


class IdsSource(Slotted):
    """One place that gives vfio-pci its `ids`: a kernel argument or a modprobe file."""

    __slots__ = ("ids", "rel", "shown")
    _fields = ("shown", "rel", "ids")

    def __init__(self, shown: str, rel: Optional[str], ids: list[str]) -> None:
        self.shown = shown  # as the host sees it ("the kernel command line", a path)
        self.rel = rel  # the root-relative file; None for the kernel command line
        self.ids = ids

    @property
    def keys(self) -> list[str]:
        return [id_key(i) for i in self.ids]


class RunningBoot:
    """The running kernel's command line (read once)."""

    def __init__(self, sysfs: Sysfs) -> None:
        self.args: list[str] = (sysfs.read(PROC_CMDLINE) or "").split()

    def params(self, name: str) -> list[str]:
        return params(self.args, name)


class NextBoot:
    """The next boot's kernel command line, modprobe options and initramfs tool.

    `family` is the distribution family (`Distro.family`): Debian's grub-mkconfig
    sources the grub.d drop-ins, EL's kernel-install reads /etc/kernel/cmdline."""

    def __init__(self, sysfs: Sysfs, family: str) -> None:
        self.sysfs = sysfs
        self.family = family
        self._grub: Optional[bootconfig.BootConfig] = None
        self._read_grub = False
        self._args: Optional[list[str]] = None

    # -- the kernel command line --------------------------------------------------------
    @property
    def drop_ins(self) -> bool:
        return Distro.of_family(self.family).grub_drop_ins

    def grub_sources(self) -> list[bootconfig.Source]:
        return bootconfig.read_sources(bootconfig.text_reader(self.sysfs.read_bytes),
                                       self.sysfs.listdir, self.drop_ins)

    @property
    def grub(self) -> Optional[bootconfig.BootConfig]:
        """grub's files as grub-mkconfig sources them; None when that cannot be known
        (grub's files could not be read as grub-mkconfig would)."""
        if not self._read_grub:
            self._read_grub = True
            try:
                self._grub = bootconfig.BootConfig(self.grub_sources())
            except bootconfig.BootConfigError:
                # Unknown: the checks and setup say so in their own words.
                self._grub = None
        return self._grub

    def grub_args(self) -> list[str]:
        grub = self.grub
        if grub is not None:
            return grub.words()
        # What cannot be worked out is read as words: better than nothing for a report.
        text = self.sysfs.read(bootconfig.DEFAULT_GRUB) or ""
        return [t for t in text.split() if "=" in t]

    def kernel_cmdline(self) -> Optional[list[str]]:
        """EL's /etc/kernel/cmdline (None: not EL, or absent)."""
        if not Distro.of_family(self.family).kernel_cmdline_file:
            return None
        text = self.sysfs.read(KERNEL_CMDLINE)
        return None if text is None else text.split()

    @property
    def known(self) -> bool:
        """A boot configuration gpulib reads is there (grub's, or EL's kernel-install's):
        without one the next boot's command line is not judged."""
        return self.sysfs.exists(bootconfig.DEFAULT_GRUB) or \
            (self.drop_ins and any(n.endswith(".cfg") for n in
                                   self.sysfs.listdir(bootconfig.GRUB_D))) or \
            self.kernel_cmdline() is not None

    def where(self) -> str:
        """The boot configuration as named in messages."""
        return " and ".join(where for where, _ in self.sources())

    def sources(self) -> list[tuple[str, list[str]]]:
        """Each place that gives the next boot's command line, with its arguments."""
        out = [("/" + bootconfig.DEFAULT_GRUB + (" (and grub.d)" if self.drop_ins else ""),
                self.grub_args())]
        kernel = self.kernel_cmdline()
        if kernel is not None:
            out.append(("/" + KERNEL_CMDLINE, kernel))
        return out

    def args(self) -> list[str]:
        """The arguments every place gives (in the grub files' order)."""
        if self._args is None:
            sources = self.sources()
            first = dict.fromkeys(sources[0][1])
            self._args = [a for a in first if all(a in s for _, s in sources[1:])]
        return self._args

    def params(self, name: str) -> list[str]:
        return params(self.args(), name)

    # -- modprobe -----------------------------------------------------------------------
    def modprobe_files(self) -> list[str]:
        """Every modprobe.d `*.conf`, root-relative, in the order modprobe reads them."""
        by_name: dict[str, str] = {}
        seen: set[str] = set()
        for directory in MODPROBE_DIRS:
            # /lib is often /usr/lib: one directory read once
            real = os.path.realpath(self.sysfs.path(directory))
            if real in seen:
                continue
            seen.add(real)
            for name in self.sysfs.listdir(directory):
                if name.endswith(".conf") and not name.startswith("."):
                    by_name.setdefault(name, f"{directory}/{name}")
        return [by_name[n] for n in sorted(by_name)]

    def vfio_ids_sources(self) -> list[IdsSource]:
        """Every `ids` vfio-pci is given at the next boot, in modprobe's order."""
        out: list[IdsSource] = []
        for rel in self.modprobe_files():
            text = self.sysfs.read(rel) or ""
            for line in text.splitlines():
                m = _VFIO_OPTIONS.match(line)
                if not m:
                    continue
                for value in params(m.group(1).split("#", 1)[0].split(), "ids"):
                    out.append(IdsSource("/" + rel, rel, id_items(value)))
        for arg in self.args():
            name, _, value = arg.partition("=")
            if name in VFIO_IDS_ARGS:
                out.append(IdsSource("the kernel command line", None, id_items(value)))
        return out

    def vfio_ids(self) -> list[str]:
        """The vendor:device ids vfio-pci takes at the next boot: the last `ids` wins."""
        sources = self.vfio_ids_sources()
        return list(dict.fromkeys(sources[-1].keys)) if sources else []

    # -- the initramfs ------------------------------------------------------------------
    def initramfs_tool(self) -> Optional[str]:
        """initramfs-tools or dracut, as installed; else the family's usual one."""
        for tool, paths in _TOOL_PATHS.items():
            if any(self.sysfs.exists(p) for p in paths):
                return tool
        return Distro.of_family(self.family).initramfs_default


def initramfs_argv(tool: Optional[str]) -> Optional[tuple[str, ...]]:
    """Every installed kernel's initramfs, not only the newest: a host pinned to an
    older kernel (a vendor vGPU driver's) boots that one."""
    if tool == INITRAMFS_TOOLS:
        return ("update-initramfs", "-u", "-k", "all")
    if tool == DRACUT:
        return ("dracut", "-f", "--regenerate-all")
    return None


__all__ = ["DRACUT", "INITRAMFS_TOOLS", "KERNEL_CMDLINE", "IdsSource",
           "NextBoot", "RunningBoot", "id_items", "id_key", "initramfs_argv", "params"]
