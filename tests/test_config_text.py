"""gpulib.conf read without configparser (`config.simple_ini`): the same answer
as configparser, or none at all (then configparser reads the file)."""

from __future__ import annotations

import configparser
from pathlib import Path
from typing import Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib.config import Config, simple_ini

REPO = Path(__file__).resolve().parent.parent


def configparser_reads(text: str) -> Optional[dict[str, dict[str, str]]]:
    """What gpulib's strict configparser makes of `text`; None if it refuses it."""
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    try:
        parser.read_string(text)
    except configparser.Error:
        return None
    return {name: dict(parser[name].items()) for name in parser.sections()}


# Lines of the kinds a gpulib.conf holds, and the odd ones around them.
WORDS = st.text(alphabet="abcXYZ_- .=:;#[]\t\r", min_size=0, max_size=8)
NAMES = st.sampled_from(["log", "allocator", "pool a", "Pool A", "DEFAULT", " x ", "a]b", ""])
LINES = st.one_of(
    st.builds(lambda n: f"[{n}]", NAMES),
    st.builds(lambda k, d, v: f"{k}{d}{v}", WORDS, st.sampled_from(["=", ":", " = ", ": "]),
              WORDS),
    st.builds(lambda c, t: f"{c}{t}", st.sampled_from(["#", ";", "  #", "\t;"]), WORDS),
    st.builds(lambda i, t: f"{i}{t}", st.sampled_from([" ", "\t", "  "]), WORDS),
    st.just(""), st.just("   "), WORDS,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(LINES, max_size=12), st.sampled_from(["\n", "\r\n"]))
def test_the_quick_reader_agrees_with_configparser_or_steps_aside(lines: list[str],
                                                                  end: str) -> None:
    text = end.join(lines)
    quick = simple_ini(text)
    if quick is not None:
        assert quick == configparser_reads(text)


SIMPLE_KEYS = st.text(alphabet="abcdefXYZ_-", min_size=1, max_size=8)
SIMPLE_VALUES = st.text(alphabet="abc 0123,.=:/-", max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["log", "allocator", "pool gold", "transformer"]),
                       st.dictionaries(SIMPLE_KEYS, SIMPLE_VALUES, max_size=5), max_size=4),
       st.booleans())
def test_a_plain_file_is_read_without_configparser(
        doc: dict[str, dict[str, str]], comments: bool) -> None:
    # Keys are written as given, in any case; keys differing only in case
    # are one key to configparser (given twice: its error), so one of each.
    lines = []
    expected: dict[str, dict[str, str]] = {}
    for section, items in doc.items():
        lines.append(f"[{section}]")
        if comments:
            lines.append("# a comment")
        found = expected[section] = {}
        for k, v in items.items():
            if k.lower() not in found:
                found[k.lower()] = v.strip()
                lines.append(f"{k} = {v}")
        lines.append("")
    text = "\n".join(lines)
    assert simple_ini(text) == expected == configparser_reads(text)


def test_keys_are_read_in_lower_case_as_configparser_reads_them(tmp_path: Path) -> None:
    text = "[state]\nLock_Timeout = 7\n[log]\nLEVEL = debug\n"
    assert simple_ini(text) == configparser_reads(text) == \
        {"state": {"lock_timeout": "7"}, "log": {"level": "debug"}}
    conf = tmp_path / "gpulib.conf"
    conf.write_text(text)
    config = Config.load(str(conf))
    assert config.get_float("state", "lock_timeout") == 7.0
    assert config.get("log", "level") == "debug"


def test_what_configparser_must_read_is_left_to_it(tmp_path: Path) -> None:
    for text in ("[log]\nlevel = info\n  debug\n",       # a continuation line
                 "[DEFAULT]\nlevel = info\n[log]\n",      # copied into every section
                 "[log]\nlevel = info\nlevel = debug\n",  # given twice: its error
                 "level = info\n",                         # no section
                 "[log]\nlevel\n"):                        # no value
        assert simple_ini(text) is None
    # ... and its answer (or its error) is what gpulib takes.
    conf = tmp_path / "gpulib.conf"
    conf.write_text("[log]\nlevel = debug\nlevel = info\n")
    lenient = Config.load(str(conf), lenient=True)
    assert any("given twice" in p for p in lenient.problems)
    assert lenient.get("log", "level") == "info"


def test_the_shipped_configuration_is_read_without_configparser() -> None:
    text = (REPO / "etc" / "gpulib" / "gpulib.conf").read_text()
    # All comments: the defaults, as configparser would have them.
    assert simple_ini(text) == configparser_reads(text) == {}
    # The example with every key set ("# key = value" taken in).
    example = (REPO / "etc" / "gpulib" / "gpulib.conf.example").read_text()
    active = "\n".join(line[2:] if line.startswith("# ") and " = " in line else line
                        for line in example.splitlines())
    assert simple_ini(active) == configparser_reads(active)
    assert simple_ini(active)["log"]
