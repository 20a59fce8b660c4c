"""`etc/gpulib/gpulib.conf`: INI read with configparser (stdlib on every target).

A missing file means defaults. Drop-ins `gpulib.conf.d/*.conf` are read
after it in lexical order. Unknown sections or keys are warned about (a typo
must not silently change behaviour, but must not stop a VM either); a bad
value fails with the file, section and key named. A UTF-8 byte-order mark is
not an error. Where a bad file must not stop the work (discovery for the
CloudStack agent, the doctor), `Config.load(path, lenient=True)` keeps the
defaults for what is bad and lists the problems instead of raising.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from gpulib import logger
from gpulib.context import AGENT_PROPERTIES
from gpulib.errors import ConfigError
from gpulib.lazyre import lazy
from gpulib.pci import PciAddress
from gpulib.records import HANDMADE
from gpulib.sysfs import ReadFailure, read_file
from gpulib.validate import is_type_id

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.context import Context

log = logger.get(__name__)

# gpulib.conf and each drop-in: a hand-edited INI file is a few KB.
CONFIG_MAX = 1024 * 1024
DROPIN_SUFFIX = ".conf"

_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}
_VENDOR_DEVICE = lazy(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\Z")
_POOL_NAME = lazy(r"^[A-Za-z0-9_.-]{1,64}\Z")

# section -> key -> (default, kind); the example config is generated from it.
DEFAULTS: dict[str, dict[str, tuple[str, str]]] = {
    "discovery": {
        "include": ("", "match-list"),
        "exclude": ("", "match-list"),
        "nvidia_smi_timeout": ("10", "float"),
        "allow_boot_vga": ("no", "bool"),
    },
    "transformer": {
        "add_group_functions": ("yes", "bool"),
        "allow_metadata_requests": ("auto", "auto-bool"),
        "refuse_in_use": ("yes", "bool"),
    },
    "release": {
        "destroy_on_demand": ("yes", "bool"),
        "clear_retry_seconds": ("5", "float"),
        "arrival_timeout": ("10", "float"),
    },
    "allocator": {
        "policy": ("spread", "policy"),
    },
    "state": {
        "lock_timeout": ("20", "float"),
    },
    "log": {
        "level": ("info", "level"),
        "syslog": ("yes", "bool"),
    },
    "setup": {
        "passthrough": ("", "device-list"),
    },
    "metrics": {
        "parent_series": ("no", "bool"),
    },
}
POOL_KEYS = {"parents", "type", "profile", "count", "per_parent"}
KIND_HELP = {
    "bool": "yes or no",
    "auto-bool": "auto, yes or no",
    "float": "seconds",
    "policy": "spread or pack",
    "level": "debug, info, warning or error",
    "match-list": "PCI addresses and vendor:device ids, separated by spaces or commas",
    "device-list": "PCI addresses and vendor:device ids (not all), separated by spaces or commas",
}


def simple_ini(text: str) -> Optional[dict[str, dict[str, str]]]:
    """`text` read as configparser reads it (interpolation off, strict), when
    it holds only what a gpulib.conf usually does: `[section]` lines,
    `key = value` or `key: value` lines, comments and blank lines, each at
    the start of its line. None for anything else (an indented line, which
    configparser may join to the value above; `[DEFAULT]`, whose keys it
    copies into every section; a key or section given twice; a line it would
    refuse): configparser then reads the file and says what is wrong.

    Its rules, as configparser applies them: lines split at "\\n" only; a
    line whose stripped text starts with "#" or ";" is a comment (no inline
    comments); a key is the text before the first "=" or ":", stripped and
    lower-cased; its value the text after it, stripped."""
    sections: dict[str, dict[str, str]] = {}
    current: Optional[dict[str, str]] = None
    for line in text.split("\n"):
        value = line.strip()
        if not value or value[0] in "#;":
            continue
        if line[0] != value[0]:
            return None  # indented: perhaps a continuation
        if value[0] == "[":
            name = value[1:-1]
            if value[-1] != "]" or not name or "[" in name or "]" in name \
                    or name == "DEFAULT" or name in sections:
                return None
            current = sections[name] = {}
            continue
        cut = min((i for i in (value.find("="), value.find(":")) if i >= 0), default=-1)
        if current is None or cut <= 0:
            return None
        key = value[:cut].rstrip().lower()
        if not key or key in current:
            return None
        current[key] = value[cut + 1:].strip()
    return sections


class Match:
    """A device selector: `all`, PCI addresses, or vendor:device ids."""

    def __init__(self, text: str, where: str) -> None:
        self.all = False
        self.addresses: set[PciAddress] = set()
        self.ids: set[tuple[int, int]] = set()
        for word in re.split(r"[\s,]+", text.strip()):
            if not word:
                continue
            if word == "all":
                self.all = True
            elif _VENDOR_DEVICE.match(word):
                v, d = word.split(":")
                self.ids.add((int(v, 16), int(d, 16)))
            else:
                try:
                    self.addresses.add(PciAddress.parse(word))
                except Exception:
                    raise ConfigError(f"{where}: {word!r} is neither 'all', a PCI address "
                                      "nor vendor:device") from None

    def __bool__(self) -> bool:
        return self.all or bool(self.addresses) or bool(self.ids)

    def matches(self, address: PciAddress, vendor_id: int, device_id: int) -> bool:
        return self.all or address in self.addresses or (vendor_id, device_id) in self.ids


class PoolConfig:
    def __init__(self, name: str, parents: Match, type_id: Optional[str],
                 profile: Optional[str], count: Optional[int], per_parent: Optional[int]) -> None:
        self.name = name
        self.parents = parents
        self.type_id = type_id
        self.profile = profile
        self.count = count
        self.per_parent = per_parent

    def targets(self, parents: list[str]) -> dict[str, int]:
        """How many members the pool wants on each of its parents (GPUs for
        MIG-backed pools): `per_parent` on each, or `count` spread over them."""
        if self.per_parent is not None:
            return {p: self.per_parent for p in parents}
        total = self.count or 0
        out = {p: 0 for p in parents}
        for i in range(total if parents else 0):
            out[parents[i % len(parents)]] += 1
        return out


class Config:
    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path or "<defaults>"
        self._values: dict[str, dict[str, str]] = {
            s: {k: d for k, (d, _) in keys.items()} for s, keys in DEFAULTS.items()}
        self.pools: dict[str, PoolConfig] = {}
        # What a lenient load set aside (each with its file named); empty
        # after a strict load, which raises on the first instead.
        self.problems: list[str] = []
        # What loading warned of (unknown sections and keys, each with its
        # file named): the doctor's `config` check reports them.
        self.warnings: list[str] = []
        self._lenient = False
        self._sources: dict[tuple[str, str], str] = {}

    # -- loading -------------------------------------------------------------
    @classmethod
    def load(cls, path: str, lenient: bool = False) -> Config:
        """gpulib.conf, then the drop-ins `<path>.d/*.conf` in lexical order
        (a key set again later wins; inside one file a duplicate section or
        key is a problem, as configparser's strict mode has it).

        Strict (the default): the first problem raises ConfigError. Lenient
        (discovery for the agent, the doctor, snapshots): a problem is kept
        in `problems` (for the caller to log or report), and what it touches
        is left at its default -- an unreadable or unparsable file, a line
        with a NUL, a bad value, a bad pool -- while everything else still
        applies. A UTF-8 byte-order mark is never a problem.
        """
        cfg = cls(path)
        cfg._lenient = lenient
        merged: dict[str, dict[str, tuple[str, str]]] = {}
        for source in [path, *_dropins(path, cfg)]:
            for section, items in cfg._parse_file(source, optional=source == path).items():
                into = merged.setdefault(section, {})
                for key, value in items.items():
                    into[key] = (value, source)
        for section, entries in merged.items():
            if section.startswith("pool "):
                cfg._load_pool(section[5:].strip(), entries)
                continue
            if section not in DEFAULTS:
                first = next(iter(entries.values()), ("", path))[1]
                cfg._warn(f"{first}: unknown section [{section}] ignored")
                continue
            for key, (value, source) in entries.items():
                if key not in DEFAULTS[section]:
                    cfg._warn(f"{source}: unknown key {key} in [{section}] ignored")
                    continue
                cfg._sources[(section, key)] = source
                try:
                    cfg._check(section, key, value)
                except ConfigError as exc:
                    cfg._problem(exc.message, "the default is used")
                    cfg._sources.pop((section, key), None)
                    continue
                cfg._values[section][key] = value.strip()
        return cfg

    def _warn(self, message: str) -> None:
        """A key or section that changes nothing: logged and kept (`warnings`)."""
        log.warning("%s", message)
        self.warnings.append(message)

    def _problem(self, message: str, outcome: str) -> None:
        """Strict: raise. Lenient: keep `message` with what became of it."""
        if not self._lenient:
            raise ConfigError(message)
        # Kept, not logged here: a lenient load may run before logging is
        # set up (the CLI reads the log settings from it); the caller logs.
        self.problems.append(f"{message} ({outcome})")

    def _parse_file(self, source: str, optional: bool) -> dict[str, dict[str, str]]:
        """One file's sections and keys; {} when it is missing or unusable."""
        data = read_file(source, CONFIG_MAX)
        if isinstance(data, ReadFailure):
            if not (optional and data.missing):
                self._problem(f"{source}: cannot read: {data.reason}", "file ignored")
            return {}
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self._problem(f"{source}: cannot parse: not UTF-8 text", "file ignored")
            return {}
        # Editors on other systems save a byte-order mark: it is not content.
        if text.startswith("\ufeff"):
            text = text[1:]
        if "\0" in text:
            lines = text.split("\n")
            bad = [i for i, line in enumerate(lines, start=1) if "\0" in line]
            self._problem(f"{source}: line {bad[0]} holds a NUL byte",
                          f"{len(bad)} line(s) with a NUL ignored")
            text = "\n".join(line for line in lines if "\0" not in line)
        simple = simple_ini(text)
        if simple is not None:
            # The common file (sections, `key = value` lines, comments): read
            # without configparser, whose import and parse cost every VM
            # start on a configured host 2-3 ms.
            return simple
        import configparser

        for strict in (True, False):
            parser = configparser.ConfigParser(interpolation=None, strict=strict)
            try:
                parser.read_string(text, source=source)
            except configparser.DuplicateOptionError as exc:
                if strict:
                    self._problem(f"{source}: line {exc.lineno}: key {exc.option} given twice "
                                  f"in [{exc.section}]", "the last one is used")
                    continue
                return {}
            except configparser.DuplicateSectionError as exc:
                if strict:
                    self._problem(f"{source}: line {exc.lineno}: section [{exc.section}] given "
                                  "twice", "their keys are merged, the last one wins")
                    continue
                return {}
            except configparser.Error as exc:
                first = str(exc).splitlines()[0]
                self._problem(f"{source}: cannot parse: {first}", "file ignored")
                return {}
            return {name: dict(parser[name].items()) for name in parser.sections()}
        return {}

    def _where(self, section: str, key: str) -> str:
        return f"{self._sources.get((section, key), self.path)}: [{section}] {key}"

    def _check(self, section: str, key: str, value: str) -> None:
        kind = DEFAULTS[section][key][1]
        where = self._where(section, key)
        v = value.strip().lower()
        if kind == "bool" and v not in _TRUE | _FALSE:
            raise ConfigError(f"{where}: {value!r} is not yes/no")
        if kind == "auto-bool" and v not in _TRUE | _FALSE | {"auto"}:
            raise ConfigError(f"{where}: {value!r} is not auto/yes/no")
        if kind == "float":
            try:
                if float(v) < 0:
                    raise ValueError
            except ValueError:
                raise ConfigError(f"{where}: {value!r} is not a non-negative number") from None
        if kind == "policy" and v not in ("spread", "pack"):
            raise ConfigError(f"{where}: {value!r} is not spread or pack")
        if kind == "level" and v not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"{where}: {value!r} is not debug/info/warning/error")
        if kind == "match-list":
            Match(value, where)
        if kind == "device-list" and Match(value, where).all:
            # gpulib setup takes these GPUs from the host: each must be named.
            raise ConfigError(f"{where}: 'all' is not allowed here; name each device")

    def _load_pool(self, name: str, items: Mapping[str, tuple[str, str]]) -> None:
        sec = f"pool {name}"
        source = next(iter(items.values()), ("", self.path))[1]
        try:
            self._pool(name, sec, source, {k: v for k, (v, _) in items.items()},
                       {k: src for k, (_, src) in items.items()})
        except ConfigError as exc:
            self._problem(exc.message, "pool ignored")

    def _pool(self, name: str, sec: str, source: str, section: Mapping[str, str],
              sources: Mapping[str, str]) -> None:
        def where(key: str) -> str:
            return f"{sources.get(key, source)}: [{sec}] {key}"

        if not _POOL_NAME.match(name):
            raise ConfigError(f"{source}: [{sec}]: pool names are letters, digits, _ . -")
        if name.lower() == HANDMADE:
            # Hand-made devices are recorded under this name; a pool of it would
            # take them as members and remove the "surplus".
            raise ConfigError(f"{source}: [{sec}]: the name {HANDMADE!r} is reserved for "
                              "hand-made devices (gpulib mdev create, gpulib vf set-type), "
                              "which are never pool members: rename the pool")
        for key in section:
            if key not in POOL_KEYS:
                self._warn(f"{sources[key]}: unknown key {key} in [{sec}] ignored")
        parents = Match(section.get("parents", "all"), where("parents"))
        type_id = section.get("type")
        profile = section.get("profile")
        if (type_id is None) == (profile is None):
            raise ConfigError(f"{source}: [{sec}]: set exactly one of type or profile")
        if type_id is not None and not is_type_id(type_id.strip()):
            raise ConfigError(f"{where('type')}: {type_id!r} is not a type id")
        counts = {}
        for key in ("count", "per_parent"):
            raw = section.get(key)
            if raw is None:
                continue
            try:
                n = int(raw)
                if not 0 <= n <= 4096:
                    raise ValueError
            except ValueError:
                raise ConfigError(f"{where(key)}: {raw!r} is not a count "
                                  "from 0 to 4096") from None
            counts[key] = n
        if len(counts) != 1:
            raise ConfigError(f"{source}: [{sec}]: set exactly one of count or per_parent")
        self.pools[name] = PoolConfig(
            name, parents, type_id.strip() if type_id else None,
            profile.strip() if profile else None,
            counts.get("count"), counts.get("per_parent"))

    # -- typed access ------------------------------------------------------------
    def get(self, section: str, key: str) -> str:
        return self._values[section][key]

    def get_bool(self, section: str, key: str) -> bool:
        return self._values[section][key].lower() in _TRUE

    def get_float(self, section: str, key: str) -> float:
        return float(self._values[section][key])

    def match(self, section: str, key: str) -> Match:
        return Match(self._values[section][key], self._where(section, key))


def keeps_console(config: Config) -> bool:
    """The boot VGA device (the host's console) is never offered or given whole:
    `[discovery] allow_boot_vga = no`, the default. Its vGPUs may be."""
    return not config.get_bool("discovery", "allow_boot_vga")


def metadata_allowed(ctx: Context, config: Config) -> bool:
    """`allow_metadata_requests`: auto = on for plain libvirt, off under CloudStack.

    Under CloudStack tenants can put XML into a domain (extraconfig), so a
    request there could claim GPUs nobody paid for. One rule for the starts
    that honour requests and for `gpulib attach`, which writes them.
    """
    value = config.get("transformer", "allow_metadata_requests").lower()
    if value == "auto":
        return not ctx.sysfs.exists(AGENT_PROPERTIES)
    return value in ("1", "yes", "true", "on")


def _dropins(path: str, cfg: Config) -> list[str]:
    """`<path>.d/*.conf` in lexical order (hidden files and other names skipped)."""
    directory = path + ".d"
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        cfg._problem(f"{directory}: cannot list: {exc.strerror}", "drop-ins ignored")
        return []
    return [os.path.join(directory, n) for n in sorted(names)
            if n.endswith(DROPIN_SUFFIX) and not n.startswith(".")]


def example_config() -> str:
    """The shipped gpulib.conf: every key commented out with its default."""
    lines = ["# gpulib configuration. Every key is shown commented out with its default.",
             "# Unknown keys are warned about; a bad value stops gpulib with the key named.",
             ""]
    for section, keys in DEFAULTS.items():
        lines.append(f"[{section}]")
        for key, (default, kind) in keys.items():
            # The kind on its own line: uncommenting a key must give a valid file.
            lines.append(f"# ({KIND_HELP.get(kind, kind)})")
            lines.append(f"# {key} = {default}".rstrip())
        lines.append("")
    lines += [
        "# vGPU pools: gpulib keeps these vGPUs created (gpulib pool apply, and at boot).",
        "# [pool desktops]",
        "# parents = all                 (all | PCI addresses | vendor:device ids)",
        "# profile = GRID T4-2Q          (or: type = nvidia-231)",
        "# per_parent = 8                (or: count = 16, spread over the parents)",
        "",
    ]
    return "\n".join(lines)
