"""A real live migration between two libvirt daemons on this machine.

Two private libvirtds (tests/helpers/migration_env.py: each its own mount and
UTS namespace, /run and state directories, hostname and host UUID), each
running gpulib's qemu hook through the trace wrapper of
tests/helpers/libvirtd_env.py against a fake gpulib host of its own. The
source's libvirtd migrates a diskless TCG domain carrying gpulib's metadata
to the destination over loopback only (`--p2p` to the destination's unix
socket, QEMU's stream to 127.0.0.1).

Real vGPUs cannot be migrated here (no GPU, no VFIO): the domain has no
hostdev, and what `migrate begin` does with vGPUs is shown on simulated
hosts (tests/test_migration.py). What this shows is libvirt's side: the
destination's hook chain (its own `/etc/libvirt/hooks/qemu`, standing for
CloudStack's, which rewrites a bridge name, then `qemu.d/`) runs gpulib's
`migrate begin` with the incoming XML, libvirt starts the XML gpulib prints
(the earlier hook's rewrite and gpulib's metadata in it), and a migration
that fails after `migrate begin` ends with the destination's `release end`
for the incoming domain, which gpulib's hook answers; the source keeps
running the VM.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.libvirtd_env import PREFIX, domain_xml, marks
from tests.helpers.migration_env import HostEnv

pytestmark = marks()

HOST_SRC = "6b1e0c2a-4d3f-4a5b-9c8d-7e6f5a4b3c2d"
HOST_DST = "f0e1d2c3-b4a5-4968-8776-655443322110"
VM_UUID = "4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75"
CANCEL_UUID = "9b1d7c3e-5f2a-4e8b-a6c4-2d0e8f1a3b57"
RECORD = ("<gpulib:device kind='mdev' id='2a61c6a5-0e57-4f5f-8a3e-0c3b1f2d4e6a' "
          "type='nvidia-232' name='GRID T4-4Q' gpu='10de:1eb8'/>")

# The destination's own /etc/libvirt/hooks/qemu, as CloudStack's: on an incoming
# migration it maps the source's bridge to this host's, printing the XML.
BRIDGE_HOOK = """\
#!/bin/sh
if [ "$2" = migrate ] && [ "$3" = begin ]; then
    sed 's/cloudbr-source/cloudbr-destination/'
    exit 0
fi
cat >/dev/null
exit 0
"""

# After gpulib's (qemu.d/ runs in name order): the destination refuses to start
# the domain named *-cancel, so its migration fails after `migrate begin`.
CANCEL_HOOK = f"""\
#!/bin/sh
if [ "$1" = {PREFIX}cancel ] && [ "$2" = prepare ]; then
    cat >/dev/null
    echo "the test cancels this migration" >&2
    exit 1
fi
cat
exit 0
"""


def vm_xml(name: str, uuid: str) -> str:
    """A diskless TCG domain with gpulib's metadata (a record, no hostdev)."""
    base = domain_xml(name)
    return base.replace(
        f"<name>{name}</name>",
        f"<name>{name}</name>\n  <uuid>{uuid}</uuid>\n"
        "  <description>uplink cloudbr-source</description>\n  <metadata>\n"
        "    <gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
        f"{RECORD}</gpulib:gpus>\n  </metadata>")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HostEnv, HostEnv]]:
    base = tmp_path_factory.mktemp("migration")
    src = HostEnv(base / "src", "gpulib-test-src", HOST_SRC)
    dst = HostEnv(base / "dst", "gpulib-test-dst", HOST_DST, main_hook=BRIDGE_HOOK,
                  extra_hooks={"70-cancel-test": CANCEL_HOOK})
    try:
        src.daemon.start()
        dst.daemon.start()
        yield src, dst
    finally:
        src.daemon.stop()
        dst.daemon.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_on(env: HostEnv, name: str, uuid: str) -> None:
    xml = Path(env.base / f"{name}.xml")
    xml.write_text(vm_xml(name, uuid))
    for args in (("define", str(xml)), ("start", name)):
        res = env.daemon.virsh(*args)
        assert res.returncode == 0, env.explain(res)


def migrate(src: HostEnv, dst: HostEnv, name: str) -> subprocess.CompletedProcess[str]:
    return src.daemon.virsh(
        "migrate", "--live", "--p2p", name, dst.unix_uri,
        "--migrateuri", f"tcp://127.0.0.1:{free_port()}", "--listen-address", "127.0.0.1",
        timeout=120)


def domstate(env: HostEnv, name: str) -> str:
    return str(env.daemon.virsh("domstate", name).stdout.strip())


def test_the_destination_runs_gpulibs_migrate_begin_and_starts_its_xml(
        hosts: tuple[HostEnv, HostEnv]) -> None:
    src, dst = hosts
    name = PREFIX + "mig"
    start_on(src, name, VM_UUID)
    res = migrate(src, dst, name)
    assert res.returncode == 0, src.explain(res) + dst.explain(res)
    assert domstate(dst, name) == "running"
    calls = dst.calls(name)
    ops = [(c["op"], c["rc"]) for c in calls]
    # libvirt 9.0: the incoming domain's hooks as at a start, migrate begin first.
    assert ops == [("migrate begin", 0), ("prepare begin", 0), ("start begin", 0),
                   ("started begin", 0)], dst.explain(res)
    # The XML libvirt runs is the one gpulib printed: the earlier hook's rewrite
    # kept, gpulib's record carried along.
    live = dst.daemon.virsh("dumpxml", name).stdout
    assert "cloudbr-destination" in live and "cloudbr-source" not in live, live
    assert "gpulib:device" in live and "GRID T4-4Q" in live, live
    # The source: the domain left, its release end answered (nothing held there).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "release end" not in \
            [c["op"] for c in src.calls(name)]:
        time.sleep(0.2)
    assert domstate(src, name) != "running"
    assert [c["rc"] for c in src.calls(name) if c["op"] == "release end"] == [0]


def test_a_migration_failing_after_migrate_begin_is_released_there(
        hosts: tuple[HostEnv, HostEnv]) -> None:
    src, dst = hosts
    name = PREFIX + "cancel"
    start_on(src, name, CANCEL_UUID)
    res = migrate(src, dst, name)
    assert res.returncode != 0
    assert "the test cancels this migration" in res.stderr, res.stderr
    # The source keeps running the VM; the destination ran gpulib's migrate
    # begin, then the incoming domain's release end, both answered.
    assert domstate(src, name) == "running"
    ops = [(c["op"], c["rc"]) for c in dst.calls(name)]
    assert ops[0] == ("migrate begin", 0) and ops[-1] == ("release end", 0), ops
    state = dst.root / "var/lib/gpulib/state.json"
    assert not state.exists() or name not in dst.state()["allocations"]
