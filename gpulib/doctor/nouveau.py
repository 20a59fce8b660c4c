"""`nouveau`: not loaded and blacklisted, on hosts with NVIDIA GPUs."""

from __future__ import annotations

import os
import re

from gpulib.context import MODPROBE_DIR
from gpulib.doctor.actions import Manual, Reboot, RunCommand, WriteFile
from gpulib.doctor.core import FAIL, MODPROBE_DIRS, OK, WARN, Result, host_path
from gpulib.lazyre import lazy
from gpulib.nvidia import NVIDIA_VENDOR

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Doctor

# Compiled on first use: only a host with modprobe files needs it.
_BLACKLIST_NOUVEAU = lazy(r"^\s*blacklist\s+nouveau\s*(#.*)?$", re.M)


def _nouveau_blacklist(d: Doctor) -> list[str]:
    found: list[str] = []
    seen: set[str] = set()
    for directory in MODPROBE_DIRS:
        real = os.path.realpath(d.ctx.path(directory))
        if real in seen:
            continue
        seen.add(real)
        for name in sorted(d.sysfs.listdir(directory)):
            if not name.endswith(".conf"):
                continue
            text = d.sysfs.read(f"{directory}/{name}")
            if text and _BLACKLIST_NOUVEAU.search(text):
                found.append(host_path(f"{directory}/{name}"))
    for name in ("modprobe.blacklist", "rd.driver.blacklist", "module_blacklist"):
        if any("nouveau" in v.split(",") for v in d.params(name)):
            found.append(f"{name}=nouveau on the kernel command line")
    return found

BLACKLIST_FILE = MODPROBE_DIR + "/blacklist-nouveau.conf"
BLACKLIST_LINES = ("blacklist nouveau", "options nouveau modeset=0")


def blacklist_action(d: Doctor) -> WriteFile:
    """The blacklist file: what it holds now plus the lines it lacks."""
    text = d.sysfs.read(BLACKLIST_FILE) or ""
    have = {" ".join(line.split()) for line in text.splitlines()}
    missing = [line for line in BLACKLIST_LINES if line not in have]
    if text and not text.endswith("\n"):
        text += "\n"
    return WriteFile(BLACKLIST_FILE, text + "".join(f"{line}\n" for line in missing))


def initramfs_actions(d: Doctor) -> list[Action]:
    argv = d.distro.initramfs_argv()
    return [RunCommand(argv)] if argv else [Manual(d.distro.initramfs_update())]


def check(d: Doctor) -> list[Result]:
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
            applied = d.setup_pending(cid)
            if applied:
                return [d.result(cid, WARN, "/sys/module/nouveau",
                                 f"{msg}; blacklisted ({', '.join(blacklisted)}) by gpulib "
                                 f"setup at {applied}: a reboot is pending",
                                 [Reboot()], pending="reboot")]
            msg += (f" although blacklisted ({', '.join(blacklisted)}): the initramfs or an "
                    "earlier boot still loads it")
            actions: list[Action] = [*initramfs_actions(d), Reboot()]
        else:
            msg += " and not blacklisted"
            actions = [blacklist_action(d), *initramfs_actions(d), Reboot()]
        return [d.result(cid, FAIL, "/sys/module/nouveau",
                         msg + f"; it must not claim this host's {len(nvidia)} NVIDIA GPU(s)",
                         actions)]
    if not blacklisted:
        return [d.result(cid, WARN, host_path(MODPROBE_DIR),
                         "nouveau is not loaded but not blacklisted either: it may claim the "
                         "NVIDIA GPUs at the next boot",
                         [blacklist_action(d), *initramfs_actions(d)])]
    unfinished = _initramfs_outstanding(d)
    if unfinished:
        return [d.result(cid, WARN, "/boot",
                         f"nouveau is not loaded and is blacklisted ({', '.join(blacklisted)}), "
                         f"but gpulib setup's `{unfinished}` did not complete: an initramfs "
                         "may still load nouveau at the next boot",
                         [*initramfs_actions(d), Reboot()])]
    return [Result(cid, OK, "/sys/module/nouveau",
                   f"nouveau is not loaded and is blacklisted ({', '.join(blacklisted)})")]


def _initramfs_outstanding(d: Doctor) -> str:
    """The initramfs rebuild gpulib setup planned and did not complete ("" if none)."""
    items = d.journal.get("outstanding")
    for item in items if isinstance(items, list) else []:
        argv = item.get("argv") if isinstance(item, dict) else None
        if isinstance(argv, list) and argv and isinstance(argv[0], str) and \
                os.path.basename(argv[0]) in ("update-initramfs", "dracut"):
            return " ".join(str(a) for a in argv)
    return ""
