"""The domain XML a CloudStack KVM agent with GPU support sends on a live
migration, built as the agent builds it (docs/cloudstack.md, "Live migration").

`LibvirtMigrateCommandWrapper.updateGpuDevicesIfNeeded` (apache/cloudstack,
4.21.0.0 on) takes the source's migratable XML, removes from the first
`<devices>` every `<hostdev>` whose `type` is `pci` or `mdev` and whose
`mode` is `subsystem` (the element only: the blank text around it stays,
as a W3C DOM removal leaves it), appends one `<hostdev>` per device the
management server allocated on the destination, rendered by `LibvirtGpuDef`
and parsed into the document, and writes the document with the JDK's
identity Transformer: an XML declaration with `standalone="no"` directly
followed by the root, attributes in double quotes and in the order the DOM
keeps them (by name).

`LibvirtGpuDef` renders (single quotes, two-space indentation, no guest
`<address>`):
* an mdev: `<hostdev mode='subsystem' type='mdev' model='vfio-pci'
  display='off'>` (with display: `display='on' ramfb='on'`) around
  `<source><address uuid='...'/></source>`;
* a PCI device: `managed='no'` for vendor 10de unless the profile is
  `passthrough`, `display='off'` (or `display='on' ramfb='on'`), a
  `<driver name='vfio'/>`, and the address: in 4.21 and 4.22.0 the bus
  address split at `:` (domain always 0x0000, the first part as the bus),
  in 4.22.1 on each part parsed (`%04x`, `%02x`, `%02x`, `%x`).
"""

from __future__ import annotations

from typing import NamedTuple

from lxml import etree

RELEASES = ("4.21", "4.22.1")  # 4.22.0 renders as 4.21


class GpuDevice(NamedTuple):
    """One `VgpuTypesInfo` the management server sends (`GPUDeviceTO`)."""

    bus_address: str  # an mdev's UUID, or the PCI address as discovery reported it
    mdev: bool = False
    model: str = "NVIDIA A10-2Q"  # the profile; 'passthrough' for a whole GPU
    vendor: str = "10de"
    display: bool = False


def gpu_def(dev: GpuDevice, release: str) -> str:
    """`LibvirtGpuDef.toString()` of one device."""
    if dev.mdev:
        display = "on' ramfb='on" if dev.display else "off"
        return (f"<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='{display}'>\n"
                "  <source>\n"
                f"    <address uuid='{dev.bus_address}'/>\n"
                "  </source>\n"
                "</hostdev>\n")
    managed = "no" if dev.vendor == "10de" and dev.model != "passthrough" else "yes"
    head = f"<hostdev mode='subsystem' type='pci' managed='{managed}'"
    head += " display='on' ramfb='on'>\n" if dev.display else " display='off'>\n"
    if release == "4.21":
        domain, bus, slot, function = "0x0000", "0x00", "0x00", "0x0"
        parts = dev.bus_address.split(":")
        if len(parts) > 1:
            bus = "0x" + parts[0]
            sf = parts[1].split(".")
            slot = "0x" + sf[0]
            if len(sf) > 1:
                function = "0x" + sf[1].strip()
    else:
        parts = dev.bus_address.split(":")
        dom_part = int(parts[0], 16) if len(parts) == 3 else 0
        bus_part, sf = parts[-2], parts[-1].split(".")
        domain, bus = f"0x{dom_part:04x}", f"0x{int(bus_part, 16):02x}"
        slot, function = f"0x{int(sf[0], 16):02x}", f"0x{int(sf[1], 16):x}"
    return (head + "  <driver name='vfio'/>\n"
            "  <source>\n"
            f"    <address domain='{domain}' bus='{bus}' slot='{slot}' function='{function}'/>\n"
            "  </source>\n"
            "</hostdev>\n")


def _remove_element_only(elem: etree._Element) -> None:
    """Remove `elem` and keep the text after it, as a DOM removeChild does."""
    parent = elem.getparent()
    assert parent is not None
    tail = elem.tail or ""
    prev = elem.getprevious()
    if prev is not None:
        prev.tail = (prev.tail or "") + tail
    else:
        parent.text = (parent.text or "") + tail
    parent.remove(elem)


def _sorted_attributes(root: etree._Element) -> None:
    for elem in root.iter():
        if not isinstance(elem.tag, str):
            continue
        items = sorted(elem.attrib.items())
        elem.attrib.clear()
        for k, v in items:
            elem.set(k, v)


def rewrite(xml: str, devices: list[GpuDevice], release: str = "4.21") -> str:
    """The XML `updateGpuDevicesIfNeeded` makes of the source's `xml`."""
    if release not in RELEASES:
        raise ValueError(f"release {release!r}: one of {RELEASES}")
    root = etree.fromstring(xml.encode())
    devices_elem = root.find("devices")
    assert devices_elem is not None
    for h in list(devices_elem.iter("hostdev")):
        if h.get("type") in ("pci", "mdev") and h.get("mode") == "subsystem":
            _remove_element_only(h)
    for dev in devices:
        devices_elem.append(etree.fromstring(gpu_def(dev, release).encode()))
    _sorted_attributes(root)
    body = etree.tostring(root, encoding="unicode")
    return '<?xml version="1.0" encoding="UTF-8" standalone="no"?>' + body
