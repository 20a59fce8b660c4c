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
one status file, only when asked (`domstatus.status_uuid`, no XML parser), and the
devices every running domain names (`running_devices`) only when a device is
about to be destroyed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from gpulib import domstatus
from gpulib.context import BOOT_ID, RUNNING_DOMAINS
from gpulib.domstatus import MAX_STATUS_BYTES, DomainDevices, running_names, status_uuid
from gpulib.lazyre import lazy
from gpulib.sysfs import ReadFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.records import Allocation
    from gpulib.sysfs import Sysfs


def running_domains(sysfs: Sysfs, save_cache: bool = False) -> list[DomainDevices]:
    """Every running domain of this boot and the devices its status file names:
    the one answer to "what runs", which every caller asks here, never of
    libvirt's files itself (`domstatus` reads them, cached by file identity).

    `save_cache`: keep what was parsed in the cross-process cache (the hooks,
    `gpulib discover` and `gpulib metrics`; see `domstatus.running_domains`)."""
    return domstatus.running_domains(sysfs, save_cache=save_cache)


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

    def launched(self, alloc: Allocation) -> bool:
        """Whether libvirt launched the run a pending allocation belongs to: its
        VM's status file exists, names the allocation's domain UUID (read, not
        assumed), and was written no earlier than the allocation was made.

        libvirt writes the status file when it launches QEMU and removes it
        when the run stops, and a start under a running VM's name is refused,
        so a newer start is recorded while no status file exists: a file
        older than the allocation is of an earlier run (a late onStart of it
        finds the newer start not launched yet)."""
        if alloc.vm not in self.names():
            return False
        uuid = self.domain_uuid(alloc.vm)
        if uuid is None or (alloc.domain_uuid is not None and uuid != alloc.domain_uuid.lower()):
            return False
        made = since_epoch(alloc.since)
        try:
            written = os.stat(self.sysfs.path(f"{RUNNING_DOMAINS}/{alloc.vm}.xml")).st_mtime
        except OSError:
            return False
        # `since` has whole seconds: a file of the same second is of this run.
        return made is None or written >= made

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


# -- is this run over? ---------------------------------------------------------------------------
# One answer, asked by the hooks' cleanup (lifecycle.release_not_running),
# reconcile, restore and the occupancy model alike: the report never calls a
# device used by a run the hooks would release, and a start never finds held
# what the report offered free.

# A pending allocation younger than this may belong to a VM that is starting:
# the agent's 30 s transformer limit, libvirt's own start, and a wide margin.
PENDING_GRACE_SECONDS = 120.0
# How long the devices `migrate begin` made wait for the incoming domain's
# `prepare begin`, which libvirt calls at once ([release] arrival_timeout).
ARRIVAL_GRACE_SECONDS = 10.0

# Why a run is over (`run_over`'s answers; the log and reconcile name them).
STOPPED = "stopped"  # active, its VM's status file gone: a stop that did not complete
EARLIER_BOOT = "earlier boot"  # made in another boot, its VM does not run
ABANDONED_ARRIVAL = "abandoned arrival"  # migrate begin's, no prepare begin within its bound
EXPIRED_START = "expired start"  # pending past its grace, its VM does not run


def run_over(alloc: Allocation, liveness: Liveness, clock: tuple[Optional[str], float],
             grace: float = PENDING_GRACE_SECONDS,
             arrival_grace: float = ARRIVAL_GRACE_SECONDS,
             by_uuid: bool = False) -> Optional[str]:
    """Whether the run an allocation belongs to is over, and why (None: it is
    not: running, or a start within its grace).

    * an active allocation of this boot: over once its VM has no status file
      (a stop that did not complete, `STOPPED`). Judged by name, one
      directory listing: a status file under the name keeps it whatever UUID
      it names, unless `by_uuid` (reconcile: then a status file naming
      another domain ends it too);
    * otherwise its VM runs (the status file names it with the allocation's
      domain UUID): not over;
    * made in another boot (`from_other_boot`): over, nothing of an earlier
      boot runs or starts (`EARLIER_BOOT`);
    * a pending one made by `migrate begin` (`arriving`): over once
      `arrival_grace` seconds have passed without its `prepare begin`
      (libvirt calls it at once; an abandoned migration sends no `release
      end`: `ABANDONED_ARRIVAL`);
    * a pending one of this boot: over once `grace` seconds of CLOCK_BOOTTIME
      have passed (a clock that never jumps; negative means another boot);
      a record without that clock (schema 1) is judged by its wall-clock
      age, and a time more than `grace` in the future (the clock was set
      back, or a bad record) is over too (`EXPIRED_START`).
    """
    this_boot = not from_other_boot(alloc, clock)
    if alloc.status == "active" and this_boot:
        if alloc.vm not in liveness.names():
            return STOPPED
        if by_uuid and not liveness.is_running(alloc.vm, alloc.domain_uuid):
            return STOPPED
        return None
    if liveness.is_running(alloc.vm, alloc.domain_uuid):
        return None
    if not this_boot:
        return EARLIER_BOOT
    _, uptime = clock
    if alloc.uptime is not None:
        elapsed = uptime - alloc.uptime
        if alloc.arriving and not (0 <= elapsed < min(grace, arrival_grace)):
            return ABANDONED_ARRIVAL
        return EXPIRED_START if elapsed < 0 or elapsed >= grace else None
    age = _age_seconds(alloc.since)
    return EXPIRED_START if age >= grace or age <= -grace else None


def run_is_over(alloc: Allocation, liveness: Liveness, clock: tuple[Optional[str], float],
                grace: float = PENDING_GRACE_SECONDS,
                arrival_grace: float = ARRIVAL_GRACE_SECONDS) -> bool:
    """`run_over` as a yes or no, as the hooks judge (by name): what the
    occupancy model does not count and the next hook releases."""
    return run_over(alloc, liveness, clock, grace, arrival_grace) is not None


_ISO = lazy(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)")


def since_epoch(iso: str) -> Optional[float]:
    """An ISO 8601 UTC time from the state file as seconds since the epoch
    (None if unreadable). Parsed by hand: time.strptime and calendar cost the
    hooks several milliseconds of imports on every VM start."""
    m = _ISO.match(iso)
    if not m:
        return None
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups())
    # Days from civil (proleptic Gregorian), as in H. Hinnant's algorithm.
    y -= mo <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (mo + (-3 if mo > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    days = era * 146097 + doe - 719468
    return float(days * 86400 + hh * 3600 + mm * 60 + ss)


def _age_seconds(iso: str) -> float:
    epoch = since_epoch(iso)
    return float("inf") if epoch is None else time.time() - epoch
