"""Unprepared KVM hosts as the distributions install them, for `gpulib setup`."""

from __future__ import annotations

import os

from gpulib.bootconfig import edit_cmdline
from gpulib.sim.fakehost import FakeHost

BTIME = 1_700_000_000
BOOT_ID = "6f1d3c52-9a4e-4d1b-8c39-2f0e5b7a9d11"
GPU = "0000:3b:00.0"
GPU_AUDIO = "0000:3b:00.1"
GPU_IDS = "10de:2484,10de:228b"

DEBIAN_GRUB = """\
# If you change this file, run 'update-grub' afterwards to update
# /boot/grub/grub.cfg.
# For full documentation of the options in this file, see:
#   info -f grub -n 'Simple configuration'

GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT="quiet"
GRUB_CMDLINE_LINUX=""

# Uncomment to disable graphical terminal (grub-pc only)
#GRUB_TERMINAL=console
"""

UBUNTU_GRUB = """\
# If you change this file or any /etc/default/grub.d/*.cfg file,
# run 'update-grub' afterwards to update /boot/grub/grub.cfg.

GRUB_DEFAULT=0
GRUB_TIMEOUT_STYLE=hidden
GRUB_TIMEOUT=0
GRUB_DISTRIBUTOR=`( . /etc/os-release; echo ${NAME:-Ubuntu} ) 2>/dev/null || echo Ubuntu`
GRUB_CMDLINE_LINUX_DEFAULT="quiet splash"
GRUB_CMDLINE_LINUX=""

#GRUB_GFXMODE=640x480
"""

EL9_GRUB = """\
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR="$(sed 's, release .*$,,g' /etc/system-release)"
GRUB_DEFAULT=saved
GRUB_DISABLE_SUBMENU=true
GRUB_TERMINAL_OUTPUT="console"
GRUB_CMDLINE_LINUX="crashkernel=1G-4G:192M,4G-64G:256M,64G-:512M resume=/dev/mapper/rl-swap \
rd.lvm.lv=rl/root rd.lvm.lv=rl/swap"
GRUB_DISABLE_RECOVERY="true"
GRUB_ENABLE_BLSCFG=true
"""

DISTROS = {
    "debian12": ('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'
                 'VERSION_ID="12"\nID=debian\n', DEBIAN_GRUB,
                 "BOOT_IMAGE=/boot/vmlinuz-6.1.0-18-amd64 root=/dev/sda1 ro quiet"),
    "ubuntu2404": ('PRETTY_NAME="Ubuntu 24.04.1 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\n'
                   'ID=ubuntu\nID_LIKE=debian\n', UBUNTU_GRUB,
                   "BOOT_IMAGE=/vmlinuz-6.8.0-45-generic root=/dev/mapper/vg-root ro quiet "
                   "splash"),
    "el9": ('NAME="Rocky Linux"\nVERSION="9.4 (Blue Onyx)"\nID="rocky"\n'
            'ID_LIKE="rhel centos fedora"\nVERSION_ID="9.4"\n'
            'PRETTY_NAME="Rocky Linux 9.4 (Blue Onyx)"\n', EL9_GRUB,
            "BOOT_IMAGE=(hd0,gpt2)/vmlinuz-5.14.0-427.13.1.el9_4.x86_64 "
            "root=/dev/mapper/rl-root ro crashkernel=1G-4G:192M,4G-64G:256M,64G-:512M "
            "resume=/dev/mapper/rl-swap rd.lvm.lv=rl/root rd.lvm.lv=rl/swap"),
}


def cpuinfo(vendor: str) -> str:
    return "".join(f"processor\t: {n}\nvendor_id\t: {vendor}\ncpu family\t: 6\n\n"
                   for n in range(2))


def backdate(host: FakeHost) -> None:
    """Every file as the installer left it: before this boot."""
    for base, dirs, files in os.walk(host.root):
        for name in dirs + files:
            path = os.path.join(base, name)
            os.utime(path, (BTIME - 3600, BTIME - 3600), follow_symlinks=False)


def unprepared_host(root: str, distro: str, cpu: str = "GenuineIntel",
                    iommu: bool = False) -> FakeHost:
    """No IOMMU argument, nouveau loaded, an NVIDIA GPU (and its audio) on nouveau.

    `iommu=True`: the IOMMU is on (groups exist; the running command line and the
    next boot's enable it) but the rest is unprepared.
    """
    os_release, grub, cmdline = DISTROS[distro]
    if iommu:
        key = "GRUB_CMDLINE_LINUX" if distro == "el9" else "GRUB_CMDLINE_LINUX_DEFAULT"
        grub = edit_cmdline(grub, key, ["intel_iommu=on", "iommu=pt"])
    host = FakeHost(root)
    host.set_cmdline(cmdline + (" intel_iommu=on iommu=pt" if iommu else ""))
    host.write_file("etc/os-release", os_release)
    host.write_file("etc/default/grub", grub)
    host.write_file("proc/cpuinfo", cpuinfo(cpu), 0o444)
    host.write_file("proc/stat", f"cpu  1 0 1 100 0 0 0 0 0 0\nbtime {BTIME}\n", 0o444)
    host.write_file("proc/sys/kernel/random/boot_id", BOOT_ID + "\n", 0o444)
    host.load_module("nouveau")
    group = host.new_iommu_group() if iommu else None
    if iommu:
        host.add_iommu_unit("dmar0")
    host.add_bridge("0000:3a:00.0", numa_node=0,
                    iommu_group=host.new_iommu_group() if iommu else None)
    host.add_function(GPU, 0x10DE, 0x2484, 0x030000, driver="nouveau", iommu_group=group,
                      numa_node=0, parent="0000:3a:00.0", vendor_name="NVIDIA Corporation",
                      device_name="GA104 [GeForce RTX 3070]")
    host.add_function(GPU_AUDIO, 0x10DE, 0x228B, 0x040300, driver="snd_hda_intel",
                      iommu_group=group, numa_node=0, parent="0000:3a:00.0",
                      vendor_name="NVIDIA Corporation", device_name="GA104 High Definition Audio")
    backdate(host)
    return host
