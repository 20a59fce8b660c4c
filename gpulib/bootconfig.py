"""The kernel command line as the boot configuration sets it: `etc/default/grub`
and, on Debian and Ubuntu, the `etc/default/grub.d/*.cfg` drop-ins.

These files are shell fragments that grub-mkconfig sources one after the
other: `/etc/default/grub` first, then (Debian's grub-mkconfig) every
`/etc/default/grub.d/*.cfg` in the shell's glob order, so a drop-in such as
Ubuntu's cloud images' `50-cloudimg-settings.cfg` overrides what
`/etc/default/grub` says. `BootConfig` reads them in that order and works out
the value grub-mkconfig will see; an edit goes to the assignment that value
comes from, so it takes effect. When the value cannot be known without
running the shell (an assignment under a condition, a command substitution,
a file sourced, a variable gpulib does not know) it is refused with the file
and line named, never guessed.

gpulib reads and edits only the `GRUB_CMDLINE_LINUX*` assignments, and edits
in place: every other line, and the rest of the edited line (quotes, spacing,
a trailing comment), stays byte-identical. What it cannot edit safely (a
value continued over several lines, an unterminated quote, text after the
closing quote) it refuses with the line named, rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gpulib.errors import GpulibError
from gpulib.lazyre import lazy
from gpulib.slotted import Slotted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

DEFAULT_GRUB = "etc/default/grub"
GRUB_D = "etc/default/grub.d"
# gpulib's own drop-in: named to come after the others in the glob's (byte) order,
# `50-cloudimg-settings.cfg` and `kdump-tools.cfg` included.
GPULIB_DROP_IN = GRUB_D + "/zz-gpulib.cfg"
DROP_IN_HEADER = ("# gpulib setup: the kernel arguments GPUs in VMs need (grub-mkconfig sources "
                  "this file last)\n")
CMDLINE_KEYS = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT")
# Compiled on first use: the doctor (and with it every `gpulib metrics`)
# imports this module, and only a host with a boot configuration to read uses them.
# The arguments gpulib adds: nothing a shell would expand or split.
_SAFE_ARG = lazy(r"[A-Za-z0-9_.,:=+/@-]+\Z")
_ASSIGN = lazy(r"(?P<lead>[ \t]*(?:export[ \t]+)?)(?P<key>[A-Za-z_][A-Za-z0-9_]*)=")


class BootConfigError(GpulibError):
    """The boot configuration holds what gpulib cannot read or edit safely; `path` is
    the file (as the host sees it)."""

    def __init__(self, message: str, path: str = "/" + DEFAULT_GRUB) -> None:
        super().__init__(message)
        self.path = path


class Assignment(Slotted):
    """`KEY=value` on one line: where the value sits and how it is quoted.

    A hand-written record (gpulib.slotted), as the boot configuration's others:
    the doctor imports this module on every `gpulib metrics`."""

    __slots__ = ("end", "key", "line", "quote", "start", "value")
    _fields = ("line", "key", "quote", "start", "end", "value")

    def __init__(self, line: int, key: str, quote: str, start: int, end: int, value: str
                 ) -> None:
        self.line = line
        self.key = key
        self.quote = quote  # '"', "'" or "" (unquoted)
        self.start = start  # offset of the value (inside the quotes) in the line
        self.end = end
        self.value = value


def check_arg(arg: str) -> str:
    if not _SAFE_ARG.match(arg):
        raise BootConfigError(f"kernel argument {arg!r} holds characters gpulib does not "
                              "write into /etc/default/grub")
    return arg


def _parse_line(number: int, line: str, name: str = "/" + DEFAULT_GRUB
                ) -> Optional[Assignment]:
    m = _ASSIGN.match(line)
    if not m or m.group("key") not in CMDLINE_KEYS:
        return None
    key, pos = m.group("key"), m.end()
    body = line.rstrip("\n")
    where = f"{name} line {number + 1} ({key})"
    if pos < len(body) and body[pos] in "\"'":
        quote = body[pos]
        i = pos + 1
        while i < len(body) and body[i] != quote:
            # inside double quotes a backslash escapes the next character
            i += 2 if quote == '"' and body[i] == "\\" else 1
        if i >= len(body):
            raise BootConfigError(f"{where}: the quote does not close on the same line; edit "
                                  "it by hand", name)
        start, end = pos + 1, i
        after = body[i + 1:]
    else:
        quote = ""
        i = pos
        while i < len(body) and not body[i].isspace() and body[i] != "#":
            if body[i] in "\"'\\$`":
                raise BootConfigError(f"{where}: mixed quoting gpulib does not edit; edit it "
                                      "by hand", name)
            i += 1
        start, end = pos, i
        after = body[i:]
    if after.strip() and not after.strip().startswith("#"):
        raise BootConfigError(f"{where}: text after the value ({after.strip()[:40]!r}); edit "
                              "it by hand", name)
    if after.rstrip().endswith("\\"):
        raise BootConfigError(f"{where}: continued on the next line; edit it by hand", name)
    return Assignment(number, key, quote, start, end, body[start:end])


def assignments(text: str, key: Optional[str] = None,
                name: str = "/" + DEFAULT_GRUB) -> list[Assignment]:
    out = []
    for number, line in enumerate(text.splitlines(keepends=True)):
        found = _parse_line(number, line, name)
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
                 remove: Iterable[str] = (), name: str = "/" + DEFAULT_GRUB) -> str:
    """`text` with `add` appended to and `remove` taken from the last `key=` line.

    Only that line changes (or one line is appended when `key` is not set).
    Idempotent: arguments already there are not added twice.
    """
    add = [check_arg(a) for a in add]
    remove = list(remove)
    found = assignments(text, key, name)
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


# -- the effective value, as grub-mkconfig sources the files ------------------------------

_KEY_WORD = lazy(r"\bGRUB_CMDLINE_LINUX(?:_DEFAULT)?\b")
_KEY_TARGET = lazy(r"\bGRUB_CMDLINE_LINUX(?:_DEFAULT)?\+?=")
# A command's first word: at the line's start or after ; & | ( { or then/do/else.
_COMMAND_START = r"(?:^|[;&|({]|\b(?:then|do|else|elif)\b)\s*"
_OPENS = lazy(_COMMAND_START + r"(if|case|while|until|for|select)\b")
_CLOSES = lazy(_COMMAND_START + r"(fi|esac|done)\b")
_FUNCTION = lazy(r"^\s*(?:function\s+)?[A-Za-z_][A-Za-z0-9_]*\s*\(\s*\)")
_SOURCES = lazy(_COMMAND_START + r"(\.|source|eval)\s")
_REFERENCE = lazy(
    r"\$(?:\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*)|(?P<other>.))")


def drop_in_names(names: Iterable[str]) -> list[str]:
    """The `grub.d/*.cfg` names in the order `for x in grub.d/*.cfg` visits them.

    grub-mkconfig runs under the caller's locale; drop-in names are ASCII
    (`50-cloudimg-settings.cfg`), for which byte order is what the glob gives
    in the C locale, the one update-grub's kernel hooks run with.
    """
    return sorted(n for n in names if n.endswith(".cfg") and not n.startswith("."))


class Source(Slotted):
    """One file grub-mkconfig sources: root-relative path and its text."""

    __slots__ = ("rel", "text")
    _fields = ("rel", "text")

    def __init__(self, rel: str, text: str) -> None:
        self.rel = rel
        self.text = text

    @property
    def shown(self) -> str:
        return "/" + self.rel


def _quoted(line: str) -> list[bool]:
    """For each character: inside quotes or backquotes (the quote characters themselves
    are not), a backslash-escaped character inside double quotes included."""
    out: list[bool] = []
    quote = ""
    escaped = False
    for ch in line:
        if not quote:
            if ch in "\"'`":
                quote = ch
            out.append(False)
        elif escaped:
            escaped = False
            out.append(True)
        elif ch == "\\" and quote in '"`':
            escaped = True
            out.append(True)
        elif ch == quote:
            quote = ""
            out.append(False)
        else:
            out.append(True)
    return out


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` that starts a word, outside quotes)."""
    inside = _quoted(line)
    for i, ch in enumerate(line):
        if ch == "#" and not inside[i] and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _unquoted(code: str) -> str:
    """The line with quoted text and command substitutions blanked out: what is left
    is the shell structure (`if`, `;`, `&&`, `.`) of the line itself. A `(...)` or
    backquoted part runs in a subshell and sets nothing here."""
    inside = _quoted(code)
    text = "".join("_" if q else ch for ch, q in zip(code, inside))
    # $( ... ) and ( ... ) subshells on one line
    previous = None
    while previous != text:
        previous = text
        text = re.sub(r"\$?\([^()]*\)", lambda m: "_" * len(m.group()), text)
    return text


class BootConfig:
    """The boot configuration's files in the order grub-mkconfig reads them, the
    effective `GRUB_CMDLINE_LINUX*` values, and where each was last assigned.

    BootConfigError when the effective value cannot be known without running
    the shell; the message names the file and line.
    """

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self.values: dict[str, str] = {k: "" for k in CMDLINE_KEYS}
        # key -> (index of the source, the assignment) the value comes from
        self.last: dict[str, tuple[int, Assignment]] = {}
        for index, source in enumerate(sources):
            self._read(index, source)

    def _read(self, index: int, source: Source) -> None:
        depth = 0
        for number, raw in enumerate(source.text.splitlines()):
            where = f"{source.shown} line {number + 1}"
            code = _unquoted(_strip_comment(raw))
            if not code.strip():
                continue
            opened = len(_OPENS.findall(code)) + (1 if _FUNCTION.match(code) else 0)
            closed = len(_CLOSES.findall(code)) + (1 if re.match(r"^\s*}", code) else 0)
            if _SOURCES.search(code):
                raise BootConfigError(f"{where} runs other shell code ({code.strip()[:40]!r}): "
                                      "the kernel command line it leads to cannot be known "
                                      "without running it; edit it by hand", source.shown)
            mentions = _KEY_WORD.search(code)
            if not mentions:
                depth = max(0, depth + opened - closed)
                continue
            found = _parse_line(number, raw, source.shown)
            conditional = depth > 0 or opened or closed
            if found is None or conditional:
                if _KEY_TARGET.search(code) or re.search(r"\bunset\b", code):
                    guarded = conditional or re.search(r"&&|\|\|", code)
                    why = ("is assigned under a condition" if guarded else
                           "is set in a way gpulib does not read")
                    raise BootConfigError(
                        f"{where}: {mentions.group()} {why} ({code.strip()[:50]!r}): its "
                        "value cannot be known without running the shell; edit it by hand",
                        source.shown)
                depth = max(0, depth + opened - closed)
                continue  # only read (e.g. GRUB_CMDLINE_XEN="$GRUB_CMDLINE_LINUX")
            self.values[found.key] = self._expand(found, where, source.shown)
            self.last[found.key] = (index, found)

    def _expand(self, a: Assignment, where: str, path: str) -> str:
        if a.quote == "'":
            return a.value
        value = a.value
        if "`" in value or "$(" in value:
            raise BootConfigError(f"{where}: {a.key} holds a command substitution: its value "
                                  "cannot be known without running it; edit it by hand", path)

        def ref(m: re.Match[str]) -> str:
            name = m.group("braced") if m.group("braced") is not None else m.group("plain")
            if name in CMDLINE_KEYS:
                return self.values[name]
            shown = m.group(0)
            raise BootConfigError(f"{where}: {a.key} refers to {shown}, which gpulib does "
                                  "not work out; edit it by hand", path)

        expanded = _REFERENCE.sub(ref, value)
        return re.sub(r"\\([\\\"$`])", r"\1", expanded)

    # -- reading ----------------------------------------------------------------------
    def args(self, key: Optional[str] = None) -> list[str]:
        """The arguments the generated linux lines get (normal boots: both keys)."""
        keys = (key,) if key else CMDLINE_KEYS
        out: list[str] = []
        for k in keys:
            for token in self.values[k].split():
                if token not in out:
                    out.append(token)
        return out

    def words(self) -> list[str]:
        """Every argument of a normal boot's linux line, in its order, repeats kept (the
        last of two intel_iommu= is the one the kernel takes)."""
        return [t for k in CMDLINE_KEYS for t in self.values[k].split()]

    def where(self, key: str) -> str:
        """The file whose assignment of `key` grub-mkconfig ends with (root-relative)."""
        if key in self.last:
            return self.sources[self.last[key][0]].rel
        return self.sources[0].rel if self.sources else DEFAULT_GRUB

    def overridden(self) -> list[str]:
        """Drop-ins that assign a command-line key after /etc/default/grub (shown paths)."""
        return [s.shown for s in self.sources[1:]
                if any(a.key in CMDLINE_KEYS for a in assignments(s.text, None, s.shown))]


# -- editing: only the files that are gpulib's to edit ---------------------------------------


# Arguments whose last value is the one that counts: the kernel's intel_iommu=
# (on and off set the same flag) and vfio-pci's ids (a string parameter: modprobe
# passes every value, the module keeps the last). Not iommu=: a later iommu=pt
# does not undo iommu=off. `-` and `_` are one in parameter names.
_LAST_WINS = frozenset({"intel_iommu", "vfio_pci.ids"})


def superseded(arg: str, args: list[str], add: Iterable[str]) -> bool:
    """`arg` (`name=value`) is still in `args` but an added `name=` comes after it, for
    a name whose last value is the one the kernel takes."""
    name, sep, _ = arg.partition("=")
    name = name.replace("-", "_")
    if not sep or arg not in args or name not in _LAST_WINS:
        return False
    last = max(i for i, a in enumerate(args) if a == arg)
    return any(a.partition("=")[0].replace("-", "_") == name and a in args and
               max(i for i, b in enumerate(args) if b == a) > last for a in add)


def owned_edit(sources: list[Source], key: str, add: Iterable[str] = (),
               remove: Iterable[str] = (), drop_ins: bool = False) -> dict[str, str]:
    """The new text of each file that changes, so that the effective command line
    gains `add` and loses `remove`, editing only the files that are gpulib's to edit:
    /etc/default/grub (the administrator's, made to be edited) and gpulib's own
    drop-in. Other drop-ins belong to other packages (kdump-tools') or to the image
    (a cloud image's): never edited. `add` goes to /etc/default/grub's `key` where that
    takes effect, else (a drop-in sets `key` after it) to gpulib's drop-in, which
    grub-mkconfig sources last and which extends the value
    (`key="$key ..."`). `remove` leaves both keys in both files; one another's file
    still gives is refused, unless an added argument of the same name comes after it.

    BootConfigError, naming the other file, when only that file could do it."""
    add, remove = [check_arg(a) for a in add], list(remove)
    texts = {s.rel: s.text for s in sources}
    for rel in (DEFAULT_GRUB, GPULIB_DROP_IN):
        if rel in texts:
            texts[rel] = _without(texts[rel], remove, "/" + rel)
    attempts = [(DEFAULT_GRUB, edit_cmdline(texts.get(DEFAULT_GRUB, ""), key, add,
                                            name="/" + DEFAULT_GRUB))]
    if drop_ins and add:
        attempts.append((GPULIB_DROP_IN, _extended(texts.get(GPULIB_DROP_IN, ""), key, add)))
    problem = ("", "")
    for rel, text in attempts:
        trial = dict(texts, **{rel: text})
        tried = _effective(trial, drop_ins)
        args = tried.words()
        lost = [a for a in add if a not in args]
        left = [r for r in remove if r in args and not superseded(r, args, add)]
        if not lost and not left:
            texts = trial
            break
        if lost:
            # the file whose assignment of `key` wins over the files gpulib edits
            where = tried.sources[tried.last[key][0]].shown if key in tried.last else \
                "/" + DEFAULT_GRUB
            problem = (f"{where} sets {key} after the files gpulib edits and drops "
                       f"{' '.join(lost)}: edit it by hand", where)
        else:
            where = next((s.shown for s in tried.sources
                          if any(left[0] in a.value.split()
                                 for a in assignments(s.text, None, s.shown))),
                         "/" + DEFAULT_GRUB)
            problem = (f"{left[0]} is set in {where}, a file gpulib does not edit (another "
                       "package's or the image's): remove it there by hand", where)
    else:
        raise BootConfigError(*problem)
    before = {s.rel: s.text for s in sources}
    return {rel: text for rel, text in texts.items() if before.get(rel, "") != text
            or (rel not in before and text)}


def _without(text: str, remove: list[str], name: str) -> str:
    for k in CMDLINE_KEYS:
        text = edit_cmdline(text, k, (), remove, name)
    return text


def _extended(text: str, key: str, add: list[str]) -> str:
    """gpulib's drop-in with `add` appended to its `key="$key ..."` line (made if absent)."""
    found = assignments(text, key, "/" + GPULIB_DROP_IN)
    if found:
        return edit_cmdline(text, key, add, name="/" + GPULIB_DROP_IN)
    if not text:
        text = DROP_IN_HEADER
    sep = "" if text.endswith("\n") else "\n"
    return text + sep + f'{key}="${key} {" ".join(dict.fromkeys(add))}"\n'


def _effective(texts: dict[str, str], drop_ins: bool) -> BootConfig:
    """The configuration the files' texts give, in grub-mkconfig's order."""
    names = drop_in_names(rel[len(GRUB_D) + 1:] for rel in texts
                          if rel.startswith(GRUB_D + "/")) if drop_ins else []
    order = [DEFAULT_GRUB] + [f"{GRUB_D}/{n}" for n in names]
    return BootConfig([Source(rel, texts.get(rel, "")) for rel in order])


def read_sources(read: Callable[[str], Optional[str]], listdir: Callable[[str], Iterable[str]],
                 with_drop_ins: bool) -> list[Source]:
    """The files grub-mkconfig sources, read with the caller's reader (None = absent)."""
    out = [Source(DEFAULT_GRUB, read(DEFAULT_GRUB) or "")]
    if with_drop_ins:
        for name in drop_in_names(listdir(GRUB_D)):
            text = read(f"{GRUB_D}/{name}")
            if text is not None:
                out.append(Source(f"{GRUB_D}/{name}", text))
    return out


def text_reader(read_bytes: Callable[[str], Optional[bytes]]) -> Callable[[str], Optional[str]]:
    """A file's whole text (None: absent or unreadable), for read_sources: line numbers
    and leading blank lines as in the file, unlike an attribute reader's stripped text."""
    def read(rel: str) -> Optional[str]:
        data = read_bytes(rel)
        return None if data is None else data.decode("utf-8", "replace")
    return read


def read_config(read: Callable[[str], Optional[str]], listdir: Callable[[str], Iterable[str]],
                family: str) -> BootConfig:
    """The boot configuration as `family`'s grub-mkconfig reads it (Debian's sources the
    grub.d drop-ins; the others only /etc/default/grub). BootConfigError as BootConfig."""
    from gpulib.distro import Distro

    return BootConfig(read_sources(read, listdir, Distro.of_family(family).grub_drop_ins))
