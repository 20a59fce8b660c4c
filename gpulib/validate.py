"""The one rule each for the names gpulib takes from outside.

Every entry point (domain XML, the CLI, the state file, mdevctl definitions,
the hooks' argv) checks UUIDs, mdev type ids, PCI addresses and VM names here,
so they all accept and refuse the same strings (DESIGN sections 2 and 8):

* a UUID as the kernel's mdev `create` takes it: 8-4-4-4-12 hex digits,
  either case (gpulib stores and prints lowercase); no braces, no
  `urn:uuid:`, no blanks, no form without dashes;
* an mdev type id is a sysfs directory name, `<driver>-<name>`
  (`nvidia-231`, `i915-GVTg_V5_4`): letters, digits and `_.:+`, a `-` after
  a non-empty driver part, at most 128 characters, never `/` or `..`;
* a PCI address `dddd:bb:ss.f` (or lspci's `bb:ss.f`, domain 0), hex in
  either case: a domain up to 0xffffffff (libvirt's range; Linux names the
  devices behind an Intel VMD `10000:01:00.0`), a bus up to 0xff, a slot up
  to 0x1f, a function up to 7; printed as Linux names it, `%04x:%02x:%02x.%x`;
* a VM name: what libvirt can keep as `<name>.xml` and gpulib can print on
  one line (see `check_vm_name`).

The patterns compile on first use (lazyre): the hooks import this module.
"""

from __future__ import annotations

from gpulib.errors import InputError
from gpulib.lazyre import lazy

UUID_RE = lazy(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
HEX32_RE = lazy(r"[0-9a-fA-F]{32}")
TYPE_ID_RE = lazy(r"[A-Za-z0-9_.:+]+-[A-Za-z0-9_.:+-]+")
PCI_ADDRESS_RE = lazy(
    r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")
TYPE_ID_MAX = 128
MAX_PCI_DOMAIN = 0xFFFFFFFF
VM_NAME_MAX = 255


def show(text: str, limit: int = 64) -> str:
    """A short, one-line rendering of untrusted text for an error message."""
    if len(text) > limit:
        return repr(text[:limit]) + f"... ({len(text)} characters)"
    return repr(text)


def is_uuid(text: object) -> bool:
    return isinstance(text, str) and UUID_RE.fullmatch(text) is not None


def check_uuid(text: object, what: str = "UUID") -> str:
    """`text` as a canonical lowercase UUID, else InputError."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text, not {type(text).__name__}")
    if UUID_RE.fullmatch(text) is None:
        raise InputError(f"not a {what}: {show(text)} (expected 8-4-4-4-12 hex digits)")
    return text.lower()


def check_domain_uuid(text: object, what: str = "domain UUID") -> str:
    """A domain's own `<uuid>` in the forms libvirt reads (dashed, or 32 hex
    digits; blanks around it), as a canonical lowercase UUID. It names no
    device: it only seeds the derived vGPU UUIDs, which are then kernel UUIDs."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text, not {type(text).__name__}")
    plain = text.strip()
    if len(plain) == 32 and HEX32_RE.fullmatch(plain) is not None:
        h = plain.lower()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    if UUID_RE.fullmatch(plain) is None:
        raise InputError(f"{what} is not a UUID: {show(text)}")
    return plain.lower()


def is_type_id(text: object) -> bool:
    return isinstance(text, str) and len(text) <= TYPE_ID_MAX and ".." not in text and \
        TYPE_ID_RE.fullmatch(text) is not None


def check_type_id(text: object) -> str:
    """An mdev type id, safe as one path component; else InputError."""
    if not is_type_id(text):
        shown = show(text) if isinstance(text, str) else type(text).__name__
        raise InputError(f"not a vGPU type id: {shown} (expected <driver>-<name>: letters, "
                         f"digits, '_.:+-', at most {TYPE_ID_MAX} characters, no '/' or '..')")
    assert isinstance(text, str)
    return text


def pci_address_parts(text: object) -> tuple[int, int, int, int]:
    """(domain, bus, slot, function) of a PCI address, else InputError."""
    m = PCI_ADDRESS_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        shown = show(text) if isinstance(text, str) else type(text).__name__
        raise InputError(f"not a PCI address: {shown} (expected dddd:bb:ss.f)")
    domain = int(m.group(1) or "0", 16)
    slot = int(m.group(3), 16)
    if domain > MAX_PCI_DOMAIN or slot > 0x1F:
        raise InputError(f"PCI address out of range: {show(str(text))}")
    return domain, int(m.group(2), 16), slot, int(m.group(4))


def check_pci_address(text: object) -> str:
    """A PCI address as Linux names it in sysfs (lowercase, domain of 4 or more
    digits), else InputError."""
    domain, bus, slot, function = pci_address_parts(text)
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


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
