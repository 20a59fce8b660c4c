"""The kernel command line as the boot configuration sets it: `etc/default/grub`.

`/etc/default/grub` is a shell fragment. gpulib reads and edits only the
`GRUB_CMDLINE_LINUX*` assignments, and edits in place: every other line, and
the rest of the edited line (quotes, spacing, a trailing comment), stays
byte-identical. What it cannot edit safely (a value continued over several
lines, an unterminated quote, text after the closing quote) it refuses with
the line named, rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from gpulib.errors import GpulibError

DEFAULT_GRUB = "etc/default/grub"
CMDLINE_KEYS = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT")
# The arguments gpulib adds: nothing a shell would expand or split.
_SAFE_ARG = re.compile(r"[A-Za-z0-9_.,:=+/@-]+\Z")
_ASSIGN = re.compile(r"(?P<lead>[ \t]*(?:export[ \t]+)?)(?P<key>[A-Za-z_][A-Za-z0-9_]*)=")


class BootConfigError(GpulibError):
    """/etc/default/grub holds what gpulib cannot edit safely."""


@dataclass
class Assignment:
    """`KEY=value` on one line: where the value sits and how it is quoted."""

    line: int
    key: str
    quote: str  # '"', "'" or "" (unquoted)
    start: int  # offset of the value (inside the quotes) in the line
    end: int
    value: str


def check_arg(arg: str) -> str:
    if not _SAFE_ARG.match(arg):
        raise BootConfigError(f"kernel argument {arg!r} holds characters gpulib does not "
                              "write into /etc/default/grub")
    return arg


def _parse_line(number: int, line: str) -> Optional[Assignment]:
    m = _ASSIGN.match(line)
    if not m or m.group("key") not in CMDLINE_KEYS:
        return None
    key, pos = m.group("key"), m.end()
    body = line.rstrip("\n")
    where = f"/etc/default/grub line {number + 1} ({key})"
    if pos < len(body) and body[pos] in "\"'":
        quote = body[pos]
        i = pos + 1
        while i < len(body) and body[i] != quote:
            # inside double quotes a backslash escapes the next character
            i += 2 if quote == '"' and body[i] == "\\" else 1
        if i >= len(body):
            raise BootConfigError(f"{where}: the quote does not close on the same line; edit "
                                  "it by hand")
        start, end = pos + 1, i
        after = body[i + 1:]
    else:
        quote = ""
        i = pos
        while i < len(body) and not body[i].isspace() and body[i] != "#":
            if body[i] in "\"'\\$`":
                raise BootConfigError(f"{where}: mixed quoting gpulib does not edit; edit it "
                                      "by hand")
            i += 1
        start, end = pos, i
        after = body[i:]
    if after.strip() and not after.strip().startswith("#"):
        raise BootConfigError(f"{where}: text after the value ({after.strip()[:40]!r}); edit "
                              "it by hand")
    if after.rstrip().endswith("\\"):
        raise BootConfigError(f"{where}: continued on the next line; edit it by hand")
    return Assignment(number, key, quote, start, end, body[start:end])


def assignments(text: str, key: Optional[str] = None) -> list[Assignment]:
    out = []
    for number, line in enumerate(text.splitlines(keepends=True)):
        found = _parse_line(number, line)
        if found and (key is None or found.key == key):
            out.append(found)
    return out


def configured_args(text: str) -> list[str]:
    """Every argument GRUB_CMDLINE_LINUX and GRUB_CMDLINE_LINUX_DEFAULT give.

    Later assignments usually extend earlier ones (`"$GRUB_CMDLINE_LINUX x"`),
    so all are read; shell references themselves are not arguments.
    """
    out: list[str] = []
    for a in assignments(text):
        for token in a.value.split():
            if not token.startswith("$") and token not in out:
                out.append(token)
    return out


def _edit_value(value: str, add: Iterable[str], remove: Iterable[str]) -> str:
    drop = set(remove)
    dropped = False
    kept: list[tuple[str, str]] = []  # (whitespace before, token)
    last = 0
    for m in re.finditer(r"\S+", value):
        gap, token = value[last:m.start()], m.group()
        last = m.end()
        if token in drop:
            dropped = True
            continue
        kept.append((gap, token))
    tail = value[last:]
    # the first kept token keeps the value's leading whitespace, not a removed one's gap
    lead = re.match(r"\s*", value)
    if kept:
        kept[0] = (lead.group() if lead else "", kept[0][1])
    present = {t for _, t in kept}
    new = [a for a in dict.fromkeys(add) if a not in present]
    if not dropped and not new:
        return value
    for arg in new:
        kept.append((" " if kept else "", arg))
    return "".join(g + t for g, t in kept) + (tail if kept else "")


def edit_cmdline(text: str, key: str, add: Iterable[str] = (),
                 remove: Iterable[str] = ()) -> str:
    """`text` with `add` appended to and `remove` taken from the last `key=` line.

    Only that line changes (or one line is appended when `key` is not set).
    Idempotent: arguments already there are not added twice.
    """
    add = [check_arg(a) for a in add]
    remove = list(remove)
    found = assignments(text, key)
    lines = text.splitlines(keepends=True)
    if not found:
        if not add:
            return text
        sep = "" if not text or text.endswith("\n") else "\n"
        return text + sep + f'{key}="{" ".join(add)}"\n'
    # A token the earlier assignments hold is removed from them too.
    for a in found[:-1]:
        if any(t in remove for t in a.value.split()):
            lines[a.line] = _replace(lines[a.line], a, _edit_value(a.value, (), remove))
    a = found[-1]
    new_value = _edit_value(a.value, add, remove)
    if new_value != a.value:
        lines[a.line] = _replace(lines[a.line], a, new_value)
    return "".join(lines)


def _replace(line: str, a: Assignment, value: str) -> str:
    if not a.quote and re.search(r"\s", value):
        # an unquoted value that now holds spaces needs quotes to stay one word
        return line[:a.start] + f'"{value}"' + line[a.end:]
    return line[:a.start] + value + line[a.end:]
