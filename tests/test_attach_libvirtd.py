"""`gpulib attach` / `detach` and the pipe workflow against a real libvirtd.

The private libvirtd of tests/helpers/libvirtd_env.py (own mount namespace,
gpulib's qemu hook wrapped to run on the simulated demo host); `gpulib attach`
reaches it with `--connect`, `virsh` in the pipe workflow with `-c`. The domains are
TCG (`type='qemu'`); their start fails for lack of VFIO here, after the
hook's `prepare begin` ran, which is what is checked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from lxml import etree

from gpulib.domain import derive_uuid, parse_domain
from gpulib.sim.hosts import DEMO_T4
from tests.helpers.libvirtd_env import (
    PREFIX,
    Env,
    PrivateLibvirtd,
    defining,
    domain_xml,
    marks,
    serving,
    shell_quote,
)
from tests.hookrun import hook_env

GPULIB = Path(sys.executable).parent / "gpulib"
TRANSFORMER = Path(sys.executable).parent / "libvirt-vm-xml-transformer"
GEFORCE = "0000:3b:00.0"
GEFORCE_AUDIO = "0000:3b:00.1"

pytestmark = marks()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return Env(tmp_path_factory.mktemp("attach-libvirtd"))


@pytest.fixture(scope="module")
def libvirtd(env: Env) -> Iterator[PrivateLibvirtd]:
    yield from serving(env)


@pytest.fixture
def define(env: Env, libvirtd: PrivateLibvirtd) -> Iterator[Callable[..., str]]:
    yield from defining(env, libvirtd)


def gpulib(env: Env, daemon: PrivateLibvirtd, *args: str,
           via_environment: bool = False) -> subprocess.CompletedProcess[str]:
    """The CLI as an administrator runs it, on the simulated host, against the daemon
    (named by --connect, or by LIBVIRT_DEFAULT_URI)."""
    environ = hook_env(str(env.root))
    environ.pop("LIBVIRT_DEFAULT_URI", None)
    if via_environment:
        environ["LIBVIRT_DEFAULT_URI"] = daemon.uri
    connect = [] if via_environment else ["--connect", daemon.uri]
    return subprocess.run([str(GPULIB), *args, *connect], capture_output=True,
                          text=True, env=environ, timeout=120, check=False)


def dumpxml(daemon: PrivateLibvirtd, name: str, *flags: str) -> str:
    res = daemon.virsh("dumpxml", *flags, name)
    assert res.returncode == 0, res.stderr
    return res.stdout


def apply_diff(old: str, diff: str) -> str:
    """Apply a unified diff (as `--dry-run` prints it) to `old`."""
    old_lines = old.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    for line in diff.splitlines(keepends=True)[2:]:
        if line.startswith("@@"):
            m = re.match(r"@@ -(\d+)(?:,(\d+))? ", line)
            assert m is not None, line
            start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
            out.extend(old_lines[i:start])
            i = start
        elif line.startswith(" "):
            assert old_lines[i] == line[1:], (old_lines[i], line)
            out.append(line[1:])
            i += 1
        elif line.startswith("-"):
            assert old_lines[i] == line[1:], (old_lines[i], line)
            i += 1
        elif line.startswith("+"):
            out.append(line[1:])
    return "".join(out + old_lines[i:])


def devices_of(xml: str) -> dict[str, Any]:
    """What attach promised, in a form libvirt's normalisation does not change."""
    dom = parse_domain(xml)
    request = dom.metadata_request()
    hostdevs: list[tuple[Any, ...]] = []
    for h in dom.mdev_hostdevs():
        hostdevs.append(("mdev", h.uuid_checked(), h.model, h.display))
    for p in dom.pci_hostdevs():
        g = p.guest_address
        hostdevs.append(("pci", str(p.address), p.managed, p.multifunction,
                         None if g is None else str(g)))
    return {"request": request, "hostdevs": hostdevs}


def test_attach_prepare_detach(env: Env, libvirtd: PrivateLibvirtd,
                               define: Callable[..., str]) -> None:
    name = define("attach")
    original = dumpxml(libvirtd, name, "--inactive")
    duuid = parse_domain(original).uuid_checked()
    uuids = [derive_uuid(duuid, k) for k in range(2)]
    state_before = env.state()
    mdevs_before = env.live_mdevs()

    # --dry-run: a diff, and the definition stays as it was.
    dry = gpulib(env, libvirtd, "attach", name, "--type", "nvidia-231", "--count", "2",
                 "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"--- {name} (defined)\n+++ {name} (after gpulib attach)\n")
    assert all(f"+        <address uuid=\"{u}\"/>" in dry.stdout for u in uuids), dry.stdout
    assert dumpxml(libvirtd, name, "--inactive") == original

    res = gpulib(env, libvirtd, "attach", name, "--type", "nvidia-231", "--count", "2")
    assert res.returncode == 0, res.stderr
    assert f"defined VM {name}" in res.stdout
    defined = dumpxml(libvirtd, name, "--inactive")
    # What libvirt keeps is what the dry run showed (libvirt-normalised).
    planned = apply_diff(str(etree.tostring(parse_domain(original).root, encoding="unicode"))
                         + "\n", dry.stdout)
    assert devices_of(defined) == devices_of(planned)
    assert [h[1] for h in devices_of(defined)["hostdevs"]] == uuids

    res = gpulib(env, libvirtd, "attach", name, "--gpu", GEFORCE, via_environment=True)
    assert res.returncode == 0, res.stderr
    shown = devices_of(dumpxml(libvirtd, name))
    assert [h[:2] for h in shown["hostdevs"]] == [("mdev", uuids[0]), ("mdev", uuids[1]),
                                                  ("pci", GEFORCE), ("pci", GEFORCE_AUDIO)]
    gpu, audio = shown["hostdevs"][2:]
    assert gpu[3] is True and gpu[4][:-1] == audio[4][:-1]  # one guest slot, multifunction
    assert env.state() == state_before and env.live_mdevs() == mdevs_before

    # The start: `prepare begin` creates both vGPUs on the T4, then libvirt itself
    # fails (no VFIO here); `release end` destroys the on-demand vGPUs again.
    res = libvirtd.virsh("start", name)
    assert res.returncode != 0, env.explain(res)
    assert "gpulib:" not in res.stderr, env.explain(res)
    calls = env.calls(name)
    assert calls[0]["op"] == "prepare begin" and calls[0]["rc"] == 0, env.explain(res)
    assert calls[-1]["op"] == "release end" and calls[-1]["rc"] == 0, env.explain(res)
    assert env.mdevs_after(calls[0]) == sorted([*mdevs_before, *uuids])
    for u in uuids:
        link = env.root / "sys/bus/mdev/devices" / u
        assert not link.exists()  # released
    prepared = env.state_after(calls[0])
    held = {d["id"] for d in prepared["allocations"][name]["devices"]}
    assert set(uuids) | {GEFORCE, GEFORCE_AUDIO} <= held
    assert all(prepared["vgpus"][u]["parent"] == DEMO_T4 and
               prepared["vgpus"][u]["type_id"] == "nvidia-231" for u in uuids)
    assert env.state()["allocations"] == state_before["allocations"]
    assert env.live_mdevs() == mdevs_before

    # detach: the definition is the original again, byte for byte.
    res = gpulib(env, libvirtd, "detach", name)
    assert res.returncode == 0, res.stderr
    assert dumpxml(libvirtd, name, "--inactive") == original


def test_running_vm_gets_the_change_at_next_start(env: Env, libvirtd: PrivateLibvirtd,
                                                  define: Callable[..., str]) -> None:
    name = define("running")
    res = libvirtd.virsh("start", name)
    assert res.returncode == 0, env.explain(res)
    live = dumpxml(libvirtd, name)

    res = gpulib(env, libvirtd, "attach", name, "--profile", "GRID T4-2Q")
    assert res.returncode == 0, res.stderr
    assert "running: only its definition changed, the change applies at its next start" \
        in res.stderr
    assert len(devices_of(dumpxml(libvirtd, name, "--inactive"))["hostdevs"]) == 1
    assert dumpxml(libvirtd, name) == live  # the running VM itself is untouched
    assert libvirtd.virsh("domstate", name).stdout.strip() == "running"


def test_unknown_and_transient_vms_are_refused(env: Env, libvirtd: PrivateLibvirtd) -> None:
    for via_environment in (False, True):
        res = gpulib(env, libvirtd, "attach", PREFIX + "nosuch", "--gpu", GEFORCE,
                     via_environment=via_environment)
        assert res.returncode == 2
        assert res.stderr == (f"gpulib: error: no VM named '{PREFIX}nosuch' in libvirt "
                              f"({libvirtd.uri})\n")

    name = PREFIX + "transient"
    xml = env.base / f"{name}.xml"
    xml.write_text(domain_xml(name))
    res = libvirtd.virsh("create", str(xml))
    assert res.returncode == 0, env.explain(res)
    try:
        before = dumpxml(libvirtd, name)
        for args in (("attach", name, "--gpu", GEFORCE), ("detach", name)):
            res = gpulib(env, libvirtd, *args)
            assert res.returncode == 2
            assert res.stderr == (f"gpulib: error: VM {name} is transient: it has no "
                                  "persistent definition to edit (virsh define it first)\n")
        assert dumpxml(libvirtd, name) == before
    finally:
        libvirtd.virsh("destroy", name)


def test_pipe_workflow(env: Env, libvirtd: PrivateLibvirtd, define: Callable[..., str]) -> None:
    """The README's `virsh dumpxml VM | libvirt-vm-xml-transformer transform - > vm.xml
    && virsh define vm.xml`, on a domain with a metadata request."""
    name = PREFIX + "pipe"
    request = ("  <metadata>\n    <gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
               "\n      <gpulib:passthrough model='10de:2484'/>\n    </gpulib:gpus>\n"
               "  </metadata>\n")
    text = domain_xml(name).replace(f"  <name>{name}</name>\n",
                                    f"  <name>{name}</name>\n  <uuid>{uuid.uuid4()}</uuid>\n"
                                    + request)
    define("pipe", text=text)
    out = env.base / "pipe-vm.xml"
    script = (f"virsh -c {shell_quote(libvirtd.uri)} dumpxml {name} | "
              f"{shell_quote(TRANSFORMER)} transform - > {shell_quote(out)} && "
              f"virsh -c {shell_quote(libvirtd.uri)} define {shell_quote(out)}")
    environ = hook_env(str(env.root))
    res = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=environ,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    shown = devices_of(dumpxml(libvirtd, name, "--inactive"))
    assert shown["request"] is not None
    assert [h[:2] for h in shown["hostdevs"]] == [("pci", GEFORCE), ("pci", GEFORCE_AUDIO)]
    # The transformer recorded the GPU for the VM (pending until it starts).
    state = json.loads((env.root / "var/lib/gpulib/state.json").read_text())
    assert {d["id"] for d in state["allocations"][name]["devices"]} == \
        {GEFORCE, GEFORCE_AUDIO}
    # libvirt starts it: `prepare begin` accepts what the transformer wrote (then libvirt
    # fails for lack of VFIO here, and `release end` releases the GPU).
    res = libvirtd.virsh("start", name)
    calls = env.calls(name)
    assert calls[0]["op"] == "prepare begin" and calls[0]["rc"] == 0, env.explain(res)
    assert calls[-1]["op"] == "release end" and calls[-1]["rc"] == 0, env.explain(res)
    assert name not in env.state()["allocations"]
    # Released again so that the other tests of this module find the GPU free.
    res = gpulib(env, libvirtd, "detach", name)
    assert res.returncode == 0, res.stderr
    rel = subprocess.run([str(GPULIB), "release", name], capture_output=True, text=True,
                         env=environ, timeout=60, check=False)
    assert rel.returncode == 0, rel.stderr
