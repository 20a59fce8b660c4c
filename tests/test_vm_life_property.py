"""Whole lives of VMs and of the host, as a hypothesis state machine.

Rules: the transformer's start (CloudStack) and `prepare begin` (plain libvirt),
libvirt running the domain (its status file appears) or failing to, onStart,
a stop (status file gone, `release end`), onStop late, twice or never, a
retried start, a start under a running VM's name, a host reboot (new boot
id; live vGPUs, VF types and status files gone; the boot unit's restore), a
kill -9 at a chosen write of a stop, a full state directory, a damaged
state file, reconcile, release, unmanage and pool apply; and the ways a stop
may miss its run (ARCHITECTURE.md, Liveness): a late onStop after a new
start, a lost stop, a missing state file, reconnect under another domain
UUID, a migration libvirt abandons after `migrate begin`; and the orders in
which a hook of the run before meets a newer start: a late onStart, a late
`release end`, reconnect of a GPU-less domain under another UUID. libvirt
runs `prepare begin` before it launches or fails a start (the qemu hook is
installed), as it does.

After every step: no device tree held by two VMs (nor in two runs), no
device of a running VM removed or retyped, no pending start's device freed,
the state file parses, and the report agrees with the hooks: the CloudStack
report calls a whole GPU or a vGPU used by exactly the VM whose run holds it
(a running domain, or an allocation whose run is not over, judged here from
first principles); once a hook has run, nothing is held by a run that
is over (an active allocation without a status file, an abandoned arrival).
After the boot unit or reconcile: every allocation belongs to a running VM
or a pending start within its grace, no on-demand vGPU without an owner,
pool membership as configured.

The hooks run in this process through the functions their executables call
(a process per step would make the machine too slow to explore); the kills
and the full disk run the real stop hook in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpulib import nvidia
from gpulib.allocator import release
from gpulib.config import Config
from gpulib.domain import parse_domain
from gpulib.domstatus import running_domains
from gpulib.entry import context_for_root
from gpulib.errors import GpulibError
from gpulib.hooks.prepare import Preparer, StartMode, record_running
from gpulib.hooks.vmstate import activate, deactivate
from gpulib.lifecycle import open_store, reconcile, restore
from gpulib.liveness import Liveness
from gpulib.occupancy import Tree
from gpulib.sim.hosts import build_demo
from gpulib.state import State
from tests.hookrun import hook_env, pci_hostdev
from tests.hosts import reboot

REPO = Path(__file__).resolve().parents[1]
STATE = "var/lib/gpulib/state.json"
BOOT_ID = "proc/sys/kernel/random/boot_id"
RTX, T4_WHOLE, A100 = "0000:3b:00.0", "0000:65:00.0", "0000:ca:00.0"
POOL_MDEV = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d"  # a demo pool member (T4)
VMS = {"vm-a": "4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75",
       "vm-b": "5d8f6b02-9e3a-4c75-b2fa-7a1c5e9d3f86",
       "vm-c": "6e9a7c13-af4b-4d86-83ab-8b2d6fae4a97"}
OTHER_UUID = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"


PLANS = {
    "vgpus": ("<metadata><gpulib:gpus xmlns:gpulib='http://gpulib.org/xmlns/domain/1'>"
              "<gpulib:vgpu profile='GRID A100-8C' count='1'/></gpulib:gpus></metadata>", ""),
    "rtx": ("", pci_hostdev(RTX)),
    "t4": ("", pci_hostdev(T4_WHOLE)),
    "a100-whole": ("", pci_hostdev(A100)),
    "pool-vgpu": ("", "<hostdev mode='subsystem' type='mdev' model='vfio-pci'>"
                      f"<source><address uuid='{POOL_MDEV}'/></source></hostdev>"),
}


def domain_xml(name: str, uuid: str, plan: str) -> str:
    meta, dev = PLANS[plan]
    return (f"<domain type='kvm'><name>{name}</name><uuid>{uuid}</uuid>{meta}<devices>"
            f"<emulator>/usr/bin/qemu-system-x86_64</emulator>{dev}</devices></domain>")


class Lives(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="gpulib-lives-")
        self.host = build_demo(os.path.join(self.tmp.name, "host"))
        self.boot = 1
        self.host.write_file(BOOT_ID, f"boot-{self.boot}\n", 0o444)
        self.root = self.host.root
        # An arrival libvirt abandons is over at once: no clock to wait for.
        with open(os.path.join(self.root, "etc/gpulib/gpulib.conf"), "a") as conf:
            conf.write("\n[release]\narrival_timeout = 0\n")
        self.ctx = context_for_root(self.root, simulate=True)
        self.config = Config.load(self.ctx.config_path)
        # Whether a hook has run to its end since the last run ended: then
        # nothing is held by a run that is over.
        self.hook_ran = False
        # What libvirt would run for each VM: the XML its last start produced.
        self.prepared: dict[str, str] = {}
        self.running: dict[str, str] = {}  # name -> the XML libvirt runs

    def teardown(self) -> None:
        self.tmp.cleanup()

    # -- what libvirt and the host do ---------------------------------------------------------
    def _status_file(self, name: str, xml: str) -> None:
        dom = parse_domain(xml)
        pci = tuple(str(h.address) for h in dom.pci_hostdevs())
        mdevs = tuple(h.uuid_checked() for h in dom.mdev_hostdevs())
        assert dom.uuid is not None
        self.host.add_running_domain(name, dom.uuid, pci=pci, mdevs=mdevs)

    def _prepare(self, name: str, uuid: str, plan: str, edit: bool) -> Optional[str]:
        dom = parse_domain(domain_xml(name, uuid, plan))
        try:
            mode = StartMode("transformer" if edit else "qemu", edits_xml=edit, requests=True)
            Preparer(self.ctx, self.config, dom, mode).run()
        except GpulibError:
            return None
        self.hook_ran = True
        return dom.to_xml()

    # -- rules -------------------------------------------------------------------------------------
    @rule(name=st.sampled_from(sorted(VMS)), plan=st.sampled_from(sorted(PLANS)),
          through=st.sampled_from(["transformer", "prepare begin"]))
    def start(self, name: str, plan: str, through: str) -> None:
        """A start (or a retried one): the transformer, or plain libvirt's prepare."""
        before = self._snapshot()
        out = self._prepare(name, VMS[name], plan, edit=through == "transformer")
        if name in self.running:
            assert out is None, "a start under a running VM's name is refused"
            assert self._snapshot()["allocations"].get(name) == before["allocations"].get(name)
        if out is not None:
            self.prepared[name] = out

    @rule(name=st.sampled_from(sorted(VMS)), plan=st.sampled_from(sorted(PLANS)))
    def start_as_another_domain(self, name: str, plan: str) -> None:
        """The same name with another domain UUID (libvirt refuses it if one runs)."""
        before = self._snapshot()
        out = self._prepare(name, OTHER_UUID, plan, edit=True)
        if name in self.running:
            assert out is None
            assert self._snapshot()["allocations"].get(name) == before["allocations"].get(name)
        elif out is not None:
            self.prepared[name] = out

    def _libvirt_prepares(self, xml: str) -> bool:
        """libvirt's `prepare begin` of the XML it is about to start."""
        try:
            Preparer(self.ctx, self.config, parse_domain(xml),
                     StartMode("qemu", edits_xml=False, requests=True)).run()
        except GpulibError:
            return False
        finally:
            self.hook_ran = True
        return True

    @rule(name=st.sampled_from(sorted(VMS)))
    def libvirt_starts(self, name: str) -> None:
        xml = self.prepared.pop(name, None)
        if xml is None or name in self.running:
            return
        live = set(os.listdir(os.path.join(self.root, "sys/bus/mdev/devices")))
        if not self._libvirt_prepares(xml) or \
                any(h.uuid_checked() not in live for h in parse_domain(xml).mdev_hostdevs()):
            # libvirt fails to start a domain whose mdev is gone (released meanwhile,
            # by an administrator or a reboot): `release end` follows.
            deactivate(self.ctx, self.config, name)
            self.hook_ran = True
            return
        self._status_file(name, xml)
        self.running[name] = xml

    @rule(name=st.sampled_from(sorted(VMS)))
    def libvirt_fails_to_start(self, name: str) -> None:
        if name in self.running:
            return
        xml = self.prepared.pop(name, None)
        if xml is None:
            return
        self._libvirt_prepares(xml)
        deactivate(self.ctx, self.config, name)  # release end after a failed start
        self.hook_ran = True

    @rule(name=st.sampled_from(sorted(VMS)))
    def on_start(self, name: str) -> None:
        """The agent's onStart: it comes after libvirt started the VM."""
        if name not in self.running:
            return
        activate(self.ctx, self.config, name)
        self.hook_ran = True

    @rule(name=st.sampled_from(sorted(VMS)))
    def libvirt_stops(self, name: str) -> None:
        if self.running.pop(name, None) is None:
            return
        self.host.stop_domain(name)
        deactivate(self.ctx, self.config, name)  # release end
        self.hook_ran = True

    @rule(name=st.sampled_from(sorted(VMS)))
    def on_stop(self, name: str) -> None:
        """The agent's onStop: late, twice, or for a VM that still runs."""
        before = self._snapshot().get("allocations", {}).get(name)
        deactivate(self.ctx, self.config, name, ends_run=False)
        self.hook_ran = True
        if before is not None and before["status"] == "pending" and \
                not before.get("arriving"):  # an abandoned arrival is no start
            after = self._snapshot()["allocations"].get(name)
            assert after is not None and after["devices"] == before["devices"], \
                "an onStop ended a pending allocation (a newer start)"

    @rule(name=st.sampled_from(sorted(VMS)), plan=st.sampled_from(sorted(PLANS)))
    def late_on_stop_after_a_new_start(self, name: str, plan: str) -> None:
        """The VM stops; the agent starts it again before the old run's onStop."""
        if self.running.pop(name, None) is None:
            return
        self.host.stop_domain(name)
        self.hook_ran = False
        out = self._prepare(name, VMS[name], plan, edit=True)
        if out is None:
            return
        self.prepared[name] = out
        before = self._snapshot()["allocations"].get(name)
        live = set(os.listdir(os.path.join(self.root, "sys/bus/mdev/devices")))
        deactivate(self.ctx, self.config, name, ends_run=False)  # the late onStop
        assert self._snapshot()["allocations"].get(name) == before
        assert live <= set(os.listdir(os.path.join(self.root, "sys/bus/mdev/devices")))

    def _stopped_then_started_again(self, name: str, plan: str) -> Optional[dict[str, Any]]:
        """The VM stops; the agent starts it again (the transformer) before a hook
        of the old run comes: the newer start's allocation, or None."""
        if self.running.pop(name, None) is None:
            return None
        self.host.stop_domain(name)
        self.hook_ran = False
        out = self._prepare(name, VMS[name], plan, edit=True)
        if out is None:
            return None
        self.prepared[name] = out
        alloc: Optional[dict[str, Any]] = self._snapshot()["allocations"].get(name)
        return alloc

    @rule(name=st.sampled_from(sorted(VMS)), plan=st.sampled_from(sorted(PLANS)))
    def late_on_start_after_a_new_start(self, name: str, plan: str) -> None:
        """The old run's onStart comes after the VM stopped and started again:
        libvirt has not launched the newer start, which stays pending."""
        before = self._stopped_then_started_again(name, plan)
        if before is None:
            return
        activate(self.ctx, self.config, name)  # the late onStart
        self.hook_ran = True
        assert self._snapshot()["allocations"].get(name) == before, \
            "a late onStart changed a newer start"

    @rule(name=st.sampled_from(sorted(VMS)), plan=st.sampled_from(sorted(PLANS)))
    def late_release_end_after_a_new_start(self, name: str, plan: str) -> None:
        """The old run's release end comes after the transformer recorded the
        newer start: neither its allocation nor its vGPUs go."""
        before = self._stopped_then_started_again(name, plan)
        if before is None:
            return
        live = set(os.listdir(os.path.join(self.root, "sys/bus/mdev/devices")))
        deactivate(self.ctx, self.config, name)  # the late release end
        self.hook_ran = True
        assert self._snapshot()["allocations"].get(name) == before, \
            "a late release end ended a newer start"
        assert live <= set(os.listdir(os.path.join(self.root, "sys/bus/mdev/devices")))

    @rule(name=st.sampled_from(sorted(VMS)))
    def reconnect_gpu_less_as_another_domain(self, name: str) -> None:
        """libvirtd restarts and finds `name` running as another domain with no
        GPU: the old domain's allocation is released."""
        from gpulib.hooks.vmstate import replace_other_domain

        if name not in self.running:
            return
        self.host.stop_domain(name)
        self.host.add_running_domain(name, OTHER_UUID)
        self.running[name] = domain_xml(name, OTHER_UUID, "rtx").replace(PLANS["rtx"][1], "")
        replace_other_domain(self.ctx, self.config, name, OTHER_UUID)
        self.hook_ran = True
        alloc = self._snapshot()["allocations"].get(name)
        assert alloc is None or alloc["domain_uuid"] == OTHER_UUID, alloc

    @rule(name=st.sampled_from(sorted(VMS)))
    def stop_lost(self, name: str) -> None:
        """libvirt stops the VM; neither onStop nor release end ever comes."""
        if self.running.pop(name, None) is None:
            return
        self.host.stop_domain(name)
        self.hook_ran = False

    @rule(name=st.sampled_from(sorted(VMS)))
    def reconnect_as_another_domain(self, name: str) -> None:
        """libvirtd restarts and finds `name` running as another domain (redefined
        and started without the hooks), with the devices it runs with."""
        xml = self.running.get(name)
        if xml is None:
            return
        dom = parse_domain(xml.replace(VMS[name], OTHER_UUID))
        self.host.stop_domain(name)
        self._status_file(name, dom.to_xml())
        self.running[name] = dom.to_xml()
        record_running(self.ctx, self.config, dom)
        self.hook_ran = True
        alloc = self._snapshot()["allocations"].get(name)
        assert alloc is None or alloc["domain_uuid"] == OTHER_UUID

    @rule(name=st.sampled_from(sorted(VMS)))
    def migration_abandoned(self, name: str) -> None:
        """`migrate begin` of `name` arriving here with an on-demand vGPU; libvirt
        abandons it: no prepare begin, no release end."""
        from gpulib.migration import arrive

        if name in self.running or name in self.prepared:
            return
        if self._snapshot().get("allocations", {}).get(name) is not None:
            return
        # The XML the source's start made: a vGPU with its record of what it is.
        out = self._prepare(name, VMS[name], "vgpus", edit=True)
        if out is None:
            return
        deactivate(self.ctx, self.config, name)  # gone from here: it runs elsewhere
        try:
            arrive(self.ctx, self.config, parse_domain(out))
        except GpulibError:
            return
        self.hook_ran = False  # its timeout (0) has passed once the next hook runs

    @rule(name=st.sampled_from(sorted(VMS)), n=st.integers(1, 4),
          mode=st.sampled_from(["kill", "enospc"]))
    def stop_interrupted(self, name: str, n: int, mode: str) -> None:
        """libvirt stops the VM; its onStop is killed, or meets a full disk, at write n."""
        if self.running.pop(name, None) is None:
            return
        self.host.stop_domain(name)
        env = hook_env(self.root)
        if mode == "enospc":
            env["CRASH_WORKER_MODE"] = "enospc"
        res = subprocess.run([sys.executable, "-m", "tests.helpers.crash_worker", str(n),
                              "gpulib.hooks.statechange", "onStop", name],
                             capture_output=True, env=env, cwd=str(REPO), timeout=60)
        assert b"Traceback" not in res.stderr, res.stderr
        assert res.returncode in (0, 4, 137), res.stderr
        self.hook_ran = res.returncode == 0

    @rule()
    def host_reboots(self) -> None:
        self.boot += 1
        self.host = reboot(self.host, build_demo)
        self.host.write_file(BOOT_ID, f"boot-{self.boot}\n", 0o444)
        self.ctx = context_for_root(self.root, simulate=True)
        self.running.clear()
        self.prepared.clear()
        self.boot_unit()

    @rule()
    def boot_unit(self) -> None:
        store = open_store(self.ctx, self.config)
        with store.transaction() as state:
            restore(self.ctx, state, autostart_wait=0, checkpoint=store.checkpoint)
        self.after_cleanup_only_live_owners()

    @rule()
    def reconcile(self) -> None:
        store = open_store(self.ctx, self.config)
        with store.transaction() as state:
            reconcile(self.ctx, state, checkpoint=store.checkpoint, arrival_grace=0)
        self.hook_ran = True
        self.after_cleanup_only_live_owners()

    @rule(name=st.sampled_from(sorted(VMS)))
    def admin_releases(self, name: str) -> None:
        """`gpulib release VM` without --force: refused while the VM runs."""
        store = open_store(self.ctx, self.config)
        with store.transaction() as state:
            release(self.ctx.sysfs, state, name, Liveness(self.ctx.sysfs),
                    checkpoint=store.checkpoint, retry_seconds=0)

    @rule(address=st.sampled_from([RTX, A100, T4_WHOLE]))
    def admin_unmanages(self, address: str) -> None:
        from gpulib.domstatus import running_domains
        from gpulib.occupancy import Occupancy

        with open_store(self.ctx, self.config).transaction() as state:
            occ = Occupancy.build(self.ctx.sysfs, state, running_domains(self.ctx.sysfs))
            if not occ.conflicts(address):  # what `device unmanage` without --force does
                state.unmanaged.add(address)

    @rule()
    def pool_apply(self) -> None:
        from gpulib.hostview import discover_host
        from gpulib.pools import apply

        store = open_store(self.ctx, self.config)
        with store.transaction() as state:
            inv = discover_host(self.ctx, self.config, state=state, learn=False)
            apply(self.ctx, self.config, state, inv)

    @rule(damage=st.sampled_from([b"", b"{", b"\x00" * 16]))
    def state_file_damaged(self, damage: bytes) -> None:
        Path(self.root, STATE).write_bytes(damage)
        open_store(self.ctx, self.config).update(lambda s: None)

    @rule()
    def state_file_missing(self) -> None:
        """The state file is gone (its copy is not): the next run rebuilds it."""
        path = Path(self.root, STATE)
        before = self._snapshot()
        if not path.exists() or not Path(self.root, STATE + ".bak").exists():
            return
        path.unlink()
        open_store(self.ctx, self.config).update(lambda s: None)
        after = self._snapshot()
        for vm, alloc in before.get("allocations", {}).items():
            if alloc["status"] == "pending":
                assert after["allocations"].get(vm, {}).get("devices") == alloc["devices"], \
                    f"{vm}'s pending start lost with the state file"

    # -- invariants -------------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        path = Path(self.root, STATE)
        return json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}

    @invariant()
    def state_parses(self) -> None:
        path = Path(self.root, STATE)
        if path.exists() and path.stat().st_size:
            raw = path.read_bytes()
            if raw.strip() not in (b"", b"{") and not raw.startswith(b"\x00"):
                State.from_json(json.loads(raw))

    @invariant()
    def no_tree_held_by_two_vms(self) -> None:
        doc = self._snapshot()
        holds: list[tuple[str, str]] = []
        for vm, alloc in doc.get("allocations", {}).items():
            holds += [(vm, d["id"]) for d in alloc["devices"]]
        for d in running_domains(self.ctx.sysfs):
            holds += [(d.name, str(a)) for a in d.pci] + [(d.name, u) for u in d.mdevs]
        tree = Tree(self.ctx.sysfs, {u: r["parent"] for u, r in doc.get("vgpus", {}).items()})
        for i, (vm1, n1) in enumerate(holds):
            c1 = tree.chain(n1)
            for vm2, n2 in holds[i + 1:]:
                if vm1 == vm2:
                    continue
                c2 = tree.chain(n2)
                assert n1 not in c2 and n2 not in c1, (vm1, n1, vm2, n2)
                if n1.count(":") == 2 and n2.count(":") == 2:
                    g1, g2 = tree.group(n1), tree.group(n2)
                    assert g1 is None or g1 != g2, (vm1, n1, vm2, n2)

    @invariant()
    def the_report_agrees_with_the_hooks(self) -> None:
        """Whole GPUs and vGPUs: the CloudStack report's user is the VM whose run
        holds the device, judged here from first principles: a running domain
        names it, or an allocation names it whose run is not over (its VM runs;
        or pending, of this boot, not an arrival past its timeout of 0, within
        its grace). Nothing else is reported used."""
        from gpulib import cloudstack
        from gpulib.hostview import discover_host
        from gpulib.liveness import PENDING_GRACE_SECONDS, boot_clock_of

        doc = self._snapshot()
        path = Path(self.root, STATE)
        if path.exists() and doc == {} and path.stat().st_size:
            return  # a damaged file: the next run rebuilds it
        running = running_domains(self.ctx.sysfs)
        names = {d.name for d in running}
        holder: dict[str, str] = {}
        for d in running:
            for u in d.mdevs:
                holder[u] = d.name
            for a in d.pci:
                holder[str(a)] = d.name
        boot_id, uptime = boot_clock_of(self.ctx.sysfs)
        for vm, alloc in doc.get("allocations", {}).items():
            if vm in names:
                live = alloc["status"] == "active" or alloc.get("domain_uuid") in (
                    None, next(d.uuid for d in running if d.name == vm))
            else:
                live = alloc["status"] == "pending" and alloc.get("boot_id") == boot_id \
                    and not alloc.get("arriving") and \
                    0 <= uptime - alloc["uptime"] < PENDING_GRACE_SECONDS
            if live:
                for dev in alloc["devices"]:
                    holder.setdefault(dev["id"], vm)
        def user(entry: dict[str, Any]) -> Any:
            got = entry["used_by_vm"]
            return None if got == cloudstack.UNAVAILABLE else got  # no VM: not offered

        inventory = discover_host(self.ctx, self.config, learn=False)
        for gpu in cloudstack.render(inventory)["gpus"]:
            address = gpu["pci_address"]
            address = address if address.count(":") == 2 else "0000:" + address
            if address in (RTX, T4_WHOLE, A100):
                assert user(gpu["full_passthrough"]) == holder.get(address), \
                    (address, gpu["full_passthrough"], holder)
            for v in gpu["vgpu_instances"]:
                assert user(v) == holder.get(v["mdev_uuid"]), (v, holder)

    @invariant()
    def nothing_held_by_a_run_that_is_over(self) -> None:
        """Once a hook ran: no active allocation without its VM's status file,
        no arrival left waiting for a prepare begin that never comes."""
        if not self.hook_ran:
            return
        names = {d.name for d in running_domains(self.ctx.sysfs)}
        for vm, alloc in self._snapshot().get("allocations", {}).items():
            assert alloc["status"] != "active" or vm in names, f"{vm}'s stop left {alloc}"
            assert not alloc.get("arriving"), f"{vm}'s abandoned arrival holds {alloc}"

    @invariant()
    def running_vms_keep_their_devices(self) -> None:
        live = set(os.listdir(os.path.join(self.root, "sys/bus/mdev/devices")))
        for d in running_domains(self.ctx.sysfs):
            for u in d.mdevs:
                assert u in live, f"{d.name}'s vGPU {u} was removed under it"
            for a in d.pci:
                assert nvidia.current_type(self.ctx.sysfs, a) != 0, \
                    f"{d.name}'s VF {a} lost its type"

    def after_cleanup_only_live_owners(self) -> None:
        """Checked right after the boot unit and reconcile (the rules call it):
        none of an earlier boot stays, whatever its status, nor an active one
        whose VM does not run."""
        doc = self._snapshot()
        allocs = doc.get("allocations", {})
        names = {d.name for d in running_domains(self.ctx.sysfs)}
        boot = f"boot-{self.boot}"
        for vm, alloc in allocs.items():
            if vm in names:
                continue
            assert alloc.get("boot_id") == boot, (vm, alloc)
            assert alloc["status"] == "pending", (vm, alloc)
        owned = {d["id"] for a in allocs.values() for d in a["devices"]}
        removing = {i["id"] for i in doc.get("intents", [])}
        for uuid, rec in doc.get("vgpus", {}).items():
            if rec["on_demand"]:
                assert uuid in owned or uuid in removing, f"on-demand {uuid} has no owner"
        pooled = [u for u, r in doc.get("vgpus", {}).items() if r["pool"] == "t4-desktops"]
        assert len(pooled) <= 2, "pool membership as configured (count = 2)"


Lives.TestCase.settings = settings(max_examples=12, stateful_step_count=14, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
class TestLives(Lives.TestCase):  # type: ignore[misc,valid-type]
    pass


def test_the_machine_sees_a_running_vm_keep_its_vgpu(tmp_path: Path) -> None:
    """One life the machine must be able to tell apart: a late onStop of a running VM."""
    machine = Lives()
    try:
        machine.start("vm-a", "vgpus", "transformer")
        machine.libvirt_starts("vm-a")
        machine.on_start("vm-a")
        machine.on_stop("vm-a")
        machine.running_vms_keep_their_devices()
        assert "vm-a" in machine._snapshot()["allocations"]
        machine.libvirt_stops("vm-a")
        machine.reconcile()
        machine.after_cleanup_only_live_owners()
        assert machine._snapshot()["allocations"] == {}
    finally:
        machine.teardown()


def test_a_lost_stop_is_finished_by_the_next_hook(tmp_path: Path) -> None:
    """The VM ran and stopped without a stop hook: the next hook (another VM's
    onStart, or the boot unit run again in the same boot) releases it."""
    machine = Lives()
    try:
        machine.start("vm-a", "vgpus", "transformer")
        machine.on_start("vm-a")
        assert machine._snapshot()["allocations"]["vm-a"]["status"] == "pending"
        machine.libvirt_starts("vm-a")
        machine.on_start("vm-a")
        assert machine._snapshot()["allocations"]["vm-a"]["status"] == "active"
        machine.stop_lost("vm-a")
        machine.start("vm-b", "rtx", "transformer")  # the next hook: another VM's start
        machine.nothing_held_by_a_run_that_is_over()
        assert list(machine._snapshot()["allocations"]) == ["vm-b"]
        machine.libvirt_fails_to_start("vm-b")
        machine.start("vm-a", "vgpus", "transformer")
        machine.on_start("vm-a")
        machine.host_reboots()
        assert machine._snapshot()["allocations"] == {}
    finally:
        machine.teardown()


def test_the_machine_sees_the_hooks_of_the_run_before(tmp_path: Path) -> None:
    """The orders of a hook of the run before and a newer start, each followed by
    the invariants the machine checks after every step."""
    machine = Lives()

    def check() -> None:
        machine.no_tree_held_by_two_vms()
        machine.the_report_agrees_with_the_hooks()
        machine.nothing_held_by_a_run_that_is_over()

    try:
        for name, plan in (("vm-a", "vgpus"), ("vm-b", "rtx")):
            machine.start(name, plan, "transformer")
            machine.libvirt_starts(name)
            machine.on_start(name)
            check()
        machine.late_on_start_after_a_new_start("vm-a", "vgpus")
        check()
        assert machine._snapshot()["allocations"]["vm-a"]["status"] == "pending"
        machine.start("vm-c", "vgpus", "transformer")  # the next hook keeps it
        check()
        assert machine._snapshot()["allocations"]["vm-a"]["status"] == "pending"
        machine.libvirt_starts("vm-a")
        machine.on_start("vm-a")
        check()
        assert machine._snapshot()["allocations"]["vm-a"]["status"] == "active"
        machine.late_release_end_after_a_new_start("vm-a", "vgpus")
        check()
        machine.reconnect_gpu_less_as_another_domain("vm-b")
        check()
        assert "vm-b" not in machine._snapshot()["allocations"]
        machine.start("vm-c", "rtx", "transformer")  # the RTX is free again
        assert machine._snapshot()["allocations"]["vm-c"]["devices"][0]["id"] == RTX
        check()
    finally:
        machine.teardown()
