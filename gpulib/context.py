"""The injected root and every location below it, passed down from the entry point.

`GPULIB_ROOT` (default `/`) puts every path gpulib touches under one root.
The environment is read by `gpulib.entry`, which also honours
`GPULIB_SIMULATE`: this module never names the simulator.
"""

from __future__ import annotations

from gpulib.sysfs import Sysfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

# Root-relative locations, the one definition of each (ARCHITECTURE.md, "Paths").
# Its drop-ins are `<CONFIG_FILE>.d/*.conf`, which gpulib.config reads after
# it, beside whichever file it is given.
CONFIG_FILE = "etc/gpulib/gpulib.conf"
STATE_DIR = "var/lib/gpulib"
STATE_FILE = STATE_DIR + "/state.json"
LOCK_FILE = STATE_DIR + "/state.lock"
LOG_DIR = "var/log/gpulib"
# A line per process that lost a log record (gpulib.logs writes it, the doctor reads it).
LOG_FAILURES_FILE = "run/gpulib/log-failures"
RUNNING_DOMAINS = "run/libvirt/qemu"
DEFINED_DOMAINS = "etc/libvirt/qemu"
MODPROBE_DIR = "etc/modprobe.d"
CLOUDSTACK_AGENT_DIR = "etc/cloudstack/agent"
PROC_CMDLINE = "proc/cmdline"
PROC_STAT = "proc/stat"
PROC_CPUINFO = "proc/cpuinfo"
# This boot's id: a VM is running exactly when its status file exists in it.
BOOT_ID = "proc/sys/kernel/random/boot_id"
OS_RELEASE = "etc/os-release"
DEFAULT_GRUB = "etc/default/grub"
MODPROBE_DIRS = (MODPROBE_DIR, "run/modprobe.d", "usr/lib/modprobe.d", "lib/modprobe.d")
AGENT_PROPERTIES = CLOUDSTACK_AGENT_DIR + "/agent.properties"
# The libvirt qemu hook (ARCHITECTURE.md, "Executables").
LIBVIRT_HOOKS_DIR = "etc/libvirt/hooks/qemu.d"
LIBVIRT_HOOK = LIBVIRT_HOOKS_DIR + "/50-gpulib"
# (daemon, pid file): libvirtd's default pid file, then the modular qemu daemon's.
LIBVIRT_DAEMONS = (("libvirtd", "run/libvirtd.pid"), ("virtqemud", "run/virtqemud.pid"))
# gpulib setup's record of what it applied and in which boot.
SETUP_JOURNAL = STATE_DIR + "/setup.json"
# At the root of an unpacked `gpulib snapshot`: what it is, and the change
# times of files that the doctor compares (a tarball keeps no ctime).
SNAPSHOT_MANIFEST = "gpulib-snapshot.json"


class Context:
    """The root, the sysfs access object and the files below that root."""

    def __init__(self, sysfs: Sysfs) -> None:
        self.sysfs = sysfs
        self.root = sysfs.root
        # Set by the hooks (state.HOOK_LOCK_TIMEOUT_CAP): the longest any state
        # lock wait may last in this process, whatever the configuration says.
        self.lock_wait_cap: Optional[float] = None
        # Set by the hooks: run with the state lock held (see StateStore.on_lock).
        self.on_lock: Optional[Callable[[], None]] = None

    @classmethod
    def for_root(cls, root: str) -> Context:
        """The context of a real host's tree at `root` (a simulated one is
        `gpulib.entry`'s)."""
        return cls(Sysfs(root))

    def path(self, rel: str) -> str:
        return self.sysfs.path(rel)

    @property
    def state_path(self) -> str:
        return self.path(STATE_FILE)

    @property
    def lock_path(self) -> str:
        return self.path(LOCK_FILE)

    @property
    def config_path(self) -> str:
        return self.path(CONFIG_FILE)

