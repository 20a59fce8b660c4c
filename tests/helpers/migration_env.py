"""Two private libvirtds on this machine, for a real live migration between them
(tests/test_migration_libvirtd.py).

Each is `libvirtd_env.Env`'s (own mount namespace: own /etc/libvirt, /run,
/var/lib/libvirt; its own fake gpulib host behind the qemu hook wrapper),
looking like a host of its own, as a migration needs:
* its own host UUID (libvirtd.conf `host_uuid`): libvirt refuses to migrate a
  domain to the host it runs on, and tells hosts apart by it;
* its own hostname (its own UTS namespace): libvirt also refuses a
  destination whose hostname is the source's. The network namespace stays
  the machine's.
The migration goes over loopback only: the source's libvirtd itself connects
to the destination's socket (`--p2p` to `qemu+unix:///system?socket=...`;
the other instance's /run is reachable through its path on the host side),
and QEMU's migration stream goes to 127.0.0.1 (`--migrateuri
tcp://127.0.0.1:<port>`, the destination listening there: `--listen-address`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from tests.helpers import mdev_fake
from tests.helpers.libvirtd_env import Env, PrivateLibvirtd


class HostEnv(Env):
    """`Env` (fake gpulib host, hook wrapper, trace) whose libvirtd looks like
    another host; `main_hook`: an `/etc/libvirt/hooks/qemu` of its own (run
    before the qemu.d/ scripts, as CloudStack's own hook is)."""

    def __init__(self, base: Path, hostname: str, host_uuid: str,
                 main_hook: Optional[str] = None,
                 extra_hooks: Optional[dict[str, str]] = None,
                 fake_vfio: bool = False) -> None:
        """`fake_vfio`: domains with mdev hostdevs run (tests/helpers/mdev_fake.py)."""
        super().__init__(base)
        wrapper = self.wrapper.read_text()
        self.daemon = PrivateLibvirtd(base / "libvirt-host", hostname, host_uuid,
                                      qemu_conf=mdev_fake.QEMU_CONF if fake_vfio else "")
        if fake_vfio:
            mdev_fake.lay_out(self.daemon.base)
            self.emulator = mdev_fake.install_wrapper(base / "qemu-wrapper")
        self.wrapper = self.daemon.install_hook(self.wrapper.name, wrapper)
        if main_hook is not None:
            path = self.daemon.base / "etc" / "hooks" / "qemu"
            path.write_text(main_hook)
            path.chmod(0o755)
        for name, text in (extra_hooks or {}).items():
            self.daemon.install_hook(name, text)

    @property
    def unix_uri(self) -> str:
        """How another libvirtd on this machine reaches this one (for --p2p)."""
        return f"qemu+unix:///system?socket={self.daemon.socket}"
