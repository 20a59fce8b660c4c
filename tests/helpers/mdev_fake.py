"""A domain with an mdev hostdev that a private libvirtd runs on a machine
without vGPUs, for the real two-daemon migration test (libvirt's ABI
stability check judges the hostdevs a CloudStack agent sends).

Three pieces, none of which touches the machine:
* a fake mdev bus for libvirt only: `<base>/sysbus` is bind-mounted on
  /sys/bus in the daemon's own mount namespace (libvirtd_env's namespace
  script), holding `mdev/devices/<uuid>/` with what libvirt reads of an mdev
  before it starts QEMU (its type's `device_api`, its `iommu_group` link);
* qemu.conf settings that keep libvirt from touching the group's
  /dev/vfio node, which does not exist (no private /dev for QEMU, no
  ownership changes; cgroups are off already);
* an emulator wrapper that gives QEMU, in place of each `vfio-pci` device
  (there is no VFIO here), a `pci-testdev` under the same id, bus and slot:
  the guest sees a PCI device where the vGPU is, QEMU can migrate it, and
  everything libvirt decides (addresses, the ABI check, hooks) is libvirt's
  own. Both daemons run the same wrapper, as two hosts run the same QEMU.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.libvirtd_env import QEMU

# qemu.conf lines: QEMU without a private /dev, libvirt without chown(2) of
# devices (the group's /dev/vfio node is not there).
QEMU_CONF = """\
namespaces = [ ]
dynamic_ownership = 0
security_driver = "none"
"""

WRAPPER = """\
#!/usr/bin/python3 -S
# gpulib's tests: QEMU with a pci-testdev in place of every vfio-pci device.
import json
import os
import sys

args = []
for arg in sys.argv[1:]:
    if arg.startswith("{{") and '"vfio-pci"' in arg:
        dev = json.loads(arg)
        if dev.get("driver") == "vfio-pci":
            dev = {{k: v for k, v in dev.items() if k in ("id", "bus", "addr")}}
            dev["driver"] = "pci-testdev"
            arg = json.dumps(dev, separators=(",", ":"))
    args.append(arg)
os.execv({qemu!r}, [{qemu!r}] + args)
"""


def lay_out(daemon_base: Path) -> None:
    """Before the daemon starts: the directories its namespace script mounts
    (`<base>/sysbus` on /sys/bus, an IOMMU group, /dev/vfio/vfio)."""
    (daemon_base / "sysbus" / "mdev" / "devices").mkdir(parents=True, exist_ok=True)
    (daemon_base / "iommu_groups" / "300").mkdir(parents=True, exist_ok=True)
    for sub in ("upper/vfio", "work", "pts", "shm"):
        (daemon_base / "dev" / sub).mkdir(parents=True, exist_ok=True)
    (daemon_base / "dev" / "upper" / "vfio" / "vfio").touch()


def install_wrapper(path: Path) -> Path:
    path.write_text(WRAPPER.format(qemu=QEMU))
    path.chmod(0o755)
    return path


def add_mdev(daemon_base: Path, uuid: str, type_id: str = "nvidia-233",
             group: int = 300) -> None:
    """Make mdev `uuid` visible to the daemon at `daemon_base` (its
    /sys/bus/mdev/devices/<uuid>, with the files libvirt reads)."""
    bus = daemon_base / "sysbus"
    types = bus / "fake-types" / type_id
    types.mkdir(parents=True, exist_ok=True)
    (types / "device_api").write_text("vfio-pci\n")
    groups = bus / "fake-groups" / str(group)
    groups.mkdir(parents=True, exist_ok=True)
    dev = bus / "mdev" / "devices" / uuid
    dev.mkdir(parents=True, exist_ok=True)
    for name, target in (("mdev_type", types), ("iommu_group", groups)):
        link = dev / name
        if not link.is_symlink():
            # As the daemon sees them: /sys/bus is this directory there.
            os.symlink("/sys/bus/" + str(target.relative_to(bus)), link)
