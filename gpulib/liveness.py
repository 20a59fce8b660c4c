"""Whether a VM runs: the one answer every path that frees, destroys, retypes or
settles a device asks.

A VM runs exactly when libvirt's status file for it, `run/libvirt/qemu/<name>.xml`,
exists and names the same domain UUID. /run is a tmpfs, so a status file exists
only in the boot whose libvirtd wrote it: after a reboot no VM of the last boot
runs. libvirt writes the file when it launches QEMU (after `prepare begin`)
and removes it before `release end` (qemuProcessStop), so a hook of a stop or
a failed start sees the VM not running, and a hook of a start sees no file yet.

Nothing a running VM holds is freed, destroyed, retyped or replaced by a hook,
whatever event arrives (a late or repeated onStop, a stop that failed, a start
under its name): the caller asks `is_running` first and logs instead.

Reading costs one directory listing (names); a UUID is read from the head of
one status file, only when asked (`usage.status_uuid`, no XML parser), and the
devices every running domain names (`running_devices`) only when a device is
about to be destroyed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from gpulib import usage
from gpulib.context import BOOT_ID, RUNNING_DOMAINS
from gpulib.sysfs import ReadFailure
from gpulib.usage import MAX_STATUS_BYTES, DomainDevices, running_names, status_uuid

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.records import Allocation
    from gpulib.sysfs import Sysfs


def running_domains(sysfs: Sysfs, save_cache: bool = False) -> list[DomainDevices]:
    """Every running domain of this boot and the devices its status file names:
    the one answer to "what runs", which every caller asks here, never of
    libvirt's files itself (`usage` reads them, cached by file identity).

    `save_cache`: keep what was parsed in the cross-process cache (the hooks,
    `gpulib discover` and `gpulib metrics`; see `usage.running_domains`)."""
    return usage.running_domains(sysfs, save_cache=save_cache)


class Liveness:
    """The running domains of this boot, read lazily and once."""

    def __init__(self, sysfs: Sysfs, domains: Optional[Iterable[DomainDevices]] = None) -> None:
        """`domains`: the running domains when the caller has read them already
        (their names, UUIDs and devices are then not read again)."""
        self.sysfs = sysfs
        self._domains: Optional[list[DomainDevices]] = list(domains) \
            if domains is not None else None
        self._names: Optional[set[str]] = {d.name for d in self._domains} \
            if self._domains is not None else None
        self._uuids: dict[str, Optional[str]] = {d.name: d.uuid for d in self._domains or ()}
        self._devices: Optional[dict[str, str]] = None

    def names(self) -> set[str]:
        """The names of the running domains (one directory listing)."""
        if self._names is None:
            self._names = running_names(self.sysfs)
        return self._names

    def domain_uuid(self, name: str) -> Optional[str]:
        """The UUID the running domain `name` has (None: not running, or its status
        file does not say)."""
        if name not in self.names():
            return None
        if name not in self._uuids:
            raw = self.sysfs.read_result(f"{RUNNING_DOMAINS}/{name}.xml", MAX_STATUS_BYTES)
            self._uuids[name] = None if isinstance(raw, ReadFailure) else status_uuid(raw)
        return self._uuids[name]

    def is_running(self, name: str, uuid: Optional[str] = None) -> bool:
        """Whether VM `name` runs, and is the domain `uuid` when one is given.

        A status file whose UUID cannot be read counts as that domain running:
        when in doubt, nothing is freed."""
        if name not in self.names():
            return False
        if uuid is None:
            return True
        running = self.domain_uuid(name)
        return running is None or running == uuid.lower()

    def domains(self) -> list[DomainDevices]:
        """Every running domain with the devices its status file names."""
        if self._domains is None:
            self._domains = running_domains(self.sysfs)
            self._names = {d.name for d in self._domains}
            for d in self._domains:
                self._uuids.setdefault(d.name, d.uuid)
        return self._domains

    def user_of(self, device: str) -> Optional[str]:
        """The running VM whose status file names `device` (an mdev's lowercase
        UUID or a canonical PCI address), or None."""
        if self._devices is None:
            found: dict[str, str] = {}
            for d in self.domains():
                for u in d.mdevs:
                    found.setdefault(u, d.name)
                for a in d.pci:
                    found.setdefault(str(a), d.name)
            self._devices = found
        return self._devices.get(device)


# -- this boot ----------------------------------------------------------------------------------
# An allocation of an earlier boot is dead whatever its VM's name: nothing of
# that boot runs. Asked by the lifecycle's releases and by the occupancy.

def boot_clock_of(sysfs: Sysfs) -> tuple[Optional[str], float]:
    """This boot's id and the seconds since it (CLOCK_BOOTTIME), from the host's files alone."""
    boot_id = sysfs.read(BOOT_ID)
    boot_id = boot_id.strip() if boot_id else None
    try:
        uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux
        uptime = time.monotonic()
    return boot_id or None, uptime


def from_other_boot(alloc: Allocation, clock: tuple[Optional[str], float]) -> bool:
    """Whether an allocation was made in an earlier boot: the kernel's boot_id
    differs, or (without one) the boot clock it recorded is ahead of this
    boot's (CLOCK_BOOTTIME starts at 0 at every boot)."""
    boot_id, uptime = clock
    if alloc.boot_id is not None and boot_id is not None:
        return alloc.boot_id != boot_id
    return alloc.uptime is not None and alloc.uptime > uptime + 1.0
