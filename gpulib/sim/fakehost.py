"""Build fake hosts laid out the way the kernel and libvirt lay out a real one.

Every link is a real relative symlink, as sysfs has them: the bus view
`sys/bus/pci/devices/<bdf>` points into `sys/devices/pci<dddd:bb>/...`,
functions have `driver`, `iommu_group`, `physfn`/`virtfnN` links, mdev parents
appear under `sys/class/mdev_bus`, live mdevs under `sys/bus/mdev/devices`.
Tests, the demo and `gpulib snapshot` replay all use this builder; the
simulated kernel (`gpulib.sim.kernel`) then acts on such trees, or on any
tree shaped like sysfs.

Methods are named by intent (`add_gpu`, `populate_mdev_parent`,
`enable_sriov`, `add_running_domain`) so a test reads as the host it builds.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Union

from gpulib.pci import PciAddress, group_number
from gpulib.sim.attrs import MDEV_ATTRS_SPEC, make_attr_files, relative_symlink
from gpulib.sim.attrs import write_file as _write

Addr = Union[str, PciAddress]

PCI_IDS_HEADER = "# pci.ids subset written by gpulib's fake host builder\n"

# NVIDIA's tool below the root (where the vGPU manager installs it), what it
# prints for `vgpu -s -v`, and the record of its calls.
NVIDIA_SMI = "usr/bin/nvidia-smi"
NVIDIA_SMI_OUTPUT = "usr/share/gpulib-sim/nvidia-smi-vgpu-s-v.txt"
NVIDIA_SMI_QUERY = "usr/share/gpulib-sim/nvidia-smi-q.txt"
NVIDIA_SMI_CALLS = "run/gpulib-sim/nvidia-smi.calls"
NVIDIA_SMI_BEHAVIOURS = ("answer", "fail", "hang")
NVIDIA_DRIVER = "580.105.06"


def _addr(a: Addr) -> PciAddress:
    return a if isinstance(a, PciAddress) else PciAddress.parse(a)


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


class FakeHost:
    """A host tree below `root`. All addresses are `dddd:bb:ss.f` strings or PciAddress."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self._next_group = 0
        self._groups_listed = False
        self._names: dict[int, tuple[str, dict[int, str]]] = {}
        os.makedirs(self.p("sys/bus/pci/devices"), exist_ok=True)
        os.makedirs(self.p("sys/kernel/iommu_groups"), exist_ok=True)
        os.makedirs(self.p("sys/class/mdev_bus"), exist_ok=True)
        os.makedirs(self.p("run/libvirt/qemu"), exist_ok=True)
        os.makedirs(self.p("etc/libvirt/qemu"), exist_ok=True)
        if not os.path.exists(self.p("proc/cmdline")):
            self.set_cmdline("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet intel_iommu=on iommu=pt")

    # -- paths -----------------------------------------------------------------
    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def device_dir(self, address: Addr) -> str:
        """Canonical directory of a function (follows the bus link)."""
        return os.path.realpath(self.p(f"sys/bus/pci/devices/{_addr(address)}"))

    def new_iommu_group(self) -> int:
        """A group number no group of the tree has: past every group when first
        asked, then the next free one (listing the groups at every call made
        building a large host quadratic in its devices)."""
        base = self.p("sys/kernel/iommu_groups")
        if not self._groups_listed:
            existing = [n for n in map(group_number, os.listdir(base)) if n is not None]
            self._next_group = max([self._next_group, *[g + 1 for g in existing]])
            self._groups_listed = True
        while os.path.lexists(os.path.join(base, str(self._next_group))):
            self._next_group += 1  # made since by another hand (the simulated kernel)
        group = self._next_group
        self._next_group += 1
        return group

    # -- names (a pci.ids subset under the root) ----------------------------------
    def name_ids(self, vendor: int, vendor_name: str, device: int, device_name: str) -> None:
        entry = self._names.setdefault(vendor, (vendor_name, {}))
        entry[1][device] = device_name
        lines = [PCI_IDS_HEADER]
        for v in sorted(self._names):
            vname, devs = self._names[v]
            lines.append(f"{v:04x}  {vname}\n")
            for d in sorted(devs):
                lines.append(f"\t{d:04x}  {devs[d]}\n")
        _write(self.p("usr/share/misc/pci.ids"), "".join(lines))

    # -- PCI topology ------------------------------------------------------------
    def add_function(self, address: Addr, vendor: int, device: int, klass: int,
                     driver: Optional[str] = None, iommu_group: Optional[int] = None,
                     numa_node: int = -1, parent: Optional[Addr] = None,
                     subsystem: tuple[int, int] = (0, 0), revision: int = 0xA1,
                     vendor_name: Optional[str] = None,
                     device_name: Optional[str] = None,
                     host_bridge: Optional[str] = None) -> str:
        """Add a PCI function (below a bridge `parent`, or the host bridge).

        `host_bridge` (e.g. `pci0000:3b`): the root bus directory when it is not
        the function's own bus, as for a VF the kernel put on a bus of its own
        below a PF on the root bus."""
        a = _addr(address)
        if parent is not None:
            base = self.device_dir(parent)
        else:
            base = self.p(f"sys/devices/{host_bridge or f'pci{a.domain:04x}:{a.bus:02x}'}")
        d = os.path.join(base, str(a))
        os.makedirs(d, exist_ok=True)
        attrs = {
            "vendor": f"0x{vendor:04x}", "device": f"0x{device:04x}", "class": f"0x{klass:06x}",
            "subsystem_vendor": f"0x{subsystem[0]:04x}",
            "subsystem_device": f"0x{subsystem[1]:04x}",
            "revision": f"0x{revision:02x}", "numa_node": str(numa_node),
            "enable": "1", "reset_method": "flr",
            "modalias": f"pci:v{vendor:08X}d{device:08X}sv{subsystem[0]:08X}"
                        f"sd{subsystem[1]:08X}bc{klass >> 16:02X}sc{(klass >> 8) & 0xFF:02X}"
                        f"i{klass & 0xFF:02X}",
        }
        for name, value in attrs.items():
            _write(os.path.join(d, name), value + "\n")
        uevent = [f"PCI_CLASS={klass:X}", f"PCI_ID={vendor:04X}:{device:04X}",
                  f"PCI_SUBSYS_ID={subsystem[0]:04X}:{subsystem[1]:04X}", f"PCI_SLOT_NAME={a}"]
        if driver:
            uevent.insert(0, f"DRIVER={driver}")
        _write(os.path.join(d, "uevent"), "\n".join(uevent) + "\n")
        relative_symlink(d, self.p(f"sys/bus/pci/devices/{a}"))
        relative_symlink(self.p("sys/bus/pci"), os.path.join(d, "subsystem"))
        if driver:
            self.bind_driver(a, driver)
        if iommu_group is not None:
            self.set_iommu_group(a, iommu_group)
        if vendor_name and device_name:
            self.name_ids(vendor, vendor_name, device, device_name)
        return d

    def add_bridge(self, address: Addr, parent: Optional[Addr] = None,
                   vendor: int = 0x8086, device: int = 0x2030, numa_node: int = -1,
                   iommu_group: Optional[int] = None) -> str:
        """A PCIe root port or switch port (class 0x0604) that GPUs sit behind."""
        return self.add_function(address, vendor, device, 0x060400, driver="pcieport",
                                 numa_node=numa_node, parent=parent, iommu_group=iommu_group)

    def bind_driver(self, address: Addr, driver: Optional[str]) -> None:
        a = _addr(address)
        d = self.device_dir(a)
        link = os.path.join(d, "driver")
        if os.path.lexists(link):
            old = os.path.basename(os.readlink(link))
            back = self.p(f"sys/bus/pci/drivers/{old}/{a}")
            if os.path.lexists(back):
                os.unlink(back)
            os.unlink(link)
        if driver:
            drv = self.p(f"sys/bus/pci/drivers/{driver}")
            os.makedirs(drv, exist_ok=True)
            relative_symlink(drv, link)
            relative_symlink(d, os.path.join(drv, str(a)))

    def set_iommu_group(self, address: Addr, group: int) -> None:
        a = _addr(address)
        d = self.device_dir(a)
        old = os.path.join(d, "iommu_group")
        if os.path.lexists(old):
            # Moved: the old group no longer lists it.
            back = os.path.join(os.path.realpath(old), "devices", str(a))
            if os.path.lexists(back):
                os.unlink(back)
        g = self.p(f"sys/kernel/iommu_groups/{group}")
        os.makedirs(os.path.join(g, "devices"), exist_ok=True)
        _write(os.path.join(g, "type"), "DMA\n")
        relative_symlink(g, os.path.join(d, "iommu_group"))
        relative_symlink(d, os.path.join(g, "devices", str(a)))
        self._next_group = max(self._next_group, group + 1)

    # -- SR-IOV ------------------------------------------------------------------
    def set_sriov_capability(self, pf: Addr, totalvfs: int, vf_device: int,
                             offset: int = 1, stride: int = 1) -> None:
        """The PF's SR-IOV attributes, before any VF exists (sriov_numvfs 0)."""
        d = self.device_dir(pf)
        for name, value in (("sriov_totalvfs", totalvfs), ("sriov_numvfs", 0),
                            ("sriov_offset", offset), ("sriov_stride", stride)):
            _write(os.path.join(d, name), f"{value}\n")
        _write(os.path.join(d, "sriov_vf_device"), f"{vf_device:x}\n")
        _write(os.path.join(d, "sriov_drivers_autoprobe"), "1\n")

    def vf_address(self, pf: Addr, index: int) -> PciAddress:
        """Routing-ID arithmetic the kernel uses: PF rid + offset + index * stride."""
        a = _addr(pf)
        d = self.device_dir(a)
        with open(os.path.join(d, "sriov_offset")) as fh:
            offset = int(fh.read())
        with open(os.path.join(d, "sriov_stride")) as fh:
            stride = int(fh.read())
        rid = (a.bus << 8 | a.slot << 3 | a.function) + offset + index * stride
        return PciAddress(a.domain, rid >> 8, (rid >> 3) & 0x1F, rid & 7)

    def enable_sriov(self, pf: Addr, numvfs: int, vf_driver: Optional[str] = None) -> list[str]:
        """Create `numvfs` VFs as the kernel does on `echo N > sriov_numvfs`."""
        a = _addr(pf)
        d = self.device_dir(a)

        def read(name: str) -> str:
            with open(os.path.join(d, name)) as fh:
                return fh.read().strip()

        vendor = int(read("vendor"), 16)
        klass = int(read("class"), 16)
        numa = int(read("numa_node"))
        vf_device = int(read("sriov_vf_device"), 16)
        subsystem = (int(read("subsystem_vendor"), 16), int(read("subsystem_device"), 16))
        parent_dir = os.path.dirname(d)
        # VFs sit beside their PF, below the same bridge, whatever bus their
        # routing IDs fall on (the kernel adds a virtual bus for those past the
        # PF's own).
        on_root = os.path.basename(parent_dir).startswith("pci")
        out = []
        for i in range(numvfs):
            va = self.vf_address(a, i)
            self.add_function(va, vendor, vf_device, klass, driver=vf_driver,
                              iommu_group=self.new_iommu_group(), numa_node=numa,
                              parent=None if on_root else os.path.basename(parent_dir),
                              host_bridge=os.path.basename(parent_dir) if on_root else None,
                              subsystem=(subsystem[0], 0))
            relative_symlink(d, os.path.join(self.device_dir(va), "physfn"))
            relative_symlink(self.device_dir(va), os.path.join(d, f"virtfn{i}"))
            out.append(str(va))
        _write(os.path.join(d, "sriov_numvfs"), f"{numvfs}\n")
        return out

    def renumber_vfs(self, pf: Addr, links: dict[int, Addr]) -> None:
        """Replace the PF's `virtfnN` links by `links` (index -> VF address): the
        numbering some hosts show, with gaps or out of address order."""
        d = self.device_dir(pf)
        for name in os.listdir(d):
            if name.startswith("virtfn"):
                os.unlink(os.path.join(d, name))
        for index, vf in links.items():
            relative_symlink(self.device_dir(vf), os.path.join(d, f"virtfn{index}"))

    # -- mdev ---------------------------------------------------------------------
    def populate_mdev_parent(self, parent: Addr, types: list[dict[str, object]]) -> None:
        """Make `parent` an mdev parent offering `types`.

        Each type: {"type_id", "name" (optional), "description" (optional),
        "available_instances", "device_api" (default vfio-pci)}.
        """
        a = _addr(parent)
        d = self.device_dir(a)
        supported = os.path.join(d, "mdev_supported_types")
        os.makedirs(supported, exist_ok=True)
        for t in types:
            td = os.path.join(supported, str(t["type_id"]))
            for made in (td, os.path.join(td, "devices")):
                try:
                    os.mkdir(made)
                except FileExistsError:
                    pass
            if t.get("name") is not None:
                _write(os.path.join(td, "name"), f"{t['name']}\n", 0o444)
            if t.get("description") is not None:
                _write(os.path.join(td, "description"), f"{t['description']}\n", 0o444)
            _write(os.path.join(td, "available_instances"),
                   f"{t.get('available_instances', 1)}\n", 0o444)
            _write(os.path.join(td, "device_api"), f"{t.get('device_api', 'vfio-pci')}\n", 0o444)
            _write(os.path.join(td, "create"), "", 0o200)
        relative_symlink(d, self.p(f"sys/class/mdev_bus/{a}"))

    def add_mdev_attributes(self, parent: Addr, type_id: str, attrs: dict[str, str]) -> None:
        """Devices of this type get attribute files: name (may hold a '/') -> the
        regular expression of the values the driver accepts (others: EINVAL)."""
        td = os.path.join(self.device_dir(_addr(parent)), "mdev_supported_types", type_id)
        _write(os.path.join(td, MDEV_ATTRS_SPEC), json.dumps(attrs, sort_keys=True) + "\n")

    def add_mdev(self, uuid: str, parent: Addr, type_id: str,
                 consume: bool = True) -> str:
        """A live mdev as the kernel creates it (links, remove, iommu group)."""
        a = _addr(parent)
        d = self.device_dir(a)
        td = os.path.join(d, "mdev_supported_types", type_id)
        md = os.path.join(d, uuid)
        os.makedirs(md, exist_ok=True)
        relative_symlink(td, os.path.join(md, "mdev_type"))
        _write(os.path.join(md, "remove"), "", 0o200)
        _write(os.path.join(md, "uevent"), f"MDEV_TYPE={type_id}\n")
        drv = self.p("sys/bus/mdev/drivers/vfio_mdev")
        os.makedirs(drv, exist_ok=True)
        relative_symlink(drv, os.path.join(md, "driver"))
        relative_symlink(self.p("sys/bus/mdev"), os.path.join(md, "subsystem"))
        self.set_mdev_group(md, self.new_iommu_group())
        relative_symlink(md, self.p(f"sys/bus/mdev/devices/{uuid}"))
        relative_symlink(md, os.path.join(td, "devices", uuid))
        make_attr_files(md, td)
        if consume:
            avail = os.path.join(td, "available_instances")
            with open(avail) as fh:
                n = int(fh.read().strip() or 0)
            _write(avail, f"{max(n - 1, 0)}\n", 0o444)
        return md

    def set_mdev_group(self, mdev_dir: str, group: int) -> None:
        g = self.p(f"sys/kernel/iommu_groups/{group}")
        os.makedirs(os.path.join(g, "devices"), exist_ok=True)
        relative_symlink(g, os.path.join(mdev_dir, "iommu_group"))
        relative_symlink(mdev_dir, os.path.join(g, "devices", os.path.basename(mdev_dir)))

    # -- NVIDIA vendor-specific vGPU -------------------------------------------------
    def add_nvidia_vf_types(self, vf: Addr, types: dict[int, str], current: int = 0,
                            extra_files: bool = True, instance_files: bool = False) -> None:
        """`nvidia/creatable_vgpu_types` and `current_vgpu_type` on a VF;
        `instance_files`: also `gpu_instance_id` and `placement_id`, as newer
        drivers have them (the GPU instance a MIG-backed vGPU runs on)."""
        d = os.path.join(self.device_dir(vf), "nvidia")
        lines = ["ID    : vGPU Name"] + [f"{tid:<5d} : {name}" for tid, name in types.items()]
        _write(os.path.join(d, "creatable_vgpu_types"), "\n".join(lines) + "\n", 0o444)
        _write(os.path.join(d, "current_vgpu_type"), f"{current}\n", 0o644)
        if extra_files:
            _write(os.path.join(d, "vgpu_params"), "", 0o644)
        if instance_files:
            from gpulib.sim.migdriver import IDLE_GPU_INSTANCE

            _write(os.path.join(d, "gpu_instance_id"), IDLE_GPU_INSTANCE + "\n", 0o644)
            _write(os.path.join(d, "placement_id"), "0\n", 0o644)

    # -- NVIDIA's tool -----------------------------------------------------------------
    def install_nvidia_smi(self, output: str, behaviour: str = "answer",
                           driver: str = NVIDIA_DRIVER) -> None:
        """`usr/bin/nvidia-smi` as the NVIDIA vGPU manager installs it, and the
        loaded driver's version (`sys/module/nvidia/version`). `answer`: prints
        `output` for `nvidia-smi vgpu -s -v` and the GPUs' `-q` (MIG mode
        N/A), and refuses other arguments; on a host with a MIG-capable GPU
        it is `gpulib.sim.nvidia_smi`, which also answers `mig`); `fail`:
        what it prints when it cannot reach the driver (exit 9); `hang`:
        never answers. Each call is appended to NVIDIA_SMI_CALLS."""
        if behaviour not in NVIDIA_SMI_BEHAVIOURS:
            raise ValueError(f"unknown nvidia-smi behaviour {behaviour!r} "
                             f"(known: {', '.join(NVIDIA_SMI_BEHAVIOURS)})")
        _write(self.p(NVIDIA_SMI_OUTPUT), output)
        os.makedirs(os.path.dirname(self.p(NVIDIA_SMI_CALLS)), exist_ok=True)
        version = self.p("sys/module/nvidia/version")
        if os.path.lexists(version):
            os.unlink(version)  # read-only, as the kernel has it
        _write(version, driver + "\n", 0o444)
        from gpulib.sim import nvidia_smi

        found = nvidia_smi.gpus(self.root)
        _write(self.p(NVIDIA_SMI_QUERY), nvidia_smi.query(self.root, found, found))
        body = {
            "answer": (f'if [ "$*" = "vgpu -s -v" ]; then\n'
                       f'    cat "$root/{NVIDIA_SMI_OUTPUT}"\n    exit 0\nfi\n'
                       f'if [ "$*" = "-q" ]; then\n'
                       f'    cat "$root/{NVIDIA_SMI_QUERY}"\n    exit 0\nfi\n'
                       "echo \"Invalid combination of input arguments. Please run "
                       "'nvidia-smi -h' for help.\"\nexit 2\n"),
            "fail": ("echo \"NVIDIA-SMI has failed because it couldn't communicate with the "
                     "NVIDIA driver. Make sure that the latest NVIDIA driver is installed "
                     "and running.\"\nexit 9\n"),
            "hang": "exec sleep 120\n",
        }[behaviour]
        if behaviour == "answer" and self.mig_gpus():
            # The simulator's tool, in the interpreter (and gpulib) that built the host.
            import sys

            import gpulib

            package_dir = os.path.dirname(os.path.dirname(os.path.abspath(gpulib.__file__)))
            body = (f"PYTHONPATH={_sh_quote(package_dir)}\nexport PYTHONPATH\n"
                    f"exec {_sh_quote(sys.executable)} -m gpulib.sim.nvidia_smi "
                    '"$root" "$@"\n')
        _write(self.p(NVIDIA_SMI), "#!/bin/sh\n"
               "# nvidia-smi as gpulib's simulator fakes it (FakeHost.install_nvidia_smi).\n"
               'root=$(cd "$(dirname "$0")/../.." && pwd)\n'
               f'echo "$*" >> "$root/{NVIDIA_SMI_CALLS}"\n' + body, 0o755)

    def mig_gpus(self) -> list[str]:
        """The physical functions with the simulator's MIG state (`gpulib.sim.migdriver`)."""
        from gpulib.sim.migdriver import STATE_FILE

        base = self.p("sys/bus/pci/devices")
        return [a for a in sorted(os.listdir(base))
                if os.path.exists(os.path.join(base, a, STATE_FILE))]

    def nvidia_smi_calls(self) -> list[str]:
        """The arguments of each call of the fake nvidia-smi so far."""
        try:
            with open(self.p(NVIDIA_SMI_CALLS), encoding="utf-8") as fh:
                return fh.read().splitlines()
        except FileNotFoundError:
            return []

    # -- host files -----------------------------------------------------------------
    def set_cmdline(self, cmdline: str) -> None:
        _write(self.p("proc/cmdline"), cmdline + "\n", 0o444)

    def load_module(self, name: str) -> None:
        os.makedirs(self.p(f"sys/module/{name}"), exist_ok=True)

    def add_iommu_unit(self, name: str = "dmar0") -> None:
        os.makedirs(self.p(f"sys/class/iommu/{name}"), exist_ok=True)

    def write_file(self, rel: str, content: str, mode: int = 0o644) -> None:
        _write(self.p(rel), content, mode)

    # -- libvirt domains ----------------------------------------------------------------
    @staticmethod
    def domain_xml(name: str, uuid: str, pci: tuple[Addr, ...] = (),
                   mdevs: tuple[str, ...] = (), domain_id: Optional[int] = None,
                   vnc_password: Optional[str] = None, managed: bool = True) -> str:
        hostdevs = []
        for a in pci:
            lv = _addr(a).libvirt()
            flag = "yes" if managed else "no"
            hostdevs.append(
                f"    <hostdev mode='subsystem' type='pci' managed='{flag}'>\n"
                "      <driver name='vfio'/>\n      <source>\n"
                f"        <address domain='{lv['domain']}' bus='{lv['bus']}' "
                f"slot='{lv['slot']}' function='{lv['function']}'/>\n"
                "      </source>\n    </hostdev>\n")
        for u in mdevs:
            hostdevs.append(
                "    <hostdev mode='subsystem' type='mdev' managed='no' model='vfio-pci' "
                "display='off'>\n      <source>\n"
                f"        <address uuid='{u}'/>\n      </source>\n    </hostdev>\n")
        id_attr = f" id='{domain_id}'" if domain_id is not None else ""
        graphics = (f"    <graphics type='vnc' port='-1' autoport='yes' passwd='{vnc_password}'/>\n"
                    if vnc_password else "")
        return (f"<domain type='kvm'{id_attr}>\n  <name>{name}</name>\n  <uuid>{uuid}</uuid>\n"
                "  <memory unit='KiB'>1048576</memory>\n  <vcpu placement='static'>1</vcpu>\n"
                "  <os>\n    <type arch='x86_64' machine='pc'>hvm</type>\n  </os>\n"
                "  <devices>\n    <emulator>/usr/bin/qemu-system-x86_64</emulator>\n"
                + graphics + "".join(hostdevs) + "  </devices>\n</domain>\n")

    def add_defined_domain(self, name: str, uuid: str, pci: tuple[Addr, ...] = (),
                           mdevs: tuple[str, ...] = (), vnc_password: Optional[str] = None,
                           managed: bool = True) -> str:
        """`etc/libvirt/qemu/<name>.xml` as libvirtd keeps a defined domain."""
        xml = self.domain_xml(name, uuid, pci=pci, mdevs=mdevs, vnc_password=vnc_password,
                              managed=managed)
        path = self.p(f"etc/libvirt/qemu/{name}.xml")
        _write(path, "<!--\nWARNING: THIS IS AN AUTO-GENERATED FILE.\n-->\n" + xml, 0o600)
        return path

    def add_running_domain(self, name: str, uuid: str, pid: int = 4242,
                           pci: tuple[Addr, ...] = (), mdevs: tuple[str, ...] = (),
                           vnc_password: Optional[str] = None, managed: bool = True,
                           domain_id: int = 1) -> str:
        """`run/libvirt/qemu/<name>.xml` as libvirtd writes it (a <domstatus>), and
        the definition beside it."""
        xml = self.domain_xml(name, uuid, pci=pci, mdevs=mdevs, domain_id=domain_id,
                              vnc_password=vnc_password, managed=managed)
        status = (f"<domstatus state='running' reason='booted' pid='{pid}'>\n"
                  "  <monitor path='/var/lib/libvirt/qemu/domain-1/monitor.sock' type='unix'/>\n"
                  "  <vcpus>\n    <vcpu id='0' pid='4243'/>\n  </vcpus>\n"
                  + "".join("  " + line + "\n" for line in xml.splitlines())
                  + "</domstatus>\n")
        path = self.p(f"run/libvirt/qemu/{name}.xml")
        _write(path, status, 0o600)
        self.add_defined_domain(name, uuid, pci=pci, mdevs=mdevs, vnc_password=vnc_password,
                                managed=managed)
        return path

    def launch_domain(self, xml: str, pid: int = 4242, domain_id: int = 1) -> str:
        """libvirt started a transient domain from `xml` (as the CloudStack agent
        starts one, with the XML its transformer returned): the status file
        holds that domain, with its id, and no definition is kept. The VM's
        name; ValueError when the XML is no domain with a name and a UUID."""
        from lxml import etree

        parser = etree.XMLParser(resolve_entities=False, no_network=True)
        try:
            dom = etree.fromstring(xml.encode("utf-8"), parser)
        except etree.XMLSyntaxError as exc:
            raise ValueError(f"not a domain XML: {exc}") from None
        name, uuid = dom.findtext("name"), dom.findtext("uuid")
        if dom.tag != "domain" or not name or not uuid or "/" in name:
            raise ValueError("not a domain XML with a <name> and a <uuid>")
        dom.set("id", str(domain_id))
        text = etree.tostring(dom, encoding="unicode")
        status = (f"<domstatus state='running' reason='booted' pid='{pid}'>\n"
                  "  <monitor path='/var/lib/libvirt/qemu/domain-1/monitor.sock' type='unix'/>\n"
                  + text + "\n</domstatus>\n")
        _write(self.p(f"run/libvirt/qemu/{name}.xml"), status, 0o600)
        return str(name)

    def stop_domain(self, name: str) -> None:
        path = self.p(f"run/libvirt/qemu/{name}.xml")
        if os.path.exists(path):
            os.unlink(path)
