"""What a finding asks for, as data: the doctor prints it, `gpulib setup` applies it.

Each action is one typed step. `render` turns a finding's actions into the fix
text the doctor has always printed, so both commands describe the same thing.
Paths are root-relative (`etc/modprobe.d/x.conf`); rendering shows them as
the host sees them.
"""

from __future__ import annotations

from gpulib.slotted import FrozenSlotted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol, Union

    class Distro(Protocol):
        """What rendering needs of a distribution (`gpulib.doctor.core.Distro`,
        above this module: named by its shape, not imported)."""

        def kernel_args_fix(self, add: str = "", remove: str = "",
                            where: str = "/etc/default/grub") -> str: ...


# Hand-written records (gpulib.slotted), not dataclasses: `gpulib metrics` runs
# the doctor every minute within a budget that dataclasses' import would eat into.


class KernelArgs(FrozenSlotted):
    """Change the kernel command line for good (boot loader config), then reboot."""

    __slots__ = ("add", "remove", "where")
    _fields = ("add", "remove", "where")
    # `where` is where the text says to edit, not what the action is.
    _compared = ("add", "remove")
    add: tuple[str, ...]
    remove: tuple[str, ...]
    # the file the effective value comes from (shown), "" = /etc/default/grub
    where: str

    def __init__(self, add: tuple[str, ...] = (), remove: tuple[str, ...] = (),
                 where: str = "") -> None:
        self._set("add", add)
        self._set("remove", remove)
        self._set("where", where)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "kernel-args", "add": list(self.add), "remove": list(self.remove)}


class WriteFile(FrozenSlotted):
    """Give a file exactly this content (created when missing)."""

    __slots__ = ("content", "mode", "path")
    _fields = ("path", "content", "mode")
    path: str
    content: str
    mode: int

    def __init__(self, path: str, content: str, mode: int = 0o644) -> None:
        self._set("path", path)
        self._set("content", content)
        self._set("mode", mode)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "write-file", "path": "/" + self.path, "content": self.content,
                "mode": f"{self.mode:04o}"}


class RunCommand(FrozenSlotted):
    """Run a command (argv, no shell)."""

    __slots__ = ("argv",)
    _fields = ("argv",)
    argv: tuple[str, ...]

    def __init__(self, argv: tuple[str, ...]) -> None:
        self._set("argv", argv)

    @property
    def shown(self) -> str:
        import shlex  # here: only a fix that runs a command needs it, not a healthy host

        return " ".join(shlex.quote(a) for a in self.argv)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "command", "argv": list(self.argv)}


class Reboot(FrozenSlotted):
    """What the other actions change takes effect at the next boot."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        return {"kind": "reboot"}


class RestartService(FrozenSlotted):
    """A daemon must be restarted to see the change."""

    __slots__ = ("name", "note")
    _fields = ("name", "note")
    name: str
    note: str

    def __init__(self, name: str, note: str = "") -> None:
        self._set("name", name)
        self._set("note", note)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "restart", "service": self.name}


class Manual(FrozenSlotted):
    """Something only the operator can do (firmware setup, a driver install)."""

    __slots__ = ("text",)
    _fields = ("text",)
    text: str

    def __init__(self, text: str) -> None:
        self._set("text", text)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "manual", "text": self.text}


if TYPE_CHECKING:
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
