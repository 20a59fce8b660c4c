"""libvirt domain XML: a safe parser and a small in-place model of what gpulib edits.

Modelled on virt-manager's virtinst: one small class per XML element, whose
properties read and write the lxml element in place. Nothing is ever rebuilt
from a model, so every element, attribute, comment and namespace gpulib does
not know survives an edit untouched. The module is pure XML: it never reads
sysfs or files.

The CloudStack agent renders its XML with quirks this module must take as
they are (see tests/data/cloudstack-xml/README.md): two `<devices>` elements,
no indentation, `display`/`ramfb` on PCI hostdevs, `managed='no'` for NVIDIA
vendor-specific VFs. A domain nobody edited comes back byte-identical.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union, overload

from lxml import etree

from gpulib import logger
from gpulib.errors import InputError
from gpulib.lazyre import lazy
from gpulib.pci import MAX_DOMAIN, PciAddress, libvirt_uint
from gpulib.profiles import serves
from gpulib.validate import (
    check_domain_uuid,
    check_type_id,
    check_vm_name,
    is_type_id,
    libvirt_uuid,
)
from gpulib.xmlns import GPULIB_NS  # defined without lxml, for the hooks' fast path

log = logger.get(__name__)

# The agent passes the whole XML in argv; libvirt caps a domain XML at 10 MB
# of its own, and real domains are a few kB. 8 MiB leaves room for anything
# genuine and refuses a 50 MB argument before lxml sees it.
MAX_XML_BYTES = 8 * 1024 * 1024

# libxml2 needs ~130 bytes per node: 8 MiB of `<a/>` is 2 million nodes and
# 280 MB of RAM. A large real domain (64 disks, 64 NICs) has ~2000 nodes.
MAX_XML_NODES = 100_000


# Fixed forever: changing it would change the UUIDs of on-demand vGPUs that
# running VMs and the state file already know. It is
# uuid5(NAMESPACE_URL, GPULIB_NS + "#derived-vgpu"), written out literally.
DERIVED_UUID_NAMESPACE = "0d451d0a-8ba7-512b-b10e-f967a0efb639"

# Linux caps NUMA nodes at 1024 (CONFIG_NODES_SHIFT=10); a larger number in a
# nodeset is a typo, and expanding "0-99999999" would eat memory.
MAX_NUMA_NODE = 1023

MAX_REQUEST_COUNT = 16

# The type id becomes a path component under mdev_supported_types/ and an
# NVIDIA creatable type: no '/', and no leading '.' so '.' and '..' are out.
_VENDOR_DEVICE_RE = lazy(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{4})$")
_SMALL_INT_RE = lazy(r"^[0-9]{1,4}$")
_CONTROL_RE = lazy(r"[\x00-\x1f\x7f]")
_POSITION_SUFFIX_RE = lazy(r",? line \d+, column \d+$")

# lxml ships no type stubs: elements are Any to mypy. The alias documents intent.
Element = Any


class DomainXmlError(InputError):
    """The domain XML is malformed, unsafe, or asks for something invalid."""


# --------------------------------------------------------------------------
# Parsing


def _xml_parser() -> Any:
    # A fresh parser per call: lxml parsers keep an error log across calls.
    return etree.XMLParser(
        resolve_entities=False,  # never expand entities (bombs, external files)
        no_network=True,  # never fetch anything
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,  # keep libxml2's depth and text-size limits
        strip_cdata=False,  # keep CDATA sections as written
        collect_ids=False,
        remove_blank_text=False,  # untouched formatting must survive
        # We always hand lxml UTF-8; a stale encoding= in an XML declaration
        # must not make it decode the bytes differently.
        encoding="utf-8",
    )


def _prolog_end(text: str) -> tuple[int, bool]:
    """Where the prolog ends, and whether a DOCTYPE starts there.

    The prolog is an optional BOM, then whitespace, comments and processing
    instructions (the XML declaration is one). A DOCTYPE can only appear there,
    so a linear scan finds it exactly, before libxml2 parses any DTD.
    """
    pos = 1 if text.startswith("\ufeff") else 0
    n = len(text)
    while pos < n:
        ch = text[pos]
        if ch in " \t\r\n":
            pos += 1
        elif text.startswith("<?", pos):
            end = text.find("?>", pos + 2)
            if end < 0:
                break
            pos = end + 2
        elif text.startswith("<!--", pos):
            end = text.find("-->", pos + 4)
            if end < 0:
                break
            pos = end + 3
        else:
            break
    return pos, text.startswith("<!DOCTYPE", pos)


def _syntax_error(exc: Any) -> DomainXmlError:
    # exc.msg is this parse's first error; exc.error_log may also hold errors
    # of earlier parses in the same thread, so it is not used.
    message = _POSITION_SUFFIX_RE.sub("", str(exc.msg or "")).strip() or "not well-formed"
    line = exc.lineno
    where = f"line {line}: " if line else ""
    return DomainXmlError(f"malformed domain XML: {where}{message}")


def parse_domain(text: Union[str, bytes]) -> Domain:
    """Parse a libvirt domain XML safely; raises DomainXmlError with one line.

    Refused: input over MAX_XML_BYTES or with more than MAX_XML_NODES markup
    nodes, any DOCTYPE (so no entity declarations: no bombs, no external
    entities), bytes that are not UTF-8, and a root that is not `<domain>`.
    Entities are never expanded and nothing is ever fetched.
    """
    if isinstance(text, str):
        # Characters are at most bytes: a cheap first check before encoding.
        if len(text) > MAX_XML_BYTES:
            raise DomainXmlError(
                f"domain XML too large: more than {MAX_XML_BYTES} bytes")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # argv decoded with surrogateescape carries undecodable bytes this way
            raise DomainXmlError(
                f"domain XML is not valid UTF-8 (character {exc.start})") from None
        original = text
    elif isinstance(text, (bytes, bytearray)):
        data = bytes(text)
        if len(data) > MAX_XML_BYTES:
            raise DomainXmlError(
                f"domain XML too large: {len(data)} bytes, limit {MAX_XML_BYTES}")
        try:
            # libvirt reads and writes domain XML as UTF-8 only.
            original = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DomainXmlError(
                f"domain XML is not valid UTF-8 (byte {exc.start})") from None
    else:
        raise TypeError(f"parse_domain wants str or bytes, not {type(text).__name__}")

    if len(data) > MAX_XML_BYTES:
        raise DomainXmlError(
            f"domain XML too large: {len(data)} bytes, limit {MAX_XML_BYTES}")
    if not original.strip():
        raise DomainXmlError("domain XML is empty")
    # Every element, comment or PI starts with '<' (never literal in text or
    # attributes), so this bounds the node count before libxml2 allocates.
    if data.count(b"<") > MAX_XML_NODES:
        raise DomainXmlError(
            f"domain XML has too many elements (more than {MAX_XML_NODES})")
    _, has_doctype = _prolog_end(original)
    if has_doctype:
        raise DomainXmlError(
            "domain XML must not contain a DOCTYPE or entity declarations")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]  # lxml's encoding override does not expect the BOM

    try:
        root = etree.fromstring(data, _xml_parser())
    except etree.XMLSyntaxError as exc:
        raise _syntax_error(exc) from None
    tree = root.getroottree()
    # Belt and braces: the scan above should have caught every DOCTYPE.
    if tree.docinfo.internalDTD is not None or tree.docinfo.doctype:
        raise DomainXmlError(
            "domain XML must not contain a DOCTYPE or entity declarations")
    if root.tag != "domain":
        raise DomainXmlError(
            f"not a libvirt domain XML: root element is <{_display_tag(root.tag)}>, "
            "expected <domain>")
    return Domain(root, source_text=original)


def _display_tag(tag: Any) -> str:
    text = str(tag)
    if text.startswith("{"):
        ns, _, local = text[1:].partition("}")
        return f"{local} xmlns='{ns}'"
    return text


# --------------------------------------------------------------------------
# Small helpers shared by the element classes


def _is_ws(text: Optional[str]) -> bool:
    return text is None or not text.strip()


def _canonical_uuid(value: Optional[str], what: str) -> str:
    """A UUID of the XML read as libvirt reads it (gpulib.validate.libvirt_uuid),
    in canonical form: libvirt accepts `7F3A...` without dashes and writes it
    back canonical, so a VM naming a vGPU so names that vGPU."""
    found = libvirt_uuid(value) if value is not None else None
    if found is None:
        shown = value if value is not None else "(missing)"
        raise DomainXmlError(f"{what} is not a UUID: {shown!r}")
    return found


def _domain_uuid(value: Optional[str]) -> str:
    """The domain's `<uuid>` in libvirt's forms, lowercase dashed."""
    try:
        return check_domain_uuid(value if value is not None else "")
    except InputError:
        shown = value if value is not None else "(missing)"
        raise DomainXmlError(f"domain UUID is not a UUID: {shown!r}") from None


def _layout(elem: Element, indent: Optional[str], step: str = "  ") -> None:
    """Indent a freshly built subtree whose own start tag sits at `indent`.

    indent None means the surroundings use no line breaks: keep it compact.
    """
    children = [c for c in elem if isinstance(c.tag, str)]
    if not children:
        return
    if indent is None:
        for child in children:
            _layout(child, None, step)
        return
    inner = indent + step
    elem.text = "\n" + inner
    for child in children:
        _layout(child, inner, step)
        child.tail = "\n" + inner
    children[-1].tail = "\n" + indent


def _indent_before(elem: Element) -> Optional[str]:
    """The indentation in front of `elem`, None when it starts no line."""
    prev = elem.getprevious()
    parent = elem.getparent()
    before = prev.tail if prev is not None else (parent.text if parent is not None else None)
    if before is None or "\n" not in before or not _is_ws(before):
        return None
    return str(before.rsplit("\n", 1)[1])


def _insert_after(parent: Element, ref: Optional[Element], new: Element) -> None:
    """Insert `new` after `ref` (or at the end), in the surrounding layout.

    The whitespace in front of `ref` is what separates siblings here: it goes
    in front of `new` too, and ref's old tail (the way to the next sibling or
    to the parent's end tag) now follows `new`.
    """
    if ref is None and len(parent):
        ref = parent[-1]
    if ref is None:
        # An empty parent: put the child one step deeper than the parent.
        own = _indent_before(parent)
        parent.append(new)
        if own is None:
            _layout(new, None)
            return
        parent.text = "\n" + own + "  "
        new.tail = "\n" + own
        _layout(new, own + "  ")
        return
    prev = ref.getprevious()
    sep = prev.tail if prev is not None else parent.text
    if not _is_ws(sep):
        sep = None  # mixed content: copy no text, only layout
    old_tail = ref.tail
    ref.addnext(new)
    if _is_ws(old_tail):
        ref.tail = sep
        new.tail = old_tail
    else:
        # ref was followed by real text: it stays right after ref.
        ref.tail = old_tail
        new.tail = sep
    _layout(new, _indent_before(new))


def _remove_keep_layout(elem: Element) -> None:
    """Remove `elem`; the whitespace before the parent's end tag survives."""
    parent = elem.getparent()
    if parent is None:
        return
    prev = elem.getprevious()
    tail = elem.tail
    if not _is_ws(tail) or elem.getnext() is None:
        # lxml drops the tail with the element. Real text must stay; and the
        # last child's tail is the indentation of the parent's end tag.
        if prev is not None:
            prev.tail = tail if _is_ws(prev.tail) else (prev.tail or "") + (tail or "")
        else:
            parent.text = tail if _is_ws(parent.text) else (parent.text or "") + (tail or "")
    parent.remove(elem)


# --------------------------------------------------------------------------
# Element classes


class _Attr:
    """A string attribute of the wrapped element, read and written in place.

    Setting None removes the attribute; setting the value it already has
    changes nothing (so the domain stays byte-identical).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: Optional[type] = None) -> _Attr: ...

    @overload
    def __get__(self, obj: _XmlNode, objtype: Optional[type] = None) -> Optional[str]: ...

    def __get__(self, obj: Optional[_XmlNode],
                objtype: Optional[type] = None) -> Union[_Attr, Optional[str]]:
        if obj is None:
            return self
        value = obj.element.get(self.name)
        return None if value is None else str(value)

    def __set__(self, obj: _XmlNode, value: Optional[str]) -> None:
        obj._set_attr(obj.element, self.name, value)


class _XmlNode:
    """Base of the element classes: the element plus the domain it belongs to."""

    __slots__ = ("_owner", "element")

    def __init__(self, element: Element, owner: Optional[Domain] = None) -> None:
        self.element = element
        self._owner = owner

    def _mark_changed(self) -> None:
        if self._owner is not None:
            self._owner.mark_changed()

    def _set_attr(self, elem: Element, name: str, value: Optional[str]) -> None:
        if elem.get(name) == value:
            return
        if value is None:
            del elem.attrib[name]
        else:
            elem.set(name, value)
        self._mark_changed()

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _XmlNode) and type(other) is type(self)
                and other.element is self.element)

    def __hash__(self) -> int:
        return hash((type(self), id(self.element)))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {etree.tostring(self.element, encoding='unicode')[:80]!r}>"


class PciHostdev(_XmlNode):
    """`<hostdev mode='subsystem' type='pci'>`: a host PCI function given to the VM."""

    __slots__ = ()

    display = _Attr("display")
    ramfb = _Attr("ramfb")

    @property
    def address(self) -> PciAddress:
        """The host function, from `<source><address>`."""
        addr = self.element.find("source/address")
        if addr is None:
            raise DomainXmlError("PCI hostdev without <source><address>")
        # libvirt defaults a missing domain to 0; bus and slot are required
        # here because a hostdev without them is a mistake, not the host bridge.
        for name in ("bus", "slot"):
            if addr.get(name) is None:
                raise DomainXmlError(f"PCI hostdev <source><address> has no {name}=")
        try:
            return PciAddress.from_libvirt(
                addr.get("domain"), addr.get("bus"), addr.get("slot"), addr.get("function"))
        except InputError as exc:
            raise DomainXmlError(f"PCI hostdev: {exc.message}") from None

    @address.setter
    def address(self, value: PciAddress) -> None:
        """Point the hostdev at another host function: only `<source><address>`
        changes; an attribute already naming the same number keeps its spelling."""
        addr = self.element.find("source/address")
        if addr is None:
            raise DomainXmlError("PCI hostdev without <source><address>")
        try:
            if self.address == value:
                return
        except DomainXmlError:
            pass  # unreadable before: written anew
        for name, text in value.libvirt().items():
            current = addr.get(name)
            if current is not None and libvirt_uint(str(current)) == int(text, 16):
                continue  # bus='0x3b' and bus='59' are one bus: the spelling stays
            if current is None and name in ("domain", "function") and int(text, 16) == 0:
                continue  # libvirt's default
            self._set_attr(addr, name, text)

    def agent421_mangled(self) -> Optional[tuple[int, int, int]]:
        """(PCI domain, bus, function) when the source address is CloudStack 4.21's
        rendering of a function in a non-zero PCI domain, else None.

        That agent split `0001:d6:00.0` on ':' and wrote
        `domain='0x0000' bus='0x0001' slot='0xd6' function='0x0'`: the bus
        attribute carries the domain's four (or more: `10000`) hex digits,
        which no agent writes for a bus (a domain 0000 is never rendered so:
        the agent gets `bb:ss.f` for it). The slot may then be above 0x1f (no
        real address), or not: `000f:01:00.0` becomes bus='0x000f'
        slot='0x01', which reads as the valid 0000:0f:01.0. The slot itself is
        lost, and so is the function (always written 0x0): a whole GPU at
        function 0 may be repaired by whoever knows the host's functions when
        exactly one matches, a VF (0001:04:00.2 as bus='0x0001' slot='0x04')
        never, as its PF and every VF on its bus read the same.
        """
        addr = self.element.find("source/address")
        if addr is None:
            return None
        bus, slot = addr.get("bus") or "", addr.get("slot") or ""
        try:
            d, b, s, f = (int(v, 0) for v in (addr.get("domain") or "0", bus, slot,
                                                addr.get("function") or "0"))
        except ValueError:
            return None
        digits = bus[2:] if bus[:2].lower() == "0x" else ""
        if d != 0 or not 4 <= len(digits) <= 8 or not 0 <= s <= 0xFF or not 0 <= f <= 7 \
                or not 0 < b <= MAX_DOMAIN:
            return None
        return b, s, f

    @property
    def managed(self) -> bool:
        # libvirt's default when the attribute is absent is 'no'.
        return bool(self.element.get("managed") == "yes")

    @managed.setter
    def managed(self, value: bool) -> None:
        self._set_attr(self.element, "managed", "yes" if value else "no")

    def _guest_address_element(self) -> Optional[Element]:
        # A direct child: the <address> inside <source> is the host side.
        return self.element.find("address")

    @property
    def guest_address(self) -> Optional[PciAddress]:
        """Where the guest sees the device (`<address type='pci'>`), if fixed."""
        addr = self._guest_address_element()
        if addr is None or addr.get("type") != "pci":
            return None
        try:
            return PciAddress.from_libvirt(
                addr.get("domain"), addr.get("bus"), addr.get("slot"), addr.get("function"))
        except InputError as exc:
            raise DomainXmlError(f"PCI hostdev guest address: {exc.message}") from None

    @property
    def multifunction(self) -> bool:
        addr = self._guest_address_element()
        return addr is not None and bool(addr.get("multifunction") == "on")

    def set_guest_address(self, addr: Optional[PciAddress],
                          multifunction: bool = False) -> None:
        """Fix (or, with None, drop) the guest PCI address of this device.

        multifunction='on' belongs on function 0 of a guest slot that holds
        more than one function (a GPU and its HDMI audio, say).
        """
        current = self._guest_address_element()
        if addr is None:
            if current is not None:
                _remove_keep_layout(current)
                self._mark_changed()
            return
        wanted: dict[str, Optional[str]] = {"type": "pci"}
        wanted.update(addr.libvirt())
        wanted["multifunction"] = "on" if multifunction else None
        if current is None:
            new = etree.Element("address")
            for name, value in wanted.items():
                if value is not None:
                    new.set(name, value)
            _insert_after(self.element, self.element.find("source"), new)
            self._mark_changed()
            return
        if current.get("type") != "pci":
            # Another bus type's address (ccw, ...): its attributes mean
            # nothing for PCI, start afresh in place.
            for name in list(current.attrib):
                self._set_attr(current, name, None)
        for name, value in wanted.items():
            self._set_attr(current, name, value)


class MdevHostdev(_XmlNode):
    """`<hostdev mode='subsystem' type='mdev'>`: a mediated device (vGPU)."""

    __slots__ = ()

    model = _Attr("model")
    display = _Attr("display")
    ramfb = _Attr("ramfb")

    @property
    def uuid(self) -> Optional[str]:
        """The mdev UUID as written, lowercased; None if there is none."""
        addr = self.element.find("source/address")
        value = addr.get("uuid") if addr is not None else None
        return None if value is None else str(value).strip().lower()

    @uuid.setter
    def uuid(self, value: Optional[str]) -> None:
        """Point the hostdev at another mdev: only `<source><address uuid=>` changes
        (a migration's destination gives the VM its own instance of the type)."""
        canonical = _canonical_uuid(value, "mdev UUID")
        addr = self.element.find("source/address")
        if addr is None:
            raise DomainXmlError("mdev hostdev without <source><address>")
        if (addr.get("uuid") or "").strip().lower() != canonical:
            self._set_attr(addr, "uuid", canonical)

    def uuid_checked(self) -> str:
        """The mdev UUID in canonical form; DomainXmlError if it is not one."""
        addr = self.element.find("source/address")
        return _canonical_uuid(addr.get("uuid") if addr is not None else None, "mdev UUID")


class Graphics(_XmlNode):
    """`<graphics>`: vnc, spice, egl-headless, ..."""

    __slots__ = ()

    type = _Attr("type")


class Video(_XmlNode):
    """`<video>`; its kind lives in `<model type=...>`."""

    __slots__ = ()

    @property
    def type(self) -> Optional[str]:
        model = self.element.find("model")
        value = model.get("type") if model is not None else None
        return None if value is None else str(value)


Hostdev = Union[PciHostdev, MdevHostdev]


# --------------------------------------------------------------------------
# gpulib's metadata request (NamedTuples: immutable values, and cheaper to
# define than dataclasses on the hooks' start path)


class VgpuRequest(NamedTuple):
    """N vGPUs of a profile name (`GRID T4-2Q`) or of a type id (`nvidia-231`).

    The one request type: read from metadata, asked for by `gpulib attach`,
    served by the allocator. Built from untrusted values, call `checked()`.
    A migration asks with both (a recorded type: `profiles.serves`), never
    from untrusted values alone.
    """

    profile: Optional[str]
    type_id: Optional[str]
    count: int = 1  # type: ignore[assignment]  # shadows tuple.count, on purpose
    numa: Optional[int] = None

    def checked(self) -> VgpuRequest:
        """Itself, when it names exactly one of profile or type, a valid type id
        and a count from 1 to MAX_REQUEST_COUNT; InputError otherwise."""
        if (self.profile is None) == (self.type_id is None):
            raise InputError("a vGPU request names exactly one of profile or type")
        if not 1 <= self.count <= MAX_REQUEST_COUNT:
            raise InputError(f"vGPU count must be 1..{MAX_REQUEST_COUNT}, not {self.count}")
        if self.type_id is not None:
            check_type_id(self.type_id)
        return self

    @property
    def label(self) -> str:
        return self.profile or self.type_id or "?"

    def matches_type(self, type_id: str, name: Optional[str]) -> bool:
        """Whether an mdev type (its directory name and `name` file) serves it
        (the one rule: `profiles.serves`)."""
        return serves(self.profile, self.type_id, type_id, name)

    def matches_vendor(self, type_id: int, name: Optional[str]) -> bool:
        """Whether an NVIDIA vendor-specific VF type (number, name) serves it."""
        return serves(self.profile, self.type_id, type_id, name)


class PassthroughRequest(NamedTuple):
    """N whole GPUs of a model: `10de:1eb8`, or a substring of the device name."""

    model: str
    count: int = 1  # type: ignore[assignment]  # shadows tuple.count, on purpose
    numa: Optional[int] = None

    @property
    def vendor_device(self) -> Optional[tuple[int, int]]:
        """(vendor, device) when the model is written as `vvvv:dddd`."""
        m = _VENDOR_DEVICE_RE.match(self.model)
        return (int(m.group(1), 16), int(m.group(2), 16)) if m else None

    def checked(self) -> PassthroughRequest:
        if not 1 <= self.count <= MAX_REQUEST_COUNT:
            raise InputError(
                f"passthrough count must be 1..{MAX_REQUEST_COUNT}, not {self.count}")
        return self

    def matches_device(self, vendor_id: int, device_id: int, device_name: str) -> bool:
        """Whether a GPU is of this model: its `vvvv:dddd`, or a substring of its
        pci.ids device name (case ignored)."""
        m = self.model.lower()
        return m == f"{vendor_id:04x}:{device_id:04x}" or \
            (":" not in m and m in device_name.lower())


GpuRequestItem = Union[VgpuRequest, PassthroughRequest]


class GpuRequest(NamedTuple):
    """Everything one domain's `<gpulib:gpus>` asks for, in document order."""

    items: tuple[GpuRequestItem, ...] = ()

    @property
    def vgpus(self) -> list[VgpuRequest]:
        return [i for i in self.items if isinstance(i, VgpuRequest)]

    @property
    def passthrough(self) -> list[PassthroughRequest]:
        return [i for i in self.items if isinstance(i, PassthroughRequest)]

    @property
    def total(self) -> int:
        return sum(i.count for i in self.items)


_VGPU_ATTRS = frozenset({"profile", "type", "count", "numa"})
_PASSTHROUGH_ATTRS = frozenset({"model", "count", "numa"})


def _meta_error(elem_name: str, message: str) -> DomainXmlError:
    return DomainXmlError(f"gpulib metadata: <gpulib:{elem_name}> {message}")


def _meta_count(elem: Element, elem_name: str) -> int:
    raw = elem.get("count")
    if raw is None:
        return 1
    text = str(raw).strip()
    if not _SMALL_INT_RE.match(text) or not 1 <= int(text) <= MAX_REQUEST_COUNT:
        raise _meta_error(
            elem_name, f"count={raw!r}: must be a whole number from 1 to {MAX_REQUEST_COUNT}")
    return int(text)


def _meta_numa(elem: Element, elem_name: str) -> Optional[int]:
    raw = elem.get("numa")
    if raw is None:
        return None
    text = str(raw).strip()
    if not _SMALL_INT_RE.match(text) or int(text) > MAX_NUMA_NODE:
        raise _meta_error(
            elem_name, f"numa={raw!r}: must be a NUMA node number from 0 to {MAX_NUMA_NODE}")
    return int(text)


def _meta_name(elem: Element, elem_name: str, attr: str) -> str:
    raw = str(elem.get(attr))
    text = raw.strip()
    if not text or len(text) > 128 or _CONTROL_RE.search(text):
        raise _meta_error(
            elem_name, f"{attr}={raw!r}: must be 1 to 128 printable characters")
    return text


def _parse_request_item(elem: Element) -> GpuRequestItem:
    local = etree.QName(elem).localname
    allowed = _VGPU_ATTRS if local == "vgpu" else _PASSTHROUGH_ATTRS
    for name in elem.attrib:
        # Attributes in other namespaces are someone else's extension.
        if not str(name).startswith("{") and name not in allowed:
            raise _meta_error(local, f"has an unknown attribute {name}=")
    count = _meta_count(elem, local)
    numa = _meta_numa(elem, local)
    if local == "passthrough":
        if elem.get("model") is None:
            raise _meta_error(local, "needs model= (vendor:device or a device name)")
        return PassthroughRequest(_meta_name(elem, local, "model"), count, numa)
    has_profile = elem.get("profile") is not None
    has_type = elem.get("type") is not None
    if has_profile == has_type:
        raise _meta_error(local, "needs exactly one of profile= or type=")
    if has_profile:
        return VgpuRequest(_meta_name(elem, local, "profile"), None, count, numa)
    raw = str(elem.get("type"))
    if not is_type_id(raw):
        raise _meta_error(
            local, f"type={raw!r}: not a vGPU type id (<driver>-<name>: letters, digits, "
            "'_.:+-'; no '/' or '..')")
    return VgpuRequest(None, raw, count, numa)


# --------------------------------------------------------------------------
# The domain


def _parse_nodeset(text: str) -> list[int]:
    """libvirt's nodeset syntax: '0', '0-1', '0,2', '0-3,^2'."""
    include: set[int] = set()
    exclude: set[int] = set()
    if not text.strip():
        raise DomainXmlError("<numatune><memory nodeset=''> is empty")
    for token in text.split(","):
        part = token.strip()
        negate = part.startswith("^")
        if negate:
            part = part[1:].strip()
        lo_text, dash, hi_text = part.partition("-")
        lo_text, hi_text = lo_text.strip(), hi_text.strip()
        if not _SMALL_INT_RE.match(lo_text) or (dash and not _SMALL_INT_RE.match(hi_text)):
            raise DomainXmlError(f"<numatune><memory nodeset={text!r}> is not a node set")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if hi < lo or hi > MAX_NUMA_NODE or (negate and dash):
            raise DomainXmlError(f"<numatune><memory nodeset={text!r}> is not a node set")
        (exclude if negate else include).update(range(lo, hi + 1))
    return sorted(include - exclude)


class Domain:
    """A libvirt domain XML document, edited in place.

    Build it with `parse_domain`. Other code may edit `root` directly with
    lxml, and must then call `mark_changed()` so `to_xml()` serializes.
    """

    def __init__(self, root: Element, source_text: Optional[str] = None) -> None:
        self.root = root
        self._source = source_text
        self._changed = False

    # -- identity -----------------------------------------------------------

    @property
    def name(self) -> Optional[str]:
        value = self.root.findtext("name")
        return None if value is None else str(value)

    def name_checked(self) -> str:
        """The name, refused when unusable as a file or state key."""
        name = self.name
        if name is None or not name.strip():
            raise DomainXmlError("domain XML has no <name>")
        try:
            return check_vm_name(name)  # the rule every entry point applies
        except InputError as e:
            raise DomainXmlError(f"domain XML: {e.message}") from None

    @property
    def uuid(self) -> Optional[str]:
        value = self.root.findtext("uuid")
        return None if value is None else str(value).strip()

    def uuid_checked(self) -> str:
        """The UUID in canonical lowercase form; DomainXmlError if malformed."""
        return _domain_uuid(self.uuid)

    # -- change tracking and output -------------------------------------------

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        self._changed = True

    def to_xml(self) -> str:
        """The domain as text: the input verbatim unless something was edited.

        After an edit, the root element is serialized by lxml (double quotes,
        collapsed spaces in tags); the text before and after it (declaration,
        comments, the final newline) is kept from the input. No XML
        declaration is added.
        """
        if not self._changed and self._source is not None:
            return self._source
        body = etree.tostring(self.root, encoding="unicode", with_tail=False)
        if self._source is None:
            return str(body)
        prolog_end, _ = _prolog_end(self._source)
        prolog = self._source[:prolog_end]
        epilogue = "".join(
            "\n" + etree.tostring(sib, encoding="unicode", with_tail=False)
            for sib in self.root.itersiblings())
        stripped = self._source.rstrip()
        trailing = self._source[len(stripped):]
        return prolog + str(body) + epilogue + trailing

    # -- devices --------------------------------------------------------------

    def devices_elements(self) -> list[Element]:
        """Every `<devices>` child; the CloudStack agent emits two."""
        return list(self.root.findall("devices"))

    def _device_children(self, tag: str) -> list[Element]:
        return [child for devices in self.devices_elements() for child in devices.findall(tag)]

    def hostdevs(self) -> list[Hostdev]:
        """PCI and mdev subsystem hostdevs in document order, across all `<devices>`."""
        out: list[Hostdev] = []
        for elem in self._device_children("hostdev"):
            # libvirt treats a missing mode as 'subsystem'.
            if (elem.get("mode") or "subsystem") != "subsystem":
                continue
            kind = elem.get("type")
            if kind == "pci":
                out.append(PciHostdev(elem, self))
            elif kind == "mdev":
                out.append(MdevHostdev(elem, self))
        return out

    def pci_hostdevs(self) -> list[PciHostdev]:
        return [h for h in self.hostdevs() if isinstance(h, PciHostdev)]

    def mdev_hostdevs(self) -> list[MdevHostdev]:
        return [h for h in self.hostdevs() if isinstance(h, MdevHostdev)]

    def find_pci_hostdev(self, address: PciAddress) -> Optional[PciHostdev]:
        for h in self.pci_hostdevs():
            try:
                if h.address == address:
                    return h
            except DomainXmlError:
                continue  # an unreadable address (4.21's rendering) names no device
        return None

    def find_mdev_hostdev(self, mdev_uuid: str) -> Optional[MdevHostdev]:
        wanted = _canonical_uuid(mdev_uuid, "mdev UUID")
        for h in self.mdev_hostdevs():
            if h.uuid_checked() == wanted:
                return h
        return None

    def _hostdev_parent(self) -> Element:
        devices = self.devices_elements()
        for elem in devices:
            if elem.find("hostdev") is not None:
                return elem
        if devices:
            return devices[0]
        # A domain without <devices> is odd but libvirt accepts it.
        new = etree.Element("devices")
        _insert_after(self.root, None, new)
        return new

    def _append_hostdev(self, elem: Element) -> None:
        parent = self._hostdev_parent()
        existing = parent.findall("hostdev")
        # After the last hostdev keeps the GPUs together, in the order given.
        _insert_after(parent, existing[-1] if existing else None, elem)
        self.mark_changed()

    def add_pci_hostdev(self, address: PciAddress, managed: bool = True,
                        guest_address: Optional[PciAddress] = None,
                        multifunction: bool = False) -> PciHostdev:
        """Give host PCI function `address` to the VM (vfio), in the agent's style."""
        if multifunction and guest_address is None:
            raise ValueError("multifunction needs a guest_address")
        if self.find_pci_hostdev(address) is not None:
            raise DomainXmlError(f"domain already has a hostdev for PCI device {address}")
        elem = etree.Element("hostdev")
        elem.set("mode", "subsystem")
        elem.set("type", "pci")
        elem.set("managed", "yes" if managed else "no")
        etree.SubElement(elem, "driver").set("name", "vfio")
        source_addr = etree.SubElement(etree.SubElement(elem, "source"), "address")
        for name, value in address.libvirt().items():
            source_addr.set(name, value)
        if guest_address is not None:
            guest = etree.SubElement(elem, "address")
            guest.set("type", "pci")
            for name, value in guest_address.libvirt().items():
                guest.set(name, value)
            if multifunction:
                guest.set("multifunction", "on")
        log.debug("adding PCI hostdev %s (managed=%s, guest %s) to %s",
                  address, managed, guest_address, self.name)
        self._append_hostdev(elem)
        return PciHostdev(elem, self)

    def add_mdev_hostdev(self, uuid: str, display: Optional[str] = None) -> MdevHostdev:
        """Give mediated device `uuid` to the VM, as the agent renders vGPUs."""
        canonical = _canonical_uuid(uuid, "mdev UUID")
        if display not in (None, "on", "off"):
            raise DomainXmlError(f"mdev display must be 'on' or 'off', not {display!r}")
        if self.find_mdev_hostdev(canonical) is not None:
            raise DomainXmlError(f"domain already has a hostdev for mdev {canonical}")
        elem = etree.Element("hostdev")
        elem.set("mode", "subsystem")
        elem.set("type", "mdev")
        elem.set("model", "vfio-pci")
        if display is not None:
            elem.set("display", display)
        etree.SubElement(etree.SubElement(elem, "source"), "address").set("uuid", canonical)
        log.debug("adding mdev hostdev %s to %s", canonical, self.name)
        self._append_hostdev(elem)
        return MdevHostdev(elem, self)

    def remove_hostdev(self, hostdev: Hostdev) -> None:
        elem = hostdev.element
        if elem.getroottree().getroot() is not self.root or elem.getparent() is None:
            raise ValueError("that hostdev is not part of this domain")
        log.debug("removing hostdev from %s", self.name)
        _remove_keep_layout(elem)
        self.mark_changed()

    def graphics(self) -> list[Graphics]:
        return [Graphics(e, self) for e in self._device_children("graphics")]

    def videos(self) -> list[Video]:
        return [Video(e, self) for e in self._device_children("video")]

    # -- placement and requests -------------------------------------------------

    def numa_nodes(self) -> list[int]:
        """Host NUMA nodes the VM's memory is bound to; [] when not bound."""
        memory = self.root.find("numatune/memory")
        if memory is None:
            return []
        nodeset = memory.get("nodeset")
        if nodeset is None:
            return []  # placement='auto' or no binding
        return _parse_nodeset(str(nodeset))

    def metadata_request(self) -> Optional[GpuRequest]:
        """What `<metadata><gpulib:gpus>` asks for; None when there is none."""
        found = [gpus for metadata in self.root.findall("metadata")
                 for gpus in metadata.findall(f"{{{GPULIB_NS}}}gpus")]
        if not found:
            return None
        if len(found) > 1:
            # libvirt keeps one metadata element per namespace.
            raise DomainXmlError("gpulib metadata: more than one <gpulib:gpus> element")
        items: list[GpuRequestItem] = []
        records = 0
        for child in found[0]:
            if not isinstance(child.tag, str):
                continue  # comments, processing instructions
            qname = etree.QName(child)
            if qname.namespace == GPULIB_NS and qname.localname == "device":
                records += 1  # what a vGPU the VM holds is (device_types): no request
                continue
            if qname.namespace != GPULIB_NS or qname.localname not in ("vgpu", "passthrough"):
                raise DomainXmlError(
                    f"gpulib metadata: unknown element <{_display_tag(child.tag)}> "
                    "in <gpulib:gpus> (expected vgpu, passthrough or device)")
            items.append(_parse_request_item(child))
        if records and not items:
            return None
        return GpuRequest(tuple(items))

    def _gpulib_element(self) -> Optional[Element]:
        found = [gpus for metadata in self.root.findall("metadata")
                 for gpus in metadata.findall(f"{{{GPULIB_NS}}}gpus")]
        if len(found) > 1:
            # libvirt keeps one metadata element per namespace.
            raise DomainXmlError("gpulib metadata: more than one <gpulib:gpus> element")
        return found[0] if found else None

    def device_types(self) -> list[DeviceType]:
        """What each vGPU the VM was given is (`<gpulib:device>` in gpulib's
        metadata): written when gpulib gives it, read where the VM migrates to."""
        gpus = self._gpulib_element()
        if gpus is None:
            return []
        return [_parse_device_type(child) for child in gpus
                if isinstance(child.tag, str) and child.tag == f"{{{GPULIB_NS}}}device"]

    def set_device_types(self, records: list[DeviceType]) -> None:
        """Record what the VM's vGPUs are (in this order); [] removes the records.
        Nothing changes when they are recorded so already (the XML stays
        byte-identical)."""
        if self.device_types() == list(records):
            return
        gpus = self._gpulib_element()
        if gpus is not None:
            for child in list(gpus):
                if isinstance(child.tag, str) and child.tag == f"{{{GPULIB_NS}}}device":
                    _remove_keep_layout(child)
        if not records:
            if gpus is not None and not any(isinstance(c.tag, str) for c in gpus):
                metadata = gpus.getparent()
                _remove_keep_layout(gpus)
                if not any(isinstance(c.tag, str) for c in metadata):
                    _remove_keep_layout(metadata)
            self.mark_changed()
            return
        if gpus is None:
            self._new_gpulib_element([_device_type_element(rec) for rec in records])
            self.mark_changed()
            return
        last = None
        for child in gpus:
            if isinstance(child.tag, str):
                last = child
        for rec in records:
            elem = _device_type_element(rec)
            _insert_after(gpus, last, elem)
            last = elem
        self.mark_changed()

    def _new_gpulib_element(self, children: list[Element]) -> Element:
        """`<gpulib:gpus>` holding `children`, put into `<metadata>` (made when
        there is none)."""
        gpus = etree.Element(f"{{{GPULIB_NS}}}gpus", nsmap={"gpulib": GPULIB_NS})
        for child in children:
            gpus.append(child)
        metadata = self.root.find("metadata")
        if metadata is None:
            metadata = etree.Element("metadata")
            metadata.append(gpus)
            # libvirt keeps <metadata> after the identity elements.
            ref = None
            for tag in ("name", "uuid", "genid", "title", "description"):
                elem = self.root.find(tag)
                if elem is not None:
                    ref = elem
            if ref is None:
                self.root.insert(0, metadata)
                _layout(metadata, _indent_before(metadata))
            else:
                _insert_after(self.root, ref, metadata)
        else:
            _insert_after(metadata, None, gpus)
        return gpus

    def set_metadata_request(self, request: Optional[GpuRequest]) -> None:
        """Write `<metadata><gpulib:gpus>` to ask for `request`; None or an empty
        request removes it (and `<metadata>` when nothing else is left in it).

        The items are written anew in the given order (the order fixes which
        derived UUID belongs to which vGPU); the rest of `<metadata>` stays.
        """
        found = [gpus for metadata in self.root.findall("metadata")
                 for gpus in metadata.findall(f"{{{GPULIB_NS}}}gpus")]
        if len(found) > 1:
            raise DomainXmlError("gpulib metadata: more than one <gpulib:gpus> element")
        request_tags = (f"{{{GPULIB_NS}}}vgpu", f"{{{GPULIB_NS}}}passthrough")
        if request is None or not request.items:
            if found:
                records = [c for c in found[0] if c.tag == f"{{{GPULIB_NS}}}device"]
                if records:
                    # What the VM's vGPUs are stays recorded (device_types).
                    for child in list(found[0]):
                        if child.tag in request_tags:
                            _remove_keep_layout(child)
                    self.mark_changed()
                    return
                metadata = found[0].getparent()
                _remove_keep_layout(found[0])
                if not any(isinstance(c.tag, str) for c in metadata):
                    _remove_keep_layout(metadata)
                self.mark_changed()
            return
        if found:
            gpus = found[0]
            for child in list(gpus):
                if child.tag in request_tags or not isinstance(child.tag, str):
                    _remove_keep_layout(child)
            last = None
            for item in request.items:
                elem = _request_element(item)
                _insert_after(gpus, last, elem)
                last = elem
            self.mark_changed()
            return
        self._new_gpulib_element([_request_element(item) for item in request.items])
        self.mark_changed()


def _request_element(item: GpuRequestItem) -> Element:
    """One `<gpulib:vgpu>` or `<gpulib:passthrough>` as metadata_request reads it."""
    if isinstance(item, VgpuRequest):
        elem = etree.Element(f"{{{GPULIB_NS}}}vgpu", nsmap={"gpulib": GPULIB_NS})
        if item.profile is not None:
            elem.set("profile", item.profile)
        else:
            elem.set("type", str(item.type_id))
    else:
        elem = etree.Element(f"{{{GPULIB_NS}}}passthrough", nsmap={"gpulib": GPULIB_NS})
        elem.set("model", item.model)
    elem.set("count", str(item.count))
    if item.numa is not None:
        elem.set("numa", str(item.numa))
    return elem


class DeviceType(NamedTuple):
    """What one vGPU a VM holds is, as `<gpulib:device>` records it.

    `kind`: 'mdev' (`id` the mdev UUID, `type_id` its type, e.g. nvidia-232) or
    'vf' (`id` the NVIDIA vendor VF's PCI address, `type_id` its numeric
    `current_vgpu_type`). `name`: the type's name (GRID T4-2Q); `gpu`: the
    physical GPU's vendor:device (10de:1eb8), lowercase."""

    kind: str
    id: str
    type_id: str
    name: Optional[str]
    gpu: Optional[str]


def _parse_device_type(elem: Element) -> DeviceType:
    for name in elem.attrib:
        if not str(name).startswith("{") and name not in ("kind", "id", "type", "name", "gpu"):
            raise _meta_error("device", f"has an unknown attribute {name}=")
    kind = elem.get("kind")
    if kind not in ("mdev", "vf"):
        raise _meta_error("device", f"kind={kind!r}: must be mdev or vf")
    raw_id = elem.get("id")
    if raw_id is None:
        raise _meta_error("device", "needs id= (the mdev UUID or the VF's PCI address)")
    try:
        ident = _canonical_uuid(raw_id, "mdev UUID") if kind == "mdev" \
            else str(PciAddress.parse(str(raw_id)))
    except InputError as exc:
        raise _meta_error("device", f"id={raw_id!r}: {exc.message}") from None
    raw_type = str(elem.get("type") or "")
    if kind == "mdev" and not is_type_id(raw_type):
        raise _meta_error("device", f"type={raw_type!r}: not an mdev type id")
    if kind == "vf" and not (_SMALL_INT_RE.match(raw_type) and int(raw_type) > 0):
        raise _meta_error("device", f"type={raw_type!r}: not an NVIDIA vGPU type number")
    name = _meta_name(elem, "device", "name") if elem.get("name") is not None else None
    gpu = elem.get("gpu")
    if gpu is not None and not _VENDOR_DEVICE_RE.match(str(gpu)):
        raise _meta_error("device", f"gpu={gpu!r}: must be vendor:device (4 hex digits each)")
    return DeviceType(kind, ident, raw_type, name, None if gpu is None else str(gpu).lower())


def _device_type_element(rec: DeviceType) -> Element:
    elem = etree.Element(f"{{{GPULIB_NS}}}device", nsmap={"gpulib": GPULIB_NS})
    elem.set("kind", rec.kind)
    elem.set("id", rec.id)
    elem.set("type", rec.type_id)
    if rec.name is not None:
        elem.set("name", rec.name)
    if rec.gpu is not None:
        elem.set("gpu", rec.gpu)
    return elem


def derive_uuid(domain_uuid: str, index: int) -> str:
    """The UUID of the index-th on-demand vGPU of a domain, always the same.

    Deterministic so that a restarted hook, the qemu hook and the next start
    all name the same mdev without having to remember it.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"vGPU index must be a whole number >= 0, not {index!r}")
    canonical = _domain_uuid(domain_uuid)
    return _uuid5(DERIVED_UUID_NAMESPACE, f"{canonical}/{index}")


def _uuid5(namespace: str, name: str) -> str:
    """str(uuid.uuid5(UUID(namespace), name)) (RFC 4122 section 4.3), without
    the uuid and hashlib modules: a start computes these with the state lock
    held, and importing those (OpenSSL's libcrypto with them) costs more there
    than everything else it does."""
    try:
        from _sha1 import sha1  # CPython's own SHA-1, a small built-in module
    except ImportError:  # a build without it
        from hashlib import sha1
    digest = bytearray(sha1(bytes.fromhex(namespace.replace("-", ""))
                            + name.encode("utf-8")).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # the RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


__all__ = [
    "DERIVED_UUID_NAMESPACE",
    "GPULIB_NS",
    "MAX_XML_BYTES",
    "MAX_XML_NODES",
    "DeviceType",
    "Domain",
    "DomainXmlError",
    "GpuRequest",
    "GpuRequestItem",
    "Graphics",
    "Hostdev",
    "MdevHostdev",
    "PassthroughRequest",
    "PciHostdev",
    "VgpuRequest",
    "Video",
    "derive_uuid",
    "parse_domain",
]
