"""NVIDIA's tool asked about MIG, and told to change it: bounded, cached, failing soft.

What a GPU's MIG layout is (mode, profiles, placements, GPU and compute
instances) only NVIDIA's tool tells; sysfs shows no more than what the VFs
can take. gpulib asks it the way `gpulib.nvidiasmi` does (found below the
injected root, run with a bound on its time, its process group killed when
it overruns; `nvidiasmi.run`), and only from commands:

* reports (`gpulib discover` as JSON or table, `gpulib metrics`, the doctor)
  read the layout through a cache (`var/lib/gpulib/nvidia-mig.json`), asked
  again when the driver changes, when what the GPU's VFs show changes (the
  fingerprint discovery hands in: their types, creatable lists and GPU
  instances), when gpulib changed the layout itself (`forget`), or after
  `CACHE_SECONDS`. A GPU without MIG (`MIG Mode : N/A`, an A10) is asked
  once per driver. A tool that fails leaves the layout unknown (the report
  stays whole, the reason is logged) and is not asked again for
  `nvidiasmi.RETRY_SECONDS`;
* `gpulib pool apply`, `gpulib restore`, `gpulib reconcile` and
  scripts/device create and destroy GPU instances (`Tool.create`,
  `Tool.destroy`) and read the layout fresh. The hooks never run it: a start
  only types a VF whose GPU instance exists (its creatable list says so).

The questions, per GPU in MIG mode: `nvidia-smi -q` (every GPU's MIG mode,
one call), then `nvidia-smi mig -i <bus id>` with `-lgip`, `-lgipp`, `-lgi`
and `-lci`. `No GPU instances found` (exit 6) is an empty layout, not a
failure. A GPU instance is made with its default compute instance
(`-cgi <profile>:<start> -C`): a MIG-backed vGPU needs both on the host.
"""

from __future__ import annotations

import json
import os
import time

from gpulib import logger, mig, nvidiasmi
from gpulib.nvidiasmi import ToolFailed
from gpulib.pci import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Optional

    from gpulib.discovery import Gpu, Inventory

log = logger.get(__name__)

CACHE_FILE = "var/lib/gpulib/nvidia-mig.json"
CACHE_VERSION = 1
# A layout another tool changed without the VFs showing it (a second free
# instance of a profile already free) is reported at most this late.
CACHE_SECONDS = 120.0
# nvidia-smi's exit code for "not found" (no instance, no MIG device).
NOT_FOUND = 6


class Tool:
    """nvidia-smi below a root, each call bounded by `timeout` seconds."""

    def __init__(self, path: str, timeout: float = nvidiasmi.DEFAULT_TIMEOUT) -> None:
        self.path = path
        self.timeout = timeout

    @classmethod
    def find(cls, root: str, timeout: float = nvidiasmi.DEFAULT_TIMEOUT) -> Optional[Tool]:
        path = nvidiasmi.tool_path(root)
        return cls(path, timeout) if path is not None else None

    def _run(self, args: tuple[str, ...], empty_ok: bool = False) -> str:
        code, out, err = nvidiasmi.run(self.path, args, self.timeout)
        if code == 0 or (empty_ok and code == NOT_FOUND):
            return out
        raise nvidiasmi.failure(self.path, args, code, out, err)

    def query(self) -> dict[PciAddress, dict[str, str]]:
        """Every GPU's `-q` fields (MIG mode, product, virtualization mode)."""
        return mig.parse_query(self._run(("-q",)))

    def layout(self, gpu: PciAddress, fields: Optional[dict[str, str]] = None) -> mig.Layout:
        """One GPU's layout, asked now (`fields`: its `-q` answer, when read)."""
        if fields is None:
            fields = self.query().get(gpu, {})
        current, _pending = mig.mode_of(fields)
        if current != mig.ENABLED:
            return mig.layout_of(fields, {}, {}, [], {})
        bus = gpu.bus_id
        # The tool numbers the one GPU asked about (`-i`) by its index, which
        # gpulib does not need to know: the answer is the only one.
        profiles = next(iter(mig.parse_profiles(
            self._run(("mig", "-i", bus, "-lgip"))).values()), {})
        placements = next(iter(mig.parse_placements(
            self._run(("mig", "-i", bus, "-lgipp"))).values()), {})
        instances = next(iter(mig.parse_instances(
            self._run(("mig", "-i", bus, "-lgi"), empty_ok=True)).values()), [])
        compute = next(iter(mig.parse_compute(
            self._run(("mig", "-i", bus, "-lci"), empty_ok=True)).values()), {})
        return mig.layout_of(fields, profiles, placements, instances, compute)

    def layouts(self, gpus: Iterable[PciAddress]) -> dict[PciAddress, mig.Layout]:
        fields = self.query()
        return {g: self.layout(g, fields.get(g, {})) for g in gpus}

    def create(self, gpu: PciAddress, profile: int, start: int) -> tuple[int, Optional[int]]:
        """A GPU instance of `profile` at `start` with its default compute
        instance: (its GPU instance id, its compute instance id or None)."""
        out = self._run(("mig", "-i", gpu.bus_id, "-cgi", f"{profile}:{start}", "-C"))
        gis, cis = mig.parse_created(out)
        if not gis:
            raise ToolFailed(f"{self.path} made no GPU instance of profile {profile} at "
                             f"{start} on {gpu} (it said: "
                             f"{(out.strip().splitlines() or ['nothing'])[0][:200]})")
        gi = gis[0][0]
        return gi, next((ci for g, ci in cis if g == gi), None)

    def create_compute(self, gpu: PciAddress, gi: int) -> None:
        """The default compute instance of GPU instance `gi`."""
        self._run(("mig", "-i", gpu.bus_id, "-gi", str(gi), "-cci"))

    def destroy(self, gpu: PciAddress, gi: int) -> None:
        """GPU instance `gi` and its compute instances (the driver refuses
        while a vGPU runs on it: "In use by another client")."""
        bus = gpu.bus_id
        dci = ("mig", "-i", bus, "-gi", str(gi), "-dci")
        code, out, err = nvidiasmi.run(self.path, dci, self.timeout)
        if code not in (0, NOT_FOUND):
            raise nvidiasmi.failure(self.path, dci, code, out, err)
        had_compute = code == 0
        try:
            self._run(("mig", "-i", bus, "-gi", str(gi), "-dgi"))
        except ToolFailed as exc:
            # The instance stays: it gets its compute instance back, or a
            # MIG-backed vGPU could never run on it again.
            if had_compute:
                try:
                    self.create_compute(gpu, gi)
                except ToolFailed as again:
                    raise ToolFailed(f"{exc}; and its compute instance, destroyed before, "
                                     f"could not be made again: {again}") from exc
            raise


# -- the cache of the reports -------------------------------------------------------------------

def _driver(root: str) -> Optional[str]:
    try:
        with open(os.path.join(root, nvidiasmi.DRIVER_VERSION), encoding="utf-8") as fh:
            return fh.read(256).strip() or None
    except OSError:
        return None


def _load(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.loads(fh.read(nvidiasmi.OUTPUT_MAX))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else {}


def _save(path: str, data: dict[str, object]) -> None:
    from gpulib.atomicfile import AtomicWriteError, write_atomic

    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        write_atomic(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(),
                     mode=0o644, durable=False, sync_dir=False)
    except (AtomicWriteError, OSError) as exc:
        log.info("could not cache the MIG layout in %s: %s", path, exc)


def forget(root: str) -> None:
    """Drop the cached layouts: gpulib changed them (or may have)."""
    try:
        os.unlink(os.path.join(root, CACHE_FILE))
    except OSError:
        pass


def fingerprint(gpu: Gpu) -> str:
    """What the GPU's VFs show of its MIG layout: their vGPU types, creatable
    lists and GPU instances (a GPU instance made or destroyed, or taken by a
    VF, changes it)."""
    parts = []
    for vf in gpu.vfs:
        nv = vf.nvidia
        if nv is not None:
            parts.append(f"{vf.address}={nv.current_type}:{nv.gpu_instance}:"
                         + ",".join(map(str, sorted(nv.creatable))))
    return ";".join(parts)


def _still_good(entry: dict[str, object], gpu: Gpu, now: float, frozen: bool) -> bool:
    """Whether a cached layout holds: the VFs show what they showed, and it
    is recent (or a snapshot's, `frozen`)."""
    if entry.get("fingerprint") != fingerprint(gpu):
        return False
    at = entry.get("at")
    return frozen or (isinstance(at, (int, float)) and 0 <= now - float(at) < CACHE_SECONDS)


def layouts(root: str, gpus: list[Gpu], timeout: float = nvidiasmi.DEFAULT_TIMEOUT,
            now: Optional[float] = None, save: bool = True,
            unknown: Optional[list[str]] = None) -> dict[PciAddress, mig.Layout]:
    """The layouts of `gpus` (NVIDIA GPUs with vendor VFs) for a report:
    from the cache while it is good, else from the tool; a GPU nothing is
    known of is left out (why, added to `unknown`). `save` False (the
    doctor, which never writes): what was asked is not kept."""
    why = unknown if unknown is not None else []
    if not gpus:
        return {}
    now = time.time() if now is None else now
    path = os.path.join(root, CACHE_FILE)
    driver = _driver(root)
    cache = _load(path)
    if cache.get("driver") != driver:
        cache = {}
    cached = cache.get("gpus") if isinstance(cache.get("gpus"), dict) else {}
    assert isinstance(cached, dict)
    # A snapshot's replay has no tool to ask: its layouts hold while the
    # VFs show what they showed (`frozen`).
    frozen = cache.get("frozen") is True
    out: dict[PciAddress, mig.Layout] = {}
    stale = []
    for g in gpus:
        entry = cached.get(str(g.address))
        layout = mig.Layout.from_json(entry.get("layout")) if isinstance(entry, dict) else None
        if layout is not None and layout.current in (mig.ENABLED, mig.DISABLED) and \
                not _still_good(entry, g, now, frozen):  # type: ignore[arg-type]
            layout = None  # a MIG-capable GPU's layout changes
        if layout is not None:
            out[g.address] = layout
        else:
            stale.append(g)
    if not stale:
        return out
    failed_at = cache.get("failed_at")
    if isinstance(failed_at, (int, float)) and 0 <= now - failed_at < nvidiasmi.RETRY_SECONDS:
        # failed lately (logged then): not asked again yet
        why.append(f"nvidia-smi failed {int(now - failed_at)} s ago (see the log); it is "
                   f"asked again {int(nvidiasmi.RETRY_SECONDS)} s after a failure")
        return out
    tool = Tool.find(root, timeout)
    if tool is None:
        log.debug("no nvidia-smi below %s: MIG layouts unknown", root)
        why.append("nvidia-smi is not installed")
        return out
    fresh: dict[str, object] = {"version": CACHE_VERSION, "driver": driver,
                                "gpus": dict(cached)}
    if frozen:
        fresh["frozen"] = True
    try:
        found = tool.layouts(g.address for g in stale)
    except ToolFailed as exc:
        why.append(str(exc))
        log.warning("MIG layouts unknown (left out of the report): %s; not asked again for "
                    "%d s", exc, int(nvidiasmi.RETRY_SECONDS))
        fresh["failed_at"] = now
        if save:
            _save(path, fresh)
        return out
    gpus_entry = fresh["gpus"]
    assert isinstance(gpus_entry, dict)
    for g in stale:
        layout = found.get(g.address)
        if layout is None:
            continue
        out[g.address] = layout
        gpus_entry[str(g.address)] = {"fingerprint": fingerprint(g), "at": now,
                                      "layout": layout.as_json()}
    if save:
        _save(path, fresh)
    return out


def frozen_cache(root: str, gpus: list[Gpu], found: dict[PciAddress, mig.Layout],
                 now: float) -> bytes:
    """The cache a snapshot carries: the layouts of `gpus` as the reports
    read them, held in a replay (which has no tool) while the VFs show what
    they show now."""
    entries = {str(g.address): {"fingerprint": fingerprint(g), "at": now,
                                "layout": found[g.address].as_json()}
               for g in gpus if g.address in found}
    doc = {"version": CACHE_VERSION, "driver": _driver(root), "frozen": True, "gpus": entries}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def wanted(inventory: Inventory) -> list[Gpu]:
    """The GPUs a MIG layout is asked for: NVIDIA GPUs with vendor-specific VFs."""
    return [g for g in inventory.gpus if any(vf.nvidia is not None for vf in g.vfs)]


def attach(inventory: Inventory, root: str, timeout: float = nvidiasmi.DEFAULT_TIMEOUT,
           save: bool = True) -> None:
    """Give each NVIDIA GPU with vendor VFs its MIG layout (`Gpu.mig`) when
    NVIDIA's tool reports one (a GPU without MIG support reports `N/A`: None)."""
    gpus = wanted(inventory)
    found = layouts(root, gpus, timeout, save=save)
    for g in gpus:
        layout = found.get(g.address)
        g.mig = layout if layout is not None and layout.current in (mig.ENABLED,
                                                                    mig.DISABLED) else None
