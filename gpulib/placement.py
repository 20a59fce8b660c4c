"""How a start edits the domain XML (the transformer, `gpulib attach`).

The XML side of a start (`gpulib.hooks.prepare`): the devices a metadata
request was given are inserted as hostdevs (mdev UUIDs, NVIDIA vendor VFs
unmanaged, whole GPUs managed), and a GPU's IOMMU-group endpoints (its HDMI
audio) are placed beside it, functions 1.. of its guest slot. Everything is
edited in place on the parsed tree (`gpulib.domain`): the rest of the XML
stays as it was.

`Placement` edits (the transformer's output is the XML the agent starts);
`FixedXml` is the same start's XML side under libvirt's `prepare begin` and
`restore begin`, whose stdout libvirt ignores: it edits nothing, and refuses
where the transformer would repair.
"""

from __future__ import annotations

from typing import Optional

from gpulib import logger
from gpulib.config import Config
from gpulib.domain import Domain, DomainXmlError, PciHostdev
from gpulib.errors import DeviceError
from gpulib.hostfacts import HostReader
from gpulib.occupancy import Occupancy
from gpulib.pci import PciAddress, libvirt_uint
from gpulib.plan import Action, AddGroupPeer, Refusals, UsePci, UseVf, plan_group_peers
from gpulib.state import Device, State
from gpulib.sysfs import Sysfs

log = logger.get(__name__)

AGENT_421_BUG = ("CloudStack 4.21 agent bug: a PCI domain other than 0000 rendered as "
                 "bus and slot (apache/cloudstack issue 12960)")
# The same rendering of a VF keeps only its PCI domain and bus: 0001:04:00.2
# becomes bus='0x0001' slot='0x04' function='0x0', like its PF and every VF
# beside it. The agent's LibvirtGpuDef was fixed for 4.22.1.
AGENT_LOST_VF = ("the CloudStack agent lost the VF's address (4.21 and 4.22.0 render "
                 "0001:04:00.2 as bus='0x0001' slot='0x04' function='0x0'); "
                 "upgrade the agent to 4.22.1 or later (apache/cloudstack pull 12981, "
                 "the PCI domain fix of LibvirtGpuDef)")

# Guest slots gpulib uses for a GPU that has no fixed guest address but needs
# its group peers beside it; low slots are left to the machine's own devices.
FIRST_GUEST_SLOT = 0x10


class Placement:
    """Edits one domain for one VM's start."""

    # A metadata request can be filled: its devices become new hostdevs.
    takes_new_devices = True

    def __init__(self, dom: Domain, vm: str, config: Config, reader: HostReader) -> None:
        self.dom = dom
        self.vm = vm
        self.config = config
        self.reader = reader

    def display_note(self, h: PciHostdev, addr: PciAddress) -> None:
        if h.display or h.ramfb:
            log.info("%s: display/ramfb on PCI hostdev %s has no effect (libvirt ignores "
                     "them for PCI devices)", self.vm, addr)

    # -- the devices the XML names -----------------------------------------------------------
    def repair_address(self, h: PciHostdev, fixed: PciAddress, literal: Optional[PciAddress],
                       written: str) -> None:
        """Point a hostdev CloudStack 4.21 rendered wrongly at the GPU it means
        (`written`: its attributes as the agent wrote them)."""
        h.address = fixed

    def peers_wanted(self) -> bool:
        """Whether a named GPU's IOMMU-group endpoints are added beside it."""
        return self.config.get_bool("transformer", "add_group_functions")

    def unmanage_vf(self, h: PciHostdev, addr: PciAddress) -> None:
        if h.managed:
            # libvirt would unbind the nvidia driver from a managed VF and
            # lose the vGPU: these VFs go to guests unmanaged.
            h.managed = False
            log.info("%s: NVIDIA vGPU VF %s set to managed='no'", self.vm, addr)

    def place_named(self, applied: list[tuple[Action, list[Device]]],
                    addresses: list[PciAddress]) -> list[Device]:
        """The XML side of the named devices' plan, once it is applied: every
        device made ready, in the plan's order, each GPU's group peers right
        after it (placed on the GPU's guest slot)."""
        hostdevs = self.dom.pci_hostdevs()
        devices: list[Device] = []
        for action, made in applied:
            devices += made
            if isinstance(action, UseVf):
                h, addr = hostdevs[action.at], addresses[action.at]
                self.display_note(h, addr)
                self.unmanage_vf(h, addr)
            elif isinstance(action, UsePci):
                h, addr = hostdevs[action.at], addresses[action.at]
                self.display_note(h, addr)
                peers = [a.address for a, _ in applied
                         if isinstance(a, AddGroupPeer) and a.gpu == action.address]
                if peers:
                    devices += self.place_peers(h, peers)
        return devices

    def record_types(self, sysfs: Sysfs, state: State, devices: list[Device]) -> None:
        """What each vGPU is, in the domain's metadata: it travels in the live
        XML, so a migration's destination gives the VM the same (gpulib.migration)."""
        if any(d.kind in ("mdev", "vf") for d in devices):
            from gpulib.devicetype import record_types

            record_types(sysfs, state, self.dom)

    def add_group_peers(self, h: PciHostdev, occ: Optional[Occupancy] = None
                         ) -> list[Device]:
        """Plan and place the group peers of one GPU hostdev (`occ`: who holds
        what; None where it is not known, as in an offline edit)."""
        named = {x.address for x in self.dom.pci_hostdevs()}
        members = self.reader.group_facts(h.address, named)
        if not members:
            return []
        refusals = None if occ is None else Refusals(
            occ, self.vm, strict=self.config.get_bool("transformer", "refuse_in_use"))
        peers = plan_group_peers(str(h.address), members, {str(a) for a in named}, refusals)
        return self.place_peers(h, [p.address for p in peers])

    def place_peers(self, h: PciHostdev, peers: list[str]) -> list[Device]:
        """Add the peers beside their GPU: functions 1.. of its guest slot."""
        guest = h.guest_address or PciAddress(0, 0, self.free_guest_slot(), 0)
        if guest.function != 0 or len(peers) > 7:
            log.warning("%s: cannot place the group peers of %s beside it", self.vm, h.address)
            return []
        h.set_guest_address(guest, multifunction=True)
        out = []
        for i, member in enumerate(peers, start=1):
            self.dom.add_pci_hostdev(PciAddress.parse(member), managed=h.managed,
                                     guest_address=PciAddress(guest.domain, guest.bus,
                                                              guest.slot, i))
            log.info("%s: added %s, in the IOMMU group of %s", self.vm, member, h.address)
            out.append(Device("pci", member))
        return out

    def free_guest_slot(self) -> int:
        used = set()
        for elem in self.dom.root.iter("address"):
            # Read as libvirt reads them (bus='00' is bus 0 too).
            if elem.get("type") == "pci" and libvirt_uint(elem.get("bus") or "0") == 0:
                slot = libvirt_uint(elem.get("slot") or "0")
                if slot is not None:
                    used.add(slot)
        for slot in range(FIRST_GUEST_SLOT, 0x1F):
            if slot not in used:
                return slot
        raise DeviceError(f"no free guest PCI slot on bus 0 for the GPU of {self.vm}")

    def insert(self, devices: list[Device], occ: Occupancy) -> list[Device]:
        """Put devices into the XML; returns the group peers added beside GPUs."""
        peers: list[Device] = []
        for d in devices:
            if d.kind == "mdev":
                if self.dom.find_mdev_hostdev(d.id) is None:
                    self.dom.add_mdev_hostdev(d.id, display="off")
            elif d.kind == "vf" and self.dom.find_pci_hostdev(PciAddress.parse(d.id)) is None:
                self.dom.add_pci_hostdev(PciAddress.parse(d.id), managed=False)
        # Whole GPUs first: their group peers go beside them, on the same slot.
        gpus = [d for d in devices if d.kind == "pci" and self.reader.is_gpu(d.id)]
        for d in gpus:
            addr = PciAddress.parse(d.id)
            if self.dom.find_pci_hostdev(addr) is None:
                h = self.dom.add_pci_hostdev(addr, managed=True)
                if self.config.get_bool("transformer", "add_group_functions"):
                    peers += self.add_group_peers(h, occ)
        for d in devices:
            if d.kind == "pci" and self.dom.find_pci_hostdev(PciAddress.parse(d.id)) is None:
                self.dom.add_pci_hostdev(PciAddress.parse(d.id), managed=True)
        known = {d.id for d in devices}
        return [p for p in peers if p.id not in known]


class FixedXml(Placement):
    """The XML side of libvirt's `prepare begin` / `restore begin`: libvirt
    starts the XML it passed (the hook's stdout is ignored), so it is never
    edited, and a request's devices cannot be added to it."""

    takes_new_devices = False

    def repair_address(self, h: PciHostdev, fixed: PciAddress, literal: Optional[PciAddress],
                       written: str) -> None:
        if literal is not None:
            # libvirt would give the VM the device the XML reads as.
            raise DomainXmlError(
                f"PCI hostdev <address {written}> names {literal}, not the GPU {fixed}: "
                f"{AGENT_421_BUG} (start it through the CloudStack transformer hook, or "
                "upgrade the agent)")

    def peers_wanted(self) -> bool:
        return False

    def unmanage_vf(self, h: PciHostdev, addr: PciAddress) -> None:
        pass  # libvirt gets the VF as the XML has it

    def record_types(self, sysfs: Sysfs, state: State, devices: list[Device]) -> None:
        pass

    def place_peers(self, h: PciHostdev, peers: list[str]) -> list[Device]:
        raise RuntimeError("the XML of a libvirt start is not edited")

    def insert(self, devices: list[Device], occ: Occupancy) -> list[Device]:
        raise RuntimeError("the XML of a libvirt start is not edited")
