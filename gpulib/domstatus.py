"""Which devices running domains hold, read from libvirt's status files.

Hooks must never call libvirt, so this reads `run/libvirt/qemu/<name>.xml`
(`<domstatus><domain>`; ARCHITECTURE.md, "Ownership of the device tree").
Only what libvirt itself acts on counts: `<hostdev>` elements that are
children of the domain's `<devices>`, in no namespace. Nothing inside
`<metadata>` (any namespace), comments or CDATA is a device: a tenant can
put XML there.

Defined but stopped domains (`etc/libvirt/qemu/*.xml`) are not users: a
plain-libvirt user may keep two defined VMs naming one GPU and start either.

Cost: a file without the bytes `<hostdev` is not parsed at all (its name
comes from the file name, as libvirt names it); the others are parsed once
by libxml2, which is linear in their size (no regular expression, no
backtracking: malformed input fails fast). Results are cached, keyed on the
file's identity (device, inode), size and mtime: in the process (a hook reads
the directory before taking the state lock and again under it) and across
processes in `run/gpulib/domains.json` (libvirt replaces a status file by
rename, so a changed file never matches its old key), so a start on a host
with many running VMs parses only the files that changed since the last one,
and so does the agent's periodic discovery (which keeps the file too).
"""

from __future__ import annotations

import json
import os

from gpulib import logger
from gpulib.context import RUNNING_DOMAINS
from gpulib.errors import InputError
from gpulib.pci import PciAddress
from gpulib.sysfs import ReadFailure, Sysfs
from gpulib.validate import libvirt_uuid

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

    from gpulib.sysfs import AlreadyRead

log = logger.get(__name__)

# libvirt caps a domain XML at 10 MB; a status file is that plus a little.
MAX_STATUS_BYTES = 16 * 1024 * 1024


class DomainDevices:
    """The host devices one running domain holds, and the domain's UUID."""

    __slots__ = ("mdevs", "name", "pci", "uuid")

    def __init__(self, name: str, uuid: Optional[str] = None) -> None:
        self.name = name
        # The domain's UUID as its status file names it (None: unreadable).
        self.uuid = uuid
        self.pci: list[PciAddress] = []
        self.mdevs: list[str] = []

    def __repr__(self) -> str:
        return (f"DomainDevices({self.name!r}, uuid={self.uuid!r}, pci={self.pci!r}, "
                f"mdevs={self.mdevs!r})")


def status_uuid(data: bytes) -> Optional[str]:
    """The domain UUID of a status (or domain) XML, found without parsing it.

    libvirt writes `<uuid>` as the second child of `<domain>`, after `<name>`
    and before anything a tenant controls (`<metadata>`, `<description>`), so
    the first `<uuid>` after the `<domain` start tag is the domain's own."""
    start = data.find(b"<domain ")
    if start < 0:
        start = data.find(b"<domain>")
    if start < 0:
        return None
    i = data.find(b"<uuid>", start)
    j = data.find(b"</uuid>", i) if i >= 0 else -1
    if i < 0 or j < 0 or j - i > 128:
        return None
    return libvirt_uuid(data[i + 6:j].decode("ascii", "replace"))


def _parser() -> Any:
    from lxml import etree

    return etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False,
                           huge_tree=False, collect_ids=False, remove_comments=True,
                           remove_pis=True)


def _hostdevs(domain: Any, found: DomainDevices) -> None:
    for devices in domain.iterchildren("devices"):
        for hd in devices.iterchildren("hostdev"):
            if (hd.get("mode") or "subsystem") != "subsystem":
                continue
            addr = hd.find("source/address")
            if addr is None:
                continue
            kind = hd.get("type")
            if kind == "pci":
                try:
                    found.pci.append(PciAddress.from_libvirt(
                        addr.get("domain") or "0", addr.get("bus") or "",
                        addr.get("slot") or "", addr.get("function") or "0"))
                except InputError:
                    log.debug("domain %s: unreadable PCI hostdev address", found.name)
            elif kind == "mdev" and addr.get("uuid"):
                # libvirt's own spelling rules (it writes the canonical form back).
                uuid = libvirt_uuid(str(addr.get("uuid")))
                if uuid is not None:
                    found.mdevs.append(uuid)


def scan_domain_xml(data: bytes, name: str) -> DomainDevices:
    """The devices a status (or domain) XML holds; nothing when it cannot be read.

    `name` is the domain's name (libvirt's file name). A file that cannot be
    parsed is logged and read as holding nothing: libvirt writes these
    files itself, so that means a file cut short, not a device to guard.
    """
    found = DomainDevices(name, status_uuid(data))
    if b"<hostdev" not in data:
        return found
    from lxml import etree

    try:
        root = etree.fromstring(data, _parser())
    except etree.XMLSyntaxError as exc:
        log.warning("cannot read the status of domain %s: %s", name, exc.msg)
        return found
    if root.tag == "domstatus":
        for domain in root.iterchildren("domain"):
            _hostdevs(domain, found)
    elif root.tag == "domain":
        _hostdevs(root, found)
    return found


# path -> ((st_dev, st_ino, st_size, st_mtime_ns), devices)
_CACHE: dict[str, tuple[tuple[int, int, int, int], DomainDevices]] = {}
CACHE_FILE = "run/gpulib/domains.json"
_loaded_roots: set[str] = set()


def _load_cache(sysfs: Sysfs) -> None:
    """Fill the in-process cache from the file other hooks left (once per root)."""
    if sysfs.root in _loaded_roots:
        return
    _loaded_roots.add(sysfs.root)
    raw = sysfs.read_result(CACHE_FILE, MAX_STATUS_BYTES)
    if isinstance(raw, ReadFailure):
        if not raw.missing:
            log.debug("cannot read %s: %s", CACHE_FILE, raw.reason)
        return  # no cache, or one we cannot use: parse the files
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            return
        for name, (dev, ino, size, mtime, uuid, pci, mdevs) in doc.items():
            found = DomainDevices(str(name), libvirt_uuid(uuid))
            found.pci = [PciAddress.parse(str(a)) for a in pci]
            found.mdevs = [str(u) for u in mdevs]
            _CACHE.setdefault(sysfs.path(f"{RUNNING_DOMAINS}/{name}.xml"),
                              ((int(dev), int(ino), int(size), int(mtime)), found))
    except (OSError, ValueError, TypeError, InputError):
        return  # no cache, or one we cannot use (an older layout): parse the files


def _save_cache(sysfs: Sysfs, found: list[tuple[tuple[int, int, int, int],
                                                 DomainDevices]]) -> None:
    from gpulib import atomicfile

    doc = {d.name: [*key, d.uuid, [str(a) for a in d.pci], d.mdevs] for key, d in found}
    path = sysfs.path(CACHE_FILE)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        atomicfile.write_atomic(path, json.dumps(doc, sort_keys=True).encode(), 0o600,
                                sync_dir=False, durable=False)
    except OSError as exc:
        log.debug("cannot write %s: %s", path, exc)


def running_names(sysfs: Sysfs) -> set[str]:
    """Names of the running domains (their status files): no file is read."""
    return {n[:-4] for n in sysfs.listdir(RUNNING_DOMAINS) if n.endswith(".xml") and len(n) > 4}


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _cached_as(cached: Optional[tuple[tuple[int, int, int, int], DomainDevices]]
               ) -> AlreadyRead:
    """Whether a status file is the one `cached` was parsed from."""
    key = cached[0] if cached is not None else None
    return lambda st: _identity(st) == key


def running_domains(sysfs: Sysfs, save_cache: bool = False) -> list[DomainDevices]:
    """Every running domain and the devices it holds.

    A status file that cannot be read (a FIFO, too large, EIO) is logged and
    read as holding nothing, like one cut short: never a wait, never the end
    of the scan.

    `save_cache`: write what was parsed to the cross-process cache (the hooks,
    and the reports run on a schedule: `gpulib discover` and `gpulib metrics`;
    the other read-only commands, such as doctor and snapshot, write nothing)."""
    _load_cache(sysfs)
    out = []
    keyed: list[tuple[tuple[int, int, int, int], DomainDevices]] = []
    parsed = False
    for name in sorted(running_names(sysfs)):
        rel = f"{RUNNING_DOMAINS}/{name}.xml"
        path = sysfs.path(rel)
        cached = _CACHE.get(path)
        got = sysfs.read_unless(rel, _cached_as(cached), MAX_STATUS_BYTES)
        if isinstance(got, ReadFailure):
            if not got.missing:  # missing: the domain stopped while we looked
                log.warning("cannot read the status of domain %s: %s", name, got)
                out.append(DomainDevices(name))
            continue
        st, data = got
        if data is None:  # the very file the cache holds
            if cached is not None:
                out.append(cached[1])
                keyed.append(cached)
            continue
        parsed = True
        found = scan_domain_xml(data, name)
        key = _identity(st)
        _CACHE[path] = (key, found)
        keyed.append((key, found))
        out.append(found)
    if parsed and save_cache:
        _save_cache(sysfs, keyed)
    return out
