"""`etc/gpulib/gpulib.conf`: INI read with configparser (stdlib on every target).

A missing file means defaults. Unknown sections or keys are warned about (a
typo must not silently change behaviour, but must not stop a VM either); a
bad value fails with the file, section and key named.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Optional

from gpulib.errors import ConfigError
from gpulib.lazyre import lazy
from gpulib.pci import PciAddress

log = logging.getLogger(__name__)

_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}
_VENDOR_DEVICE = lazy(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\Z")
_POOL_NAME = lazy(r"^[A-Za-z0-9_.-]{1,64}\Z")
_TYPE_ID = lazy(r"^[A-Za-z0-9_.:-]{1,128}\Z")

# section -> key -> (default, kind); the example config is generated from it.
DEFAULTS: dict[str, dict[str, tuple[str, str]]] = {
    "discovery": {
        "include": ("", "match-list"),
        "exclude": ("", "match-list"),
    },
    "transformer": {
        "add_group_functions": ("yes", "bool"),
        "allow_metadata_requests": ("auto", "auto-bool"),
        "refuse_in_use": ("yes", "bool"),
    },
    "release": {
        "destroy_on_demand": ("yes", "bool"),
        "clear_retry_seconds": ("5", "float"),
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


class Config:
    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path or "<defaults>"
        self._values: dict[str, dict[str, str]] = {
            s: {k: d for k, (d, _) in keys.items()} for s, keys in DEFAULTS.items()}
        self.pools: dict[str, PoolConfig] = {}

    # -- loading -------------------------------------------------------------
    @classmethod
    def load(cls, path: str) -> Config:
        cfg = cls(path)
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            return cfg
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: cannot parse: not UTF-8 text") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        if not any(line.strip() and line.lstrip()[0] not in "#;" for line in text.splitlines()):
            # The shipped file is all comments: defaults, without paying for
            # configparser on every VM start.
            return cfg
        import configparser

        parser = configparser.ConfigParser(interpolation=None, strict=True)
        try:
            parser.read_string(text, source=path)
        except configparser.Error as exc:
            first = str(exc).splitlines()[0]
            raise ConfigError(f"{path}: cannot parse: {first}") from None
        for section in parser.sections():
            if section.startswith("pool "):
                cfg._load_pool(section[5:].strip(), parser[section])
                continue
            if section not in DEFAULTS:
                log.warning("%s: unknown section [%s] ignored", path, section)
                continue
            for key, value in parser[section].items():
                if key not in DEFAULTS[section]:
                    log.warning("%s: unknown key %s in [%s] ignored", path, key, section)
                    continue
                cfg._check(section, key, value)
                cfg._values[section][key] = value.strip()
        return cfg

    def _where(self, section: str, key: str) -> str:
        return f"{self.path}: [{section}] {key}"

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

    def _load_pool(self, name: str, section: Mapping[str, str]) -> None:
        sec = f"pool {name}"
        if not _POOL_NAME.match(name):
            raise ConfigError(f"{self.path}: [{sec}]: pool names are letters, digits, _ . -")
        for key in section:
            if key not in POOL_KEYS:
                log.warning("%s: unknown key %s in [%s] ignored", self.path, key, sec)
        parents = Match(section.get("parents", "all"), self._where(sec, "parents"))
        type_id = section.get("type")
        profile = section.get("profile")
        if (type_id is None) == (profile is None):
            raise ConfigError(f"{self.path}: [{sec}]: set exactly one of type or profile")
        if type_id is not None and not _TYPE_ID.match(type_id.strip()):
            raise ConfigError(f"{self._where(sec, 'type')}: {type_id!r} is not a type id")
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
                raise ConfigError(f"{self._where(sec, key)}: {raw!r} is not a count "
                                  "from 0 to 4096") from None
            counts[key] = n
        if len(counts) != 1:
            raise ConfigError(f"{self.path}: [{sec}]: set exactly one of count or per_parent")
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
