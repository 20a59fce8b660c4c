"""The start's modes: the entry chooses one, and only the transformer's edits the XML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpulib import nvidia
from gpulib.config import Config
from gpulib.context import AGENT_PROPERTIES, Context
from gpulib.domain import parse_domain
from gpulib.hooks.prepare import Preparer, StartMode
from gpulib.pci import PciAddress
from gpulib.placement import FixedXml, Placement
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_A10_VF_TYPE

VM = "web1"
VM_UUID = "6f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"
A10_VF = "0000:41:00.4"  # the demo records its vGPU type; its live type is 0

VF_DOMAIN = (f"<domain type='kvm'>\n  <name>{VM}</name>\n  <uuid>{VM_UUID}</uuid>\n"
             "  <memory unit='KiB'>1048576</memory>\n"
             "  <devices>\n"
             "    <hostdev mode='subsystem' type='pci' managed='yes'>\n"
             "      <source>\n"
             "        <address domain='0x0000' bus='0x41' slot='0x00' function='0x4'/>\n"
             "      </source>\n"
             "    </hostdev>\n"
             "  </devices>\n</domain>\n")


def allocation(host: FakeHost) -> dict[str, object]:
    doc = json.loads(Path(host.root, "var/lib/gpulib/state.json").read_text())
    alloc: dict[str, object] = doc["allocations"][VM]
    return alloc


def test_a_start_mode_is_fixed_by_its_entry(ctx: Context, config: Config) -> None:
    mode = StartMode.transformer(ctx, config)
    assert (mode.hook, mode.edits_xml, mode.requests) == ("transformer", True, True)
    with pytest.raises(AttributeError):
        mode.edits_xml = False  # type: ignore[misc]
    assert (StartMode.libvirt_start(ctx, config).hook,
            StartMode.libvirt_start(ctx, config).edits_xml) == ("qemu", False)


def test_metadata_requests_follow_the_configuration_in_both_starts(
        host: FakeHost, ctx: Context, config: Config) -> None:
    # auto: off where the CloudStack agent is installed (tenants can inject XML).
    host.write_file(AGENT_PROPERTIES, "host=mgmt\n", 0o644)
    assert not StartMode.transformer(ctx, config).requests
    assert not StartMode.libvirt_start(ctx, config).requests


def test_the_transformer_unmanages_a_vendor_vf_and_libvirts_start_leaves_the_xml(
        host: FakeHost, ctx: Context, config: Config) -> None:
    dom = parse_domain(VF_DOMAIN)
    preparer = Preparer(ctx, config, dom, StartMode.libvirt_start(ctx, config))
    assert isinstance(preparer.xml, FixedXml)
    devices = preparer.run()
    # libvirt starts the XML it passed: not a byte of it changes.
    assert [d.id for d in devices] == [A10_VF]
    assert not dom.changed and dom.to_xml() == VF_DOMAIN
    assert nvidia.current_type(ctx.sysfs, PciAddress.parse(A10_VF)) == DEMO_A10_VF_TYPE[0]
    assert allocation(host)["status"] == "pending"

    # The transformer's output is what starts: the VF goes to the guest unmanaged.
    dom = parse_domain(VF_DOMAIN)
    preparer = Preparer(ctx, config, dom, StartMode.transformer(ctx, config))
    assert type(preparer.xml) is Placement
    assert [d.id for d in preparer.run()] == [A10_VF]
    [h] = dom.pci_hostdevs()
    assert dom.changed and not h.managed and str(h.address) == A10_VF
