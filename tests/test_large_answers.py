"""Answers of any size reach the CloudStack agent whole (DESIGN.md section 7).

The agent runs a script through its `Script` class: stderr merged into
stdout, `waitFor` the exit (30 s), and only then its `OutputInterpreter`
reads the pipe to the end. A pipe holds 64 KiB: a process that writes more
and waits for the write to finish never exits, the agent kills it at 30 s
and reads nothing. For discovery that empties the host's report (the
management server marks every GPU of it Error and Unmanaged). These tests
run the executables that way on the largest simulated host, 64 GPUs x 16
VFs x 24 types with 512 running VMs (a report of some 300 KB).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from lxml import etree

from gpulib.sim.hosts import build_large
from tests.conftest import DATA, REPO
from tests.hookrun import BIN, QEMU_HOOK, TRANSFORMER, as_the_agent_runs, hook_env
from tests.test_discovery import check_agent_document

pytestmark = pytest.mark.slow

WRAPPER = REPO / "packaging" / "cloudstack" / "cloudstack-gpudiscovery"
PIPE = 64 * 1024
# "Well inside": a loaded two-core machine, the 64-GPU report included.
WELL_INSIDE = 10


@pytest.fixture(scope="module")
def host64() -> Iterator[str]:
    """The 64-GPU host, in memory where the machine has a tmpfs (its 150,000
    files take seconds there, a minute on a busy disk); removed after."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    top = tempfile.mkdtemp(prefix="gpulib-large64.", dir=where)
    try:
        yield build_large(os.path.join(top, "host"), gpus=64).root
    finally:
        shutil.rmtree(top, ignore_errors=True)


def packaged_wrapper(tmp_path: Path) -> str:
    """The discovery script the package installs, running this tree's gpulib."""
    text = WRAPPER.read_text(encoding="utf-8")
    assert "/usr/bin/gpulib " in text
    script = tmp_path / "gpudiscovery.sh"
    script.write_text(text.replace("/usr/bin/gpulib ", f"{BIN / 'gpulib'} "), encoding="utf-8")
    script.chmod(0o755)
    return str(script)


def test_discovery_the_agents_way_on_64_gpus_gets_the_whole_report(
        host64: str, tmp_path: Path) -> None:
    """Reproduction: 16 GPUs x 16 VFs with 128 VMs wrote a 74,547-byte
    report; gpulib (and the packaged script that printed what it kept)
    blocked on the full pipe until the agent's timeout."""
    for argv in ([packaged_wrapper(tmp_path)],
                 [str(BIN / "gpulib"), "discover", "--format", "cloudstack"]):
        code, took, out = as_the_agent_runs(argv, host64)
        assert code == 0, (argv, out[-300:])
        assert took < WELL_INSIDE, (argv, took)
        assert len(out) > 4 * PIPE
        doc = json.loads(out)  # whole: it parses, and every GPU, VF and VM is in it
        check_agent_document(doc)
        assert len(doc["gpus"]) == 64
        assert sum(len(g["vgpu_instances"]) for g in doc["gpus"]) == 512
        assert {g["pci_address"].split(":")[0] for g in doc["gpus"]} == \
            {f"{d:04x}" for d in range(1, 8)} | {"11", "31", "51", "71", "91", "b1", "d1", "f1"}


@pytest.mark.parametrize("args", [["discover", "--format", "json"], ["metrics"],
                                  # The same through click (a form the plain path leaves to it).
                                  ["discover", "-fjson"]])
def test_other_reports_the_agents_way_on_64_gpus(host64: str, args: list[str]) -> None:
    code, took, out = as_the_agent_runs([str(BIN / "gpulib"), *args], host64)
    assert code == 0, out[-300:]
    assert took < WELL_INSIDE, took
    assert len(out) > 3 * PIPE
    if args[0] == "discover":
        assert len(json.loads(out)["gpus"]) == 64
    else:
        assert out.endswith(b"\n") and b"gpulib_" in out.splitlines()[-1]


def _padded(xml: str, size: int) -> str:
    """`xml` with serial consoles added until it is about `size` bytes (a
    domain with many disks or NICs is as large)."""
    one = ("<serial type='pty'><target type='isa-serial' port='0'><model name='isa-serial'/>"
           "</target></serial>\n    ")
    n = (size - len(xml)) // len(one) + 1
    return xml.replace("</devices>", one * n + "</devices>", 1)


def test_the_transformer_the_agents_way_on_64_gpus_answers_a_large_xml(host64: str) -> None:
    # A vGPU gpulib knows, on a free VF of the last GPU (PCI domain 0007).
    made = subprocess.run([str(BIN / "gpulib"), "mdev", "create", "--parent", "0007:f1:01.4",
                           "--type", "nvidia-1150"], env=hook_env(host64), capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    uuid = made.stdout.strip()
    fixture = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text(encoding="utf-8")
    xml = _padded(fixture.replace("6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d", uuid), 110 * 1024)
    assert PIPE < len(xml.encode()) < 128 * 1024  # above the pipe, below argv's limit
    code, took, out = as_the_agent_runs([TRANSFORMER, "transform", xml], host64)
    assert code == 0, out[-300:]
    assert took < WELL_INSIDE, took
    dom = etree.fromstring(out)
    assert len(dom.findall("devices/serial")) == xml.count("<serial ")
    assert [a.get("uuid") for a in dom.findall("devices/hostdev/source/address")] == [uuid]


def test_the_qemu_hooks_xml_answer_the_agents_way(host64: str) -> None:
    # `migrate begin` prints the whole domain (libvirt takes it as the new
    # XML): 1 MiB of it, read after the exit.
    fixture = (DATA / "cloudstack-xml" / "no-gpu.xml").read_text(encoding="utf-8")
    xml = _padded(fixture, 1024 * 1024)
    name = etree.fromstring(xml.encode()).findtext("name")
    assert name
    code, took, out = as_the_agent_runs([QEMU_HOOK, name, "migrate", "begin", "-"], host64,
                                        stdin=xml.encode())
    assert code == 0, out[-300:]
    assert took < WELL_INSIDE, took
    assert out == xml.encode()


def test_the_rest_of_an_answer_holds_no_lock(tmp_path: Path) -> None:
    """The process that writes what the pipe did not take outlives the
    command: it keeps none of the command's descriptors but the pipe, so a
    reader slow to read never holds a lock of gpulib's (the installation's,
    the state's) through it."""
    lock = tmp_path / "lock"
    lock.touch()
    program = ("import fcntl, os, sys\n"
               "from gpulib.process import exit_now, write_stdout\n"
               f"fd = os.open({str(lock)!r}, os.O_RDONLY)\n"
               "fcntl.flock(fd, fcntl.LOCK_SH)\n"
               f"write_stdout('x' * {4 * PIPE})\n"
               "exit_now(0)\n")
    read, write = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-c", program], stdout=write, timeout=30)
        assert proc.returncode == 0
        # The answer is still in flight (nothing read yet), its lock is not.
        probe = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
    finally:
        os.close(write)
    got = b""
    while True:
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        got += chunk
    os.close(read)
    assert got == b"x" * (4 * PIPE)
