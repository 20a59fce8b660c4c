"""The sysfs changes of one start: write-ahead intents, and undo in reverse order.

A start (transformer, `prepare begin`) may create mdevs and give VFs a vGPU
type before it knows it will succeed. Every such change goes through a
Journal:

1. the intent (action, device, VM, parent, type, on-demand) is appended to
   the state and the state is written (`checkpoint`), still under the lock;
2. the sysfs write is made, and its undo is remembered;
3. on success the start's allocation names the device and the intents are
   dropped in the same final state write; on any failure `rollback()` undoes
   every change in reverse order and the exception propagates with its code.

A process killed between 1 and 3 leaves intents in the state file: the next
run (any hook, `gpulib reconcile`) settles them with `settle()`: an intent
whose device an allocation of its VM names was completed and is dropped;
any other is undone (a live, unheld mdev it names is removed, a VF it typed
is cleared). So after any crash, a retry finds no orphan, and an allocation
never names a vGPU that is not live.

Releases go through the journal too (`release_devices`): a stop (or a
retried start dropping what its earlier attempt made) writes a removal
intent (`remove-mdev`, `clear-vf-type`) for every on-demand device it will
destroy, together with the allocation's end, before the first sysfs write;
each intent is dropped once its device is gone. A crash or a full disk at
any write therefore leaves either the allocation (nothing destroyed yet) or
intents that explain every device that may be gone: the next run finishes
them, unless a VM holds the device again by then (it is then that VM's).
The state never names a vGPU that is gone without an intent that explains it.

Nothing a running VM holds is removed or cleared by a settle: libvirt's
status files are asked first (`gpulib.liveness`).

A retried start of the same VM goes first: its own intents are left to it
(`settle(keep=vm)`), and the device one of them made is adopted in place
when the retry makes the same change (an mdev with the same UUID, parent and
type, or a VF already of that type) and nobody else holds it: no remove and
create again. The start then owns the change as if it had made it (undone on
its rollback); its intents it did not adopt are settled when it commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

from gpulib import logger, mdev, nvidia
from gpulib.errors import DeviceError, GpulibError
from gpulib.pci import PciAddress
from gpulib.state import (
    GPU_INSTANCE_ACTIONS,
    REMOVALS,
    Device,
    Intent,
    State,
    VgpuRecord,
    utc_now,
)

if TYPE_CHECKING:
    from gpulib.liveness import Liveness
    from gpulib.sysfs import Sysfs

log = logger.get(__name__)


class Journal:
    def __init__(self, sysfs: Sysfs, state: State, vm: str, liveness: Liveness,
                 checkpoint: Optional[Callable[[State], None]] = None,
                 held_by_other: Optional[Callable[[str], bool]] = None) -> None:
        """`held_by_other(device)`: whether another VM holds it (an orphan of
        `vm`'s that another VM uses is not adopted); default: an allocation
        of another VM names it."""
        self.sysfs = sysfs
        self.state = state
        self.vm = vm
        self.liveness = liveness
        # A removal was made: it cannot be undone, so the intents stay for
        # the next run to settle instead of the file being put back.
        self._removed = False
        self._checkpoint = checkpoint
        self._undo: list[tuple[str, Callable[[], object]]] = []
        self._intents: list[Intent] = []
        # The intents a killed start of this VM left (see settle(keep=...)).
        self._orphans = [i for i in state.intents if i.vm == vm and i.action not in REMOVALS
                         and i.action not in GPU_INSTANCE_ACTIONS]
        self._held_by_other = held_by_other or self._allocated_to_other

    def _allocated_to_other(self, device: str) -> bool:
        return any(d.id == device for name, a in self.state.allocations.items()
                   if name != self.vm for d in a.devices)

    def orphan(self, action: str, device: str) -> Optional[Intent]:
        """The intent a killed start of this VM left for this change, if any."""
        return self._orphan(action, device)

    def _orphan(self, action: str, device: str) -> Optional[Intent]:
        for i in self._orphans:
            if i.action == action and i.id == device:
                return i
        return None

    def _take(self, orphan: Intent, on_demand: bool) -> None:
        """The orphan's intent becomes this start's: fulfilled by its allocation
        on commit, undone on its rollback."""
        self._orphans.remove(orphan)
        orphan.on_demand = on_demand
        self._intents.append(orphan)

    def adopt_mdev(self, uuid: str) -> Optional[Intent]:
        """A live mdev a killed start of this VM created, taken over as it is
        (the retry keeps a live mdev the XML names). Its intent, or None when
        it is not such an orphan."""
        orphan = self._orphan("create-mdev", uuid)
        live = mdev.read_mdev(self.sysfs, uuid) if orphan is not None else None
        if orphan is None or live is None or str(live.parent) != orphan.parent or \
                live.type_id != orphan.type_id or self._held_by_other(uuid):
            return None
        self._take(orphan, orphan.on_demand)
        self._undo.append((f"remove mdev {uuid}",
                           lambda: mdev.remove(self.sysfs, uuid, retry_seconds=0.5)))
        log.info("%s: adopted mdev %s (%s on %s), left by an interrupted start", self.vm,
                 uuid, live.type_id, live.parent)
        return orphan

    def keep_mdev(self, uuid: str, on_demand: bool) -> bool:
        """A live mdev a start (or an arrival) keeps; taken over in place when a
        killed run of this VM made it. Whether it is on demand: as the killed
        run made it, else `on_demand`."""
        orphan = self.adopt_mdev(uuid)
        if orphan is None:
            return on_demand
        if orphan.on_demand and uuid not in self.state.vgpus and \
                orphan.parent is not None and orphan.type_id is not None:
            # Its record was to be written with the killed run's allocation.
            self.state.vgpus[uuid] = VgpuRecord(orphan.parent, orphan.type_id, None, True,
                                                utc_now())
        return orphan.on_demand

    def _intend(self, intent: Intent) -> None:
        self.state.intents.append(intent)
        self._intents.append(intent)
        if self._checkpoint is not None:
            self._checkpoint(self.state)

    def create_mdev(self, parent: PciAddress, type_id: str, uuid: str,
                    on_demand: bool, attrs: Sequence[tuple[str, str]] = ()) -> mdev.Mdev:
        orphan = self._orphan("create-mdev", uuid)
        if orphan is not None:
            live = mdev.read_mdev(self.sysfs, uuid)
            if live is not None and live.parent == parent and live.type_id == type_id and \
                    orphan.parent == str(parent) and orphan.type_id == type_id and \
                    not attrs and not self._held_by_other(uuid):
                # The same change a killed start of this VM made: adopted in place.
                self._take(orphan, on_demand)
                self._undo.append((f"remove mdev {uuid}",
                                   lambda: mdev.remove(self.sysfs, uuid, retry_seconds=0.5)))
                log.info("%s: adopted mdev %s (%s on %s), left by an interrupted start",
                         self.vm, uuid, type_id, parent)
                return live
            # Another change under the same UUID: the orphan is undone first.
            self._settle_orphan(orphan)
        self._intend(Intent("create-mdev", uuid, self.vm, str(parent), type_id, on_demand))
        made = mdev.create(self.sysfs, parent, type_id, uuid, attrs=attrs)
        self._undo.append((f"remove mdev {made.uuid}",
                           lambda: mdev.remove(self.sysfs, made.uuid, retry_seconds=0.5)))
        return made

    def set_vf_type(self, vf: PciAddress, type_id: int, on_demand: bool) -> None:
        before = nvidia.current_type(self.sysfs, vf) or 0
        orphan = self._orphan("set-vf-type", str(vf))
        if orphan is not None:
            if before == type_id and orphan.type_id == str(type_id) and \
                    not self._held_by_other(str(vf)):
                self._take(orphan, on_demand)
                self._undo.append((f"clear the vGPU type of {vf}",
                                   lambda: nvidia.clear_type(self.sysfs, vf, retry_seconds=0.5)))
                log.info("%s: adopted the vGPU type %s of %s, set by an interrupted start",
                         self.vm, type_id, vf)
                return
            self._settle_orphan(orphan)
            before = nvidia.current_type(self.sysfs, vf) or 0
        self._intend(Intent("set-vf-type", str(vf), self.vm, None, str(type_id), on_demand))
        nvidia.set_type(self.sysfs, vf, type_id)
        if before == 0:
            self._undo.append((f"clear the vGPU type of {vf}",
                               lambda: nvidia.clear_type(self.sysfs, vf, retry_seconds=0.5)))

    def release(self, devices: Sequence[Device], retry_seconds: float) -> list[str]:
        """Destroy on-demand devices this VM no longer holds (a retried start's
        earlier attempt), write-ahead; what `release_devices` says. Not undone
        by a rollback."""
        if devices:
            self._removed = True
        return release_devices(self.sysfs, self.state, self.vm, devices, self.liveness,
                               self._checkpoint, retry_seconds)

    @property
    def changed(self) -> bool:
        return bool(self._undo)

    def rollback(self) -> bool:
        """Undo every change, newest first; failures are logged, the rest still
        undone. True when everything was undone (the intents are then void)."""
        ok = not self._removed
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
                log.info("%s: rolled back: %s", self.vm, what)
            except (GpulibError, OSError) as exc:
                ok = False
                log.error("%s: rolling back failed: %s: %s", self.vm, what, exc)
        return ok

    def _settle_orphan(self, orphan: Intent) -> None:
        self._orphans.remove(orphan)
        settle(self.sysfs, self.state, self.liveness, only=[orphan])
        if orphan in self.state.intents:
            raise DeviceError(f"{orphan.action} {orphan.id}, left by an interrupted start "
                              f"of {self.vm}, cannot be undone (see the log)")

    def commit(self) -> None:
        """The start succeeded: its intents are fulfilled by its allocation.

        The intents of a killed start of this VM it did not adopt are settled
        now (completed when the allocation names their device, else undone).
        With a checkpoint function, the state (allocation recorded, intents
        dropped) is written here, while the changes can still be undone: a
        failing write (disk full) rolls them back like any other failure."""
        settled = bool(self._orphans)
        if self._orphans:
            settle(self.sysfs, self.state, self.liveness, only=self._orphans)
            self._orphans = []
        self.state.intents = [i for i in self.state.intents
                              if not any(i is mine for mine in self._intents)]
        if (self._undo or settled or self._removed) and self._checkpoint is not None:
            self._checkpoint(self.state)
        self._intents.clear()
        self._undo.clear()


def release_devices(sysfs: Sysfs, state: State, vm: str, devices: Sequence[Device],
                    liveness: Liveness, checkpoint: Optional[Callable[[State], None]],
                    retry_seconds: float, ignore_vm: Optional[str] = None) -> list[str]:
    """Destroy devices `vm` held on demand, each announced by a removal intent.

    The caller has already taken them out of `vm`'s allocation (or dropped
    it): that change and the intents reach the disk in one write (`checkpoint`)
    before the first removal. A device that goes is forgotten and its intent
    dropped; one that cannot go yet (busy: NVIDIA needs a moment after QEMU
    exits) keeps its intent, which the next run settles. One line per device.
    A VF given that is not on demand (a MIG-backed pool member returning its
    GPU instance) has its type cleared and keeps its record.
    `ignore_vm`: a VM whose status file does not count (a forced release)."""
    todo = []
    for dev in devices:
        if dev.kind not in ("mdev", "vf"):
            continue
        rec_m = state.vgpus.get(dev.id) if dev.kind == "mdev" else None
        action = "remove-mdev" if dev.kind == "mdev" else "clear-vf-type"
        intent = Intent(action, dev.id, vm, rec_m.parent if rec_m is not None else None,
                        rec_m.type_id if rec_m is not None else None,
                        on_demand=dev.on_demand or dev.kind == "mdev")
        state.intents.append(intent)
        todo.append(intent)
    if todo and checkpoint is not None:
        checkpoint(state)
    out = []
    for intent in todo:
        out.append(_finish_removal(sysfs, state, intent, liveness, retry_seconds, ignore_vm))
    return out


def _finish_removal(sysfs: Sysfs, state: State, intent: Intent, liveness: Liveness,
                    retry_seconds: float, ignore_vm: Optional[str] = None) -> str:
    """Carry out one removal intent, unless a VM holds its device again; the
    intent is dropped when done, kept (for the next run) when the kernel says no."""
    kind = "mdev" if intent.action == "remove-mdev" else "vf"
    holder = liveness.user_of(intent.id)
    if holder is not None and holder == ignore_vm:
        holder = None
    if holder is None:
        holder = next((name for name, a in state.allocations.items()
                       if any(d.id == intent.id for d in a.devices)), None)
    if holder is not None:
        # Held again (a running domain names it, or an allocation does): the
        # device is that VM's now; the removal is void.
        state.intents.remove(intent)
        return f"kept {kind} {intent.id}: {holder} holds it"
    try:
        if kind == "mdev":
            mdev.remove(sysfs, intent.id, retry_seconds=retry_seconds)
            state.vgpus.pop(intent.id, None)
        else:
            vf = PciAddress.parse(intent.id)
            if nvidia.current_type(sysfs, vf):
                nvidia.clear_type(sysfs, vf, retry_seconds=retry_seconds)
            if intent.on_demand:
                state.vf_types.pop(intent.id, None)
            else:
                state.intents.remove(intent)
                return f"returned the GPU instance of vf {intent.id} (its type cleared)"
    except (GpulibError, OSError) as exc:
        reason = exc.message if isinstance(exc, GpulibError) else str(exc)
        log.error("releasing %s %s of %s failed (the next run tries again): %s", kind,
                  intent.id, intent.vm, reason)
        return f"FAILED to destroy {kind} {intent.id}: {reason}"
    state.intents.remove(intent)
    return f"destroyed {kind} {intent.id}"


def settle(sysfs: Sysfs, state: State, liveness: Liveness, keep: Optional[str] = None,
           only: Optional[Sequence[Intent]] = None, reuse: Sequence[str] = ()) -> list[str]:
    """Complete or undo the intents of runs that died; one line per intent.

    `keep`: a VM starting now; its start intents are left to its Journal (which
    adopts what it makes again and settles the rest). `only`: these intents.
    `reuse`: devices the start now running names: a removal intent for one of
    them is void (the device stays, for that start). A removal is finished
    (journal.release_devices); a start's change is undone unless an
    allocation of its VM names the device. Nothing a running domain names is
    removed or cleared. A GPU instance's intents are left to the commands
    that may run NVIDIA's tool (`pools.settle_instances`)."""
    if not state.intents:
        return []
    out = []
    todo = [i for i in state.intents if (only is None or any(i is o for o in only))
            and i.action not in GPU_INSTANCE_ACTIONS]
    for intent in todo:
        if intent.action in REMOVALS:
            if intent.id in reuse:
                state.intents.remove(intent)
                out.append(f"{intent.action} {intent.id} of {intent.vm}: void (named again)")
                continue
            line = _finish_removal(sysfs, state, intent, liveness, 0.5)
            out.append(f"{intent.action} {intent.id} of {intent.vm}: {line}")
            continue
        if intent.vm == keep:
            continue
        alloc = state.allocations.get(intent.vm)
        if alloc is not None and any(d.id == intent.id for d in alloc.devices):
            out.append(f"{intent.action} {intent.id} of {intent.vm}: completed")
            state.intents.remove(intent)
            continue
        held = any(d.id == intent.id for a in state.allocations.values() for d in a.devices) \
            or liveness.user_of(intent.id) is not None
        try:
            if intent.action == "create-mdev":
                live = mdev.read_mdev(sysfs, intent.id)
                rec = state.vgpus.get(intent.id)
                # A registry vGPU (pool, manual) is meant to be live: it stays.
                if live is not None and not held and (rec is None or rec.on_demand):
                    mdev.remove(sysfs, intent.id, retry_seconds=0.5)
                    out.append(f"create-mdev {intent.id} of {intent.vm}: undone (removed)")
                else:
                    out.append(f"create-mdev {intent.id} of {intent.vm}: nothing to undo")
                if rec is not None and rec.on_demand and not held:
                    del state.vgpus[intent.id]
            else:
                vf = PciAddress.parse(intent.id)
                current = nvidia.current_type(sysfs, vf)
                rec_v = state.vf_types.get(intent.id)
                if current and str(current) == intent.type_id and not held and \
                        (rec_v is None or rec_v.on_demand):
                    nvidia.clear_type(sysfs, vf, retry_seconds=0.5)
                    out.append(f"set-vf-type {intent.id} of {intent.vm}: undone (cleared)")
                else:
                    out.append(f"set-vf-type {intent.id} of {intent.vm}: nothing to undo")
                if rec_v is not None and rec_v.on_demand and not held:
                    del state.vf_types[intent.id]
        except GpulibError as exc:
            # Kept: the next run tries again.
            log.error("cannot settle %s %s of %s: %s", intent.action, intent.id, intent.vm,
                      exc.message)
            out.append(f"{intent.action} {intent.id} of {intent.vm}: FAILED: {exc.message}")
            continue
        state.intents.remove(intent)
    for line in out:
        log.warning("settled an interrupted run: %s", line)
    return out
