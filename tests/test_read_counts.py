"""`Sysfs.read_counts` reads many small numbers of one directory exactly as
`read_int` reads each: the same values and the same failures noted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import mdev
from gpulib.pci import PciAddress
from gpulib.sim import faults
from gpulib.sim.faults import FaultySysfs
from gpulib.sysfs import Sysfs

TYPES = "sys/devices/pci0000:10/0000:10:01.0/0000:11:00.4/mdev_supported_types"
LINKED = "sys/bus/pci/devices/0000:11:00.4/mdev_supported_types"

# name -> what to put there (bytes: a file; a str: a special kind)
CASES: dict[str, object] = {
    "plain": b"3\n",
    "zero": b"0\n",
    "padded": b"  7  \n",
    "empty": b"",
    "negative": b"-1\n",
    "too-large": b"2000000\n",
    "long-number": b"1" * 30 + b"\n",
    "not-a-number": b"lots\n",
    "hex": b"0x10\n",
    "underscore": b"1_0\n",
    "unicode-digit": "\u0663\n".encode(),
    "undecodable": b"\xff\xfe\n",
    "exactly-64": b"1".rjust(63, b" ") + b"\n",
    "longer-than-a-read": b" " * 100 + b"5\n",
    "over-the-bound": b"1" * (64 * 1024 + 10),
    "missing": "missing",
    "fifo": "fifo",
    "directory": "directory",
    "symlink": "symlink",
    "dangling": "dangling",
}


def _build(root: Path) -> list[str]:
    base = root / TYPES
    names = []
    for case, what in CASES.items():
        d = base / f"nvidia-{case}"
        d.mkdir(parents=True)
        f = d / "available_instances"
        if isinstance(what, bytes):
            f.write_bytes(what)
        elif what == "fifo":
            os.mkfifo(f)
        elif what == "directory":
            f.mkdir()
        elif what == "symlink":
            (d / "real").write_bytes(b"4\n")
            f.symlink_to("real")
        elif what == "dangling":
            f.symlink_to("nowhere")
        names.append(f"nvidia-{case}/available_instances")
    link = root / LINKED
    link.parent.mkdir(parents=True)
    link.parent.rmdir()
    (root / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
    os.symlink("../../../devices/pci0000:10/0000:10:01.0/0000:11:00.4",
               root / "sys/bus/pci/devices/0000:11:00.4")
    return names


@pytest.mark.parametrize("rel_dir", [TYPES, LINKED])
def test_read_counts_is_read_int_file_by_file(tmp_path: Path, rel_dir: str) -> None:
    names = _build(tmp_path)
    one_by_one = Sysfs(str(tmp_path))
    expected = [one_by_one.read_int(f"{rel_dir}/{n}", low=0, high=1 << 20) for n in names]
    batch = Sysfs(str(tmp_path))
    assert batch.read_counts(rel_dir, names, high=1 << 20) == expected
    assert batch.failures == one_by_one.failures
    # What the cases are for: plain numbers read, every odd file refused.
    by_case = dict(zip(CASES, expected))
    assert (by_case["plain"], by_case["zero"], by_case["padded"]) == (3, 0, 7)
    assert by_case["longer-than-a-read"] == 5 and by_case["unicode-digit"] == 3
    assert {c for c, v in by_case.items() if v is None} == {
        "empty", "negative", "too-large", "long-number", "not-a-number", "hex",
        "undecodable", "over-the-bound", "missing", "fifo", "directory", "symlink",
        "dangling"}
    noted = {rel.split("/")[-2] for rel, _ in batch.failures}
    assert noted == {"nvidia-negative", "nvidia-too-large", "nvidia-long-number",
                     "nvidia-over-the-bound", "nvidia-fifo", "nvidia-directory",
                     "nvidia-symlink", "nvidia-dangling"}


def test_a_directory_that_cannot_be_opened_reads_each_file(tmp_path: Path) -> None:
    sysfs = Sysfs(str(tmp_path))
    assert sysfs.read_counts(f"{TYPES}/absent", ["a/available_instances"], high=9) == [None]
    assert sysfs.failures == []


def test_faults_are_consulted(tmp_path: Path) -> None:
    names = _build(tmp_path)
    faults.inject(str(tmp_path), f"{TYPES}/nvidia-plain/available_instances", "eio")
    table = faults.load_table(str(tmp_path))
    assert table is not None
    sysfs = FaultySysfs(str(tmp_path), table)
    values = sysfs.read_counts(TYPES, names, high=1 << 20)
    assert values[0] is None and values[1] == 0
    assert sysfs.failures[0][0] == f"{TYPES}/nvidia-plain/available_instances"


def test_available_all_keeps_what_available_once_reads(tmp_path: Path) -> None:
    _build(tmp_path)
    parent = PciAddress.parse("0000:11:00.4")
    sysfs = Sysfs(str(tmp_path))
    types = mdev.list_types(sysfs, parent)
    assert len(types) == len(CASES)
    fresh = Sysfs(str(tmp_path))
    expected = [t.available_once() for t in mdev.list_types(fresh, parent)]
    mdev.available_all(types)
    # Kept: the files changed since are not read again.
    (tmp_path / TYPES / "nvidia-plain/available_instances").write_bytes(b"9\n")
    assert [t.available_once() for t in types] == expected
    assert types[[t.type_id for t in types].index("nvidia-plain")].available_instances == 3


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.binary(max_size=80),
    # numbers as int() may or may not take them: signs, underscores, every
    # kind of white space around, digits of other scripts
    st.from_regex(rb"\A[ \t\n\x0b\x0c\r\x1c-\x1f]{0,3}[+-]?[0-9_]{0,30}[ \t\n\x1c]{0,3}\Z"),
    st.text("0123456789\u0663\u00a0 \n", max_size=30).map(str.encode)), min_size=1, max_size=6))
def test_any_content_reads_as_read_int_reads_it(tmp_path_factory: pytest.TempPathFactory,
                                                contents: list[bytes]) -> None:
    root = tmp_path_factory.mktemp("counts")
    names = []
    for i, data in enumerate(contents):
        d = root / TYPES / f"nvidia-{i}"
        d.mkdir(parents=True)
        (d / "available_instances").write_bytes(data)
        names.append(f"nvidia-{i}/available_instances")
    one_by_one = Sysfs(str(root))
    expected = [one_by_one.read_int(f"{TYPES}/{n}", low=0, high=1 << 20) for n in names]
    batch = Sysfs(str(root))
    assert batch.read_counts(TYPES, names, high=1 << 20) == expected
    assert batch.failures == one_by_one.failures
