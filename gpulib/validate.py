"""The one rule each for the names gpulib takes from outside.

Every entry point (domain XML, the CLI, the state file, mdevctl definitions,
the hooks' argv) checks UUIDs, mdev type ids, PCI addresses and VM names here,
so they all accept and refuse the same strings (ARCHITECTURE.md, "Bad input"):

* a UUID as the kernel's mdev `create` takes it: 8-4-4-4-12 hex digits,
  either case (gpulib stores and prints lowercase); no braces, no
  `urn:uuid:`, no blanks, no form without dashes (`check_uuid`). A UUID in
  domain XML is read as libvirt reads it (`libvirt_uuid`: 32 hex digits,
  dashes and blanks between pairs) and then stored in the canonical form;
* an mdev type id is a sysfs directory name, `<driver>-<name>`
  (`nvidia-231`, `i915-GVTg_V5_4`): letters, digits and `_.:+`, a `-` after
  a non-empty driver part, at most 128 characters, never `/` or `..`;
* a PCI address `dddd:bb:ss.f` (or lspci's `bb:ss.f`, domain 0), hex in
  either case: a domain up to 0xffffffff (libvirt's range; Linux names the
  devices behind an Intel VMD `10000:01:00.0`), a bus up to 0xff, a slot up
  to 0x1f, a function up to 7; printed as Linux names it, `%04x:%02x:%02x.%x`;
* a VM name: what libvirt can keep as `<name>.xml` and gpulib can print on
  one line (see `check_vm_name`);
* a number in a file, a link's name or an argument (a pid, an IOMMU group,
  a vGPU type id, a `virtfnN` index): ASCII decimal digits (`decimal`).

No regular expressions: string methods decide each rule in about the time
a compiled pattern takes, and compiling the patterns would cost a hook more
than parsing a whole state file, which it does under the state lock.
"""

from __future__ import annotations

from gpulib.errors import InputError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

TYPE_ID_MAX = 128
MAX_PCI_DOMAIN = 0xFFFFFFFF
VM_NAME_MAX = 255

_HEX = "0123456789abcdefABCDEF"
_LOWER_HEX = "0123456789abcdef"
_UUID_CHARS = _HEX + "-"
_LOWER_UUID_CHARS = _LOWER_HEX + "-"
_TYPE_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:+-")
_FUNCTIONS = "01234567"


def show(text: str, limit: int = 64) -> str:
    """A short, one-line rendering of untrusted text for an error message."""
    if len(text) > limit:
        return repr(text[:limit]) + f"... ({len(text)} characters)"
    return repr(text)


def decimal(text: object, digits: int) -> Optional[int]:
    """The number `text` writes in 1 to `digits` ASCII decimal digits, else
    None. str.isdigit() says yes to more: to "\u00b2", which int() refuses
    (a traceback, or a device left out), and to other scripts' digits,
    which int() reads (an argument "\u0665\u0669\u0664" taken as 594)."""
    if isinstance(text, str) and 0 < len(text) <= digits and text.isascii() and text.isdigit():
        return int(text)
    return None


def is_uuid(text: object) -> bool:
    """8-4-4-4-12 hex digits, either case."""
    # The dashes in their places and four in all: the other 32 characters are
    # then exactly the ones strip() must find to be hex digits.
    return isinstance(text, str) and len(text) == 36 and \
        text[8] == text[13] == text[18] == text[23] == "-" and text.count("-") == 4 \
        and not text.strip(_UUID_CHARS)


def is_canonical_uuid(text: object) -> bool:
    """A UUID in the form check_uuid returns it (lowercase): what gpulib stores."""
    return isinstance(text, str) and len(text) == 36 and \
        text[8] == text[13] == text[18] == text[23] == "-" and text.count("-") == 4 \
        and not text.strip(_LOWER_UUID_CHARS)


def check_uuid(text: object, what: str = "UUID") -> str:
    """`text` as a canonical lowercase UUID, else InputError."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text, not {type(text).__name__}")
    if not is_uuid(text):
        raise InputError(f"not a {what}: {show(text)} (expected 8-4-4-4-12 hex digits)")
    return text.lower()


_LOWER_HEX = "0123456789abcdef"

# ASCII white space as GLib's g_ascii_isspace takes it (libvirt's parser uses it).
_ASCII_SPACE = " \t\n\v\f\r"


def libvirt_uuid(text: object) -> Optional[str]:
    """`text` read as libvirt's virUUIDParse reads a UUID, in canonical form
    (lowercase, 8-4-4-4-12), or None when libvirt would refuse it.

    libvirt takes white space around the UUID and, between any two pairs of
    hex digits (never inside a pair), any number of '-' and ' ': exactly 32
    hex digits in all, either case. So `7F3A...` without dashes, in upper case
    or with dashes elsewhere names the same device as the canonical form, which
    is how libvirt writes it back (the status file, `virsh dumpxml`)."""
    if not isinstance(text, str) or len(text) > 4096:
        return None
    if len(text) == 36 and text[8] == text[13] == text[18] == text[23] == "-" and not (
            text[:8] + text[9:13] + text[14:18] + text[19:23] + text[24:]).strip(_LOWER_HEX):
        # Already canonical, as libvirt and gpulib write it: most UUIDs read
        # (a start reads one per running domain from the status-file cache).
        return text
    digits: list[str] = []
    body = text.strip(_ASCII_SPACE)
    i, n = 0, len(body)
    while len(digits) < 16:  # pairs
        if i >= n:
            return None
        c = body[i]
        if c in "- ":
            i += 1
            continue
        pair = body[i:i + 2]
        if len(pair) != 2 or pair.strip(_HEX):
            return None
        digits.append(pair.lower())
        i += 2
    if i != n:
        return None  # more than 32 digits, or a separator after the last pair
    h = "".join(digits)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def check_domain_uuid(text: object, what: str = "domain UUID") -> str:
    """A domain's own `<uuid>` in the forms libvirt reads, as a canonical lowercase
    UUID. It names no device: it only seeds the derived vGPU UUIDs."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text, not {type(text).__name__}")
    found = libvirt_uuid(text)
    if found is None:
        raise InputError(f"{what} is not a UUID: {show(text)}")
    return found


def is_type_id(text: object) -> bool:
    """`<driver>-<name>`: a non-empty driver part without '-', then a '-' and at
    least one more character, all of them letters, digits or '_.:+-'."""
    if not isinstance(text, str) or len(text) > TYPE_ID_MAX or ".." in text:
        return False
    dash = text.find("-")
    return 1 <= dash < len(text) - 1 and _TYPE_ID_CHARS.issuperset(text)


def check_type_id(text: object) -> str:
    """An mdev type id, safe as one path component; else InputError."""
    if not is_type_id(text):
        shown = show(text) if isinstance(text, str) else type(text).__name__
        raise InputError(f"not a vGPU type id: {shown} (expected <driver>-<name>: letters, "
                         f"digits, '_.:+-', at most {TYPE_ID_MAX} characters, no '/' or '..')")
    assert isinstance(text, str)
    return text


def _hex_field(text: str, most: int) -> bool:
    return 0 < len(text) <= most and not text.strip(_HEX)


def pci_address_parts(text: object) -> tuple[int, int, int, int]:
    """(domain, bus, slot, function) of a PCI address, else InputError."""
    fields: list[str] = []
    if isinstance(text, str) and len(text) >= 5 and text[-2] == "." and text[-1] in _FUNCTIONS:
        fields = text[:-2].split(":")
        if len(fields) == 2:
            fields.insert(0, "0")  # lspci's form: domain 0
    if len(fields) != 3 or not (_hex_field(fields[0], 8) and _hex_field(fields[1], 2)
                                and _hex_field(fields[2], 2)):
        shown = show(text) if isinstance(text, str) else type(text).__name__
        raise InputError(f"not a PCI address: {shown} (expected dddd:bb:ss.f)")
    assert isinstance(text, str)
    domain = int(fields[0], 16)
    slot = int(fields[2], 16)
    if domain > MAX_PCI_DOMAIN or slot > 0x1F:
        raise InputError(f"PCI address out of range: {show(text)}")
    return domain, int(fields[1], 16), slot, int(text[-1])


def check_pci_address(text: object) -> str:
    """A PCI address as Linux names it in sysfs (lowercase, domain of 4 or more
    digits), else InputError."""
    domain, bus, slot, function = pci_address_parts(text)
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def is_canonical_pci_address(text: object) -> bool:
    """A PCI address in the form check_pci_address returns it: what gpulib stores."""
    if not isinstance(text, str):
        return False
    d = len(text) - 8  # the domain's digits: 4, or 5 to 8 without a leading zero
    return 4 <= d <= 8 and text[d] == ":" and text[d + 3] == ":" and text[d + 6] == "." \
        and text[d + 4] in "01" and text[-1] in _FUNCTIONS and (d == 4 or text[0] != "0") \
        and not (text[:d] + text[d + 1:d + 3] + text[d + 5]).strip(_LOWER_HEX)


def is_plain_vm_name(name: object) -> bool:
    """The common case, decided at once: ASCII text of 1..255 characters with no
    '/' and no control character, not '.' or '..' (check_vm_name accepts it;
    anything else goes through its checks, which name the problem)."""
    # (For ASCII, printable means no C0 control character and no DEL.)
    return type(name) is str and 0 < len(name) <= VM_NAME_MAX and name.isascii() \
        and name.isprintable() and "/" not in name and name != "." and name != ".."


def check_vm_name(name: object) -> str:
    """Return `name` if it is usable as a VM name, else raise InputError.

    Refused: non-strings, the empty name, `.` and `..`, names containing `/`,
    a newline, NUL or any other control or line-break character (C0, DEL, C1,
    U+2028, U+2029: the name appears in one-line messages), names that are not valid
    UTF-8 text, and names longer than 255 characters (or 255 bytes in UTF-8:
    libvirt keeps `<name>.xml` files, and file names stop at 255 bytes).
    """
    if is_plain_vm_name(name):
        return name  # type: ignore[return-value]  # a str, checked above
    return vm_name_checks(name)


def vm_name_checks(name: object) -> str:
    """check_vm_name's checks one by one, each with its own message."""
    if not isinstance(name, str):
        raise InputError(f"VM name must be text, not {type(name).__name__}")
    if not name:
        raise InputError("VM name is empty")
    if len(name) > VM_NAME_MAX:
        raise InputError(f"VM name is longer than {VM_NAME_MAX} characters: {show(name)}")
    if "/" in name:
        raise InputError(f"VM name contains '/': {show(name)}")
    if "\n" in name or "\r" in name:
        raise InputError(f"VM name contains a newline: {show(name)}")
    if "\x00" in name:
        raise InputError(f"VM name contains a NUL character: {show(name)}")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" for c in name):
        raise InputError(f"VM name contains a control character: {show(name)}")
    if name in (".", ".."):
        raise InputError(f"VM name cannot be {name!r}")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"VM name is not valid UTF-8: {show(name)}") from None
    if len(encoded) > VM_NAME_MAX:
        raise InputError(f"VM name is longer than {VM_NAME_MAX} bytes in UTF-8: {show(name)}")
    return name
