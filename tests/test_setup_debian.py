"""`gpulib setup --apply` for real in a Debian 12 root, checked with Debian's own tools.

One root per test session, built with debootstrap (minbase, a kernel package,
initramfs-tools, grub2-common, python3 and gpulib's runtime dependencies),
with gpulib copied in and a second installed kernel (a host pinned to an
older kernel). Every command runs chrooted in a private mount namespace with a
fake GPU host bound over /sys (and its kernel command line, CPU and boot id
over those of /proc), so nothing of this machine's is touched and nothing is
left mounted. Needs root, debootstrap and the Debian registry: skipped with
the reason otherwise. The root lives in the session's temp dir and is removed
at its end.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from gpulib.sim.fakehost import FakeHost
from tests.setuphosts import DEBIAN_GRUB, GPU, UBUNTU_GRUB, unprepared_host

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

MIRROR = os.environ.get("GPULIB_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The packages a KVM host running gpulib has, and nothing else (recommends left out,
# but zstd: initramfs-tools recommends it and compresses with it, faster than gzip).
PACKAGES = ("initramfs-tools", "zstd", "grub2-common", "kmod", "python3", "python3-lxml",
            "python3-click", "python3-pyudev", "python3-filelock")
OLD_KERNEL_SUFFIX = "-pinned"
IDS = "10de:2484,10de:228b"


def _why_not() -> str:
    if os.geteuid() != 0:
        return "needs root (debootstrap, chroot, a private mount namespace)"
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup --full installs debootstrap)"
    try:
        with urllib.request.urlopen(f"{MIRROR}/dists/{SUITE}/Release", timeout=10) as got:
            got.read(64)
    except OSError as exc:
        return f"the Debian registry {MIRROR} cannot be reached: {exc}"
    return ""


class DebianRoot:
    """A debootstrapped root and the fake GPU host bound into it for each command."""

    def __init__(self, path: str, fake: str) -> None:
        self.path = path
        self.fake = fake
        self.host: FakeHost = unprepared_host(fake, "debian12", iommu=True)

    def p(self, rel: str) -> str:
        return os.path.join(self.path, rel.lstrip("/"))

    def run(self, *argv: str, check: bool = True, timeout: int = 600
            ) -> subprocess.CompletedProcess[str]:
        """`argv` chrooted, /sys the fake host's; the mounts die with the namespace."""
        r, f = shlex.quote(self.path), shlex.quote(self.fake)
        binds = "".join(f"mount --bind {f}/proc/{name} {r}/proc/{name} && "
                        for name in ("cmdline", "cpuinfo", "sys/kernel/random/boot_id"))
        script = (f"mount --make-rprivate / && mount -t proc proc {r}/proc && "
                  f"mount --rbind /dev {r}/dev && mount --bind {f}/sys {r}/sys && {binds}"
                  f"exec chroot {r} /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "
                  "LC_ALL=C.UTF-8 HOME=/root " + " ".join(shlex.quote(a) for a in argv))
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               script], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"{argv} exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def read(self, rel: str) -> str:
        with open(self.p(rel), encoding="utf-8") as fh:
            return fh.read()

    def write(self, rel: str, text: str) -> None:
        os.makedirs(os.path.dirname(self.p(rel)), exist_ok=True)
        with open(self.p(rel), "w", encoding="utf-8") as fh:
            fh.write(text)

    def kernels(self) -> list[str]:
        return sorted(n[len("vmlinuz-"):] for n in os.listdir(self.p("boot"))
                      if n.startswith("vmlinuz-"))

    def linux_lines(self) -> list[str]:
        out = self.run("grub-mkconfig").stdout
        return [line.strip() for line in out.splitlines()
                if re.match(r"\s*linux\s+/boot/vmlinuz-", line)]


def _build(path: str) -> None:
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    include = ",".join((f"linux-image-{arch}", *PACKAGES))
    proc = subprocess.run(["debootstrap", "--variant=minbase", f"--include={include}", SUITE,
                           path, MIRROR], capture_output=True, text=True, timeout=1200,
                          check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise AssertionError(f"debootstrap failed (exit {proc.returncode}):\n{tail}")


@pytest.fixture(scope="session")
def debian(tmp_path_factory: Any) -> Iterator[DebianRoot]:
    why = _why_not()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("debian12")
    path = str(base / "root")
    try:
        _build(path)
        root = DebianRoot(path, str(base / "fake"))
        # gpulib as a package would install it: the package and its command
        shutil.copytree(os.path.join(REPO, "gpulib"),
                        root.p("usr/lib/python3/dist-packages/gpulib"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        root.write("usr/sbin/gpulib", "#!/usr/bin/python3\nimport sys\n"
                   "from gpulib.cli import main\nsys.exit(main(sys.argv[1:]))\n")
        os.chmod(root.p("usr/sbin/gpulib"), 0o755)
        # grub-pc's postinst would have written these
        root.write("etc/default/grub", DEBIAN_GRUB)
        os.chown(root.p("etc/default/grub"), 0, 4)  # root:adm, as some images ship it
        os.chmod(root.p("etc/default/grub"), 0o640)
        os.makedirs(root.p("boot/grub"), exist_ok=True)
        # a second installed kernel, older, as a host pinned to a vendor driver's kernel
        (current,) = root.kernels()
        older = current + OLD_KERNEL_SUFFIX
        subprocess.run(["cp", "-al", root.p(f"lib/modules/{current}"),
                        root.p(f"lib/modules/{older}")], check=True)
        for kind in ("vmlinuz", "config", "System.map"):
            shutil.copy2(root.p(f"boot/{kind}-{current}"), root.p(f"boot/{kind}-{older}"))
        root.run("update-initramfs", "-c", "-k", older)
        # the fake host: an RTX 3070 and its audio function on the host's drivers, the
        # IOMMU on by default but not on the command line
        root.host.set_cmdline(f"BOOT_IMAGE=/boot/vmlinuz-{current} root=/dev/sda1 ro quiet")
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _snapshot(root: DebianRoot) -> dict[str, tuple[int, int, int, bytes]]:
    """What setup may change: /etc, /boot and gpulib's state (content, owner, mode)."""
    out: dict[str, tuple[int, int, int, bytes]] = {}
    for top in ("etc", "boot", "var/lib/gpulib"):
        for base, _dirs, files in os.walk(root.p(top)):
            for name in files:
                path = os.path.join(base, name)
                if os.path.islink(path) or name == "setup.lock":
                    continue
                st = os.lstat(path)
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, root.path)] = (st.st_uid, st.st_gid, st.st_mode,
                                                             fh.read())
    return out


def _initramfs_files(root: DebianRoot, kernel: str) -> list[str]:
    return root.run("lsinitramfs", f"/boot/initrd.img-{kernel}").stdout.splitlines()


def test_setup_prepares_a_real_debian_root(debian: DebianRoot) -> None:
    root = debian
    kernels = root.kernels()
    assert len(kernels) == 2

    # a site's initramfs hook fails: setup says so with the hook's own message, promises
    # no reboot, and leaves the rebuild to the next run
    root.write("etc/initramfs-tools/hooks/zz-site", "#!/bin/sh\n"
               "[ \"$1\" = prereqs ] && exit 0\necho 'zz-site: cannot read the site key' >&2\n"
               "exit 1\n")
    os.chmod(root.p("etc/initramfs-tools/hooks/zz-site"), 0o755)
    failed = root.run("gpulib", "setup", "--apply", "--yes", "--passthrough", GPU, check=False)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "update-initramfs -u -k all failed" in failed.stderr
    assert "zz-site" in failed.stderr, failed.stderr
    assert "- reboot the host" not in failed.stdout
    os.unlink(root.p("etc/initramfs-tools/hooks/zz-site"))

    # the next run: only what did not complete, and then it is done
    done = root.run("gpulib", "setup", "--apply", "--yes", "--passthrough", GPU)
    assert "update-initramfs -u -k all [ran]" in done.stdout, done.stdout
    assert "reboot the host" in done.stdout

    # grub-mkconfig: every linux line of the normal entries has the arguments
    lines = root.linux_lines()
    normal = [line for line in lines if "single" not in line.split()]
    assert len(normal) >= len(kernels)
    for line in normal:
        for arg in ("intel_iommu=on", "iommu=pt", f"vfio-pci.ids={IDS}"):
            assert arg in line.split(), line
    # the grub file kept its group and mode, and so did its backup
    backups = [n for n in os.listdir(root.p("etc/default")) if n.startswith("grub.gpulib-")]
    assert backups
    for rel in ["etc/default/grub", *(f"etc/default/{b}" for b in backups)]:
        st = os.stat(root.p(rel))
        assert (st.st_gid, st.st_mode & 0o7777) == (4, 0o640), rel

    # every installed kernel's initramfs: the blacklist, the vfio ids, vfio-pci early
    for kernel in kernels:
        files = _initramfs_files(root, kernel)
        assert "etc/modprobe.d/blacklist-nouveau.conf" in files, kernel
        assert "etc/modprobe.d/gpulib-vfio.conf" in files, kernel
        assert any(re.search(r"/vfio-pci\.ko(\.\w+)?$", f) for f in files), kernel
        assert "vfio_pci" in root.run("sh", "-c", f"cd /tmp && rm -rf i && mkdir i && "
                                      f"unmkinitramfs /boot/initrd.img-{kernel} i && "
                                      "cat i/main/conf/modules 2>/dev/null || "
                                      "cat i/conf/modules").stdout.split()
    # modprobe's own view of the configuration
    config = root.run("modprobe", "-c").stdout.splitlines()
    assert "blacklist nouveau" in config
    assert f"options vfio_pci ids={IDS}" in config
    assert "softdep nouveau pre: vfio_pci" in config or \
        "softdep nouveau pre: vfio-pci" in config

    # a second run changes nothing
    before = _snapshot(root)
    again = root.run("gpulib", "setup", "--apply", "--yes", "--passthrough", GPU)
    assert "nothing to change" in again.stdout, again.stdout
    after = _snapshot(root)
    assert {k: v for k, v in after.items() if not k.endswith("setup.json")} == \
        {k: v for k, v in before.items() if not k.endswith("setup.json")}


def test_an_ubuntu_style_drop_in_gets_the_arguments(debian: DebianRoot) -> None:
    """The cloud images' drop-in sets GRUB_CMDLINE_LINUX_DEFAULT after /etc/default/grub."""
    root = debian
    root.write("etc/default/grub", UBUNTU_GRUB.replace("GRUB_DISTRIBUTOR=`( . /etc/os-release; "
                                                       "echo ${NAME:-Ubuntu} ) 2>/dev/null || "
                                                       "echo Ubuntu`", "GRUB_DISTRIBUTOR=Debian"))
    root.write("etc/default/grub.d/50-cloudimg-settings.cfg",
               'GRUB_TIMEOUT=0\nGRUB_CMDLINE_LINUX_DEFAULT="console=tty1 console=ttyS0"\n')
    for line in root.linux_lines():
        assert "intel_iommu=on" not in line.split()
    done = root.run("gpulib", "setup", "--apply", "--yes", "--check", "iommu")
    assert "50-cloudimg-settings.cfg" in done.stdout, done.stdout
    normal = [line for line in root.linux_lines() if "single" not in line.split()]
    assert normal
    for line in normal:
        words = line.split()
        assert "console=ttyS0" in words and "intel_iommu=on" in words and "iommu=pt" in words
    again = root.run("gpulib", "setup", "--apply", "--yes", "--check", "iommu")
    assert "nothing to change" in again.stdout
