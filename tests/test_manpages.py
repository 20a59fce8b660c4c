"""The man pages as a reader sees them: rendered by groff, then the text checked.

The markup is not matched with regular expressions: a missing `.TP`, a font
escape that lost its backslash or quotes that troff eats all look right in
the source and wrong on the page. Each page is rendered wide (no line of a
command's synopsis wraps) and without hyphenation, so a tag (a `.TP`
paragraph's first line) is a line indented 7 columns and its text is
indented 14. The EXAMPLES of gpulib(1) are parsed by gpulib's own command
line, as a reader pasting them would run them.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path

import click
import pytest

from gpulib.config import DEFAULTS, POOL_KEYS

MAN = Path(__file__).resolve().parents[1] / "man"
PAGES = sorted(p.name for p in MAN.iterdir())
HOOK_PAGES = {
    "libvirt-vm-xml-transformer": "gpulib.hooks.transformer",
    "libvirt-vm-state-change": "gpulib.hooks.statechange",
    "gpulib-qemu-hook": "gpulib.hooks.qemu",
}
TAG = " " * 7
needs_groff = pytest.mark.skipif(shutil.which("groff") is None,
                                 reason="groff (groff-base) is not installed")
pytestmark = needs_groff


@cache
def rendered(page: str) -> str:
    """The page as plain text: 300 columns, no hyphenation, no bold or
    underline (grotty's -c mode without its overstrikes), every warning on."""
    r = subprocess.run(["groff", "-man", "-Tutf8", "-P-cbou", "-rLL=300n", "-rHY=0", "-ww",
                        str(MAN / page)], capture_output=True, text=True,
                       env={**os.environ, "LC_ALL": "C.UTF-8"}, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout


def sections(page: str) -> dict[str, list[str]]:
    """Section heading -> its lines (the running header and footer left out)."""
    out: dict[str, list[str]] = {}
    lines = rendered(page).splitlines()
    current: list[str] = []
    for line in lines[1:-1]:
        if line and not line[0].isspace():
            current = out.setdefault(line.strip(), [])
        else:
            current.append(line)
    return out


def tags(lines: list[str]) -> list[str]:
    return [line[len(TAG):] for line in lines
            if line.startswith(TAG) and not line[len(TAG)].isspace()]


def paragraphs(lines: list[str]) -> dict[str, str]:
    """Each tag with its text, the text's lines joined."""
    out: dict[str, str] = {}
    tag = None
    for line in lines:
        if line.startswith(TAG) and not line[len(TAG)].isspace():
            tag = line[len(TAG):]
            out[tag] = ""
        elif tag is not None and line.strip():
            out[tag] += " " + line.strip()
    return out


def cli_commands() -> dict[str, click.Command]:
    """Every command of gpulib by its full name ("mdev list")."""
    from gpulib.cli import cli

    out: dict[str, click.Command] = {}
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        cmd = cli.get_command(ctx, name)
        assert cmd is not None
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(click.Context(cmd)):
                found = cmd.get_command(click.Context(cmd), sub)
                assert found is not None
                out[f"{name} {sub}"] = found
        else:
            out[name] = cmd
    return out


def command_tags() -> dict[str, str]:
    """gpulib(1)'s COMMANDS: each command's tag (its synopsis) by command."""
    found: dict[str, str] = {}
    for tag in tags(sections("gpulib.1")["COMMANDS"]):
        name = next((n for n in sorted(cli_commands(), key=len, reverse=True)
                     if tag == n or tag.startswith(n + " ")), None)
        assert name is not None, f"a paragraph of COMMANDS names no command: {tag!r}"
        assert name not in found, f"{name} is described twice"
        found[name] = tag
    return found


# -- every page ------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES)
def test_page_renders_to_plain_words(page: str) -> None:
    text = rendered(page)
    # A font escape that lost its backslash shows its letter: "R[", "B--".
    assert "\\" not in text and not re.search(r"(?<![\w-])[BIR](?:\[|--|-\w)", text), \
        re.search(r".*(?:\\|(?<![\w-])[BIR](?:\[|--|-\w)).*", text)
    assert {"NAME", "SYNOPSIS", "DESCRIPTION", "SEE ALSO"} <= set(sections(page))


@pytest.mark.skipif(shutil.which("man") is None, reason="man (man-db) is not installed")
@pytest.mark.parametrize("page", PAGES)
def test_page_renders_without_warnings_through_man(page: str) -> None:
    r = subprocess.run(["man", "--warnings", "-l", "-Tutf8", str(MAN / page)],
                       capture_output=True, text=True,
                       env={**os.environ, "LC_ALL": "C.UTF-8", "MANWIDTH": "80"})
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


# -- gpulib(1) -------------------------------------------------------------------------

def test_every_command_has_its_own_paragraph() -> None:
    # A command whose paragraph lost its .TP runs into the one before it.
    missing = sorted(set(cli_commands()) - set(command_tags()))
    assert not missing, f"gpulib(1) COMMANDS does not describe: {missing}"


@pytest.mark.parametrize("name", sorted(cli_commands()))
def test_each_synopsis_names_the_commands_options(name: str) -> None:
    cmd = cli_commands()[name]
    tag = command_tags()[name][len(name):]
    given = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", tag))
    options = [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]
    known = {o for p in options for o in [*p.opts, *p.secondary_opts]} | {"-"}
    assert given <= known, f"{name}: the synopsis names {sorted(given - known)}"
    left_out = [p.opts[0] for p in options if not given & {*p.opts, *p.secondary_opts}]
    assert not left_out, f"{name}: the synopsis leaves out {left_out}"
    for arg in (p for p in cmd.params if isinstance(p, click.Argument)):
        shown = arg.metavar or (arg.name or "").upper()
        assert shown.strip("[].") in tag, f"{name}: the synopsis does not name {shown}"


def _parse(argv: list[str]) -> None:
    """gpulib's command line takes `argv` (click's UsageError otherwise)."""
    from gpulib.cli import cli

    ctx = cli.make_context("gpulib", list(argv))
    cmd: click.Command = cli
    while isinstance(cmd, click.Group):
        # click 8.2 and later keep the words before the subcommand's privately.
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") \
            else ctx.protected_args
        rest = [*protected, *ctx.args]
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        ctx = sub.make_context(name, rest, parent=ctx)
        cmd = sub


def example_commands() -> list[list[str]]:
    """The EXAMPLES' gpulib command lines as a shell would split them."""
    out = []
    for line in sections("gpulib.1")["EXAMPLES"]:
        words = shlex.split(line) if line.startswith(" " * 14) else []
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words.pop(0)  # VARIABLE=value before the command
        if words[:1] == ["gpulib"]:
            out.append(words[1:])
    return out


def test_the_examples_run_as_printed() -> None:
    examples = example_commands()
    assert len(examples) >= 6
    for argv in examples:
        try:
            _parse(argv)
        except click.UsageError as exc:
            pytest.fail(f"gpulib {shlex.join(argv)}: {exc.format_message()}")
    assert ["attach", "web1", "--profile", "GRID T4-2Q", "--count", "2", "--dry-run"] \
        in examples


def test_the_parser_check_refuses_a_pasted_example_without_its_quotes() -> None:
    with pytest.raises(click.UsageError):
        _parse(["attach", "web1", "--profile", "GRID", "T4-2Q", "--count", "2"])


def test_other_programs_are_named_where_they_run() -> None:
    text = " ".join(" ".join(sections("gpulib.1")["DESCRIPTION"]).split())
    for program in ("virsh(1)", "nvidia-smi", "update-grub", "grubby", "dracut", "sh(1)"):
        assert program in text, program
    assert "runs no external command" not in rendered("gpulib.1")


# -- gpulib.conf(5) --------------------------------------------------------------------

def test_config_page_lists_every_key_with_its_default() -> None:
    found = sections("gpulib.conf.5")
    for section, keys in DEFAULTS.items():
        assert f"[{section}]" in found, section
        described = paragraphs(found[f"[{section}]"])
        for key, (default, _kind) in keys.items():
            tag = next((t for t in described if t.split()[0] == key), None)
            assert tag is not None, f"[{section}] {key} is not described"
            if default:
                assert f"Default: {default}." in described[tag] or \
                    f"{default} (the default)" in described[tag], \
                    f"[{section}] {key}: its default {default} is not named"
    pool = next(found[s] for s in found if s.startswith("[pool"))
    assert {t.split()[0] for t in tags(pool)} >= set(POOL_KEYS)


# -- the hooks' pages ------------------------------------------------------------------

@pytest.mark.parametrize(("page", "module"), sorted(HOOK_PAGES.items()))
def test_hook_page_lists_the_hooks_exit_codes(page: str, module: str) -> None:
    doc = importlib.import_module(module).__doc__ or ""
    codes = re.findall(r"(\d) [a-z]", doc[doc.index("Exit codes:"):])
    listed = [t.split()[0] for t in tags(sections(f"{page}.8")["EXIT STATUS"])]
    assert sorted(set(codes)) == sorted(listed)
