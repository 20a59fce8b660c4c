"""The /etc/default/grub editor: one line changes, quoting kept, idempotent."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import bootconfig as bc

KEY = "GRUB_CMDLINE_LINUX_DEFAULT"
token = st.from_regex(r"[a-z][a-z0-9_.]{0,8}(=[a-z0-9,:.]{1,8})?", fullmatch=True)
space = st.sampled_from([" ", "  ", "\t"])
other_line = st.one_of(
    st.from_regex(r"#[ -~]{0,30}", fullmatch=True),
    st.from_regex(r"GRUB_[A-Z]{1,10}=[a-z0-9]{0,6}", fullmatch=True),
    st.just('GRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`'),
    st.just(""),
)


@st.composite
def grub_file(draw: st.DrawFn) -> tuple[str, list[str], str]:
    tokens = draw(st.lists(token, max_size=6, unique=True))
    quote = draw(st.sampled_from(['"', "'", ""] if len(tokens) <= 1 else ['"', "'"]))
    gaps = [draw(space) for _ in tokens]
    value = draw(st.sampled_from(["", " "] if quote else [""])) + "".join(
        (gaps[i] if i else "") + t for i, t in enumerate(tokens))
    comment = draw(st.sampled_from(["", "  # kernel arguments"]))
    line = f"{KEY}={quote}{value}{quote}{comment}"
    before = draw(st.lists(other_line, max_size=4))
    after = draw(st.lists(other_line, max_size=4))
    text = "\n".join([*before, line, *after]) + draw(st.sampled_from(["\n", ""]))
    return text, tokens, quote


def args_of(text: str) -> list[str]:
    (a,) = [x for x in bc.assignments(text, KEY)]
    return a.value.split()


@settings(max_examples=300, deadline=None)
@given(grub_file(), st.lists(token, max_size=4, unique=True),
       st.lists(token, max_size=3, unique=True))
def test_edit_changes_one_line_keeps_quoting_and_is_idempotent(
        case: tuple[str, list[str], str], add: list[str], remove: list[str]) -> None:
    text, tokens, quote = case
    add = [a for a in add if a not in remove]
    edited = bc.edit_cmdline(text, KEY, add, remove)
    # the arguments: the old ones minus `remove`, then the new ones, each once
    expected = [t for t in tokens if t not in remove]
    expected += [a for a in add if a not in expected]
    assert args_of(edited) == expected
    # every other line is byte-identical, and the edited line keeps its quote character
    old_lines, new_lines = text.splitlines(keepends=True), edited.splitlines(keepends=True)
    assert len(old_lines) == len(new_lines)
    changed = [i for i, (o, n) in enumerate(zip(old_lines, new_lines)) if o != n]
    assert len(changed) <= 1
    for i in changed:
        assert old_lines[i].startswith(KEY) and new_lines[i].endswith(
            old_lines[i][len(old_lines[i].rstrip("\n")):])
        if quote:
            assert new_lines[i].startswith(f"{KEY}={quote}")
        elif len(expected) > 1:
            assert new_lines[i].startswith(f'{KEY}="')
    if not add and not any(t in remove for t in tokens):
        assert edited == text
    # idempotent: applying the same edit again changes nothing
    assert bc.edit_cmdline(edited, KEY, add, remove) == edited
    # and what it wrote reads back as the configured arguments
    assert [t for t in bc.configured_args(edited)] == expected


def test_missing_key_is_appended_as_one_line() -> None:
    text = "GRUB_DEFAULT=0\nGRUB_TIMEOUT=5"
    edited = bc.edit_cmdline(text, "GRUB_CMDLINE_LINUX", ["intel_iommu=on", "iommu=pt"])
    assert edited == text + '\nGRUB_CMDLINE_LINUX="intel_iommu=on iommu=pt"\n'


def test_last_assignment_is_edited() -> None:
    text = 'GRUB_CMDLINE_LINUX="a"\nGRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX b"\n'
    edited = bc.edit_cmdline(text, "GRUB_CMDLINE_LINUX", ["c"], ["a"])
    assert edited == 'GRUB_CMDLINE_LINUX=""\nGRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX b c"\n'
    assert bc.configured_args(edited) == ["b", "c"]


@pytest.mark.parametrize("line", [
    'GRUB_CMDLINE_LINUX_DEFAULT="quiet',  # quote does not close on the line
    'GRUB_CMDLINE_LINUX_DEFAULT="quiet" splash',  # text after the value
    "GRUB_CMDLINE_LINUX_DEFAULT=quiet\\",  # continued
    'GRUB_CMDLINE_LINUX_DEFAULT=a"b c"',  # mixed quoting
])
def test_what_cannot_be_edited_safely_is_refused(line: str) -> None:
    with pytest.raises(bc.BootConfigError, match="by hand"):
        bc.edit_cmdline(line + "\n", KEY, ["iommu=pt"])


@pytest.mark.parametrize("arg", ["a b", "x=$(reboot)", 'q"', "", "`id`"])
def test_unsafe_arguments_are_not_written(arg: str) -> None:
    with pytest.raises(bc.BootConfigError):
        bc.edit_cmdline(f'{KEY}="quiet"\n', KEY, [arg])


# -- the effective value over /etc/default/grub and its drop-ins -------------------------

KEYS = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT")


@st.composite
def cmdline_line(draw: st.DrawFn) -> str:
    key = draw(st.sampled_from(KEYS))
    words = draw(st.lists(token, max_size=3))
    kind = draw(st.sampled_from(["set", "extend", "braced", "single", "other", "export"]))
    value = " ".join(words)
    if kind == "extend":
        return f'{key}="${draw(st.sampled_from(KEYS))} {value}"'
    if kind == "braced":
        return f'{key}="{value} ${{{draw(st.sampled_from(KEYS))}}}"'
    if kind == "single":
        return f"{key}='{value}'"
    if kind == "export":
        return f'export {key}="{value}"'
    if kind == "other":
        return draw(other_line)
    return f'{key}="{value}"  # set here'


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(cmdline_line(), max_size=4), min_size=1, max_size=4))
def test_the_effective_value_is_what_the_shell_sources(tmp_path_factory: Any,
                                                     files: list[list[str]]) -> None:
    """BootConfig agrees with sh sourcing the files in grub-mkconfig's order."""
    base = tmp_path_factory.mktemp("grub")
    sources = [bc.Source(bc.DEFAULT_GRUB if i == 0 else f"{bc.GRUB_D}/{i:02d}-x.cfg",
                         "\n".join(lines) + "\n") for i, lines in enumerate(files)]
    for s in sources:
        path = base / s.rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(s.text)
    script = (f'. "{base}/{bc.DEFAULT_GRUB}"; for x in "{base}/{bc.GRUB_D}"/*.cfg; do '
              'if [ -e "$x" ]; then . "$x"; fi; done; '
              'printf "%s\\n%s\\n" "$GRUB_CMDLINE_LINUX" "$GRUB_CMDLINE_LINUX_DEFAULT"')
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}).stdout
    linux, default = out.split("\n")[:2]
    config = bc.BootConfig(sources)
    assert config.values["GRUB_CMDLINE_LINUX"].split() == linux.split()
    assert config.values["GRUB_CMDLINE_LINUX_DEFAULT"].split() == default.split()
    # an edit goes where it takes effect, in the files gpulib edits only (/etc/default/grub
    # or its own drop-in): the shell then sees the added argument
    changes = bc.owned_edit(sources, KEY, ["gpulib.test=1"], drop_ins=True)
    assert set(changes) <= {bc.DEFAULT_GRUB, bc.GPULIB_DROP_IN}
    for rel, text in changes.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(text)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}).stdout
    assert "gpulib.test=1" in out.split()  # on a normal boot's linux line (both keys)
