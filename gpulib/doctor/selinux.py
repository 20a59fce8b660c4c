"""`selinux`: where SELinux enforces, gpulib's files carry the types its policy module gives them.

On EL9 libvirt runs its qemu hook inside its own confined domain (virtqemud_t
or virtd_t). The rpm ships a small policy module, `gpulib`, that gives the
hook, the configuration, the state and the log their own types and lets the
libvirt daemons run the hook and keep gpulib's files (packaging/selinux). A
host where the module is missing or the files kept an older label (copied
in, restored from a backup) denies the hook: with SELinux enforcing that is a
failure, permissive only logs the denials (a warning).

What it reads, below the context's root: `sys/fs/selinux/enforce` (absent:
SELinux is off, nothing to check), `etc/selinux/config` (the policy's name),
the policy store's module directory, and each file's `security.selinux`
extended attribute.
"""

from __future__ import annotations

import os

from gpulib.doctor.core import FAIL, OK, WARN, Result, host_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.facts import Facts

ENFORCE = "sys/fs/selinux/enforce"
CONFIG = "etc/selinux/config"
MODULE = "gpulib"
# Where semodule keeps installed modules (EL8 and later; older: etc/selinux).
MODULE_STORES = ("var/lib/selinux/{policy}/active/modules", "etc/selinux/{policy}/active/modules")
# The rpm installs the compiled module here (selinux-policy's convention).
MODULE_FILE = "usr/share/selinux/packages/{policy}/gpulib.pp"
# Each file or directory gpulib's module labels, and its type there.
LABELS = (
    ("usr/libexec/gpulib/gpulib-qemu-hook", "gpulib_hook_exec_t"),
    ("etc/gpulib", "gpulib_conf_t"),
    ("var/lib/gpulib", "gpulib_var_lib_t"),
    ("var/log/gpulib", "gpulib_log_t"),
    ("run/gpulib", "gpulib_var_run_t"),
    ("etc/mdevctl.d", "gpulib_mdevctl_conf_t"),
)


def check(d: Facts) -> list[Result]:
    mode = _mode(d)
    if mode is None:
        return [Result("selinux", OK, "selinux", "SELinux is not enabled on this host")]
    bad_status = FAIL if mode == "enforcing" else WARN
    policy = _policy(d)
    results: list[Result] = []
    if not _module_installed(d, policy):
        pp = host_path(MODULE_FILE.format(policy=policy))
        results.append(Result(
            "selinux", bad_status, "selinux",
            f"SELinux is {mode} and gpulib's policy module is not installed "
            f"({policy} policy): libvirt may not run gpulib's qemu hook nor keep its state",
            f"semodule -i {pp} && restorecon -R -v /etc/gpulib /var/lib/gpulib "
            f"/var/log/gpulib /run/gpulib /etc/mdevctl.d /usr/libexec/gpulib"))
    wrong = []
    for rel, wanted in LABELS:
        path = d.ctx.sysfs.path(rel)
        if not os.path.lexists(path):
            continue
        got = _label_type(path)
        if got != wanted:
            wrong.append((rel, wanted, got))
    for rel, wanted, got in wrong:
        results.append(Result(
            "selinux", bad_status, host_path(rel),
            f"labelled {got or 'without an SELinux label'}, not {wanted} (SELinux is {mode})",
            f"restorecon -R -v {host_path(rel)}"))
    if not results:
        results.append(Result("selinux", OK, "selinux",
                              f"SELinux is {mode}; gpulib's policy module is installed and "
                              "its files are labelled"))
    return results


def _mode(d: Facts) -> Optional[str]:
    text = d.ctx.sysfs.read(ENFORCE)
    if text is None:
        return None
    return "enforcing" if text.strip() == "1" else "permissive"


def _policy(d: Facts) -> str:
    text = d.ctx.sysfs.read(CONFIG) or ""
    for line in text.splitlines():
        key, _, value = line.strip().partition("=")
        if key.strip() == "SELINUXTYPE" and value.strip():
            return value.strip().strip('"')
    return "targeted"


def _module_installed(d: Facts, policy: str) -> bool:
    if "/" in policy:
        return False
    for store in MODULE_STORES:
        top = d.ctx.sysfs.path(store.format(policy=policy))
        try:
            priorities = os.listdir(top)
        except OSError:
            continue
        # semodule keeps a module under its priority: modules/400/gpulib.
        if any(os.path.isdir(os.path.join(top, p, MODULE)) for p in priorities):
            return True
    return False


def _label_type(path: str) -> Optional[str]:
    """The SELinux type of a file (`user:role:type:level`), None without a label."""
    try:
        raw = os.getxattr(path, "security.selinux", follow_symlinks=False)
    except OSError:
        return None
    parts = raw.rstrip(b"\0").decode("ascii", "replace").split(":")
    return parts[2] if len(parts) >= 3 else None
