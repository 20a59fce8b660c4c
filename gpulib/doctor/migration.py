"""`migration`: whether this host's libvirt and QEMU can live-migrate VMs with vGPUs.

A VM with a vGPU migrates only with libvirt >= 8.6 (migratable mdev
hostdevs) and QEMU >= 8.1 (VFIO device migration on by default), on both
hosts. The versions are read from files, never by running a program:
* libvirt's QEMU capabilities cache (`var/cache/libvirt/qemu/capabilities/
  *.xml`: `<selfvers>` is libvirt's, `<version>` QEMU's), written when
  libvirtd first probes QEMU;
* else libvirt's library name (`libvirt.so.0.<major*1000+minor>.<micro>`)
  and the package database of Debian and Ubuntu (`var/lib/dpkg/status`) for
  QEMU.
What no file here says is named as such: whether the vendor's driver (the
NVIDIA vGPU manager and the vGPU type) supports migration, which decides
the rest. A host whose versions cannot be read is warned about as such: it
cannot be called ready, and it may be ready (it may also never migrate a
vGPU, which the warning says too).
"""

from __future__ import annotations

from gpulib.doctor.core import OK, WARN, Result
from gpulib.lazyre import lazy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    from gpulib.doctor.facts import Facts
    from gpulib.sysfs import Sysfs

LIBVIRT_NEEDED = (8, 6, 0)
QEMU_NEEDED = (8, 1, 0)
CAPS_CACHE = "var/cache/libvirt/qemu/capabilities"
DPKG_STATUS = "var/lib/dpkg/status"
LIB_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu",
            "usr/lib/powerpc64le-linux-gnu", "usr/lib/s390x-linux-gnu", "usr/lib")
QEMU_PACKAGES = ("qemu-system-x86", "qemu-system-arm", "qemu-system-ppc", "qemu-system-s390x",
                 "qemu-kvm")
VENDOR_UNSEEN = ("whether the vGPU driver supports migration (NVIDIA: the vGPU manager "
                 "release and the vGPU type) cannot be seen from here")

_SONAME_RE = lazy(r"^libvirt\.so\.0\.(\d+)\.(\d+)$")
_CAPS_RE = lazy(r"<(selfvers|version)>(\d+)</")
_DEB_VERSION_RE = lazy(r"^(?:\d+:)?(\d+)\.(\d+)(?:\.(\d+))?")

Version = tuple[int, int, int]


def _from_number(n: int) -> Version:
    """libvirt's encoding of versions (its own and QEMU's): major*1e6 + minor*1e3 + micro."""
    return (n // 1_000_000, n // 1000 % 1000, n % 1000)


def _show(v: Version) -> str:
    return ".".join(str(x) for x in v)


def from_capabilities(sysfs: Sysfs) -> tuple[Optional[Version], Optional[Version]]:
    """(libvirt, QEMU) from the newest entry of libvirt's capabilities cache."""
    best: tuple[Optional[Version], Optional[Version]] = (None, None)
    for name in sorted(sysfs.listdir(CAPS_CACHE)):
        if not name.endswith(".xml"):
            continue
        # The two numbers are near the top: no need to parse the whole file.
        head = sysfs.read(f"{CAPS_CACHE}/{name}", limit=16384) or ""
        found = {m.group(1): int(m.group(2)) for m in _CAPS_RE.finditer(head)}
        libvirt = _from_number(found["selfvers"]) if "selfvers" in found else None
        qemu = _from_number(found["version"]) if "version" in found else None
        if qemu is not None and (best[1] is None or qemu > best[1]):
            best = (libvirt, qemu)
    return best


def caps_lines(text: str) -> str:
    """The lines of a capabilities cache entry that say a version (what a
    snapshot keeps of it)."""
    kept = [line for line in text[:16384].splitlines() if _CAPS_RE.search(line)]
    return "<qemuCaps>\n" + "".join(line + "\n" for line in kept) + "</qemuCaps>\n"


def is_libvirt_soname(name: str) -> bool:
    return _SONAME_RE.match(name) is not None


def qemu_stanzas(text: str) -> str:
    """The package database's stanzas that could be a QEMU package's (what a
    snapshot keeps of it)."""
    return "".join(stanza + "\n\n" for stanza in _qemu_stanzas(text))


def libvirt_from_library(sysfs: Sysfs) -> Optional[Version]:
    for rel in LIB_DIRS:
        for name in sysfs.listdir(rel):
            m = _SONAME_RE.match(name)
            if m:
                number = int(m.group(1))
                return (number // 1000, number % 1000, int(m.group(2)))
    return None


def qemu_from_dpkg(sysfs: Sysfs) -> Optional[Version]:
    text = sysfs.read(DPKG_STATUS) or ""
    for stanza in _qemu_stanzas(text):
        found = qemu_version(stanza)
        if found is not None:
            return found
    return None


def qemu_version(stanza: str) -> Optional[Version]:
    """The version of the installed QEMU package one dpkg stanza describes, or
    None when it describes anything else."""
    fields = dict(line.split(": ", 1) for line in stanza.splitlines()
                  if ": " in line and not line.startswith(" "))
    if fields.get("Package") in QEMU_PACKAGES and \
            "installed" in fields.get("Status", "").split():
        m = _DEB_VERSION_RE.match(fields.get("Version", ""))
        if m:
            return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    return None


def _qemu_stanzas(text: str) -> list[str]:
    """The stanzas of `text` (split at blank lines, in file order) that could
    be a QEMU package's: those holding `Package: <a QEMU package>`. A host's
    database has thousands of stanzas (near 1 MB): parsing every one cost
    `gpulib metrics` 40 ms a run; a stanza without the text cannot name one."""
    starts: set[int] = set()
    for name in QEMU_PACKAGES:
        needle = "Package: " + name
        at = text.find(needle)
        while at >= 0:
            # `split("\n\n")`'s stanza around `at` (a run of newlines leaves
            # it empty lines at most, which hold no field).
            blank = text.rfind("\n\n", 0, at)
            starts.add(0 if blank < 0 else blank + 2)
            at = text.find(needle, at + len(needle))
    out = []
    for start in sorted(starts):
        end = text.find("\n\n", start)
        out.append(text[start:] if end < 0 else text[start:end])
    return out


def versions(sysfs: Sysfs) -> tuple[Optional[Version], Optional[Version]]:
    """(libvirt, QEMU) of the host below the root; None where no file says."""
    libvirt, qemu = from_capabilities(sysfs)
    return (libvirt or libvirt_from_library(sysfs), qemu or qemu_from_dpkg(sysfs))


def check(d: Facts) -> list[Result]:
    cid = "migration"
    libvirt, qemu = versions(d.sysfs)
    seen = []
    old = []
    for what, have, needed in (("libvirt", libvirt, LIBVIRT_NEEDED),
                               ("QEMU", qemu, QEMU_NEEDED)):
        if have is None:
            continue
        seen.append(f"{what} {_show(have)}")
        if have < needed:
            old.append(f"{what} {_show(have)} is older than {_show(needed)}")
    subject = "libvirt/QEMU"
    if old:
        return [Result(cid, WARN, subject,
                       f"VMs with vGPUs cannot live-migrate to or from this host: "
                       f"{'; '.join(old)}; {VENDOR_UNSEEN}",
                       f"upgrade to libvirt >= {_show(LIBVIRT_NEEDED)} and QEMU >= "
                       f"{_show(QEMU_NEEDED)} on every host VMs migrate between")]
    unknown = [w for w, v in (("libvirt", libvirt), ("QEMU", qemu)) if v is None]
    if unknown:
        return [Result(cid, WARN, subject,
                       f"unknown: cannot tell the version of {' and '.join(unknown)} "
                       "from its files "
                       f"(vGPU migration needs libvirt >= {_show(LIBVIRT_NEEDED)} and QEMU >= "
                       f"{_show(QEMU_NEEDED)})" + (f"; {', '.join(seen)}" if seen else "")
                       + f"; {VENDOR_UNSEEN}",
                       "nothing to do on a host that never live-migrates a VM with a vGPU; "
                       "otherwise check `virsh version` (libvirt >= "
                       f"{_show(LIBVIRT_NEEDED)}, QEMU >= {_show(QEMU_NEEDED)})")]
    return [Result(cid, OK, subject,
                   f"{', '.join(seen)}: vGPU live migration supported by both; "
                   f"{VENDOR_UNSEEN}")]
