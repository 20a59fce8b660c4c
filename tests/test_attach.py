"""`gpulib attach` / `gpulib detach` against the simulated demo host.

libvirt is played by `FakeLibvirt` (the three calls attach needs, with the
answers virsh gives); tests/test_attach_libvirtd.py runs the same commands
against a real libvirtd.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from gpulib.attach import Change, Wanted, attach, detach, plan_attach, plan_detach
from gpulib.config import Config
from gpulib.context import Context
from gpulib.domain import (
    GpuRequest,
    PassthroughRequest,
    VgpuRequest,
    derive_uuid,
    parse_domain,
)
from gpulib.entry import context_for_root
from gpulib.errors import DeviceError, InputError, NotAvailableError
from gpulib.hooks.prepare import Preparer, StartMode
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_T4, add_model, models
from gpulib.virsh import DomainInfo, Virsh
from tests.hookrun import QEMU_HOOK, TRANSFORMER, run

VM = "web1"
VM_UUID = "6f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"
GEFORCE = "0000:3b:00.0"
GEFORCE_AUDIO = "0000:3b:00.1"
T4_PASSTHROUGH = "0000:65:00.0"
L40S_VF_IN_USE = "0000:82:00.4"  # the demo's running i-4-20-VM holds it


def domain(numa: Optional[str] = None, extra_devices: str = "", metadata: str = "") -> str:
    """A definition as `virsh dumpxml --inactive` prints it (single quotes, 2 spaces)."""
    numatune = (f"  <numatune>\n    <memory mode='strict' nodeset='{numa}'/>\n  </numatune>\n"
                if numa is not None else "")
    return (f"<domain type='kvm'>\n  <name>{VM}</name>\n  <uuid>{VM_UUID}</uuid>\n{metadata}"
            "  <memory unit='KiB'>1048576</memory>\n"
            f"{numatune}"
            "  <os>\n    <type arch='x86_64' machine='pc-q35-7.2'>hvm</type>\n  </os>\n"
            "  <devices>\n    <emulator>/usr/bin/qemu-system-x86_64</emulator>\n"
            "    <graphics type='vnc' port='-1' autoport='yes' passwd='s3cret'/>\n"
            f"{extra_devices}"
            "  </devices>\n</domain>\n")


class FakeLibvirt:
    """One persistent (or transient) domain, answering as virsh does."""

    def __init__(self, xml: Optional[str], running: bool = False, persistent: bool = True,
                 redefined_meanwhile: Optional[str] = None) -> None:
        self.xml = xml
        self.running = running
        self.persistent = persistent
        self.defined: list[str] = []
        self.dumps = 0
        self.redefined_meanwhile = redefined_meanwhile

    @property
    def where(self) -> str:
        return "test:///fake"

    def dominfo(self, name: str) -> DomainInfo:
        if self.xml is None or name != VM:
            raise InputError(f"no VM named {name!r} in libvirt ({self.where})")
        return DomainInfo(name, "running" if self.running else "shut off", self.persistent)

    def dumpxml_inactive(self, name: str) -> str:
        assert self.xml is not None and name == VM
        self.dumps += 1
        if self.dumps == 2 and self.redefined_meanwhile is not None:
            self.xml = self.redefined_meanwhile
        return self.xml

    def define(self, xml: str) -> None:
        parse_domain(xml)
        self.defined.append(xml)
        self.xml = xml


def fingerprint(root: str) -> str:
    """Everything gpulib could change: the state file and the live vGPUs and VF types."""
    h = hashlib.sha256()
    state = os.path.join(root, "var/lib/gpulib/state.json")
    with open(state, "rb") as fh:
        h.update(fh.read())
    h.update(" ".join(sorted(os.listdir(os.path.join(root, "sys/bus/mdev/devices")))).encode())
    for dirpath, _, files in sorted(os.walk(os.path.join(root, "sys/devices"))):
        if "current_vgpu_type" in files:
            with open(os.path.join(dirpath, "current_vgpu_type"), "rb") as fh:
                h.update(dirpath.encode() + fh.read())
    return h.hexdigest()


def hostdev_sources(xml: str) -> list[str]:
    dom = parse_domain(xml)
    out = [f"mdev {h.uuid_checked()}" for h in dom.mdev_hostdevs()]
    out += [f"pci {h.address}" for h in dom.pci_hostdevs()]
    return out


# -- attach: vGPUs ---------------------------------------------------------------------------


def test_vgpus_get_a_request_and_hostdevs_with_derived_uuids(host: FakeHost, ctx: Context,
                                                             config: Config) -> None:
    before = fingerprint(host.root)
    change = plan_attach(ctx, config, domain(numa="1"), Wanted(profile="GRID T4-2Q", count=2))

    dom = parse_domain(change.after)
    assert dom.metadata_request() == GpuRequest((VgpuRequest("GRID T4-2Q", None, 2, 1),))
    assert [h.uuid_checked() for h in dom.mdev_hostdevs()] == \
        [derive_uuid(VM_UUID, 0), derive_uuid(VM_UUID, 1)]
    assert all(h.display == "off" and h.model == "vfio-pci" for h in dom.mdev_hostdevs())
    # The VNC password and everything else of the definition survive.
    assert "passwd=\"s3cret\"" in change.after
    assert len(change.lines) == 2 and "NUMA node 1" in change.lines[0]
    # Nothing is created or recorded before the VM starts.
    assert fingerprint(host.root) == before


def test_missing_qemu_hook_is_noted(host: FakeHost, ctx: Context, config: Config) -> None:
    from gpulib.doctor import LIBVIRT_HOOK

    change = plan_attach(ctx, config, domain(), Wanted(type_id="nvidia-231"))
    assert any("qemu hook is not installed" in n for n in change.notes)
    os.makedirs(os.path.dirname(ctx.path(LIBVIRT_HOOK)), exist_ok=True)
    os.symlink("/usr/libexec/gpulib/gpulib-qemu-hook", ctx.path(LIBVIRT_HOOK))
    change = plan_attach(ctx, config, domain(), Wanted(type_id="nvidia-231"))
    assert change.notes == []


def test_no_numa_binding_leaves_placement_open(ctx: Context, config: Config) -> None:
    change = plan_attach(ctx, config, domain(), Wanted(type_id="nvidia-231"))
    assert parse_domain(change.after).metadata_request() == \
        GpuRequest((VgpuRequest(None, "nvidia-231", 1, None),))


def test_memory_node_without_room_is_not_forced(ctx: Context, config: Config) -> None:
    # The only T4 with mdev types is on node 1; a VM bound to node 0 still gets them.
    change = plan_attach(ctx, config, domain(numa="0"), Wanted(type_id="nvidia-231"))
    assert parse_domain(change.after).metadata_request() == \
        GpuRequest((VgpuRequest(None, "nvidia-231", 1, None),))
    assert any("NUMA node 0" in n for n in change.notes)


def test_second_attach_continues_the_indices_in_one_item(ctx: Context, config: Config) -> None:
    first = plan_attach(ctx, config, domain(), Wanted(type_id="nvidia-231"))
    second = plan_attach(ctx, config, first.after, Wanted(type_id="nvidia-231", count=2))
    dom = parse_domain(second.after)
    assert dom.metadata_request() == GpuRequest((VgpuRequest(None, "nvidia-231", 3, None),))
    assert [h.uuid_checked() for h in dom.mdev_hostdevs()] == \
        [derive_uuid(VM_UUID, k) for k in range(3)]


def test_prepare_begin_creates_what_attach_named(host: FakeHost, ctx: Context,
                                                 config: Config, tmp_path: Path) -> None:
    change = plan_attach(ctx, config, domain(numa="1"), Wanted(profile="GRID T4-2Q", count=2))
    uuids = [derive_uuid(VM_UUID, k) for k in range(2)]

    res = run([QEMU_HOOK, VM, "prepare", "begin", "-"], host.root, change.after.encode())
    assert res.returncode == 0, res.stderr
    for u in uuids:
        link = Path(host.root, "sys/bus/mdev/devices", u)
        assert os.path.basename(os.readlink(link / "mdev_type")) == "nvidia-231"
        assert os.path.basename(os.path.dirname(os.path.realpath(link))) == DEMO_T4

    res = run([QEMU_HOOK, VM, "release", "end", "-"], host.root, b"")
    assert res.returncode == 0, res.stderr
    for u in uuids:
        assert not Path(host.root, "sys/bus/mdev/devices", u).exists()


# -- attach: whole GPUs ----------------------------------------------------------------------


def test_gpu_and_its_audio_function_share_a_guest_slot_as_the_transformer_puts_them(
        ctx: Context, config: Config) -> None:
    change = plan_attach(ctx, config, domain(), Wanted(gpu=GEFORCE))
    dom = parse_domain(change.after)
    gpu, audio = dom.pci_hostdevs()
    assert (str(gpu.address), str(audio.address)) == (GEFORCE, GEFORCE_AUDIO)
    assert gpu.guest_address is not None and audio.guest_address is not None
    assert gpu.guest_address.slot_key == audio.guest_address.slot_key
    assert (gpu.guest_address.function, audio.guest_address.function) == (0, 1)
    assert gpu.multifunction and gpu.managed and audio.managed

    # The transformer, asked for the same GPU by a metadata request, writes the same hostdevs.
    req = domain(metadata="  <metadata>\n    <gpulib:gpus xmlns:gpulib="
                          "'http://gpulib.org/xmlns/domain/1'>\n      <gpulib:passthrough "
                          "model='10de:2484'/>\n    </gpulib:gpus>\n  </metadata>\n")
    theirs = parse_domain(req)
    Preparer(ctx, config, theirs, StartMode("transformer", edits_xml=True, requests=True)).run()

    def hostdevs(d: object) -> list[bytes]:
        return [etree.tostring(h.element, with_tail=False) for h in d.pci_hostdevs()]  # type: ignore[attr-defined]

    assert hostdevs(dom) == hostdevs(theirs)


def test_gpu_by_model_prefers_the_vm_memory_node(tmp_path: Path) -> None:
    host = FakeHost(str(tmp_path / "two"))
    t4 = models()["t4"]
    for bus, node_of_bus in ((0x3B, 0), (0x8B, 1)):
        host.add_bridge(f"0000:{bus - 1:02x}:00.0", numa_node=node_of_bus,
                        iommu_group=host.new_iommu_group())
        add_model(host, t4, f"0000:{bus:02x}:00.0", node_of_bus,
                  parent=f"0000:{bus - 1:02x}:00.0",
                  driver="vfio-pci")
    ctx = context_for_root(host.root, simulate=True)
    config = Config()
    cases: list[tuple[Optional[str], str]] = [("1", "0000:8b:00.0"), ("0", "0000:3b:00.0"),
                                              (None, "0000:3b:00.0")]
    for node, expected in cases:
        change = plan_attach(ctx, config, domain(numa=node), Wanted(gpu="10de:1eb8"))
        assert [str(h.address) for h in parse_domain(change.after).pci_hostdevs()] == \
            [expected]
    both = plan_attach(ctx, config, domain(numa="1"), Wanted(gpu="10de:1eb8", count=2))
    assert [str(h.address) for h in parse_domain(both.after).pci_hostdevs()] == \
        ["0000:8b:00.0", "0000:3b:00.0"]


def test_nvidia_vendor_vf_with_a_recorded_type_goes_unmanaged(ctx: Context,
                                                              config: Config) -> None:
    change = plan_attach(ctx, config, domain(), Wanted(gpu="0000:41:00.4"))
    (h,) = parse_domain(change.after).pci_hostdevs()
    assert str(h.address) == "0000:41:00.4" and not h.managed


# -- refusals ----------------------------------------------------------------------------------


REFUSALS = {
    "no such profile": (Wanted(profile="GRID T4-3Q"), InputError,
                        "no GPU on this host offers vGPU profile 'GRID T4-3Q'"),
    "profile only on vendor VFs": (Wanted(profile="NVIDIA A10-4Q"), InputError,
                                   "gpulib vf set-type --keep 0000:41:00.5 593"),
    "profile a free typed vendor VF carries": (
        Wanted(profile="NVIDIA A10-6Q"), InputError,
        "VF 0000:41:00.4 carries it and is free: gpulib attach web1 --gpu 0000:41:00.4"),
    "no capacity left": (Wanted(profile="GRID T4-16Q", count=2), NotAvailableError,
                         "no capacity left for 2 vGPU(s) of profile 'GRID T4-16Q': 1 can"),
    "no such GPU model": (Wanted(gpu="10de:ffff"), InputError, "no GPU 10de:ffff on this host"),
    "no GPU of the model free": (Wanted(gpu="10de:2484", count=2), NotAvailableError,
                                 "no capacity left: 1 of the 2 GPU(s) 10de:2484"),
    "no such address": (Wanted(gpu="0000:99:00.0"), InputError,
                        "no PCI device 0000:99:00.0 on this host"),
    "not a GPU": (Wanted(gpu="0000:18:00.0"), InputError, "is not a GPU or a VF of one"),
    "held by a running VM": (Wanted(gpu=L40S_VF_IN_USE), DeviceError,
                             f"PCI device {L40S_VF_IN_USE} is in use by running VM i-4-20-VM"),
    "GPU that hands out vGPUs": (Wanted(gpu=DEMO_T4), NotAvailableError,
                                 f"GPU {DEMO_T4} hands out vGPUs or VFs (mdev)"),
    "vendor VF without type": (Wanted(gpu="0000:41:00.5"), InputError,
                               "NVIDIA VF 0000:41:00.5 has no vGPU type"),
    "nothing asked": (Wanted(), InputError, "exactly one of --profile, --type or --gpu"),
    "two things asked": (Wanted(profile="GRID T4-2Q", gpu=GEFORCE), InputError,
                         "exactly one of"),
    "count with an address": (Wanted(gpu=GEFORCE, count=2), InputError,
                              "an address names one device"),
    "bad type id": (Wanted(type_id="../x"), InputError, "type"),
    "bad count": (Wanted(type_id="nvidia-231", count=0), InputError, "--count must be"),
    "garbage for --gpu": (Wanted(gpu="rtx"), InputError, "--gpu takes a PCI address"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusal(case: str, host: FakeHost, ctx: Context, config: Config) -> None:
    wanted, error, message = REFUSALS[case]
    libvirt = FakeLibvirt(domain())
    before = fingerprint(host.root)
    with pytest.raises(error) as exc:
        attach(ctx, config, libvirt, VM, wanted)
    assert message in exc.value.message
    assert "\n" not in exc.value.message
    assert libvirt.defined == []
    assert fingerprint(host.root) == before


def test_unknown_vm_is_refused(ctx: Context, config: Config) -> None:
    libvirt = FakeLibvirt(None)
    with pytest.raises(InputError, match="no VM named 'web1'"):
        attach(ctx, config, libvirt, VM, Wanted(type_id="nvidia-231"))
    with pytest.raises(InputError, match="no VM named 'web1'"):
        detach(ctx, config, libvirt, VM, [])


def test_transient_domain_is_refused(ctx: Context, config: Config) -> None:
    libvirt = FakeLibvirt(domain(), running=True, persistent=False)
    with pytest.raises(InputError, match="transient: it has no persistent definition"):
        attach(ctx, config, libvirt, VM, Wanted(type_id="nvidia-231"))
    with pytest.raises(InputError, match="transient: it has no persistent definition"):
        detach(ctx, config, libvirt, VM, [])
    assert libvirt.defined == []


def test_device_in_another_stopped_vm_is_given_with_a_note(host: FakeHost, ctx: Context,
                                                           config: Config) -> None:
    """A stopped VM's definition holds nothing (ARCHITECTURE.md, "Ownership of
    the device tree"): two VMs may name one GPU."""
    host.add_defined_domain("db1", "0f5c1a3e-2b4d-4c6e-8f0a-1b2c3d4e5f60",
                            pci=(T4_PASSTHROUGH,))
    libvirt = FakeLibvirt(domain())
    change = attach(ctx, config, libvirt, VM, Wanted(gpu=T4_PASSTHROUGH))
    assert hostdev_sources(libvirt.defined[-1]) == [f"pci {T4_PASSTHROUGH}"]
    assert change.notes == [f"{T4_PASSTHROUGH} is also in the definition of VM db1: only one "
                            "of them can run at a time"]


def test_running_vm_holding_the_gpu_is_refused(host: FakeHost, ctx: Context,
                                               config: Config) -> None:
    host.add_running_domain("db3", "0f5c1a3e-2b4d-4c6e-8f0a-1b2c3d4e5f61",
                            pci=(T4_PASSTHROUGH,))
    libvirt = FakeLibvirt(domain())
    with pytest.raises(DeviceError, match=f"PCI device {T4_PASSTHROUGH} is in use by "
                       "running VM db3"):
        attach(ctx, config, libvirt, VM, Wanted(gpu=T4_PASSTHROUGH))
    with pytest.raises(NotAvailableError, match="0 of the 1 GPU"):
        attach(ctx, config, libvirt, VM, Wanted(gpu="10de:1eb8"))
    assert libvirt.defined == []


def test_vgpus_of_other_vms_on_a_gpu_leave_room_for_more(host: FakeHost, ctx: Context,
                                                         config: Config) -> None:
    """A running VM with a vGPU on the T4 shares it; it does not hold it whole."""
    used = "5b2d9c1e-3f4a-4b6c-8d7e-9f0a1b2c3d4e"
    host.add_mdev(used, DEMO_T4, "nvidia-231")
    host.add_running_domain("db4", "0f5c1a3e-2b4d-4c6e-8f0a-1b2c3d4e5f62", mdevs=(used,))
    change = plan_attach(ctx, config, domain(), Wanted(type_id="nvidia-231"))
    assert len(parse_domain(change.after).mdev_hostdevs()) == 1
    # Given whole to a running VM, the T4 has no room left for anyone.
    host.add_running_domain("db5", "0f5c1a3e-2b4d-4c6e-8f0a-1b2c3d4e5f63", pci=(DEMO_T4,))
    with pytest.raises(NotAvailableError, match="0 can be created"):
        plan_attach(ctx, config, domain(), Wanted(type_id="nvidia-231"))


def test_device_in_a_gpulib_allocation_is_refused(host: FakeHost, ctx: Context,
                                                  config: Config) -> None:
    from gpulib.lifecycle import open_store
    from gpulib.state import Allocation, Device, utc_now

    # A start of now (one past its grace is over: its devices are free).
    with open_store(ctx, config).transaction() as state:
        state.allocations["db2"] = Allocation("db2", None, "pending", utc_now(),
                                              [Device("pci", GEFORCE)])
    with pytest.raises(DeviceError, match=f"PCI device {GEFORCE} is in use by starting VM "
                       r"db2 \(pending allocation\)"):
        attach(ctx, config, FakeLibvirt(domain()), VM, Wanted(gpu=GEFORCE))


def test_profile_on_a_typed_vendor_vf_another_vm_holds_suggests_typing_a_free_one(
        ctx: Context, config: Config) -> None:
    """The A10-6Q VF gpulib records is taken: the next free VF is the one to type."""
    from gpulib.lifecycle import open_store
    from gpulib.state import Allocation, Device, utc_now

    with open_store(ctx, config).transaction() as state:
        state.allocations["db2"] = Allocation("db2", None, "pending", utc_now(),
                                              [Device("vf", "0000:41:00.4")])
    with pytest.raises(InputError) as exc:
        attach(ctx, config, FakeLibvirt(domain()), VM, Wanted(profile="NVIDIA A10-6Q"))
    assert "gpulib vf set-type --keep 0000:41:00.5 594" in exc.value.message
    assert "0000:41:00.4" not in exc.value.message


def test_cloudstack_host_is_refused_unless_forced(host: FakeHost, ctx: Context,
                                                  config: Config) -> None:
    host.write_file("etc/cloudstack/agent/agent.properties", "hypervisor.type=kvm\n")
    libvirt = FakeLibvirt(domain())
    with pytest.raises(InputError, match=r"CloudStack host .* use --force"):
        attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE))
    with pytest.raises(InputError, match=r"CloudStack host .* use --force"):
        detach(ctx, config, libvirt, VM, [])
    assert libvirt.defined == []
    # Forced: a GPU can be given; vGPUs cannot, since the hook ignores requests there.
    attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE), force=True)
    assert len(libvirt.defined) == 1
    with pytest.raises(InputError, match="allow_metadata_requests"):
        attach(ctx, config, libvirt, VM, Wanted(type_id="nvidia-231"), force=True)


def test_already_attached_gpu_is_refused(ctx: Context, config: Config) -> None:
    libvirt = FakeLibvirt(domain())
    attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE))
    with pytest.raises(InputError, match=f"already has PCI device {GEFORCE}"):
        attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE))


def test_capacity_counts_vgpus_already_attached(ctx: Context, config: Config) -> None:
    libvirt = FakeLibvirt(domain())
    attach(ctx, config, libvirt, VM, Wanted(profile="GRID T4-16Q"))  # the T4's only one
    with pytest.raises(NotAvailableError, match="1 more already attached to web1"):
        attach(ctx, config, libvirt, VM, Wanted(profile="GRID T4-16Q"))


# -- libvirt side: dry run, running VMs, concurrent edits ------------------------------------


def test_dry_run_prints_the_diff_and_defines_nothing(host: FakeHost, ctx: Context,
                                                     config: Config) -> None:
    libvirt = FakeLibvirt(domain())
    before = fingerprint(host.root)
    change = attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE), dry_run=True)
    assert libvirt.defined == []
    assert fingerprint(host.root) == before
    diff = change.diff("attach")
    assert diff.startswith(f"--- {VM} (defined)\n+++ {VM} (after gpulib attach)\n")
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == []
    assert sum("<hostdev " in ln for ln in added) == 2
    # What a real run defines is what the dry run showed.
    real = attach(ctx, config, FakeLibvirt(domain()), VM, Wanted(gpu=GEFORCE))
    assert real.after == change.after


def test_running_vm_changes_its_definition_only_with_a_note(ctx: Context,
                                                            config: Config) -> None:
    libvirt = FakeLibvirt(domain(), running=True)
    change = attach(ctx, config, libvirt, VM, Wanted(type_id="nvidia-231"))
    assert len(libvirt.defined) == 1
    assert any("running" in n and "next start" in n for n in change.notes)


def test_definition_changed_meanwhile_is_not_overwritten(ctx: Context, config: Config) -> None:
    other = domain(extra_devices="    <watchdog model='i6300esb'/>\n")
    libvirt = FakeLibvirt(domain(), redefined_meanwhile=other)
    with pytest.raises(DeviceError, match="changed while gpulib edited it"):
        attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE))
    assert libvirt.defined == []


# -- detach ----------------------------------------------------------------------------------


def lxml_form(xml: str) -> bytes:
    return bytes(etree.tostring(parse_domain(xml).root))


def test_detach_all_restores_the_definition(ctx: Context, config: Config) -> None:
    original = domain(numa="1")
    libvirt = FakeLibvirt(original)
    attach(ctx, config, libvirt, VM, Wanted(profile="GRID T4-2Q", count=2))
    attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE))
    assert len(hostdev_sources(libvirt.xml or "")) == 4
    change = detach(ctx, config, libvirt, VM, [])
    assert lxml_form(change.after) == lxml_form(original)
    assert change.after.replace('"', "'") == original


def test_detach_one_vgpu_renumbers_the_rest(ctx: Context, config: Config) -> None:
    libvirt = FakeLibvirt(domain())
    attach(ctx, config, libvirt, VM, Wanted(type_id="nvidia-231", count=2))
    attach(ctx, config, libvirt, VM, Wanted(type_id="nvidia-232", count=1))
    change = detach(ctx, config, libvirt, VM, [derive_uuid(VM_UUID, 0)])
    dom = parse_domain(change.after)
    assert dom.metadata_request() == GpuRequest((VgpuRequest(None, "nvidia-231", 1, None),
                                                 VgpuRequest(None, "nvidia-232", 1, None)))
    assert [h.uuid_checked() for h in dom.mdev_hostdevs()] == \
        [derive_uuid(VM_UUID, 0), derive_uuid(VM_UUID, 1)]


def test_detach_a_gpu_takes_its_group_peer_along(ctx: Context, config: Config) -> None:
    libvirt = FakeLibvirt(domain())
    attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE))
    attach(ctx, config, libvirt, VM, Wanted(gpu=T4_PASSTHROUGH))
    change = detach(ctx, config, libvirt, VM, [GEFORCE])
    assert hostdev_sources(change.after) == [f"pci {T4_PASSTHROUGH}"]


def test_detach_keeps_what_is_not_a_gpu(ctx: Context, config: Config) -> None:
    nic = ("    <hostdev mode='subsystem' type='pci' managed='yes'>\n      <source>\n"
           "        <address domain='0x0000' bus='0x18' slot='0x00' function='0x0'/>\n"
           "      </source>\n    </hostdev>\n")
    libvirt = FakeLibvirt(domain(extra_devices=nic))
    attach(ctx, config, libvirt, VM, Wanted(gpu=GEFORCE))
    change = detach(ctx, config, libvirt, VM, [])
    assert hostdev_sources(change.after) == ["pci 0000:18:00.0"]


def test_detach_refusals_and_nothing_to_do(ctx: Context, config: Config) -> None:
    libvirt = FakeLibvirt(domain())
    with pytest.raises(InputError, match=r"has no device 0000:3b:00\.0 in its definition"):
        detach(ctx, config, libvirt, VM, [GEFORCE])
    with pytest.raises(InputError, match="neither a vGPU UUID nor a PCI address"):
        detach(ctx, config, libvirt, VM, ["foo"])
    change = detach(ctx, config, libvirt, VM, [])
    assert not change.changed and libvirt.defined == []


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("attach"), st.sampled_from(["nvidia-222", "nvidia-231", "nvidia-232"]),
              st.integers(1, 3)),
    st.tuples(st.just("detach"), st.integers(0, 20), st.just(0))), max_size=8))
def test_request_and_derived_hostdevs_stay_in_step(ctx: Context, config: Config,
                                                   ops: list[tuple[str, object, int]]) -> None:
    """Whatever attaches and detaches happen, the k-th vGPU of the request is the
    hostdev with the k-th derived UUID, which is what prepare begin relies on; and
    detaching everything gives the original definition back."""
    original = domain()
    libvirt = FakeLibvirt(original)
    for op, arg, count in ops:
        if op == "attach":
            try:
                attach(ctx, config, libvirt, VM, Wanted(type_id=str(arg), count=count))
            except NotAvailableError:
                pass
        else:
            uuids = parse_domain(libvirt.xml or "").mdev_hostdevs()
            if uuids:
                target = uuids[int(str(arg)) % len(uuids)].uuid_checked()
                detach(ctx, config, libvirt, VM, [target])
        dom = parse_domain(libvirt.xml or "")
        request = dom.metadata_request()
        total = sum(v.count for v in request.vgpus) if request else 0
        assert [h.uuid_checked() for h in dom.mdev_hostdevs()] == \
            [derive_uuid(VM_UUID, k) for k in range(total)]
    change = detach(ctx, config, libvirt, VM, [])
    assert lxml_form(change.after if change.changed else libvirt.xml or "") == \
        lxml_form(original)


# -- the pipe workflow -------------------------------------------------------------------------


PIPE_REQUEST = ("  <metadata>\n    <gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>\n"
                "      <gpulib:vgpu type='nvidia-231' count='1'/>\n"
                "      <gpulib:passthrough model='10de:2484'/>\n"
                "    </gpulib:gpus>\n  </metadata>\n")


def test_pipe_workflow_transformer_then_prepare(host: FakeHost) -> None:
    """`virsh dumpxml VM | libvirt-vm-xml-transformer transform - > vm.xml`, then the
    qemu hook's `prepare begin` on what libvirt would start."""
    res = run([TRANSFORMER, "transform", "-"], host.root, domain(metadata=PIPE_REQUEST).encode())
    assert res.returncode == 0 and res.stderr == b"", res.stderr
    out = res.stdout.decode()
    dom = parse_domain(out)
    assert dom.metadata_request() is not None  # kept: the next start reads it again
    sources = hostdev_sources(out)
    assert f"pci {GEFORCE}" in sources and f"pci {GEFORCE_AUDIO}" in sources
    (mdev,) = dom.mdev_hostdevs()
    assert Path(host.root, "sys/bus/mdev/devices", mdev.uuid_checked()).exists()

    res = run([QEMU_HOOK, VM, "prepare", "begin", "-"], host.root, out.encode())
    assert res.returncode == 0, res.stderr


def test_transformer_on_its_own_output_adds_nothing(host: FakeHost) -> None:
    once = run([TRANSFORMER, "transform", "-"], host.root,
               domain(metadata=PIPE_REQUEST).encode()).stdout
    twice = run([TRANSFORMER, "transform", "-"], host.root, once).stdout
    assert hostdev_sources(twice.decode()) == hostdev_sources(once.decode())


# -- virsh and the command line ----------------------------------------------------------------


FAKE_VIRSH = """#!{python}
import sys
args = sys.argv[1:]
if args[:1] == ["-c"]:
    args = args[2:]
if args[0] == "dominfo" and args[-1] == "web1":
    print("Id:             -\\nName:           web1\\nState:          shut off\\n"
          "Persistent:     yes\\nAutostart:      disable")
    sys.exit(0)
sys.stderr.write("error: failed to get domain '%s'\\n" % args[-1])
sys.exit(1)
"""


def fake_virsh(tmp_path: Path) -> Path:
    path = tmp_path / "virsh"
    path.write_text(FAKE_VIRSH.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_virsh_answers_are_read(tmp_path: Path) -> None:
    virsh = Virsh("test:///default", program=str(fake_virsh(tmp_path)))
    assert virsh.dominfo("web1") == DomainInfo("web1", "shut off", True)
    with pytest.raises(InputError, match="no VM named 'db9' in libvirt \\(test:///default\\)"):
        virsh.dominfo("db9")
    missing = Virsh(program=str(tmp_path / "no-virsh"))
    with pytest.raises(DeviceError, match="not found"):
        missing.dominfo("web1")


def test_cli_unknown_vm_one_line_exit_2(host: FakeHost, tmp_path: Path) -> None:
    fake_virsh(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULIB_")}
    env.update(GPULIB_ROOT=host.root, GPULIB_SIMULATE="1",
               PATH=f"{tmp_path}:{os.environ.get('PATH', '')}")
    gpulib = str(Path(sys.executable).parent / "gpulib")
    res = subprocess.run([gpulib, "attach", "db9", "--type", "nvidia-231"], capture_output=True,
                         text=True, env=env, timeout=60, check=False)
    assert res.returncode == 2
    assert res.stderr == "gpulib: error: no VM named 'db9' in libvirt (virsh's default " \
                         "connection)\n"
    res = subprocess.run([gpulib, "attach", "web1"], capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "exactly one of --profile" in res.stderr


def test_change_diff_is_empty_without_edit(ctx: Context, config: Config) -> None:
    change: Change = plan_detach(ctx, config, domain(), [])
    assert change.diff("detach") == ""
    assert not change.changed


_NAMES = st.text(st.sampled_from("ABCTQ-_ 0123456789:."), min_size=1, max_size=20).filter(
    lambda t: t.strip() == t and t.strip() != "" and ".." not in t and not t.startswith("."))
# mdev type ids are sysfs directory names, <driver>-<name> (gpulib.validate).
_TYPE_IDS = st.from_regex(r"[A-Za-z0-9_.:]{1,8}-[A-Za-z0-9_.:-]{1,8}", fullmatch=True).filter(
    lambda t: ".." not in t)
_ITEMS = st.one_of(
    st.builds(VgpuRequest, _NAMES, st.none(), st.integers(1, 16),
              st.one_of(st.none(), st.integers(0, 7))),
    st.builds(VgpuRequest, st.none(), _TYPE_IDS,
              st.integers(1, 16), st.one_of(st.none(), st.integers(0, 7))),
    st.builds(PassthroughRequest, _NAMES, st.integers(1, 16),
              st.one_of(st.none(), st.integers(0, 7))))


@settings(max_examples=60, deadline=None)
@given(first=st.lists(_ITEMS, max_size=4), second=st.lists(_ITEMS, min_size=1, max_size=4),
       other_metadata=st.booleans())
def test_request_writer_property(first: list[object], second: list[object],
                                 other_metadata: bool) -> None:
    """Whatever is written reads back the same; rewriting replaces it; removing it
    leaves the document as it was (other applications' metadata untouched)."""
    meta = ("  <metadata>\n    <app:x xmlns:app='http://example.org/app'>keep</app:x>\n"
            "  </metadata>\n") if other_metadata else ""
    original = domain(metadata=meta)
    dom = parse_domain(original)
    for items in (first, second):
        request = GpuRequest(tuple(items))  # type: ignore[arg-type]
        dom.set_metadata_request(request)
        dom = parse_domain(dom.to_xml())
        assert dom.metadata_request() == (request if items else None)
    dom.set_metadata_request(None)
    assert lxml_form(dom.to_xml()) == lxml_form(original)


def test_request_writer_round_trips_through_the_parser() -> None:
    request = GpuRequest((VgpuRequest("GRID T4-2Q", None, 2, 1),
                          PassthroughRequest("10de:2484", 1, None),
                          VgpuRequest(None, "nvidia-231", 3, None)))
    dom = parse_domain(domain())
    dom.set_metadata_request(request)
    again = parse_domain(dom.to_xml())
    assert again.metadata_request() == request
    again.set_metadata_request(None)
    assert lxml_form(again.to_xml()) == lxml_form(domain())
