"""`nouveau`: not loaded and blacklisted, on hosts with NVIDIA GPUs."""

from __future__ import annotations

import os
import re

from gpulib.bootstate import DRACUT
from gpulib.context import MODPROBE_DIR
from gpulib.doctor.actions import Manual, Reboot, RunCommand, WriteFile
from gpulib.doctor.core import FAIL, OK, WARN, Result, host_path
from gpulib.lazyre import lazy
from gpulib.nvidia import NVIDIA_VENDOR

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Facts

# Compiled on first use: only a host with modprobe files needs it.
_BLACKLIST_NOUVEAU = lazy(r"^\s*blacklist\s+nouveau\s*(#.*)?$", re.M)
_HOSTONLY = lazy(r'^\s*hostonly\s*=\s*"?(yes|no)"?', re.M)
_INSTALL_ITEMS = lazy(r'^\s*install_items\s*\+?=\s*"([^"]*)"', re.M)


def _blacklist_files(d: Facts) -> list[str]:
    """The modprobe files (root-relative) that blacklist nouveau, in modprobe's order."""
    return [rel for rel in d.next_boot.modprobe_files()
            if _BLACKLIST_NOUVEAU.search(d.sysfs.read(rel) or "")]


def _nouveau_blacklist(d: Facts) -> list[str]:
    found = [host_path(rel) for rel in _blacklist_files(d)]
    for name in ("modprobe.blacklist", "rd.driver.blacklist", "module_blacklist"):
        if any("nouveau" in v.split(",") for v in d.params(name)):
            found.append(f"{name}=nouveau on the kernel command line")
    return found

BLACKLIST_FILE = MODPROBE_DIR + "/blacklist-nouveau.conf"
BLACKLIST_LINES = ("blacklist nouveau", "options nouveau modeset=0")


DRACUT_BLACKLIST = "etc/dracut.conf.d/gpulib-blacklist-nouveau.conf"


def blacklist_actions(d: Facts) -> list[Action]:
    """The blacklist file (what it holds now plus the lines it lacks) and, where dracut
    makes the initramfs, its name in dracut's configuration: dracut's images hold
    /etc/modprobe.d only where they are host-only (EL's default, not Debian's)."""
    text = d.sysfs.read(BLACKLIST_FILE) or ""
    have = {" ".join(line.split()) for line in text.splitlines()}
    missing = [line for line in BLACKLIST_LINES if line not in have]
    if text and not text.endswith("\n"):
        text += "\n"
    out: list[Action] = [WriteFile(BLACKLIST_FILE,
                                   text + "".join(f"{line}\n" for line in missing))]
    files = list(dict.fromkeys([*_blacklist_files(d), BLACKLIST_FILE]))
    return out + dracut_actions(d, files)


def dracut_content(files: list[str]) -> str:
    return ("# gpulib setup: the nouveau blacklist in every initramfs\n"
            f'install_items+=" {" ".join("/" + f for f in files)} "\n')


def dracut_lacks(d: Facts, files: list[str], judged: bool = False) -> list[str]:
    """Where dracut makes the initramfs: the blacklist files dracut's configuration does
    not name (empty elsewhere, or when it names them all). `judged`: what the doctor
    holds against the host, where a host-only image holds /etc/modprobe.d anyway."""
    if d.next_boot.initramfs_tool() != DRACUT or not files:
        return []
    if judged and _host_only(d):
        files = [f for f in files if not f.startswith(MODPROBE_DIR + "/")]
    data = d.sysfs.read_bytes(DRACUT_BLACKLIST)
    named = _INSTALL_ITEMS.findall(data.decode("utf-8", "replace")) if data else []
    items = {w for value in named for w in value.split()}
    return [f for f in files if "/" + f not in items]


def _host_only(d: Facts) -> bool:
    """dracut makes host-only images (EL's and SUSE's default; Debian's is not): the
    last `hostonly=` of its configuration files, in the order dracut reads them."""
    value = "yes" if d.distro.dracut_host_only else "no"
    names: dict[str, str] = {}
    for directory in ("usr/lib/dracut/dracut.conf.d", "etc/dracut.conf.d"):
        for name in d.sysfs.listdir(directory):
            if name.endswith(".conf"):
                names[name] = f"{directory}/{name}"  # /etc's hides /usr/lib's
    for rel in ["etc/dracut.conf", *(names[n] for n in sorted(names))]:
        for m in _HOSTONLY.finditer(d.sysfs.read(rel) or ""):
            value = m.group(1)
    return value == "yes"


def dracut_actions(d: Facts, files: list[str]) -> list[Action]:
    """Where dracut makes the initramfs: the files that blacklist nouveau (whoever wrote
    them) named in its configuration, so every image holds them."""
    if not dracut_lacks(d, files):
        return []
    return [WriteFile(DRACUT_BLACKLIST, dracut_content(files))]


def initramfs_actions(d: Facts) -> list[Action]:
    argv = d.initramfs_argv()
    return [RunCommand(argv)] if argv else [Manual(d.initramfs_update())]


def check(d: Facts) -> list[Result]:
    cid = "nouveau"
    loaded = d.sysfs.isdir("sys/module/nouveau")
    nvidia = [g for g in d.inventory.gpus if g.fn.vendor_id == NVIDIA_VENDOR]
    blacklisted = _nouveau_blacklist(d)
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
            # an initramfs gpulib setup did not finish making (any apply's) is what the
            # blacklist waits for, not the reboot an earlier apply promised
            unfinished = _initramfs_outstanding(d)
            applied = None if unfinished else d.setup_pending(cid)
            if applied:
                return [d.result(cid, WARN, "/sys/module/nouveau",
                                 f"{msg}; blacklisted ({', '.join(blacklisted)}) by gpulib "
                                 f"setup at {applied}: a reboot is pending",
                                 [Reboot()], pending="reboot")]
            if unfinished:
                msg += (f" although blacklisted ({', '.join(blacklisted)}): gpulib setup's "
                        f"`{unfinished}` did not complete, so the initramfs may still load "
                        "it; run gpulib setup --apply again before rebooting")
            else:
                msg += (f" although blacklisted ({', '.join(blacklisted)}): the initramfs or "
                        "an earlier boot still loads it")
            actions: list[Action] = [*dracut_actions(d, _blacklist_files(d)),
                                     *initramfs_actions(d), Reboot()]
        else:
            msg += " and not blacklisted"
            actions = [*blacklist_actions(d), *initramfs_actions(d), Reboot()]
        return [d.result(cid, FAIL, "/sys/module/nouveau",
                         msg + f"; it must not claim this host's {len(nvidia)} NVIDIA GPU(s)",
                         actions)]
    if not blacklisted:
        return [d.result(cid, WARN, host_path(MODPROBE_DIR),
                         "nouveau is not loaded but not blacklisted either: it may claim the "
                         "NVIDIA GPUs at the next boot",
                         [*blacklist_actions(d), *initramfs_actions(d)])]
    lacks = dracut_lacks(d, _blacklist_files(d), judged=True)
    if lacks:
        shown = ", ".join(host_path(f) for f in lacks)
        return [d.result(cid, WARN, host_path(DRACUT_BLACKLIST),
                         f"nouveau is not loaded and is blacklisted ({', '.join(blacklisted)}), "
                         f"but dracut's configuration does not put {shown} in the initramfs: "
                         "an initramfs made without it may load nouveau at the next boot",
                         [*dracut_actions(d, _blacklist_files(d)), *initramfs_actions(d)])]
    unfinished = _initramfs_outstanding(d)
    if unfinished:
        return [d.result(cid, WARN, "/boot",
                         f"nouveau is not loaded and is blacklisted ({', '.join(blacklisted)}), "
                         f"but gpulib setup's `{unfinished}` did not complete: an initramfs "
                         "may still load nouveau at the next boot",
                         [*initramfs_actions(d), Reboot()])]
    return [Result(cid, OK, "/sys/module/nouveau",
                   f"nouveau is not loaded and is blacklisted ({', '.join(blacklisted)})")]


def _initramfs_outstanding(d: Facts) -> str:
    """The initramfs rebuild gpulib setup planned and did not complete ("" if none)."""
    items = d.journal.get("outstanding")
    for item in items if isinstance(items, list) else []:
        argv = item.get("argv") if isinstance(item, dict) else None
        if isinstance(argv, list) and argv and isinstance(argv[0], str) and \
                os.path.basename(argv[0]) in ("update-initramfs", "dracut"):
            return " ".join(str(a) for a in argv)
    return ""
