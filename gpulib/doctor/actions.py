"""What a finding asks for, as data: the doctor prints it, `gpulib setup` applies it.

Each action is one typed step. `render` turns a finding's actions into the fix
text the doctor has always printed, so both commands describe the same thing.
Paths are root-relative (`etc/modprobe.d/x.conf`); rendering shows them as
the host sees them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from gpulib.doctor.core import Distro


@dataclass(frozen=True)
class KernelArgs:
    """Change the kernel command line for good (boot loader config), then reboot."""

    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    # the file the effective value comes from (shown), "" = /etc/default/grub: where
    # the text says to edit, not what the action is
    where: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "kernel-args", "add": list(self.add), "remove": list(self.remove)}


@dataclass(frozen=True)
class WriteFile:
    """Give a file exactly this content (created when missing)."""

    path: str
    content: str
    mode: int = 0o644

    def to_json(self) -> dict[str, Any]:
        return {"kind": "write-file", "path": "/" + self.path, "content": self.content,
                "mode": f"{self.mode:04o}"}


@dataclass(frozen=True)
class RunCommand:
    """Run a command (argv, no shell)."""

    argv: tuple[str, ...]

    @property
    def shown(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "command", "argv": list(self.argv)}


@dataclass(frozen=True)
class Reboot:
    """What the other actions change takes effect at the next boot."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "reboot"}


@dataclass(frozen=True)
class RestartService:
    """A daemon must be restarted to see the change."""

    name: str
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "restart", "service": self.name}


@dataclass(frozen=True)
class Manual:
    """Something only the operator can do (firmware setup, a driver install)."""

    text: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": "manual", "text": self.text}


Action = Union[KernelArgs, WriteFile, RunCommand, Reboot, RestartService, Manual]


def _printf(content: str) -> str:
    escaped = content.replace("\\", "\\\\").replace("%", "%%").replace("'", "'\\''")
    return "printf '" + escaped.replace("\n", "\\n") + "'"


def render(actions: list[Action], distro: Distro) -> str:
    """The fix text: commands that follow each other are chained with `&&`."""
    lines: list[str] = []
    chain = False  # the last line is a command the next command can follow
    rebooting = False  # a kernel argument change already ends with a reboot
    for action in actions:
        if isinstance(action, KernelArgs):
            lines.append(distro.kernel_args_fix(add=" ".join(action.add),
                                                remove=" ".join(action.remove),
                                                where=action.where or "/etc/default/grub"))
            chain, rebooting = False, True
            continue
        if isinstance(action, WriteFile):
            lines.append(f"{_printf(action.content)} > /{action.path}")
            chain = False
            continue
        if isinstance(action, Manual):
            lines.append(action.text)
            chain = False
            continue
        if isinstance(action, Reboot):
            if rebooting:
                continue
            text = "reboot"
            rebooting = True
        elif isinstance(action, RestartService):
            text = f"systemctl restart {action.name}" + (f" {action.note}" if action.note
                                                          else "")
        else:
            text = action.shown
        if chain and lines:
            lines[-1] += f" && {text}"
        else:
            lines.append(text)
        chain = True
    return "\n".join(lines)
