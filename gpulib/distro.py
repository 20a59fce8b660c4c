"""The distribution (`etc/os-release`) and what its family does: the one place
gpulib tells Debian from EL and SUSE. The doctor's fixes, `gpulib setup`'s
commands, the boot configuration's reading and the initramfs tool ask
here; nothing else compares distribution names."""

from __future__ import annotations

from gpulib.context import OS_RELEASE
from gpulib.slotted import Slotted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

    from gpulib.context import Context

FAMILIES = ("debian", "rhel", "suse")
INITRAMFS_TOOLS = "initramfs-tools"
DRACUT = "dracut"


class Distro(Slotted):
    """The distribution from `etc/os-release`, for the commands in fixes."""

    __slots__ = ("id", "id_like", "name")
    _fields = ("id", "id_like", "name")

    def __init__(self, id: str = "", id_like: Optional[list[str]] = None,
                 name: str = "") -> None:
        self.id = id
        self.id_like: list[str] = [] if id_like is None else id_like
        self.name = name

    @classmethod
    def read(cls, ctx: Context) -> Distro:
        text = ctx.sysfs.read(OS_RELEASE) or ctx.sysfs.read("usr/lib/os-release") or ""
        values: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key and not key.startswith("#"):
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                values[key] = value
        return cls(values.get("ID", "").lower(), values.get("ID_LIKE", "").lower().split(),
                   values.get("PRETTY_NAME", values.get("NAME", "")))

    @property
    def family(self) -> str:
        """debian, rhel, suse or unknown."""
        ids = [self.id, *self.id_like]
        if any(i in ("debian", "ubuntu") for i in ids):
            return "debian"
        if any(i in ("rhel", "fedora", "centos", "rocky", "almalinux", "ol") for i in ids):
            return "rhel"
        if any("suse" in i for i in ids):
            return "suse"
        return "unknown"

    @classmethod
    def of_family(cls, family: str) -> Distro:
        """A distribution known by its family alone (a caller that kept only that)."""
        return cls(family if family in FAMILIES else "")

    # -- what a family does (every other module asks here, never compares names) ------
    @property
    def grub_drop_ins(self) -> bool:
        """Whether grub-mkconfig sources /etc/default/grub.d/*.cfg (Debian's does)."""
        return self.family == "debian"

    @property
    def initramfs_default(self) -> Optional[str]:
        """The initramfs tool the family installs by default (None: unknown)."""
        if self.family == "debian":
            return INITRAMFS_TOOLS
        if self.family in ("rhel", "suse"):
            return DRACUT
        return None

    @property
    def kernel_cmdline_file(self) -> bool:
        """Whether kernel-install reads /etc/kernel/cmdline (EL's does: new kernels'
        boot entries take their arguments from it)."""
        return self.family == "rhel"

    @property
    def dracut_host_only(self) -> bool:
        """Whether the family's dracut makes host-only images by default (EL's and
        SUSE's do; Debian's does not)."""
        return self.family in ("rhel", "suse")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id or None, "id_like": self.id_like, "name": self.name or None,
                "family": self.family}

    # -- commands for fixes -------------------------------------------------------------
    def kernel_args_fix(self, add: str = "", remove: str = "",
                        where: str = "/etc/default/grub") -> str:
        """How to change the kernel command line for good, on this distribution
        (the variable and file gpulib setup edits: `where` is the file the
        effective value comes from)."""
        key = self.grub_key
        if remove and add:
            edit = f'replace "{remove}" with "{add}" in {key}'
        elif remove:
            edit = f'remove "{remove}" from {key}'
        else:
            edit = f'add "{add}" to {key}'
        edit += f" in {where}"
        family = self.family
        if family == "debian":
            return f"{edit}, then: update-grub && reboot"
        if family == "rhel":
            args = (f' --remove-args="{remove}"' if remove else "") + \
                (f' --args="{add}"' if add else "")
            return (f"grubby --update-kernel=ALL{args} && reboot\n"
                    f"(or {edit}, then: grub2-mkconfig -o /boot/grub2/grub.cfg && reboot)")
        if family == "suse":
            return f"{edit}, then: grub2-mkconfig -o /boot/grub2/grub.cfg && reboot"
        return (f"{edit}, then: update-grub (Debian/Ubuntu) or "
                "grub2-mkconfig -o /boot/grub2/grub.cfg (RHEL/Fedora/SUSE), and reboot")

    def _by_family(self, debian: str, rhel: str, either: str) -> str:
        if self.family == "debian":
            return debian
        if self.family in ("rhel", "suse"):
            return rhel
        return either

    def grub_update(self) -> str:
        return self._by_family("update-grub", "grub2-mkconfig -o /boot/grub2/grub.cfg",
                               "update-grub or grub2-mkconfig -o /boot/grub2/grub.cfg")

    # -- commands for gpulib setup (argv, run without a shell) --------------------------
    @property
    def grub_key(self) -> str:
        """The /etc/default/grub variable setup edits: Debian's is for normal boots only."""
        return "GRUB_CMDLINE_LINUX_DEFAULT" if self.family == "debian" else "GRUB_CMDLINE_LINUX"

    def boot_config_commands(self, add: tuple[str, ...] = (),
                             remove: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        """What makes an edited /etc/default/grub reach the boot entries ([] if unknown)."""
        if self.family == "debian":
            return [("update-grub",)]
        if self.family == "rhel":
            # BLS entries keep their own options: grubby edits every installed kernel's,
            # /etc/default/grub is for kernels installed later.
            argv = ["grubby", "--update-kernel=ALL"]
            if add:
                argv.append(f"--args={' '.join(add)}")
            if remove:
                argv.append(f"--remove-args={' '.join(remove)}")
            return [tuple(argv)]
        if self.family == "suse":
            return [("grub2-mkconfig", "-o", "/boot/grub2/grub.cfg")]
        return []
