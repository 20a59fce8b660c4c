"""The NVIDIA driver's MIG state in the simulator: a GPU's instances and the
GPU instances its VFs' MIG-backed vGPUs run on.

The real driver keeps this in its memory; the simulator keeps it in a
hidden file of the physical function's directory (`.sim-mig.json`), so it
goes with sysfs at a reboot, as GPU instances do (MIG mode itself is the
GPU's setting and survives: the host builder writes it again). Two parts of
the simulator change it and both end with `refresh()`:

* the simulated kernel (`gpulib.sim.kernel`), when a VF's
  `nvidia/current_vgpu_type` is written: a MIG-backed type takes a free GPU
  instance of its profile (the lowest id), 0 gives it back;
* the simulated `nvidia-smi` (`gpulib.sim.nvidia_smi`): `mig -cgi`, `-cci`,
  `-dci`, `-dgi`, `-mig`.

`refresh()` rewrites every VF's `creatable_vgpu_types` the way the driver
shows it: an idle VF lists each MIG-backed type whose profile has a GPU
instance that has a compute instance and runs no vGPU; a typed VF lists
nothing; and `gpu_instance_id` names the instance a typed VF runs on
(`-1` when idle: the idle value was not seen on a real host).

GPU instance ids follow the placement, as on A100 and H100 (the captures in
tests/data/nvidia-smi show 7 + start for 1-slice instances, 3 + start / 2
for 2-slice ones, 1 + start / 4 for 4-slice ones, 0 for the whole GPU); a
model may give its own bases (`instance_ids`: the A30 numbers from 3, 1, 0);
an instance created without a placement goes to the highest free start, as
the driver placed the 1g instances of those captures from slice 6 down.

A MIG-backed type may run several vGPUs on one GPU instance (`per_gi`, the
RTX PRO 6000 Blackwell's time-sliced MIG-backed types: `DC-1-8Q` three to a
`1g.24gb+gfx` instance): a VF of that type takes the lowest-id instance of
its profile that runs fewer than `per_gi` vGPUs, all of the same type.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any, Optional

from gpulib import mig
from gpulib.sim.attrs import read_attribute as _read
from gpulib.sim.attrs import rewrite_attribute as _write

STATE_FILE = ".sim-mig.json"
IDLE_GPU_INSTANCE = "-1"
# nvidia-smi's exit codes (its man page): not found, in use, insufficient resources.
NOT_FOUND = 6
IN_USE = 19
INSUFFICIENT = 23


class MigError(Exception):
    """A MIG operation the driver refuses: the tool's exit code and NVML's words."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


H100_INSTANCE_IDS = {8: 0, 4: 1, 2: 3, 1: 7}


def instance_id(start: int, size: int, bases: Optional[dict[int, int]] = None) -> int:
    """The id the driver gives the instance at `start:size` (see the module's notes)."""
    base = (H100_INSTANCE_IDS if bases is None else bases).get(size)
    return base + start // size if base is not None else 100 + start


class MigGpu:
    """One GPU's MIG state (see the module's notes)."""

    def __init__(self, pf_dir: str, data: dict[str, Any]) -> None:
        self.pf_dir = pf_dir
        self.data = data

    # -- the file ---------------------------------------------------------------------------
    @staticmethod
    def path(pf_dir: str) -> str:
        return os.path.join(pf_dir, STATE_FILE)

    @classmethod
    def load(cls, pf_dir: str) -> Optional[MigGpu]:
        """The GPU's MIG state, None for a GPU without MIG (no state file)."""
        try:
            with open(cls.path(pf_dir), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return None
        return cls(pf_dir, data) if isinstance(data, dict) else None

    @classmethod
    def create(cls, pf_dir: str, profiles: list[dict[str, Any]],
               types: dict[str, list[Any]], enabled: bool = True,
               instance_ids: Optional[dict[int, int]] = None,
               product: Optional[str] = None) -> MigGpu:
        """A MIG-capable GPU: its profiles (models.json's `mig_profiles`), the
        MIG-backed vGPU types of its driver ({type id: [name, profile id] or
        [name, profile id, vGPUs per instance]}), MIG mode on or off (current
        and pending alike), no instance; its model's instance id bases and
        product name when not the H100 PCIe's."""
        mode = mig.ENABLED if enabled else mig.DISABLED
        data: dict[str, Any] = {"current": mode, "pending": mode, "profiles": profiles,
                                "types": types, "instances": [], "bound": {}}
        if instance_ids is not None:
            data["instance_ids"] = {str(k): v for k, v in instance_ids.items()}
        if product is not None:
            data["product"] = product
        gpu = cls(pf_dir, data)
        gpu.save()
        return gpu

    def save(self) -> None:
        path = self.path(self.pf_dir)
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8"):
                pass
        _write(path, json.dumps(self.data, indent=1, sort_keys=True) + "\n")

    # -- what it holds ------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self.data.get("current") == mig.ENABLED)

    @property
    def current(self) -> str:
        return str(self.data.get("current", mig.DISABLED))

    @property
    def pending(self) -> str:
        return str(self.data.get("pending", mig.DISABLED))

    def set_pending(self, enabled: bool) -> None:
        self.data["pending"] = mig.ENABLED if enabled else mig.DISABLED

    def profile(self, ident: str) -> Optional[dict[str, Any]]:
        """A profile by id (`19`) or name (`1g.10gb`, `MIG 1g.10gb`)."""
        for p in self.data.get("profiles", []):
            if ident.isdigit() and int(ident) == p["id"]:
                return p  # type: ignore[no-any-return]
            if ident in (p["name"], mig.short_name(p["name"])):
                return p  # type: ignore[no-any-return]
        return None

    def types(self) -> dict[int, tuple[str, int]]:
        return {int(k): (str(v[0]), int(v[1])) for k, v in self.data.get("types", {}).items()}

    def per_gi(self, type_id: int) -> int:
        """How many vGPUs of the type one GPU instance runs (1 unless the model says more)."""
        found = self.data.get("types", {}).get(str(type_id), [])
        return int(found[2]) if len(found) > 2 else 1

    @property
    def product(self) -> Optional[str]:
        value = self.data.get("product")
        return str(value) if value is not None else None

    def instances(self) -> list[dict[str, Any]]:
        return list(self.data.get("instances", []))

    def instance(self, gi: int) -> Optional[dict[str, Any]]:
        return next((i for i in self.data["instances"] if i["id"] == gi), None)

    def bound(self) -> dict[str, int]:
        return dict(self.data.get("bound", {}))

    def model(self) -> tuple[list[mig.Profile], list[mig.Instance]]:
        """The profiles (with what is free now) and instances, as gpulib.mig models them."""
        names = {p["id"]: p["name"] for p in self.data.get("profiles", [])}
        used = [mig.Instance(i["id"], i["profile"], names.get(i["profile"], "?"), i["start"],
                             i["size"], i["cis"]) for i in self.data["instances"]]
        profiles = []
        for p in self.data.get("profiles", []):
            prof = mig.Profile(p["id"], p["name"], 0, p["total"], p["memory_gib"], "No",
                               p["sm"], p["dec"], p["enc"], p["ce"], p["jpeg"], p["ofa"],
                               p["placements"], p["size"])
            same = sum(1 for i in used if i.profile_id == prof.id)
            prof.free = mig.free_count(prof, used, same) if self.enabled else 0
            profiles.append(prof)
        return profiles, sorted(used, key=lambda i: i.start)

    # -- the driver's operations -------------------------------------------------------------
    def create_gi(self, ident: str, start: Optional[int] = None) -> tuple[int, dict[str, Any]]:
        """A new GPU instance of the profile `ident`, at `start` or where the driver puts it."""
        p = self.profile(ident)
        if p is None:
            raise MigError(2, "Invalid profile")
        profiles, used = self.model()
        prof = next(x for x in profiles if x.id == p["id"])
        free = mig.free_placements(prof, used)
        if sum(1 for i in used if i.profile_id == prof.id) >= prof.total:
            free = []
        if start is None:
            start = max(free) if free else None
        elif start not in prof.placements:
            raise MigError(2, "Invalid Argument")
        if start is None or start not in free:
            raise MigError(INSUFFICIENT, "Insufficient Resources")
        bases = self.data.get("instance_ids")
        gi = instance_id(start, p["size"],
                         {int(k): int(v) for k, v in bases.items()} if bases else None)
        self.data["instances"].append({"id": gi, "profile": p["id"], "start": start,
                                       "size": p["size"], "cis": []})
        return gi, p

    def create_ci(self, gi: int) -> tuple[int, int]:
        """The default compute instance of GPU instance `gi` (all its slices):
        (compute instance id, its profile id)."""
        inst = self.instance(gi)
        if inst is None:
            raise MigError(NOT_FOUND, "Not Found")
        if inst["cis"]:
            raise MigError(INSUFFICIENT, "Insufficient Resources")
        p = self.profile(str(inst["profile"]))
        inst["cis"] = [0]
        return 0, int(p["ci_profile"]) if p else 0

    def _in_use(self, gi: int) -> bool:
        return gi in self.data.get("bound", {}).values()

    def destroy_ci(self, gi: int, ci: Optional[int] = None) -> list[int]:
        inst = self.instance(gi)
        if inst is None:
            raise MigError(NOT_FOUND, "Not Found")
        if self._in_use(gi):
            raise MigError(IN_USE, "In use by another client")
        gone = [c for c in inst["cis"] if ci is None or c == ci]
        if ci is not None and not gone:
            raise MigError(NOT_FOUND, "Not Found")
        inst["cis"] = [c for c in inst["cis"] if c not in gone]
        return gone

    def destroy_gi(self, gi: int) -> None:
        inst = self.instance(gi)
        if inst is None:
            raise MigError(NOT_FOUND, "Not Found")
        if self._in_use(gi) or inst["cis"]:
            raise MigError(IN_USE, "In use by another client")
        self.data["instances"].remove(inst)

    def free_instance(self, profile_id: int, type_id: Optional[int] = None) -> Optional[int]:
        """The lowest-id GPU instance of the profile that has a compute
        instance and room for a vGPU of `type_id`: none running, or (a type
        with several vGPUs per instance) fewer than it holds, all of that type."""
        bound = self.data.get("bound", {})
        kinds = self.data.get("bound_types", {})
        room = self.per_gi(type_id) if type_id is not None else 1
        ids = []
        for i in self.data["instances"]:
            if i["profile"] != profile_id or not i["cis"]:
                continue
            on = [vf for vf, gi in bound.items() if gi == i["id"]]
            if len(on) < room and all(kinds.get(vf) == type_id for vf in on):
                ids.append(i["id"])
        return min(ids) if ids else None

    def bind(self, vf: str, type_id: int) -> int:
        """A VF's vGPU of MIG-backed type `type_id` takes a GPU instance with room."""
        found = self.types().get(type_id)
        if found is None:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), vf)
        gi = self.free_instance(found[1], type_id)
        if gi is None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), vf)
        self.data.setdefault("bound", {})[vf] = gi
        self.data.setdefault("bound_types", {})[vf] = type_id
        return gi

    def unbind(self, vf: str) -> None:
        self.data.setdefault("bound", {}).pop(vf, None)
        self.data.setdefault("bound_types", {}).pop(vf, None)

    # -- what the VFs show --------------------------------------------------------------------
    def vf_dirs(self) -> list[str]:
        out = []
        for name in sorted(os.listdir(self.pf_dir), key=lambda n: (len(n), n)):
            if name.startswith("virtfn"):
                d = os.path.realpath(os.path.join(self.pf_dir, name))
                if os.path.isdir(os.path.join(d, "nvidia")):
                    out.append(d)
        return out

    def refresh(self) -> None:
        """Every VF's creatable list and GPU instance, from the state (see the
        notes); nothing while MIG mode is off (time-sliced types then)."""
        if not self.enabled:
            return
        types = self.types()
        bound = self.bound()
        offered = {tid: name for tid, (name, pid) in sorted(types.items())
                   if self.free_instance(pid, tid) is not None}
        for d in self.vf_dirs():
            nv = os.path.join(d, "nvidia")
            vf = os.path.basename(d)
            typed = _read(os.path.join(nv, "current_vgpu_type")) not in ("", "0")
            lines = ["ID    : vGPU Name"] + ([] if typed else
                                             [f"{k:<5d} : {v}" for k, v in offered.items()])
            _write(os.path.join(nv, "creatable_vgpu_types"), "\n".join(lines) + "\n")
            gi_file = os.path.join(nv, "gpu_instance_id")
            if os.path.exists(gi_file):
                _write(gi_file, f"{bound[vf]}\n" if vf in bound else IDLE_GPU_INSTANCE + "\n")
