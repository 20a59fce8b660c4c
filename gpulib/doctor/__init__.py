"""`gpulib doctor`: the host readiness checklist, automated.

Every check looks at the host below the context's root and reports results
with a status (ok, warn, fail), a subject (a device address or a file as the
host sees it), a one-line message and, for warn and fail, a fix: the exact
commands for the distribution found in `etc/os-release`.

Check ids (stable: scripts and the JSON depend on them):

* `iommu`          the IOMMU is enabled on the kernel command line and active
                   (`sys/class/iommu/*`, populated `sys/kernel/iommu_groups`),
                   and the next boot's command line enables it too
                   (`gpulib.bootstate`: the reading gpulib setup plans from)
* `nouveau`        nouveau is not loaded and is blacklisted (hosts with NVIDIA GPUs)
* `driver-binding` passthrough GPUs are on vfio-pci (or no driver, or waiting for
                   the next boot: vfio-pci's ids, driverctl's overrides), vGPU
                   GPUs on their vendor driver, the boot VGA device left to the
                   host; `vfio-pci.ids=`/`pci-stub.ids=` are shown
* `iommu-group`    every other endpoint in a passthrough GPU's group can go with it
* `sriov`          VFs are enabled where the card's vGPU needs them
* `mdev`           mdev types offered, instances left, every pool finds its type on its GPUs
* `mig`            GPUs in MIG mode: no mode change pending a reset, every GPU instance
                   has a compute instance, the driver offers MIG-backed vGPU types, the
                   GPU instances pools need exist (NVIDIA's tool, cached: `gpulib.migtool`)
* `hooks`          gpulib's hooks are installed and executable (libvirt's qemu.d,
                   the CloudStack agent's hook directory)
* `libvirt`        libvirtd was (re)started after the qemu hook appeared (the
                   link's ctime: packages set its mtime to their build time)
* `migration`      libvirt >= 8.6 and QEMU >= 8.1 for vGPU live migration (from
                   libvirt's capabilities cache, its library name, dpkg's database);
                   the vendor driver's support named as not visible
* `config`         gpulib.conf parses without errors or unknown keys
* `state`          the state file is readable and consistent, the lock works
* `discovery`      the CloudStack discovery JSON is valid for the agent
* `logging`        no hook or command lost log records since boot (a full log
                   disk, a broken syslog: `run/gpulib/log-failures`)
* `selinux`        where SELinux is on: gpulib's policy module is installed and
                   its files carry its types (the qemu hook, config, state, log)

A check emits one `ok` result summing up what it saw, or one result per
problem. The report's status is the worst status; the exit code is 0 when
everything is ok, 1 when anything failed, 5 for warnings only (2 is a usage
error, as for every gpulib command: an unknown option or check).

Each check is a module of this package (`iommu`, `nouveau`, `binding`,
`groups`, `sriov`, `mdev`, `mig`, `hooks`, `libvirt`, `migration`, `config`, `state`,
`discovery`, `logfailures`, `selinux`): `check(doctor) -> [Result]`. A result's fix is rendered from
its typed actions (`gpulib.doctor.actions`) where the fix is something
`gpulib setup` can apply, so one place decides what is wrong and what fixes it.

The doctor never writes: discovery runs without learning names, the state
file is read without the lock, and the lock is only tried (flock on the
existing lock file, released at once).
"""

from __future__ import annotations

from gpulib.doctor.core import (
    AGENT_HOOK_EXECUTABLES,
    AGENT_PROPERTIES,
    AMD_VENDOR,
    BOOT_ID,
    CHECK_IDS,
    DEFAULT_GRUB,
    EXIT_CODES,
    EXIT_WARNINGS,
    FAIL,
    HOST_DISPLAY_DRIVERS,
    LIBVIRT_DAEMONS,
    LIBVIRT_HOOK,
    LIBVIRT_HOOKS_DIR,
    MODPROBE_DIRS,
    OK,
    OS_RELEASE,
    PROC_CPUINFO,
    PROC_STAT,
    QEMU_HOOK_EXECUTABLE,
    SCHEMA,
    SETUP_JOURNAL,
    WARN,
    Distro,
    Report,
    Result,
    agent_hooks_dir,
    host_path,
    is_free_for_vfio,
    is_vfio_driver,
    worst,
)
from gpulib.doctor.discovery import agent_document_problems
from gpulib.doctor.runner import Doctor, run

__all__ = [
    "AGENT_HOOK_EXECUTABLES", "AGENT_PROPERTIES", "AMD_VENDOR", "BOOT_ID", "CHECK_IDS",
    "DEFAULT_GRUB", "EXIT_CODES", "EXIT_WARNINGS", "FAIL", "HOST_DISPLAY_DRIVERS",
    "LIBVIRT_DAEMONS", "LIBVIRT_HOOK", "LIBVIRT_HOOKS_DIR", "MODPROBE_DIRS", "OK", "OS_RELEASE",
    "PROC_CPUINFO", "PROC_STAT", "QEMU_HOOK_EXECUTABLE", "SCHEMA", "SETUP_JOURNAL", "WARN",
    "Distro", "Doctor", "Report", "Result", "agent_document_problems", "agent_hooks_dir",
    "host_path", "is_free_for_vfio", "is_vfio_driver", "run", "worst",
]
