"""NVIDIA's Multi-Instance GPU (MIG): the layout of a GPU's instances, what
NVIDIA's tool prints of it, and where a new instance goes.

A GPU in MIG mode is cut into GPU instances (GIs), each of a profile
(`MIG 1g.10gb`: one compute slice, 10 GB) placed on the GPU's memory slices
(`start:size`, eight slices on an A100 or H100); a GI runs its work in
compute instances (CIs). A MIG-backed vGPU (`NVIDIA H100-1-10C`) runs on one
GI of its profile: an SR-IOV VF can take such a type (its
`nvidia/creatable_vgpu_types` lists it) only while a GI of that profile with
a compute instance is free, and a typed VF names the GI it runs on in
`nvidia/gpu_instance_id`.

This module is pure: the parsers of what `nvidia-smi` prints (`-q`, `mig
-lgip`, `-lgipp`, `-lgi`, `-lci`, `-cgi ... -C`) and the choice of a
placement (`choose_placement`). Running the tool is `gpulib.migtool`'s. It
writes none of these formats: the simulator's tool prints them after real
captures (`gpulib.sim.captured`), so the parsers meet the tool's layout,
not their own.

Formats, as NVIDIA's MIG User Guide and public captures show them (see
tests/data/nvidia-smi/README.md):

    $ nvidia-smi mig -lgipp
    GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1
    GPU  0 Profile ID  5 Placement : {0}:4

    $ nvidia-smi mig -lgi
    |   0  MIG 2g.20gb           14        3          0:2     |

Lines a parser does not know are skipped; a row it cannot read is left out,
never guessed.
"""

from __future__ import annotations

from gpulib.errors import InputError
from gpulib.lazyre import lazy
from gpulib.pci import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from typing import Any, Optional

# Numbers the tool prints are small; more digits are not its.
_ID_DIGITS = 4
_PROFILE_ROW = lazy(r"^\|\s*(\d{1,4})\s+(MIG \S{1,40})\s+(\d{1,4})\s+(\d{1,4})/(\d{1,4})\s+"
                    r"([\d.]{1,10})\s+(\S{1,8})\s+(\d{1,5})\s+(\d{1,4})\s+(\d{1,4})\s*\|$")
_PROFILE_MORE = lazy(r"^\|\s+(\d{1,4})\s+(\d{1,4})\s+(\d{1,4})\s*\|$")
_PLACEMENTS = lazy(r"^GPU\s+(\d{1,4})\s+Profile ID\s+(\d{1,4})\s+Placements?\s*:\s*"
                   r"\{([\d,\s]{0,200})\}:(\d{1,2})\s*$")
_GI_ROW = lazy(r"^\|\s*(\d{1,4})\s+(MIG \S{1,40})\s+(\d{1,4})\s+(\d{1,4})\s+"
               r"(\d{1,2}):(\d{1,2})\s*\|$")
_CI_ROW = lazy(r"^\|\s*(\d{1,4})\s+(\d{1,4})\s+(MIG \S{1,40})\s+(\d{1,4})\s+(\d{1,4})\s+"
               r"(\d{1,2}):(\d{1,2})\s*\|$")
_CREATED_GI = lazy(r"^Successfully created GPU instance ID\s+(\d{1,4}) on GPU\s+(\d{1,4}) "
                   r"using profile (MIG \S{1,40}) \(ID\s+(\d{1,4})\)")
_CREATED_CI = lazy(r"^Successfully created compute instance ID\s+(\d{1,4}) on GPU\s+(\d{1,4}) "
                   r"GPU instance ID\s+(\d{1,4}) using profile (MIG \S{1,40}) \(ID\s+(\d{1,4})\)")
# `1g.10gb`, `3g.40gb`, `1g.10gb+me`, `1c.3g.40gb`: compute slices before `g.`.
_SLICES = lazy(r"(?:^|\.| )(\d{1,2})g\.")
# A MIG-backed vGPU type's name ends in <slices>-<frame buffer><series>:
# "NVIDIA H100-1-10C", "GRID A100-3-20C", "NVIDIA H100-1-10CME", "DC-1-24Q".
_MIG_BACKED_NAME = lazy(r"-(\d{1,2})-(\d{1,4})[A-Z]{1,5}$")

ENABLED = "Enabled"
DISABLED = "Disabled"


def slices_of(profile_name: str) -> Optional[int]:
    """The compute slices of a profile named `MIG 3g.40gb` (3), else None."""
    m = _SLICES.search(profile_name)
    return int(m.group(1)) if m else None


def mig_backed_slices(type_name: Optional[str]) -> Optional[int]:
    """The compute slices a vGPU type's name says it runs on (`NVIDIA
    H100-3-40C`: 3), None for a time-sliced type's name (`NVIDIA A10-6Q`)."""
    m = _MIG_BACKED_NAME.search(type_name or "")
    return int(m.group(1)) if m else None


def short_name(profile_name: str) -> str:
    """`1g.10gb` of `MIG 1g.10gb` (how nvidia-smi also accepts a profile)."""
    return profile_name[4:] if profile_name.startswith("MIG ") else profile_name


def _bus_address(text: str) -> Optional[PciAddress]:
    try:
        return PciAddress.parse(text.strip().lower())
    except InputError:
        return None


# -- the model ---------------------------------------------------------------------------------

class Profile:
    """A GPU instance profile (one row of `-lgip`, its placements from `-lgipp`)."""

    __slots__ = ("ce", "dec", "enc", "free", "id", "jpeg", "memory_gib", "name", "ofa", "p2p",
                 "placements", "size", "sm", "total")

    def __init__(self, id: int, name: str, free: int = 0, total: int = 0,
                 memory_gib: str = "", p2p: str = "No", sm: int = 0, dec: int = 0, enc: int = 0,
                 ce: int = 0, jpeg: int = 0, ofa: int = 0,
                 placements: Sequence[int] = (), size: int = 0) -> None:
        self.id = id
        self.name = name
        self.free = free
        self.total = total
        self.memory_gib = memory_gib  # as printed: "9.75"
        self.p2p = p2p
        self.sm = sm
        self.dec = dec
        self.enc = enc
        self.ce = ce
        self.jpeg = jpeg
        self.ofa = ofa
        self.placements = tuple(placements)  # the starts it may have
        self.size = size  # memory slices it takes

    @property
    def slices(self) -> int:
        """Compute slices (`3g`: 3); 0 when the name does not say."""
        return slices_of(self.name) or 0

    @property
    def memory_mb(self) -> Optional[int]:
        try:
            return int(float(self.memory_gib) * 1024)
        except ValueError:
            return None

    def as_json(self) -> dict[str, object]:
        return {"id": self.id, "name": self.name, "free": self.free, "total": self.total,
                "memory_mb": self.memory_mb, "slices": self.slices,
                "placements": list(self.placements), "size": self.size}

    def __repr__(self) -> str:
        return f"Profile({self.id}, {self.name!r}, {self.free}/{self.total})"


class Instance:
    """A GPU instance: its id, profile, placement and compute instances."""

    __slots__ = ("compute", "id", "profile_id", "profile_name", "size", "start")

    def __init__(self, id: int, profile_id: int, profile_name: str, start: int, size: int,
                 compute: Sequence[int] = ()) -> None:
        self.id = id
        self.profile_id = profile_id
        self.profile_name = profile_name
        self.start = start
        self.size = size
        self.compute = tuple(compute)  # its compute instances' ids

    def slots(self) -> range:
        return range(self.start, self.start + self.size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Instance) and all(
            getattr(self, f) == getattr(other, f) for f in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Instance({self.id}, {self.profile_name!r}, {self.start}:{self.size}, "
                f"compute={list(self.compute)})")


class Layout:
    """One GPU's MIG mode, profiles and instances, as NVIDIA's tool reported them."""

    __slots__ = ("current", "instances", "pending", "profiles")

    def __init__(self, current: str = DISABLED, pending: str = DISABLED,
                 profiles: Optional[dict[int, Profile]] = None,
                 instances: Optional[list[Instance]] = None) -> None:
        self.current = current  # "Enabled", "Disabled", "N/A"
        self.pending = pending
        self.profiles: dict[int, Profile] = profiles or {}
        self.instances: list[Instance] = instances or []

    @property
    def enabled(self) -> bool:
        return self.current == ENABLED

    @property
    def reset_pending(self) -> bool:
        """MIG mode set to change at the GPU's next reset (or the host's reboot)."""
        return self.pending in (ENABLED, DISABLED) and self.current in (ENABLED, DISABLED) \
            and self.pending != self.current

    def instance(self, gi: int) -> Optional[Instance]:
        return next((i for i in self.instances if i.id == gi), None)

    def at(self, start: int, profile_id: Optional[int] = None) -> Optional[Instance]:
        """The instance placed at `start` (of `profile_id`, when given)."""
        return next((i for i in self.instances if i.start == start and
                     (profile_id is None or i.profile_id == profile_id)), None)

    def as_json(self) -> dict[str, Any]:
        return {"mode": {"current": self.current, "pending": self.pending},
                "profiles": [p.as_json() for _, p in sorted(self.profiles.items())],
                "gpu_instances": [{"id": i.id, "profile_id": i.profile_id,
                                   "profile": i.profile_name,
                                   "placement": {"start": i.start, "size": i.size},
                                   "compute_instances": list(i.compute)}
                                  for i in sorted(self.instances, key=lambda i: i.start)]}

    @classmethod
    def from_json(cls, data: object) -> Optional[Layout]:
        """The layout `as_json` wrote (gpulib's cache); None for anything else."""
        if not isinstance(data, dict):
            return None
        mode = data.get("mode")
        if not isinstance(mode, dict):
            return None
        layout = cls(str(mode.get("current", DISABLED))[:16],
                     str(mode.get("pending", DISABLED))[:16])
        for p in data.get("profiles") or ():
            if not isinstance(p, dict) or not _ints(p, "id", "free", "total", "size"):
                continue
            placements = p.get("placements")
            starts = [s for s in placements if _small(s)] if isinstance(placements, list) else []
            memory = p.get("memory_mb")
            layout.profiles[p["id"]] = Profile(
                p["id"], str(p.get("name", ""))[:64], p["free"], p["total"],
                f"{memory / 1024:.2f}" if isinstance(memory, int) and _small(memory, 10 ** 7)
                else "", placements=starts, size=p["size"])
        for i in data.get("gpu_instances") or ():
            place = i.get("placement") if isinstance(i, dict) else None
            if not isinstance(i, dict) or not isinstance(place, dict) or \
                    not _ints(i, "id", "profile_id") or not _ints(place, "start", "size"):
                continue
            compute = i.get("compute_instances")
            layout.instances.append(Instance(
                i["id"], i["profile_id"], str(i.get("profile", ""))[:64], place["start"],
                place["size"],
                [c for c in compute if _small(c)] if isinstance(compute, list) else []))
        return layout

    def __repr__(self) -> str:
        return f"Layout({self.current}/{self.pending}, {self.instances!r})"


def _small(value: object, high: int = 10 ** _ID_DIGITS) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < high


def _ints(d: dict[str, object], *keys: str) -> bool:
    return all(_small(d.get(k)) for k in keys)


# -- parsers ---------------------------------------------------------------------------------

def parse_query(text: str) -> dict[PciAddress, dict[str, str]]:
    """`nvidia-smi -q`: each GPU's `Section.Key` (or `Key`) values, e.g.
    `MIG Mode.Current` -> `Enabled`, `Product Name` -> `NVIDIA H100 PCIe`.
    Only the first two levels of nesting are kept."""
    out: dict[PciAddress, dict[str, str]] = {}
    fields: Optional[dict[str, str]] = None
    section = ""
    for raw in text.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        line = raw.strip()
        if indent == 0:
            fields = None
            if line.startswith("GPU ") and " : " not in line:
                address = _bus_address(line[4:])
                if address is not None:
                    fields = out.setdefault(address, {})
            continue
        if fields is None:
            continue
        key, sep, value = line.partition(" : ")
        key = " ".join(key.split())
        if not sep:
            if indent == 4 and not line.endswith(":"):
                section = key
            continue
        if indent == 4:
            section = ""
            fields.setdefault(key, value.strip())
        elif indent == 8 and section:
            fields.setdefault(f"{section}.{key}", value.strip())
    return out


def mode_of(fields: dict[str, str]) -> tuple[str, str]:
    """(current, pending) MIG mode from one GPU's `parse_query` fields."""
    return (fields.get("MIG Mode.Current", "N/A"), fields.get("MIG Mode.Pending", "N/A"))


def parse_profiles(text: str) -> dict[int, dict[int, Profile]]:
    """`nvidia-smi mig -lgip`: {GPU index: {profile id: Profile}} (placements empty)."""
    out: dict[int, dict[int, Profile]] = {}
    last: Optional[Profile] = None
    for raw in text.splitlines():
        line = raw.strip()
        m = _PROFILE_ROW.match(line)
        if m:
            gpu, name, pid, free, total, mem, p2p, sm, dec, enc = m.groups()
            last = Profile(int(pid), name, int(free), int(total), mem, p2p, int(sm),
                           int(dec), int(enc))
            out.setdefault(int(gpu), {})[last.id] = last
            continue
        more = _PROFILE_MORE.match(line)
        if more and last is not None:
            last.ce, last.jpeg, last.ofa = (int(g) for g in more.groups())
        last = None
    return out


def parse_placements(text: str) -> dict[int, dict[int, tuple[tuple[int, ...], int]]]:
    """`nvidia-smi mig -lgipp`: {GPU index: {profile id: (starts, size)}}."""
    out: dict[int, dict[int, tuple[tuple[int, ...], int]]] = {}
    for raw in text.splitlines():
        m = _PLACEMENTS.match(raw.strip())
        if not m:
            continue
        starts = []
        for part in m.group(3).split(","):
            part = part.strip()
            if part.isascii() and part.isdigit() and len(part) <= 2:
                starts.append(int(part))
        out.setdefault(int(m.group(1)), {})[int(m.group(2))] = (tuple(starts),
                                                                int(m.group(4)))
    return out


def parse_instances(text: str) -> dict[int, list[Instance]]:
    """`nvidia-smi mig -lgi`: {GPU index: [Instance]} (compute instances empty).
    `No GPU instances found` is no instance, not an error."""
    out: dict[int, list[Instance]] = {}
    for raw in text.splitlines():
        m = _GI_ROW.match(raw.strip())
        if m:
            gpu, name, pid, gi, start, size = m.groups()
            out.setdefault(int(gpu), []).append(
                Instance(int(gi), int(pid), name, int(start), int(size)))
    return out


def parse_compute(text: str) -> dict[int, dict[int, list[int]]]:
    """`nvidia-smi mig -lci`: {GPU index: {GPU instance id: [compute instance ids]}}."""
    out: dict[int, dict[int, list[int]]] = {}
    for raw in text.splitlines():
        m = _CI_ROW.match(raw.strip())
        if m:
            gpu, gi, _name, _pid, ci, _start, _size = m.groups()
            out.setdefault(int(gpu), {}).setdefault(int(gi), []).append(int(ci))
    return out


def parse_created(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """What `nvidia-smi mig -cgi ... -C` says it made: ([(GI id, profile id)],
    [(GI id, compute instance id)])."""
    gis: list[tuple[int, int]] = []
    cis: list[tuple[int, int]] = []
    for raw in text.splitlines():
        line = raw.strip()
        m = _CREATED_GI.match(line)
        if m:
            gis.append((int(m.group(1)), int(m.group(4))))
            continue
        c = _CREATED_CI.match(line)
        if c:
            cis.append((int(c.group(3)), int(c.group(1))))
    return gis, cis


def layout_of(fields: dict[str, str], profiles: dict[int, Profile],
              placements: dict[int, tuple[tuple[int, ...], int]],
              instances: list[Instance], compute: dict[int, list[int]]) -> Layout:
    """One GPU's Layout from the parsed answers of -q, -lgip, -lgipp, -lgi, -lci."""
    current, pending = mode_of(fields)
    for pid, (starts, size) in placements.items():
        p = profiles.get(pid)
        if p is not None:
            p.placements, p.size = starts, size
    for i in instances:
        i.compute = tuple(sorted(compute.get(i.id, ())))
    return Layout(current, pending, profiles, sorted(instances, key=lambda i: i.start))


# -- placement -------------------------------------------------------------------------------

def free_placements(profile: Profile, used: Iterable[Instance]) -> list[int]:
    """The starts of `profile` whose memory slices no instance of `used` takes."""
    taken: set[int] = set()
    for i in used:
        taken.update(i.slots())
    return [s for s in profile.placements
            if not taken.intersection(range(s, s + profile.size))]


def choose_placement(profile: Profile, profiles: Iterable[Profile], used: Sequence[Instance],
                     among: Optional[Sequence[int]] = None) -> Optional[int]:
    """Where a new GPU instance of `profile` goes, or None when it fits nowhere.

    Of the free placements, the one that leaves the most room for larger
    profiles: for each profile larger than this one, largest first, the
    number of its placements still free after this one is taken (compared in
    that order); ties go to the highest start (instances pack from the top,
    as the driver's own choice does), so a 4g or 3g instance still fits at
    slice 0 after 1g ones. `among`: only these starts are considered."""
    free = free_placements(profile, used)
    if among is not None:
        free = [s for s in free if s in among]
    if not free:
        return None
    larger = sorted((p for p in profiles if p.size > profile.size and p.placements),
                    key=lambda p: (-p.size, -p.slices, p.id))

    def room(start: int) -> tuple[int, ...]:
        trial = [*used, Instance(-1, profile.id, profile.name, start, profile.size)]
        return tuple(len(free_placements(p, trial)) for p in larger)

    return max(free, key=lambda s: (room(s), s))


def free_count(profile: Profile, used: Sequence[Instance], same_profile: int = 0) -> int:
    """How many more instances of `profile` fit (what `-lgip` prints as Free):
    its free placements taken greedily, within its total."""
    trial = list(used)
    n = 0
    while n + same_profile < profile.total:
        starts = free_placements(profile, trial)
        if not starts:
            break
        trial.append(Instance(-1, profile.id, profile.name, starts[0], profile.size))
        n += 1
    return n


def choose_kept(profile: Profile, profiles: Iterable[Profile], used: Sequence[Instance],
                starts: Sequence[int], n: int) -> list[int]:
    """Which `n` of a pool's instances of `profile` at `starts` to keep when
    the others go (`used`: the GPU's other instances): those
    `choose_placement` would have chosen were they made now, so that what
    goes leaves the most room for larger profiles."""
    profiles = list(profiles)
    kept: list[int] = []
    trial = list(used)
    for _ in range(min(n, len(starts))):
        start = choose_placement(profile, profiles, trial,
                                 among=[s for s in starts if s not in kept])
        if start is None:
            break
        kept.append(start)
        trial.append(Instance(-1, profile.id, profile.name, start, profile.size))
    return kept
