"""A real live migration between two libvirt daemons on this machine.

Two private libvirtds (tests/helpers/migration_env.py: each its own mount and
UTS namespace, /run and state directories, hostname and host UUID), each
running gpulib's qemu hook through the trace wrapper of
tests/helpers/libvirtd_env.py against a fake gpulib host of its own. The
source's libvirtd migrates a diskless TCG domain carrying gpulib's metadata
to the destination over loopback only (`--p2p` to the destination's unix
socket, QEMU's stream to 127.0.0.1).

Real vGPUs cannot be migrated here (no GPU, no VFIO). The first tests' domain
has no hostdev; the last ones' has an mdev hostdev that each libvirtd runs
on a fake mdev bus of its own, QEMU getting a `pci-testdev` in the vGPU's
place (tests/helpers/mdev_fake.py): everything libvirt decides is real.
What `migrate begin` does with vGPUs in detail is shown on simulated hosts
(tests/test_migration.py, tests/test_migration_cloudstack.py).

CloudStack's rewrite (tests/helpers/cloudstack_migrate.py: the hostdevs
replaced by the management server's choice, without a guest `<address>`)
is judged by libvirt's ABI stability check on the *source*, when it parses
the XML the migration is given (the hostdev gets an address then), before
the destination is asked: it passes when that address is the one the
hostdev had (libvirt gave it the first free slot at start, on pc and q35
alike) and fails otherwise, and no destination hook can change that.

What the first tests show is libvirt's side: the
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

from gpulib.domain import derive_uuid
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
    src = HostEnv(base / "src", "gpulib-test-src", HOST_SRC, fake_vfio=True)
    dst = HostEnv(base / "dst", "gpulib-test-dst", HOST_DST, main_hook=BRIDGE_HOOK,
                  extra_hooks={"70-cancel-test": CANCEL_HOOK}, fake_vfio=True)
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


# -- CloudStack's rewrite and libvirt's ABI stability check ------------------------------------

VGPU_UUID = "5d2c8e41-7a3b-4f9e-b1c6-0e8d7a2f4b93"
GUEST_SLOT_UUID = "7e4a1c9b-2d5f-4e8a-9b3c-6f1d0a8e2c47"
Q35_UUID = "3b9e6d1f-4c2a-4e7b-8d5f-9a0c1e2b3d46"
T4_8Q = "nvidia-233"


def vgpu_xml(name: str, uuid: str, mdev: str, emulator: Path, guest_slot: str = "",
             machine: str = "pc") -> str:
    """A TCG domain with one vGPU as CloudStack starts it: the hostdev as
    LibvirtGpuDef renders it (no guest address, unless `guest_slot` gives one)
    and gpulib's record of it. The memtune limit is this machine's: libvirt
    raises a VFIO domain's locked-memory limit to it, and the test process may
    not raise it above its own 8 MiB."""
    address = (f"\n  <address type='pci' domain='0x0000' bus='0x00' slot='{guest_slot}' "
               "function='0x0'/>") if guest_slot else ""
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <uuid>{uuid}</uuid>
  <metadata>
    <gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'><gpulib:device kind='mdev' \
id='{mdev}' type='{T4_8Q}' name='GRID T4-8Q' gpu='10de:1eb8'/></gpulib:gpus>
  </metadata>
  <memory unit='MiB'>64</memory>
  <memtune><hard_limit unit='KiB'>8192</hard_limit></memtune>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='{machine}'>hvm</type></os>
  <devices>
    <emulator>{emulator}</emulator>
<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'>
  <source>
    <address uuid='{mdev}'/>
  </source>{address}
</hostdev>
  </devices>
</domain>
"""


def start_vgpu_vm(src: HostEnv, name: str, uuid: str, guest_slot: str = "",
                  machine: str = "pc") -> None:
    """The VM runs on the source with its vGPU (live in gpulib's host and on
    libvirt's fake mdev bus)."""
    from gpulib.sim.fakehost import FakeHost
    from gpulib.sim.hosts import DEMO_T4
    from tests.helpers.mdev_fake import add_mdev

    FakeHost(str(src.root)).add_mdev(src_mdev(uuid), DEMO_T4, T4_8Q)
    add_mdev(src.daemon.base, src_mdev(uuid))
    xml = Path(src.base / f"{name}.xml")
    xml.write_text(vgpu_xml(name, uuid, src_mdev(uuid), src.emulator, guest_slot, machine))
    for args in (("define", str(xml)), ("start", name)):
        res = src.daemon.virsh(*args)
        assert res.returncode == 0, src.explain(res)


def src_mdev(vm_uuid: str) -> str:
    """The VM's vGPU on the source (one per VM)."""
    return derive_uuid(vm_uuid, 40)


def dst_mdev(vm_uuid: str) -> str:
    """The vGPU the management server chose for the VM on the destination."""
    return derive_uuid(vm_uuid, 41)


def cloudstack_migrate(src: HostEnv, dst: HostEnv, name: str, vm_uuid: str
                       ) -> tuple[subprocess.CompletedProcess[str], str]:
    """What the CloudStack agent does: the migratable XML with the hostdevs
    replaced by the management server's choice on the destination
    (updateGpuDevicesIfNeeded), then a live migration with that XML."""
    from tests.helpers.cloudstack_migrate import GpuDevice, rewrite
    from tests.helpers.mdev_fake import add_mdev

    add_mdev(dst.daemon.base, dst_mdev(vm_uuid))
    live = src.daemon.virsh("dumpxml", "--migratable", name).stdout
    sent = rewrite(live, [GpuDevice(dst_mdev(vm_uuid), mdev=True, model="GRID T4-8Q")])
    path = src.base / f"{name}.cloudstack.xml"
    path.write_text(sent)
    res = src.daemon.virsh(
        "migrate", "--live", "--p2p", name, dst.unix_uri, "--xml", str(path),
        "--migrateuri", f"tcp://127.0.0.1:{free_port()}", "--listen-address", "127.0.0.1",
        timeout=120)
    return res, live


def guest_address(xml: str) -> str:
    """The hostdev's guest PCI address (q35: on a pcie-root-port's bus)."""
    from lxml import etree

    addr = etree.fromstring(xml.encode()).find("devices/hostdev/address")
    assert addr is not None
    return ":".join(str(addr.get(k)) for k in ("domain", "bus", "slot", "function"))


@pytest.mark.parametrize("machine,uuid", [("pc", VGPU_UUID), ("q35", Q35_UUID)])
def test_cloudstacks_rewrite_passes_the_abi_check_and_gpulib_keeps_its_choice(
        hosts: tuple[HostEnv, HostEnv], machine: str, uuid: str) -> None:
    src, dst = hosts
    name = PREFIX + "vgpu-" + machine
    start_vgpu_vm(src, name, uuid, machine=machine)
    res, live = cloudstack_migrate(src, dst, name, uuid)
    assert res.returncode == 0, src.explain(res) + dst.explain(res)
    assert domstate(dst, name) == "running"
    # libvirt gave the address-less hostdev the slot the source's had (the
    # first free one, as at the start), and the destination runs CloudStack's
    # choice: gpulib made it under its UUID, nothing rewritten.
    there = dst.daemon.virsh("dumpxml", name).stdout
    mine = dst_mdev(uuid)
    assert mine in there and src_mdev(uuid) not in there, there
    assert guest_address(there) == guest_address(live)
    ops = [(c["op"], c["rc"]) for c in dst.calls(name)]
    assert ops[:2] == [("migrate begin", 0), ("prepare begin", 0)], ops
    assert mine in dst.live_mdevs()
    assert [d["id"] for d in dst.state()["allocations"][name]["devices"]] == [mine]
    # The record travels, naming the vGPU here.
    assert f"id=\"{mine}\"" in there or f"id='{mine}'" in there, there


def test_a_hostdev_off_the_first_free_slot_fails_the_abi_check_on_the_source(
        hosts: tuple[HostEnv, HostEnv]) -> None:
    src, dst = hosts
    name = PREFIX + "slot"
    # A guest address of its own (given by hand, or by libvirt around devices
    # since removed): not the slot libvirt gives an address-less hostdev.
    start_vgpu_vm(src, name, GUEST_SLOT_UUID, guest_slot="0x09")
    res, _ = cloudstack_migrate(src, dst, name, GUEST_SLOT_UUID)
    assert res.returncode != 0
    assert "does not match source" in res.stderr and "0000:00:09.0" in res.stderr, res.stderr
    # Refused by the source's libvirt before the destination was asked: gpulib's
    # migrate begin never ran there, and the VM runs on at the source.
    assert dst.calls(name) == []
    assert domstate(src, name) == "running"
