"""Keeping the host's vGPUs and gpulib's records in step.

* `restore`: after a reboot every mdev is gone and every NVIDIA VF reads type
  0; recreate what the registry (and mdevctl's definitions) say should exist,
  with the same UUIDs on the same parents.
* `reconcile`: settle the write-ahead intents of starts that died (complete
  or undo them, `gpulib.journal`), release allocations of VMs that are not
  running (a pending one once proven dead: `pending_is_dead`), and report
  registry entries whose device vanished and live vGPUs nobody holds.
* `rebuild_state`: what a corrupt state file is replaced with: the registry
  and allocations re-learned from sysfs and libvirt's status files.
* `open_store`: the StateStore every entry point uses (with that rebuild).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

from gpulib import mdev, nvidia
from gpulib.allocator import release
from gpulib.config import Config
from gpulib.context import Context
from gpulib.errors import GpulibError, InputError
from gpulib.lazyre import lazy
from gpulib.pci import PciAddress, list_addresses
from gpulib.state import Allocation, Device, State, StateStore, VfRecord, VgpuRecord, utc_now
from gpulib.usage import DomainDevices, running_domains

log = logging.getLogger(__name__)

MDEVCTL_DIR = "etc/mdevctl.d"
_ISO = lazy(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)")
# A pending allocation younger than this may belong to a VM that is starting:
# the agent's 30 s transformer limit, libvirt's own start, and a wide margin.
PENDING_GRACE_SECONDS = 120.0
BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"


def open_store(ctx: Context, config: Optional[Config] = None,
               timeout: Optional[float] = None) -> StateStore:
    if timeout is None:
        timeout = config.get_float("state", "lock_timeout") if config else 20.0
    return StateStore.for_context(ctx, timeout=timeout, rebuild=lambda: rebuild_state(ctx))


def rebuild_state(ctx: Context) -> State:
    """Re-learn what can be re-learned: live vGPUs, VF types, running VMs' devices."""
    sysfs = ctx.sysfs
    state = State()
    for uuid, m in mdev.live_mdevs(sysfs).items():
        state.vgpus[uuid] = VgpuRecord(str(m.parent), m.type_id)
    for address in list_addresses(sysfs):
        if nvidia.is_vendor_vf(sysfs, address):
            current = nvidia.current_type(sysfs, address) or 0
            if current:
                state.vf_types[str(address)] = VfRecord(current)
    for dom in running_domains(sysfs):
        devices = [Device("mdev", u) for u in dom.mdevs if u in state.vgpus]
        devices += [Device("vf" if str(a) in state.vf_types else "pci", str(a)) for a in dom.pci]
        if devices:
            state.allocations[dom.name] = Allocation(dom.name, None, "active", utc_now(), devices)
    log.error("state rebuilt from sysfs and libvirt: %d vGPUs, %d VF types, %d allocations",
              len(state.vgpus), len(state.vf_types), len(state.allocations))
    return state


# -- mdevctl -------------------------------------------------------------------------------

def read_mdevctl(ctx: Context) -> dict[str, tuple[str, str, bool]]:
    """mdevctl's persistent definitions: uuid -> (parent, type, start=auto)."""
    out: dict[str, tuple[str, str, bool]] = {}
    sysfs = ctx.sysfs
    for parent in sysfs.listdir(MDEVCTL_DIR):
        for name in sysfs.listdir(f"{MDEVCTL_DIR}/{parent}"):
            try:
                uuid = mdev.check_uuid(name)
                doc = json.loads(sysfs.read(f"{MDEVCTL_DIR}/{parent}/{name}") or "{}")
                type_id = mdev.check_type_id(str(doc.get("mdev_type", "")))
                PciAddress.parse(parent)
            except (InputError, ValueError) as exc:
                log.warning("ignoring mdevctl definition %s/%s: %s", parent, name, exc)
                continue
            out[uuid] = (parent, type_id, doc.get("start") == "auto")
    return out


def write_mdevctl(ctx: Context, uuid: str, parent: str, type_id: str) -> None:
    """Keep mdevctl's view in step, so `mdevctl list -d` shows gpulib's pool vGPUs."""
    directory = ctx.path(f"{MDEVCTL_DIR}/{parent}")
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{uuid}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"mdev_type": type_id, "start": "auto", "attrs": []}, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, os.path.join(directory, uuid))
    except OSError as exc:
        log.warning("could not write mdevctl definition for %s: %s", uuid, exc)


def remove_mdevctl(ctx: Context, uuid: str, parent: str) -> None:
    path = ctx.path(f"{MDEVCTL_DIR}/{parent}/{uuid}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove mdevctl definition %s: %s", path, exc)


# -- restore --------------------------------------------------------------------------------

class Outcome:
    def __init__(self, kind: str, ident: str, action: str, ok: bool, detail: str = "") -> None:
        self.kind = kind
        self.ident = ident
        self.action = action
        self.ok = ok
        self.detail = detail

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "id": self.ident, "action": self.action, "ok": self.ok,
                "detail": self.detail}

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        extra = f": {self.detail}" if self.detail else ""
        return f"{status:6s} {self.action} {self.kind} {self.ident}{extra}"


def restore(ctx: Context, state: State, adopt_mdevctl: bool = True) -> list[Outcome]:
    """Recreate registry vGPUs that are not live and set recorded VF types."""
    sysfs = ctx.sysfs
    out: list[Outcome] = []
    if adopt_mdevctl:
        for uuid, (parent, type_id, auto) in sorted(read_mdevctl(ctx).items()):
            if uuid not in state.vgpus and auto:
                state.vgpus[uuid] = VgpuRecord(parent, type_id, pool="mdevctl")
                out.append(Outcome("mdev", uuid, "adopted from mdevctl", True,
                                   f"{type_id} on {parent}"))
    for uuid, rec in sorted(state.vgpus.items()):
        live = mdev.read_mdev(sysfs, uuid)
        if live is not None:
            continue
        try:
            mdev.create(sysfs, PciAddress.parse(rec.parent), rec.type_id, uuid)
            out.append(Outcome("mdev", uuid, "recreated", True, f"{rec.type_id} on {rec.parent}"))
        except GpulibError as exc:
            out.append(Outcome("mdev", uuid, "recreate", False, exc.message))
    for addr, vrec in sorted(state.vf_types.items()):
        try:
            vf = PciAddress.parse(addr)
            current = nvidia.current_type(sysfs, vf)
            if current is None:
                raise GpulibError(f"{addr} is gone or not an NVIDIA vGPU VF")
            if current == vrec.type_id:
                continue
            nvidia.set_type(sysfs, vf, vrec.type_id)
            out.append(Outcome("vf", addr, "set type", True,
                               f"{vrec.type_id} ({vrec.name or '?'})"))
        except GpulibError as exc:
            out.append(Outcome("vf", addr, "set type", False, exc.message))
    return out


# -- reconcile --------------------------------------------------------------------------------

def age_seconds(iso: str) -> float:
    """Seconds since an ISO 8601 UTC time from the state file (inf if unreadable).

    Parsed by hand: time.strptime and calendar cost the hooks several
    milliseconds of imports on every VM start.
    """
    m = _ISO.match(iso)
    if not m:
        return float("inf")
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups())
    # Days from civil (proleptic Gregorian), as in H. Hinnant's algorithm.
    y -= mo <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (mo + (-3 if mo > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    days = era * 146097 + doe - 719468
    return time.time() - (days * 86400 + hh * 3600 + mm * 60 + ss)


def boot_clock(ctx: Context) -> tuple[Optional[str], float]:
    """This boot's id and the seconds since it (CLOCK_BOOTTIME: no clock change moves it)."""
    boot_id = ctx.sysfs.read(BOOT_ID_FILE)
    boot_id = boot_id.strip() if boot_id else None
    try:
        uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux
        uptime = time.monotonic()
    return boot_id or None, uptime


def stamp(ctx: Context, alloc: Allocation) -> None:
    """Mark an allocation as made now, in this boot (see pending_is_dead)."""
    alloc.since = utc_now()
    alloc.boot_id, alloc.uptime = boot_clock(ctx)


def pending_is_dead(alloc: Allocation, running: set[str], clock: tuple[Optional[str], float],
                    grace: float = PENDING_GRACE_SECONDS) -> bool:
    """Whether a pending allocation's start is proven dead: its VM does not run and
    is not starting.

    The proof, in order:
    * its VM runs (libvirt wrote its status file): alive;
    * it was made in another boot (the kernel's boot_id differs): dead, nothing
      of an earlier boot is still starting;
    * it was made in this boot: dead once `grace` seconds of CLOCK_BOOTTIME have
      passed (a clock that never jumps; negative means another boot: dead);
    * a record without that clock (schema 1): its wall-clock age decides, and a
      time more than `grace` in the future (the clock was set back, or a bad
      record) is dead too, so such an allocation can always be released.
    """
    if alloc.vm in running:
        return False
    boot_id, uptime = clock
    if alloc.boot_id is not None and boot_id is not None and alloc.boot_id != boot_id:
        return True
    if alloc.uptime is not None:
        elapsed = uptime - alloc.uptime
        return elapsed < 0 or elapsed >= grace
    age = age_seconds(alloc.since)
    return age >= grace or age <= -grace


def release_not_running(ctx: Context, state: State, running: set[str],
                        destroy_on_demand: bool = True, grace: float = PENDING_GRACE_SECONDS,
                        pending_only: bool = False, keep: Optional[str] = None
                        ) -> list[Outcome]:
    """Release allocations of VMs that are not running.

    A pending one is kept until proven dead (`pending_is_dead`); `pending_only`
    (the hooks' cheap cleanup) leaves active ones to `gpulib reconcile`.
    """
    out: list[Outcome] = []
    clock = boot_clock(ctx)
    for vm, alloc in sorted(state.allocations.items()):
        if vm == keep or vm in running or (pending_only and alloc.status != "pending"):
            continue
        if alloc.status == "pending" and not pending_is_dead(alloc, running, clock, grace):
            continue
        log.warning("releasing the %s allocation of %s: it is not running (since %s)",
                    alloc.status, vm, alloc.since)
        actions = release(ctx.sysfs, state, vm, destroy_on_demand=destroy_on_demand,
                          retry_seconds=0.5)
        out.append(Outcome("vm", vm, f"released {alloc.status} allocation", True,
                           "; ".join(actions)))
    return out


def reconcile(ctx: Context, state: State, destroy_on_demand: bool = True,
              grace: float = PENDING_GRACE_SECONDS,
              running: Optional[list[DomainDevices]] = None) -> list[Outcome]:
    from gpulib.occupancy import Occupancy

    sysfs = ctx.sysfs
    domains = running_domains(sysfs) if running is None else running
    out = settle_intents(ctx, state)
    out += release_not_running(ctx, state, {d.name for d in domains}, destroy_on_demand, grace)
    occ = Occupancy.build(sysfs, state, domains)
    live = mdev.live_mdevs(sysfs)
    for uuid, rec in sorted(state.vgpus.items()):
        try:
            parent = PciAddress.parse(rec.parent)
        except InputError:
            parent = None
        if parent is None or not sysfs.exists(f"sys/bus/pci/devices/{parent}"):
            out.append(Outcome("mdev", uuid, "report", False,
                               f"parent {rec.parent} is gone from this host"))
    for uuid in occ.stray_mdevs(live, state.vgpus):
        m = live[uuid]
        out.append(Outcome("mdev", uuid, "report", False,
                           f"live {m.type_id} on {m.parent} is unknown to gpulib and "
                           f"used by no running VM (remove it: gpulib mdev remove {uuid})"))
    return out


def settle_intents(ctx: Context, state: State) -> list[Outcome]:
    """Complete or undo what interrupted starts left (journal.settle)."""
    from gpulib.journal import settle

    return [Outcome("intent", line.split(" ", 2)[1], line.split(": ", 1)[-1],
                    "FAILED" not in line, line) for line in settle(ctx.sysfs, state)]
