"""`gpulib setup --apply` for real in Debian 12 and 13 roots, checked with Debian's own tools.

One root of each per test session, built with debootstrap (minbase, a kernel
package, grub2-common, python3 and gpulib's runtime dependencies), with gpulib
copied in. Debian 12's has initramfs-tools and a second installed kernel (a
host pinned to an older kernel); Debian 13's has dracut in its place (apt
installs it with the kernel: debootstrap's resolver picks initramfs-tools) and
driverctl. Every command runs chrooted in a private mount namespace with a fake
GPU host bound over /sys (and its kernel command line, CPU and boot id over
those of /proc), so nothing of this machine's is touched and nothing is left
mounted. Needs root, debootstrap and the Debian registry: skipped with the
reason otherwise. The roots live in the session's temp dir and are removed at
its end. Cost on a two-core machine: Debian 12's about 4 minutes, Debian 13's
about 5 (most of it debootstrap and apt; its dracut is told to build small
images, about 13 s each, as a site could).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpulib.sim.fakehost import FakeHost
from tests.setuphosts import DEBIAN_GRUB, GPU, GPU_AUDIO, UBUNTU_GRUB, unprepared_host

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

MIRROR = os.environ.get("GPULIB_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
TRIXIE = "trixie"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The packages a KVM host running gpulib has, and nothing else (recommends left out,
# but zstd: initramfs-tools recommends it and compresses with it, faster than gzip).
PACKAGES = ("initramfs-tools", "zstd", "grub2-common", "kmod", "python3", "python3-lxml",
            "python3-click", "python3-pyudev", "python3-filelock")
OLD_KERNEL_SUFFIX = "-pinned"
IDS = "10de:2484,10de:228b"


def _why_not(suite: str = SUITE) -> str:
    if os.geteuid() != 0:
        return "needs root (debootstrap, chroot, a private mount namespace)"
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup --full installs debootstrap)"
    if not os.path.exists(f"/usr/share/debootstrap/scripts/{suite}"):
        return f"this debootstrap does not know {suite}"
    try:
        with urllib.request.urlopen(f"{MIRROR}/dists/{suite}/Release", timeout=10) as got:
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


def _arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _debootstrap(path: str, suite: str, packages: tuple[str, ...]) -> None:
    _checked("debootstrap", ["debootstrap", "--variant=minbase",
                             f"--include={','.join(packages)}", suite, path, MIRROR])


def _checked(what: str, argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200,
                          stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise AssertionError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _build(path: str) -> None:
    _debootstrap(path, SUITE, (f"linux-image-{_arch()}", *PACKAGES))


def _install(root: DebianRoot) -> None:
    """gpulib as a package would install it: the package and its command; and the
    /etc/default/grub grub-pc's postinst would have written."""
    shutil.copytree(os.path.join(REPO, "gpulib"),
                    root.p("usr/lib/python3/dist-packages/gpulib"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    root.write("usr/sbin/gpulib", "#!/usr/bin/python3\nimport sys\n"
               "from gpulib.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    os.chmod(root.p("usr/sbin/gpulib"), 0o755)
    root.write("etc/default/grub", DEBIAN_GRUB)
    os.makedirs(root.p("boot/grub"), exist_ok=True)


@contextlib.contextmanager
def _made(tmp_path_factory: Any, suite: str, build: Callable[[str], None]
          ) -> Iterator[DebianRoot]:
    """A root of `suite`, built, with gpulib installed; removed at the end."""
    why = _why_not(suite)
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp(suite)
    try:
        build(str(base / "root"))
        root = DebianRoot(str(base / "root"), str(base / "fake"))
        _install(root)
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def debian(tmp_path_factory: Any) -> Iterator[DebianRoot]:
    with _made(tmp_path_factory, SUITE, _build) as root:
        os.chown(root.p("etc/default/grub"), 0, 4)  # root:adm, as some images ship it
        os.chmod(root.p("etc/default/grub"), 0o640)
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


def test_a_refused_grub_file_changes_nothing_in_a_real_root(debian: DebianRoot) -> None:
    """/etc/default/grub's value cannot be known (`$EXTRA`): no file, no initramfs, no
    boot entry, and no promise for the next boot; an administrator's later modprobe
    file is the ids modprobe would still pass."""
    root = debian
    grub = root.read("etc/default/grub")
    st = os.stat(root.p("etc/default/grub"))
    try:
        root.write("etc/default/grub", 'GRUB_CMDLINE_LINUX_DEFAULT="quiet $EXTRA"\n')
        root.write("etc/modprobe.d/zz-site-vfio.conf", "options vfio-pci ids=8086:10ed\n")
        before = _snapshot(root)
        refused = root.run("gpulib", "setup", "--apply", "--yes", "--passthrough", GPU,
                           check=False)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "nothing was changed: not edited: /etc/default/grub" in refused.stderr
        assert "nothing is applied while /etc/default/grub is refused" in refused.stdout
        assert "reboot the host" not in refused.stdout
        assert "vfio-pci takes it at the next boot" not in refused.stdout
        assert _snapshot(root) == before
        config = root.run("modprobe", "-c").stdout.splitlines()
        assert [x for x in config if x.startswith("options vfio_pci")] == \
            ["options vfio_pci ids=8086:10ed"]
    finally:
        os.unlink(root.p("etc/modprobe.d/zz-site-vfio.conf"))
        root.write("etc/default/grub", grub)
        os.chown(root.p("etc/default/grub"), st.st_uid, st.st_gid)
        os.chmod(root.p("etc/default/grub"), st.st_mode & 0o7777)


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


# -- Debian 13 with dracut, driverctl and an administrator's own configuration -------------

# installed with apt once the base is there: debootstrap's resolver gives the kernel
# initramfs-tools, which conflicts with dracut
TRIXIE_PACKAGES = ("zstd", "grub2-common", "kmod", "python3", "python3-lxml",
                   "python3-click", "python3-pyudev", "python3-filelock")
TRIXIE_APT = ("dracut", "driverctl", "systemd-sysv")
# A site's dracut settings that keep each image small and quick to make (about 13 s
# instead of 35): a test setting, not gpulib's.
SMALL_DRACUT = 'dracutmodules=" base kernel-modules "\ncompress="cat"\n'
TWIN = "0000:5e:00.0"
TWIN_AUDIO = "0000:5e:00.1"
ADMIN_VFIO = "etc/modprobe.d/vfio.conf"
ADMIN_IDS = "8086:10ed"  # the administrator's own passthrough device (an 82599 VF)
ADMIN_BLACKLIST = "etc/modprobe.d/nvidia-blacklists-nouveau.conf"


def _build_trixie(path: str) -> None:
    _debootstrap(path, TRIXIE, TRIXIE_PACKAGES)
    os.makedirs(os.path.join(path, "etc/dracut.conf.d"), exist_ok=True)
    with open(os.path.join(path, "etc/dracut.conf.d/00-site-small.conf"), "w") as fh:
        fh.write(SMALL_DRACUT)
    shutil.copyfile("/etc/resolv.conf", os.path.join(path, "etc/resolv.conf"))
    r = shlex.quote(path)
    packages = " ".join((f"linux-image-{_arch()}", *TRIXIE_APT))
    script = (f"mount --make-rprivate / && mount -t proc proc {r}/proc && "
              f"mount --rbind /dev {r}/dev && exec chroot {r} /usr/bin/env -i "
              "PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "
              f"apt-get install -y -q --no-install-recommends {packages}")
    _checked("apt-get install", ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                 script])


@pytest.fixture(scope="session")
def trixie(tmp_path_factory: Any) -> Iterator[DebianRoot]:
    with _made(tmp_path_factory, TRIXIE, _build_trixie) as root:
        (current,) = root.kernels()
        host = root.host
        # the IOMMU enabled for this boot only (a boot-menu edit): /etc/default/grub lacks it
        host.set_cmdline(f"BOOT_IMAGE=/boot/vmlinuz-{current} root=/dev/sda1 ro quiet "
                         "intel_iommu=on iommu=pt")
        # the named GPU's twin, with no driver, and its audio function
        group = host.new_iommu_group()
        host.add_bridge("0000:5d:00.0", iommu_group=host.new_iommu_group())
        host.add_function(TWIN, 0x10DE, 0x2484, 0x030000, iommu_group=group,
                          parent="0000:5d:00.0")
        host.add_function(TWIN_AUDIO, 0x10DE, 0x228B, 0x040300, iommu_group=group,
                          parent="0000:5d:00.0")
        # the administrator's own vfio-pci ids, and their own nouveau blacklist
        root.write(ADMIN_VFIO, f"options vfio-pci ids={ADMIN_IDS}\n")
        root.write(ADMIN_BLACKLIST, "blacklist nouveau\n")
        yield root


def _sys_state(root: DebianRoot) -> dict[str, tuple[int, bytes]]:
    """The fake /sys: every file's content (a write to unbind, new_id, driver_override or
    a driver link would show)."""
    out: dict[str, tuple[int, bytes]] = {}
    for base, dirs, files in os.walk(os.path.join(root.fake, "sys")):
        for name in dirs + files:
            path = os.path.join(base, name)
            if os.path.islink(path):
                out[path] = (0, os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    out[path] = (1, fh.read())
    return out


def test_setup_on_debian_13_with_dracut_keeps_what_is_not_gpulibs(trixie: DebianRoot) -> None:
    root = trixie
    (kernel,) = root.kernels()
    gpulib = ("gpulib",)
    assert root.run("sh", "-c", ". /etc/os-release; echo $VERSION_ID").stdout.strip() == "13"

    # the doctor: the next boot has no IOMMU; it says which command line says what
    doc = json.loads(root.run(*gpulib, "doctor", "--json", "--check", "iommu",
                              check=False).stdout)
    (iommu,) = doc["checks"]
    assert iommu["status"] == "fail", iommu
    assert "the running kernel has intel_iommu=on iommu=pt" in iommu["message"]
    assert "loses the IOMMU at its next reboot" in iommu["message"]

    # the GPU alone: its driverless twin would go with vfio-pci.ids, so per device through
    # driverctl's override files; nothing is unbound now
    sys_before = _sys_state(root)
    done = root.run(*gpulib, "setup", "--apply", "--yes", "--passthrough", GPU)
    out = done.stdout
    assert "dracut -f --regenerate-all [ran]" in out, out
    assert "update-grub [ran]" in out and "update-initramfs" not in out
    assert not os.path.exists(root.p("etc/modprobe.d/gpulib-vfio.conf"))  # no ids at all
    assert "driverctl list-persisted" in out and "nothing is rebound now" in out
    persisted = root.run("driverctl", "list-persisted").stdout.split("\n")
    assert f"{GPU} vfio-pci" in persisted and f"{GPU_AUDIO} vfio-pci" in persisted
    assert not any(TWIN in line for line in persisted)
    assert _sys_state(root) == sys_before
    # the doctor reads driverctl's records: the GPU waits for the next boot
    doc = json.loads(root.run(*gpulib, "doctor", "--json", "--check", "driver-binding",
                              check=False).stdout)
    (gpu,) = [r for r in doc["checks"] if r["subject"] == GPU]
    assert gpu["pending"] == "reboot" and "driverctl overrides it to vfio-pci" in gpu["message"]

    # now the twin too, named: by vfio-pci.ids (the GPU's override keeps it where it goes),
    # with the administrator's ids kept in the value the next boot takes last
    root.run(*gpulib, "setup", "--apply", "--yes", "--passthrough", TWIN)
    assert _sys_state(root) == sys_before
    assert root.read(ADMIN_VFIO) == f"options vfio-pci ids={ADMIN_IDS}\n"
    ids = f"{ADMIN_IDS},10de:2484,10de:228b"
    assert f"options vfio-pci ids={ids}" in root.read("etc/modprobe.d/gpulib-vfio.conf")
    conf = root.read("etc/dracut.conf.d/gpulib-vfio.conf")
    assert "force_drivers+=" in conf and "/etc/modprobe.d/gpulib-vfio.conf" in conf
    normal = [line for line in root.linux_lines() if "single" not in line.split()]
    assert normal
    for line in normal:  # the IOMMU made permanent, every id in one argument
        words = line.split()
        assert {"intel_iommu=on", "iommu=pt", f"vfio-pci.ids={ids}"} <= set(words), line
        assert sum(w.startswith("vfio-pci.ids=") for w in words) == 1
    # dracut's image: vfio-pci forced in, gpulib's modprobe file and the blacklist in it
    files = root.run("lsinitrd", f"/boot/initrd.img-{kernel}").stdout
    assert re.search(r"/vfio-pci\.ko(\.\w+)?$", files, re.M), files[-2000:]
    assert "etc/modprobe.d/gpulib-vfio.conf" in files
    # the administrator's blacklist, named in dracut's configuration (gpulib wrote none)
    assert ADMIN_BLACKLIST in files and "blacklist-nouveau.conf" not in files
    assert f"/{ADMIN_BLACKLIST}" in root.read("etc/dracut.conf.d/gpulib-blacklist-nouveau.conf")

    # the next boot, as modprobe will see it: the ids it passes vfio-pci, the last wins
    args = normal[0].split(None, 2)[2]
    root.host.set_cmdline(args)
    loads = root.run("modprobe", "-S", kernel, "-n", "-v", "vfio-pci").stdout
    (line,) = [x for x in loads.splitlines() if re.search(r"/vfio-pci\.ko", x)]
    assert [w for w in line.split() if w.startswith("ids=")][-1] == f"ids={ids}", line
    assert f"ids={ADMIN_IDS}" in line.split()  # the administrator's file is still read

    # back to this boot: the doctor waits for the reboot, and a second run changes nothing
    root.host.set_cmdline(f"BOOT_IMAGE=/boot/vmlinuz-{kernel} root=/dev/sda1 ro quiet "
                          "intel_iommu=on iommu=pt")
    again = root.run(*gpulib, "setup", "--apply", "--yes", "--passthrough", GPU,
                     "--passthrough", TWIN)
    assert "nothing to change" in again.stdout, again.stdout
    doc = json.loads(root.run(*gpulib, "doctor", "--json", "--check", "iommu", "--check",
                              "driver-binding", check=False).stdout)
    assert {r["status"] for r in doc["checks"]} <= {"ok", "warn"}, doc
    binding = {r["subject"]: r for r in doc["checks"] if r["id"] == "driver-binding"}
    assert binding[GPU]["pending"] == "reboot" and binding[GPU]["status"] == "warn"
