"""The numbers of NVIDIA's vendor-specific vGPU types, from NVIDIA's own tool.

An NVIDIA vendor-specific VF (vGPU 17+, `nvidia/creatable_vgpu_types`) has
no `description` to read a type's numbers from, as an mdev type has. The
CloudStack agent's stock script asks `nvidia-smi vgpu` for them, and the
management server creates a profile once, from whichever host reports it
first: a host reporting nulls would leave it so (one vGPU per GPU, say). So
this is the one external command discovery runs, and only here (`gpulib
attach` and `detach` run virsh, `gpulib setup --apply` its plan's commands):

* only when a GPU discovery reports has vendor-specific VFs, and only for
  reports that carry the numbers (`gpulib discover` as JSON or for the
  agent, `gpulib mdev types`); never on a hook's path;
* found through the injected root (`usr/bin/nvidia-smi`), never on PATH;
* bounded in time (`[discovery] nvidia_smi_timeout`), its process group
  killed when it overruns;
* failing soft: the report stays complete with the numbers null, and the
  reason is logged once: a failure (or a GPU the tool did not list) is
  remembered, and the tool is not asked again for `RETRY_SECONDS` under the
  same driver;
* cached in `var/lib/gpulib/nvidia-vgpu-types.json` for the loaded driver
  (`sys/module/nvidia/version`): the numbers are the driver's, so discovery
  asks again only when the driver changes or a GPU is new to the cache.

`nvidia-smi vgpu -s -v` lists, for each physical GPU (`GPU 00000000:41:00.0`),
every supported type as a block of `key : value` lines:

    GPU 00000000:8C:00.0
        vGPU Type ID                          : 0x5f1
            Name                              : NVIDIA RTX Pro 6000 Blackwell DC-4Q
            Max Instances                     : 24
            FB Memory                         : 4096 MiB
            Display Heads                     : 4
            Maximum X Resolution              : 7680
            Maximum Y Resolution              : 4320

(other keys omitted). The type id is the decimal one of
`creatable_vgpu_types` written in hex. A MIG-backed type (`NVIDIA
H100-1-10C`) names the GPU instance profile it runs on (`GPU Instance
Profile ID : 19`; `N/A` for a time-sliced type): `gpulib.mig`, `pools` and
the doctor take it from here.

`run` is the bounded way to run the tool, for the other questions gpulib
asks it (`gpulib.migtool`).
"""

from __future__ import annotations

import json
import os
import time
from collections import namedtuple

from gpulib import logger
from gpulib.errors import InputError
from gpulib.pci import PciAddress
from gpulib.validate import decimal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, NamedTuple, Optional


log = logger.get(__name__)

# Where the NVIDIA vGPU manager installs its tool, below the root.
TOOL_PATHS = ("usr/bin/nvidia-smi", "usr/sbin/nvidia-smi")
ARGS = ("vgpu", "-s", "-v")
CACHE_FILE = "var/lib/gpulib/nvidia-vgpu-types.json"
DRIVER_VERSION = "sys/module/nvidia/version"
CACHE_VERSION = 2  # 2: the GPU instance profile of MIG-backed types
# After a failure the tool is left alone this long (the agent asks for a
# report every minute or so: a hanging tool must not cost each one its bound).
RETRY_SECONDS = 600.0
DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 300.0
# nvidia-smi's answer for a host of 8 GPUs is some 100 KB; more is not it.
OUTPUT_MAX = 8 * 1024 * 1024
# Numbers the driver prints are small; a bound keeps junk out of the report.
NUMBER_MAX = 10 ** 9


if TYPE_CHECKING:
    class _TypeNumbersFields(NamedTuple):
        name: Optional[str]
        max_instances: Optional[int]
        framebuffer_mb: Optional[int]
        num_heads: Optional[int]
        max_resolution: Optional[tuple[int, int]]
        # The GPU instance profile a MIG-backed type runs on (None: time-sliced).
        gi_profile: Optional[int] = None
        # How many vGPUs of a MIG-backed type one GPU instance runs ("Max
        # Instances Per GI"; None: not said, one).
        per_gi: Optional[int] = None
else:  # without typing (see gpulib.pci.PciAddress)
    _TypeNumbersFields = namedtuple("_TypeNumbersFields", (
        "name", "max_instances", "framebuffer_mb", "num_heads", "max_resolution",
        "gi_profile", "per_gi"), defaults=(None, None))


class TypeNumbers(_TypeNumbersFields):
    """What the management server stores of a vGPU profile."""

    __slots__ = ()

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "max_instances": self.max_instances,
                "framebuffer_mb": self.framebuffer_mb, "num_heads": self.num_heads,
                "max_resolution": list(self.max_resolution) if self.max_resolution else None,
                "gi_profile": self.gi_profile,
                **({"per_gi": self.per_gi} if self.per_gi not in (None, 1) else {})}

    @classmethod
    def from_json(cls, data: object) -> Optional[TypeNumbers]:
        if not isinstance(data, dict):
            return None
        res = data.get("max_resolution")
        resolution = (tuple(res) if isinstance(res, list) and len(res) == 2
                      and all(_is_number(v) for v in res) else None)
        name = data.get("name")

        def number(key: str) -> Optional[int]:
            value = data.get(key)
            return value if isinstance(value, int) and _is_number(value) else None

        return cls(name if isinstance(name, str) else None, number("max_instances"),
                   number("framebuffer_mb"), number("num_heads"),
                   (int(resolution[0]), int(resolution[1])) if resolution else None,
                   number("gi_profile"), number("per_gi"))


Numbers = dict[PciAddress, dict[int, TypeNumbers]]


def _is_number(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= NUMBER_MAX


def _int(text: str) -> Optional[int]:
    """The leading decimal number of a value (`4096 MiB`, `24`), else None (`N/A`)."""
    value = decimal(text.split(" ", 1)[0], 10)
    return value if value is not None and value <= NUMBER_MAX else None


def _gpu_address(text: str) -> Optional[PciAddress]:
    """nvidia-smi's bus id (`00000000:8C:00.0`: a 32-bit domain) as an address."""
    try:
        return PciAddress.parse(text.strip().lower())
    except InputError:
        return None


def parse(text: str) -> Numbers:
    """Each GPU's types and their numbers from `nvidia-smi vgpu -s -v` (also
    `-c -v`). Lines it does not know are skipped; a type without a readable id
    or outside a GPU's section is left out; a missing number is None."""
    out: Numbers = {}
    gpu: Optional[dict[int, TypeNumbers]] = None
    type_id: Optional[int] = None
    fields: dict[str, str] = {}

    def close() -> None:
        if gpu is not None and type_id is not None:
            gpu[type_id] = _numbers(fields)

    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("GPU ") and ":" in line and " : " not in line:
            close()
            address = _gpu_address(line[4:])
            gpu = out.setdefault(address, {}) if address is not None else None
            type_id, fields = None, {}
            continue
        key, sep, value = line.partition(" : ")
        if not sep:
            key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = " ".join(key.split()), value.strip()
        if key == "vGPU Type ID":
            close()
            fields = {}
            try:
                type_id = int(value, 16) if value.lower().startswith("0x") else int(value)
            except ValueError:
                type_id = None
            if type_id is not None and not 0 < type_id <= NUMBER_MAX:
                type_id = None
        elif type_id is not None:
            fields.setdefault(key, value)
    close()
    return out


def _numbers(fields: dict[str, str]) -> TypeNumbers:
    x = _int(fields.get("Maximum X Resolution", ""))
    y = _int(fields.get("Maximum Y Resolution", ""))
    name = fields.get("Name") or None
    return TypeNumbers(name[:256] if name else None, _int(fields.get("Max Instances", "")),
                       _int(fields.get("FB Memory", "")), _int(fields.get("Display Heads", "")),
                       (x, y) if x and y else None,
                       _int(fields.get("GPU Instance Profile ID", "")),
                       _int(fields.get("Max Instances Per GI", "")))


# -- the tool, bounded ---------------------------------------------------------------------

class ToolFailed(Exception):
    """nvidia-smi could not give the numbers (the message says why, in one line)."""


def tool_path(root: str) -> Optional[str]:
    for rel in TOOL_PATHS:
        path = os.path.join(root, rel)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def bounded_timeout(timeout: float) -> float:
    """gpulib.conf takes any non-negative number (nan and inf too): kept sane."""
    return min(max(timeout, 0.05), MAX_TIMEOUT) if timeout == timeout else DEFAULT_TIMEOUT


def run(path: str, args: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `path args`, in its own session, no
    shell, in the C locale; ToolFailed when it cannot be run, overruns
    `timeout` (its whole process group is killed then) or prints more than
    OUTPUT_MAX."""
    import signal
    import subprocess

    timeout = bounded_timeout(timeout)
    what = f"{path} {' '.join(args)}"
    try:
        proc = subprocess.Popen([path, *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True,
                                env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})
    except OSError as exc:
        raise ToolFailed(f"{path} cannot be run: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        # Not communicate(): a child that left the group may hold the pipes open.
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        raise ToolFailed(f"{what} gave no answer within {timeout:g} s (killed)") from None
    if len(out) > OUTPUT_MAX or len(err) > OUTPUT_MAX:
        raise ToolFailed(f"{what} printed more than {OUTPUT_MAX} bytes")
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def failure(path: str, args: Sequence[str], code: int, out: str, err: str) -> ToolFailed:
    """The one-line error of a run that exited `code` (its first line said)."""
    said = (err or out).strip().splitlines()
    return ToolFailed(f"{path} {' '.join(args)} failed (exit {code})"
                      + (f": {said[0][:200]}" if said else ""))


def run_tool(path: str, timeout: float) -> str:
    """`nvidia-smi vgpu -s -v`'s output; ToolFailed when it fails, says nothing
    or overruns `timeout`."""
    code, out, err = run(path, ARGS, timeout)
    if code != 0:
        raise failure(path, ARGS, code, out, err)
    return out


# -- the cache -------------------------------------------------------------------------------

class Cache:
    """The numbers known for the loaded driver, and when the tool was last
    asked without an answer for every GPU (it failed, or left one out)."""

    def __init__(self, driver: Optional[str], gpus: Optional[Numbers] = None,
                 incomplete_at: Optional[float] = None) -> None:
        self.driver = driver
        self.gpus: Numbers = gpus or {}
        self.incomplete_at = incomplete_at

    @classmethod
    def load(cls, path: str) -> Optional[Cache]:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.loads(fh.read(OUTPUT_MAX))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return None
        gpus: Numbers = {}
        raw = data.get("gpus")
        for address, types in (raw.items() if isinstance(raw, dict) else ()):
            pci = _gpu_address(str(address))
            if pci is None or not isinstance(types, dict):
                continue
            gpus[pci] = {}
            for tid, numbers in types.items():
                found = TypeNumbers.from_json(numbers)
                number = decimal(str(tid), 9)
                if found is not None and number is not None:
                    gpus[pci][number] = found
        incomplete = data.get("incomplete_at")
        driver = data.get("driver")
        return cls(driver if isinstance(driver, str) else None, gpus,
                   float(incomplete) if isinstance(incomplete, (int, float)) else None)

    def dumps(self) -> bytes:
        return (json.dumps({
            "version": CACHE_VERSION, "driver": self.driver,
            "incomplete_at": self.incomplete_at,
            "gpus": {str(a): {str(t): n.as_json() for t, n in sorted(types.items())}
                     for a, types in sorted(self.gpus.items())},
        }, indent=1, sort_keys=True) + "\n").encode()


def _driver(root: str) -> Optional[str]:
    try:
        with open(os.path.join(root, DRIVER_VERSION), encoding="utf-8") as fh:
            return fh.read(256).strip() or None
    except OSError:
        return None


def _save(path: str, cache: Cache) -> None:
    from gpulib.atomicfile import AtomicWriteError, write_atomic

    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        # A cache: atomic, not worth an fsync.
        write_atomic(path, cache.dumps(), mode=0o644, durable=False, sync_dir=False)
    except (AtomicWriteError, OSError) as exc:
        log.info("could not cache the NVIDIA vGPU type numbers in %s: %s", path, exc)


def numbers(root: str, gpus: list[PciAddress], timeout: float = DEFAULT_TIMEOUT,
            now: Optional[float] = None) -> Numbers:
    """The numbers of the types of `gpus` (NVIDIA PFs with vendor-specific VFs),
    from the cache or nvidia-smi; a GPU nothing is known of is left out."""
    found, cache, changed = lookup(root, gpus, timeout, now)
    if changed:
        _save(os.path.join(root, CACHE_FILE), cache)
    return found


def lookup(root: str, gpus: list[PciAddress], timeout: float = DEFAULT_TIMEOUT,
           now: Optional[float] = None) -> tuple[Numbers, Cache, bool]:
    """`numbers`' answer, the cache as that answer leaves it and whether that
    differs from the file (to be saved), without writing anything: `gpulib
    snapshot` puts the cache in its tarball, so a replay, which has no tool,
    reports the same numbers."""
    now = time.time() if now is None else now
    driver = _driver(root)
    cache = Cache.load(os.path.join(root, CACHE_FILE))
    if not gpus:
        return {}, cache or Cache(driver), False
    if cache is not None and cache.driver == driver:
        if all(cache.gpus.get(g) for g in gpus):
            return cache.gpus, cache, False
        if cache.incomplete_at is not None and 0 <= now - cache.incomplete_at < RETRY_SECONDS:
            # asked lately (a failure was logged then): not again yet
            return cache.gpus, cache, False
    else:
        cache = Cache(driver)
    tool = tool_path(root)
    if tool is None:
        # No vGPU manager's tool on this host: nothing to ask, nothing failed.
        log.debug("no nvidia-smi below %s: NVIDIA vGPU type numbers unknown", root)
        return cache.gpus, cache, False
    try:
        found = parse(run_tool(tool, timeout))
    except ToolFailed as exc:
        log.warning("NVIDIA vGPU type numbers unknown (reported as null): %s; not asked "
                    "again for %d s", exc, int(RETRY_SECONDS))
        cache.incomplete_at = now
        return cache.gpus, cache, True
    # A GPU the tool does not list (not in vGPU mode yet) is asked about again
    # later, not at every report.
    unlisted = [g for g in gpus if not found.get(g)]
    if unlisted:
        log.info("nvidia-smi lists no vGPU types of %s: their numbers are null",
                 ", ".join(map(str, unlisted)))
    return found, Cache(driver, found, now if unlisted else None), True
