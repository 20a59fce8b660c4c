"""A sysfs-shaped tree written with plain os calls, not gpulib's builder.

It follows the kernel's layout independently (including things the builder
never writes, such as `firmware_node` links and `power/` directories), so the
discovery tests also run on a tree gpulib did not build.
"""

from __future__ import annotations

import os


def _w(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def _ln(target: str, link: str) -> None:
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(os.path.relpath(target, os.path.dirname(link)), link)


# The primitives, for other hand-laid trees.
write, link = _w, _ln


def fn(root: str, chain: list[str], vendor: str, device: str, klass: str, driver: str | None,
       group: int, numa: str = "0") -> str:
    """A function at sys/devices/pci<dom:bus>/<chain...>."""
    first = chain[0]
    host_bridge = f"pci{first[:7]}"
    d = os.path.join(root, "sys/devices", host_bridge, *chain)
    for name, value in (("vendor", vendor), ("device", device), ("class", klass),
                        ("numa_node", numa), ("irq", "0"), ("local_cpus", "ff")):
        _w(os.path.join(d, name), value + "\n")
    os.makedirs(os.path.join(d, "power"), exist_ok=True)
    bdf = chain[-1]
    _ln(d, os.path.join(root, "sys/bus/pci/devices", bdf))
    if driver:
        drv = os.path.join(root, "sys/bus/pci/drivers", driver)
        os.makedirs(drv, exist_ok=True)
        _ln(drv, os.path.join(d, "driver"))
    g = os.path.join(root, "sys/kernel/iommu_groups", str(group))
    _ln(g, os.path.join(d, "iommu_group"))
    _ln(d, os.path.join(g, "devices", bdf))
    return d


def build(root: str) -> None:
    # Host bridge + BMC VGA behind a bridge (not a GPU)
    fn(root, ["0000:00:00.0"], "0x8086", "0x09a2", "0x060000", None, 0)
    fn(root, ["0000:00:1c.5"], "0x8086", "0xa195", "0x060400", "pcieport", 1)
    fn(root, ["0000:00:1c.5", "0000:03:00.0"], "0x1a03", "0x2000", "0x030000", "ast", 1)
    # A Matrox G200eR BMC display: not a GPU either
    fn(root, ["0000:00:1c.6", "0000:04:00.0"], "0x102b", "0x0536", "0x030000", "mgag200", 2)
    # NIC (not a GPU)
    fn(root, ["0000:17:02.0", "0000:18:00.0"], "0x8086", "0x1572", "0x020000", "i40e", 3)
    # Passthrough GPU (VGA) + its audio function in one group, used by a running VM
    fn(root, ["0000:64:00.0", "0000:65:00.0"], "0x10de", "0x2484", "0x030000", "vfio-pci", 7)
    fn(root, ["0000:64:00.0", "0000:65:00.1"], "0x10de", "0x228b", "0x040300", "vfio-pci", 7)
    # Display controller class on PCI domain 0001 (AMD MI210), defined VM uses it
    fn(root, ["0001:d5:00.0", "0001:d6:00.0"], "0x1002", "0x740f", "0x038000", "vfio-pci", 9,
       numa="1")
    # Processing accelerator of a GPU vendor (MI300X) on PCI domain 0001
    fn(root, ["0001:e5:00.0", "0001:e6:00.0"], "0x1002", "0x74a1", "0x120000", "vfio-pci", 10,
       numa="1")
    # Processing accelerator of another vendor (Habana Gaudi): not a GPU
    fn(root, ["0000:b0:00.0", "0000:b1:00.0"], "0x1da3", "0x1020", "0x120000", "habanalabs", 11)
    # SR-IOV GPU: PF with 2 VFs, mdev types on each VF, one live mdev on VF 1
    pf = fn(root, ["0000:c9:00.0", "0000:ca:00.0"], "0x10de", "0x20f1", "0x030200", "nvidia", 12,
            numa="1")
    _w(os.path.join(pf, "sriov_totalvfs"), "16\n")
    _w(os.path.join(pf, "sriov_numvfs"), "2\n")
    vfs = []
    for i, f in enumerate(("0000:ca:00.4", "0000:ca:00.5")):
        vf = fn(root, ["0000:c9:00.0", f], "0x10de", "0x20f1", "0x030200", "nvidia", 13 + i,
                numa="1")
        _ln(pf, os.path.join(vf, "physfn"))
        _ln(vf, os.path.join(pf, f"virtfn{i}"))
        t = os.path.join(vf, "mdev_supported_types", "nvidia-470")
        _w(os.path.join(t, "name"), "GRID A100-8C\n")
        _w(os.path.join(t, "description"),
           "num_heads=1, frl_config=60, framebuffer=8192M, max_resolution=4096x2160, "
           "max_instance=5\n")
        _w(os.path.join(t, "available_instances"), "1\n")
        _w(os.path.join(t, "device_api"), "vfio-pci\n")
        os.makedirs(os.path.join(t, "devices"), exist_ok=True)
        _ln(vf, os.path.join(root, "sys/class/mdev_bus", f))
        vfs.append(vf)
    uuid = "0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
    m = os.path.join(vfs[1], uuid)
    os.makedirs(m)
    _ln(os.path.join(vfs[1], "mdev_supported_types", "nvidia-470"), os.path.join(m, "mdev_type"))
    _w(os.path.join(m, "remove"), "")
    _ln(m, os.path.join(root, "sys/bus/mdev/devices", uuid))
    _ln(m, os.path.join(vfs[1], "mdev_supported_types", "nvidia-470", "devices", uuid))
    # NVIDIA vendor-specific VFs with current_vgpu_type set on one
    pf2 = fn(root, ["0000:80:01.2", "0000:82:00.0"], "0x10de", "0x26b9", "0x030200", "nvidia", 20,
             numa="1")
    _w(os.path.join(pf2, "sriov_totalvfs"), "32\n")
    _w(os.path.join(pf2, "sriov_numvfs"), "11\n")
    for i in range(11):
        rid = (0x82 << 8) + 4 + i
        f = f"0000:{rid >> 8:02x}:{(rid >> 3) & 0x1f:02x}.{rid & 7}"
        vf = fn(root, ["0000:80:01.2", f], "0x10de", "0x26b9", "0x030200", "nvidia", 21 + i,
                numa="1")
        _ln(pf2, os.path.join(vf, "physfn"))
        _ln(vf, os.path.join(pf2, f"virtfn{i}"))
        nv = os.path.join(vf, "nvidia")
        if i == 0:
            _w(os.path.join(nv, "current_vgpu_type"), "1151\n")
            _w(os.path.join(nv, "creatable_vgpu_types"), "ID    : vGPU Name\n")
        else:
            _w(os.path.join(nv, "current_vgpu_type"), "0\n")
            _w(os.path.join(nv, "creatable_vgpu_types"),
               "ID    : vGPU Name\n1151  : NVIDIA L40S-6Q\n")
    # libvirt: a running VM (status file) and a defined one
    _w(os.path.join(root, "run/libvirt/qemu/vm-running.xml"),
       "<domstatus state='running' pid='99'>\n<domain type='kvm' id='3'>\n"
       "<name>vm-running</name>\n<devices>\n"
       "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
       "<address domain='0x0000' bus='0x65' slot='0x00' function='0x0'/></source></hostdev>\n"
       f"<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='{uuid}'/>"
       "</source></hostdev>\n"
       "<hostdev mode='subsystem' type='pci' managed='no'><source>"
       "<address domain='0x0000' bus='0x82' slot='0x00' function='0x4'/></source></hostdev>\n"
       "</devices>\n</domain>\n</domstatus>\n")
    _w(os.path.join(root, "etc/libvirt/qemu/vm-defined.xml"),
       "<domain type='kvm'>\n  <name>vm-defined</name>\n  <devices>\n"
       "    <hostdev mode='subsystem' type='pci' managed='yes'>\n      <source>\n"
       "        <address domain=\"0x0001\" bus=\"0xd6\" slot=\"0x00\" function=\"0x0\"/>\n"
       "      </source>\n    </hostdev>\n"
       "    <!-- <hostdev mode='subsystem' type='pci'><source><address domain='0x0001' "
       "bus='0xe6' slot='0x00' function='0x0'/></source></hostdev> -->\n"
       "  </devices>\n</domain>\n")
