"""`python -m gpulib.sim launch|shutdown`: libvirt's start and stop on a simulated
host, as scripts/demo uses them: what the hooks and the reports then see is
what they see of a VM libvirt runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import build_demo
from tests.conftest import DATA
from tests.hookrun import BIN, STATE_CHANGE, as_agent, hook_env

GPULIB = str(BIN / "gpulib")


def sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpulib.sim", *args], capture_output=True,
                          text=True, timeout=60)


def status(root: str) -> dict:  # type: ignore[type-arg]
    r = subprocess.run([GPULIB, "status", "--json"], capture_output=True, text=True,
                       env=hook_env(root), timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def transformed(tmp_path: Path) -> tuple[FakeHost, str, Path]:
    """The demo host after the agent's transformer ran for its vGPU VM: the host,
    the VM's name and the XML the transformer returned (in a file)."""
    host = build_demo(str(tmp_path / "demo"))
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    vm = xml.split("<name>", 1)[1].split("<", 1)[0]
    res = as_agent(host.root, xml)
    assert res.returncode == 0, res.stdout
    out = tmp_path / "out.xml"
    out.write_bytes(res.stdout)
    return host, vm, out


def test_a_cloudstack_start_and_stop_as_the_demo_runs_them(tmp_path: Path) -> None:
    host, vm, out = transformed(tmp_path)
    xml = (DATA / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    pending = status(host.root)["allocations"][vm]
    assert (pending["status"], pending["run"]["state"]) == ("pending", "starting")

    assert sim("launch", host.root, str(out)).returncode == 0
    status_file = Path(host.p(f"run/libvirt/qemu/{vm}.xml"))
    assert "<domstatus" in status_file.read_text() and not Path(
        host.p(f"etc/libvirt/qemu/{vm}.xml")).exists()  # transient, as the agent's
    subprocess.run([STATE_CHANGE, "onStart", vm], env=hook_env(host.root), check=True,
                   timeout=60)
    doc = status(host.root)
    assert (doc["allocations"][vm]["status"], doc["allocations"][vm]["run"]["state"]) == (
        "active", "running")
    mdev = xml.split("<address uuid='", 1)[1].split("'", 1)[0]
    assert [v["used_by"] for g in doc["gpus"] for v in g["vgpus"] if v["uuid"] == mdev] == [vm]

    assert sim("shutdown", host.root, vm).returncode == 0
    assert not status_file.exists()
    subprocess.run([STATE_CHANGE, "onStop", vm], env=hook_env(host.root), check=True,
                   timeout=60)
    assert status(host.root)["allocations"] == {}


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    host = build_demo(str(tmp_path / "demo"))
    bad = tmp_path / "bad.xml"
    bad.write_text("<domain><name>x</name></domain>")
    for args in (("launch", host.root, str(bad)), ("launch", str(tmp_path / "none"), str(bad)),
                 ("shutdown", host.root, "../x")):
        r = sim(*args)
        assert r.returncode == 1 and r.stderr.startswith("gpulib.sim: ") and \
            r.stderr.count("\n") == 1, (args, r.stderr)
    assert not (tmp_path / "none").exists()
    assert sim("launch", host.root).returncode == 2


def test_status_says_a_stop_that_did_not_complete_is_over(tmp_path: Path) -> None:
    """The VM stopped and its onStop never came: the allocation is still
    active in the file, and status says what the hooks will do with it."""
    host, vm, out = transformed(tmp_path)
    assert sim("launch", host.root, str(out)).returncode == 0
    subprocess.run([STATE_CHANGE, "onStart", vm], env=hook_env(host.root), check=True,
                   timeout=60)
    assert sim("shutdown", host.root, vm).returncode == 0
    run = status(host.root)["allocations"][vm]["run"]
    assert (run["state"], run["why"]) == ("over", "stopped")
    text = subprocess.run([GPULIB, "status"], capture_output=True, text=True,
                          env=hook_env(host.root), timeout=60).stdout
    assert "over: its stop did not complete" in text and "the next hook releases it" in text
