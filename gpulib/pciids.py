"""Vendor and device names as `lspci -nnm` prints them.

Sources, in order: udev's database entry for the device (what udev's hwdb
resolved at boot: `run/udev/data/+pci:<address>`); on the real root, udev's
hwdb queried through pyudev with the device's modalias; then a `pci.ids`
file below the root (`usr/share/misc`, `usr/share/hwdata`); then lspci's own
fallback `Device xxxx`. Reading the udev entry is what pyudev's
`Device.properties` does; reading the file directly avoids loading libudev
for the common case.

pci.ids is 1.3 MB; instead of parsing it whole we find the vendor block with
str.find and the device line inside it, which keeps a lookup well under a
millisecond.
"""

from __future__ import annotations

from gpulib.pci import PciAddress
from gpulib.sysfs import ATTRIBUTE_MAX, DOCUMENT_MAX, Sysfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

PCI_IDS_PATHS = ("usr/share/misc/pci.ids", "usr/share/hwdata/pci.ids", "usr/share/pci.ids")
# pci.ids names are below 100 characters; a longer one is garbage, cut.
NAME_MAX = 200


def clean_name(text: str) -> str:
    """A name fit for a report: printable characters only, bounded."""
    if len(text) <= NAME_MAX and text.isprintable():
        return text
    return "".join(c for c in text[:NAME_MAX] if c.isprintable()).strip()


class PciNames:
    def __init__(self, sysfs: Sysfs) -> None:
        self._sysfs = sysfs
        self._text: Optional[str] = None
        self._loaded = False
        self._vendor_blocks: dict[int, tuple[Optional[str], str]] = {}

    def _ids_text(self) -> str:
        if not self._loaded:
            self._loaded = True
            for rel in PCI_IDS_PATHS:
                # A FIFO, a directory or a 1 GB file in its place is skipped
                # (logged once): names fall back to the next source.
                data = self._sysfs.read_bytes(rel, DOCUMENT_MAX)
                if data is not None:
                    self._text = data.decode("utf-8", "replace")
                    break
        return self._text or ""

    def _udev(self, address: PciAddress) -> dict[str, str]:
        text = self._sysfs.read(f"run/udev/data/+pci:{address}", ATTRIBUTE_MAX)
        out: dict[str, str] = {}
        if text:
            for line in text.splitlines():
                if line.startswith("E:ID_") and "=" in line:
                    key, _, value = line[2:].partition("=")
                    out[key] = clean_name(value)
        if not out and self._sysfs.root == "/":
            out = hwdb_lookup(str(address))
        return out

    def _vendor_block(self, vendor: int) -> tuple[Optional[str], str]:
        cached = self._vendor_blocks.get(vendor)
        if cached is not None:
            return cached
        text = self._ids_text()
        key = f"\n{vendor:04x}  "
        start = text.find(key)
        if start < 0:
            result: tuple[Optional[str], str] = (None, "")
        else:
            line_end = text.find("\n", start + 1)
            name = text[start + len(key):line_end if line_end >= 0 else None].strip()
            # The block runs until the next line that does not start with a tab.
            pos = line_end
            while 0 <= pos < len(text) - 1:
                nxt = text[pos + 1]
                if nxt not in "\t#\n":
                    break
                pos = text.find("\n", pos + 1)
                if pos < 0:
                    pos = len(text)
            block = text[line_end:pos if pos >= 0 else None] if line_end >= 0 else ""
            result = (name, block)
        self._vendor_blocks[vendor] = result
        return result

    def vendor(self, vendor: int, address: Optional[PciAddress] = None) -> str:
        if address is not None:
            name = self._udev(address).get("ID_VENDOR_FROM_DATABASE")
            if name:
                return name
        found, _ = self._vendor_block(vendor)
        return clean_name(found) if found else f"Vendor {vendor:04x}"

    def device(self, vendor: int, device: int, address: Optional[PciAddress] = None) -> str:
        if address is not None:
            name = self._udev(address).get("ID_MODEL_FROM_DATABASE")
            if name:
                return name
        _, block = self._vendor_block(vendor)
        key = f"\n\t{device:04x}  "
        start = block.find(key)
        if start >= 0:
            end = block.find("\n", start + 1)
            return clean_name(block[start + len(key):end if end >= 0 else None].strip())
        return f"Device {device:04x}"


_hwdb: list[object] = []


def hwdb_lookup(address: str) -> dict[str, str]:
    """udev's properties of a PCI device (its hwdb names among them), through
    pyudev's public Device interface; {} when unavailable.

    libudev finds udev's database wherever this system keeps it; any failure
    (no libudev, no entry, another pyudev) falls back to pci.ids.
    """
    try:
        import pyudev

        if not _hwdb:
            _hwdb.append(pyudev.Context())
        device = pyudev.Devices.from_sys_path(_hwdb[0], f"/sys/bus/pci/devices/{address}")
        return {k: clean_name(v) for k, v in device.properties.items() if k.startswith("ID_")}
    except Exception:
        return {}
