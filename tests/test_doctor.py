"""`gpulib doctor`: a healthy host is all ok; each broken host names exactly its fault."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import pytest

from gpulib import cli
from gpulib import doctor as dr
from gpulib.cloudstack import AGENT_HOOKS_DIR, STATE_CHANGE_HOOK, TRANSFORMER_HOOK
from gpulib.context import Context
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_A10, DEMO_T4, build_demo
from tests.hosts import (
    HOOKS_AT,
    LIBVIRTD_PID,
    healthy_host,
    install_hooks,
    simulated,
    start_libvirtd,
    tree_state,
)

RTX = "0000:3b:00.0"
RTX_AUDIO = "0000:3b:00.1"
V620 = "0000:c1:00.0"


@pytest.fixture
def host(tmp_path: Any) -> FakeHost:
    return healthy_host(str(tmp_path))


def run(host: FakeHost, **kw: Any) -> dr.Report:
    return dr.run(Context.for_root(host.root), **kw)


def only(report: dr.Report, check: str) -> dr.Result:
    found = report.results_for(check)
    assert len(found) == 1, [r.to_json() for r in found]
    return found[0]


def assert_fault(report: dr.Report, check: str, status: str, subject: str,
                 others_ok: bool = True, allowed: tuple[str, ...] = ()) -> dr.Result:
    """`check` reports `status` about `subject` with a fix; the other checks are ok."""
    results = [r for r in report.results_for(check) if r.status != dr.OK]
    assert results, f"{check} found nothing: {[r.to_json() for r in report.results]}"
    hit = [r for r in results if r.subject == subject]
    assert hit, f"{check} names {[r.subject for r in results]}, not {subject}"
    assert hit[0].status == status, hit[0].to_json()
    assert hit[0].fix and hit[0].fix.strip(), hit[0].to_json()
    assert subject in hit[0].message or subject in hit[0].subject
    if others_ok:
        summary = report.summary()
        bad = {c: s for c, s in summary.items() if c != check and c not in allowed and s != "ok"}
        assert not bad, [r.to_json() for r in report.results if r.check in bad]
    return hit[0]


def test_healthy_demo_host_is_all_ok(host: FakeHost) -> None:
    before = tree_state(host.root)
    report = run(host)
    doc = report.to_json()
    assert doc["summary"] == {c: "ok" for c in dr.CHECK_IDS}, \
        [r for r in doc["checks"] if r["status"] != "ok"]
    assert doc["status"] == "ok" and doc["exit_code"] == 0 and report.exit_code == 0
    assert [c["id"] for c in doc["checks"]] == list(dr.CHECK_IDS)
    for c in doc["checks"]:
        assert set(c) >= {"id", "status", "subject", "message", "fix"}
        assert c["message"] and "\n" not in c["message"]
    assert doc["distribution"]["family"] == "debian"
    # the T4 with mdev types on its PF (sriov_totalvfs 16, numvfs 0) is fine
    assert DEMO_T4 not in json.dumps([r.to_json() for r in report.results_for("sriov")])
    mdev = only(report, "mdev")
    assert any(d["parent"] == DEMO_T4 and d["available_instances"] > 0
               for d in mdev.details or [])
    # the doctor never writes below the root
    assert tree_state(host.root) == before


def test_demo_host_as_built_lacks_hooks(tmp_path: Any) -> None:
    host = build_demo(str(tmp_path / "demo"))
    report = run(host)
    # No libvirtd has run there yet: nothing says its or QEMU's version either.
    assert_fault(report, "hooks", "fail", "/" + dr.LIBVIRT_HOOK, allowed=("libvirt", "migration"))
    assert only(report, "migration").status == "warn"
    agent = [r for r in report.results_for("hooks") if r.subject == "/etc/cloudstack/agent"]
    assert agent and agent[0].status == "warn"
    assert only(report, "libvirt").status == "warn"


# -- one fault each (variants of a fault share one host: building one is the slow part) -----

HEALTHY_CMDLINE = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet intel_iommu=on iommu=pt"


def test_iommu_off(host: FakeHost) -> None:
    host.set_cmdline("BOOT_IMAGE=/vmlinuz-6.1.0 root=/dev/sda1 ro quiet")
    shutil.rmtree(host.p("sys/class/iommu"))
    r = assert_fault(run(host), "iommu", "fail", "/proc/cmdline")
    assert "intel_iommu=on" in (r.fix or "") and "update-grub" in (r.fix or "")

    # switched off explicitly, on an EL host: grubby and grub2-mkconfig
    host.add_iommu_unit("dmar0")
    host.set_cmdline("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro intel_iommu=off")
    host.write_file("etc/os-release", 'NAME="Rocky Linux"\nID="rocky"\n'
                                      'ID_LIKE="rhel centos fedora"\nVERSION_ID="9.4"\n')
    r = assert_fault(run(host), "iommu", "fail", "/proc/cmdline")
    assert "intel_iommu=off" in r.message
    fix = r.fix or ""
    assert 'grubby --update-kernel=ALL --remove-args="intel_iommu=off"' in fix
    assert "grub2-mkconfig -o /boot/grub2/grub.cfg" in fix and "update-grub" not in fix

    # active only by the kernel's default: a warning
    host.set_cmdline("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro")
    assert_fault(run(host), "iommu", "warn", "/proc/cmdline")


def test_nouveau_loaded(host: FakeHost) -> None:
    host.load_module("nouveau")
    r = assert_fault(run(host), "nouveau", "fail", "/sys/module/nouveau")
    assert "update-initramfs -u" in (r.fix or "")

    # not loaded, but not blacklisted either: a warning
    os.rmdir(host.p("sys/module/nouveau"))
    os.unlink(host.p("etc/modprobe.d/blacklist-nouveau.conf"))
    r = assert_fault(run(host), "nouveau", "warn", "/etc/modprobe.d")
    assert "blacklist nouveau" in (r.fix or "")


def test_passthrough_gpu_on_host_driver(host: FakeHost) -> None:
    host.bind_driver(RTX, "nvidia")
    r = assert_fault(run(host), "driver-binding", "fail", RTX)
    fix = r.fix or ""
    # what gpulib setup --passthrough applies: nothing rebound now, vfio-pci at the next boot
    assert f"gpulib setup --apply --passthrough {RTX}" in fix and "unbind" not in fix
    # the GPU and its HDMI audio function, in modprobe.d and on the command line
    assert "options vfio-pci ids=10de:2484,10de:228b" in fix
    assert "vfio-pci.ids=10de:2484,10de:228b" in fix and "update-grub" in fix
    assert "no vfio-pci.ids=" in r.message

    # the ids on the command line are listed; nvidia won the race: softdep
    host.set_cmdline(HEALTHY_CMDLINE + " vfio-pci.ids=10de:2484,10de:228b "
                     "pci-stub.ids=1002:740f")
    r = assert_fault(run(host), "driver-binding", "fail", RTX)
    assert "vfio-pci.ids=10de:2484,10de:228b" in r.message
    assert "pci-stub.ids=1002:740f" in r.message
    assert "softdep nvidia pre: vfio-pci" in (r.fix or "")


def test_audio_function_on_host_driver_in_shared_group(host: FakeHost) -> None:
    host.bind_driver(RTX_AUDIO, "snd_hda_intel")
    r = assert_fault(run(host), "iommu-group", "fail", RTX_AUDIO)
    assert "snd_hda_intel" in r.message and RTX in r.message
    assert f"printf 'vfio-pci\\n' > /etc/driverctl.d/pci-{RTX_AUDIO}" in (r.fix or "")
    assert "nothing is rebound now" in (r.fix or "")
    assert "unbind" not in (r.fix or ""), "never a live rebind"


def test_vfs_not_enabled(host: FakeHost) -> None:
    sysfs = simulated(host).sysfs
    sysfs.write(f"sys/bus/pci/devices/{DEMO_A10}/sriov_numvfs", "0")
    report = run(host)
    # the state file gives one of the vanished VFs a vGPU type: reported, as a warning
    r = assert_fault(report, "sriov", "fail", DEMO_A10, allowed=("state",))
    assert f"/usr/lib/nvidia/sriov-manage -e {DEMO_A10}" in (r.fix or "")
    assert {x.status for x in report.results_for("state")} == {"warn"}
    # still a vGPU GPU on its vendor driver, not a passthrough GPU on the host driver
    assert only(report, "driver-binding").status == "ok"

    # AMD MxGPU on gim: echo N > sriov_numvfs
    sysfs.write(f"sys/bus/pci/devices/{DEMO_A10}/sriov_numvfs", "8")
    sysfs.write(f"sys/bus/pci/devices/{V620}/sriov_numvfs", "0")
    r = assert_fault(run(host), "sriov", "fail", V620)
    assert f"echo 4 > /sys/bus/pci/devices/{V620}/sriov_numvfs" in (r.fix or "")


def test_hooks_missing(host: FakeHost) -> None:
    transformer = f"{AGENT_HOOKS_DIR}/{TRANSFORMER_HOOK}"
    os.unlink(host.p(transformer))
    r = assert_fault(run(host), "hooks", "fail", "/" + transformer)
    assert "libvirt-vm-xml-transformer" in (r.fix or "")

    install_hooks(host)
    state_change = f"{AGENT_HOOKS_DIR}/{STATE_CHANGE_HOOK}"
    os.chmod(host.p(state_change), 0o644)
    r = assert_fault(run(host), "hooks", "fail", "/" + state_change)
    assert r.fix == f"chmod 0755 /{state_change}"

    install_hooks(host)
    os.unlink(host.p(dr.LIBVIRT_HOOK))
    report = run(host)
    r = assert_fault(report, "hooks", "fail", "/" + dr.LIBVIRT_HOOK, allowed=("libvirt",))
    assert "qemu.d/50-gpulib" in (r.fix or "")
    assert only(report, "libvirt").status == "warn"

    # the agent's hook directory comes from agent.properties
    install_hooks(host)
    host.write_file("etc/cloudstack/agent/agent.properties",
                    "guid=abc\nagent.hooks.basedir=/opt/hooks\n")
    subjects = {r.subject for r in run(host, only=["hooks"]).results}
    assert subjects == {f"/opt/hooks/{TRANSFORMER_HOOK}", f"/opt/hooks/{STATE_CHANGE_HOOK}"}

    # no CloudStack agent at all: a warning, not a failure
    shutil.rmtree(host.p("etc/cloudstack"))
    report = run(host)
    assert_fault(report, "hooks", "warn", "/etc/cloudstack/agent")
    assert report.exit_code == dr.EXIT_WARNINGS == 5


def test_libvirtd_started_before_the_hook(host: FakeHost) -> None:
    start_libvirtd(host, started=HOOKS_AT - 60)
    r = assert_fault(run(host), "libvirt", "fail", "/" + dr.LIBVIRT_HOOK)
    assert (r.fix or "").startswith("systemctl restart libvirtd")

    def no_pid_file() -> None:
        os.unlink(host.p("run/libvirtd.pid"))

    def not_running() -> None:
        os.unlink(host.p(f"proc/{LIBVIRTD_PID}/stat"))

    def no_btime() -> None:
        host.write_file("proc/stat", "cpu  1 2 3\n")

    def other_process() -> None:
        start_libvirtd(host, comm="bash")

    # whatever is missing to tell: a warning with the restart as the fix
    for breakage in (no_pid_file, not_running, no_btime, other_process):
        start_libvirtd(host)
        assert run(host, only=["libvirt"]).status == "ok"
        breakage()
        r = assert_fault(run(host, only=["libvirt"]), "libvirt", "warn", "/" + dr.LIBVIRT_HOOK)
        assert r.fix == "systemctl restart libvirtd", breakage.__name__


def test_state_problems(host: FakeHost) -> None:
    import filelock

    state_rel = "var/lib/gpulib/state.json"
    with open(host.p(state_rel)) as fh:
        good = fh.read()

    host.write_file(state_rel, '{"version": 1, "vgpus": ', 0o600)
    r = assert_fault(run(host), "state", "fail", "/" + state_rel, allowed=("discovery",))
    assert "gpulib reconcile" in (r.fix or "")

    host.write_file(state_rel, '{"version": 99}\n', 0o600)
    r = assert_fault(run(host), "state", "fail", "/" + state_rel, allowed=("discovery",))
    assert "upgrade" in (r.fix or "")

    doc = json.loads(good)
    uuid = "0b7c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"
    doc["vgpus"][uuid] = dict(next(iter(doc["vgpus"].values())), parent="0000:e0:00.0")
    host.write_file(state_rel, json.dumps(doc), 0o600)
    r = assert_fault(run(host), "state", "fail", uuid, allowed=("discovery",))
    assert "0000:e0:00.0" in r.message

    host.write_file(state_rel, good, 0o600)
    lock = filelock.FileLock(host.p("var/lib/gpulib/state.lock"))
    lock.acquire()
    try:
        r = assert_fault(run(host, lock_timeout=0.2), "state", "fail",
                         "/var/lib/gpulib/state.lock")
    finally:
        lock.release()
    assert "fuser" in (r.fix or "")
    assert run(host, only=["state"]).status == "ok"


def test_mdev_problems(host: FakeHost) -> None:
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool desks]\nparents = all\ntype = nvidia-999\ncount = 1\n")
    r = assert_fault(run(host), "mdev", "warn", "pool desks")
    assert "nvidia-999" in r.message

    os.unlink(host.p("etc/gpulib/gpulib.conf"))
    for base, _dirs, files in os.walk(host.p("sys/devices")):
        if "available_instances" in files:
            host.write_file(os.path.relpath(os.path.join(base, "available_instances"),
                                            host.root), "0\n", 0o444)
    r = assert_fault(run(host), "mdev", "warn", "/sys/class/mdev_bus")
    assert "gpulib mdev remove" in (r.fix or "")


def test_mdev_pools_are_judged_as_pool_apply_plans_them(host: FakeHost) -> None:
    """A pool is a problem when `gpulib pool apply` would find nothing for it:
    among its own GPUs, in mdev types or NVIDIA vendor VF types, by a
    profile that is a type's name or its id."""
    conf = "etc/gpulib/gpulib.conf"
    offered = (
        f"[pool t4]\nparents = {DEMO_T4}\nprofile = GRID T4-2B\ncount = 1\n"
        # the type's id as the profile, as a request may name it
        "[pool t4-ids]\nparents = 10de:1eb8\nprofile = nvidia-223\ncount = 1\n"
        f"[pool a10]\nparents = {DEMO_A10}\nprofile = NVIDIA A10-2B\ncount = 1\n"
        f"[pool a10-ids]\nparents = {DEMO_A10}\ntype = 589\ncount = 1\n")
    host.write_file(conf, offered)
    assert only(run(host, only=["mdev"]), "mdev").status == dr.OK
    # The T4's type asked of the A10, which offers it no more than an
    # absent profile: neither pool gets a vGPU.
    host.write_file(conf, offered
                    + f"[pool elsewhere]\nparents = {DEMO_A10}\ntype = nvidia-223\ncount = 1\n"
                    "[pool nothing]\nparents = all\nprofile = GRID T4-99Q\ncount = 1\n")
    found = {r.subject: r for r in run(host, only=["mdev"]).results_for("mdev")}
    assert set(found) == {"pool elsewhere", "pool nothing"}
    assert all(r.status == dr.WARN and r.fix for r in found.values())
    assert "type nvidia-223" in found["pool elsewhere"].message
    assert "'GRID T4-99Q'" in found["pool nothing"].message


def test_bad_config(host: FakeHost) -> None:
    host.write_file("etc/gpulib/gpulib.conf", "[transformer]\nrefuse_in_use = maybe\n")
    r = assert_fault(run(host), "config", "fail", "/etc/gpulib/gpulib.conf", allowed=("mdev",))
    assert "refuse_in_use" in r.message
    host.write_file("etc/gpulib/gpulib.conf", "[transformer]\nrefuse_in_uze = yes\n")
    r = assert_fault(run(host), "config", "warn", "/etc/gpulib/gpulib.conf", allowed=("mdev",))
    assert "refuse_in_uze" in r.message


def test_no_gpu_host_warns_in_discovery(tmp_path: Any) -> None:
    host = FakeHost(str(tmp_path / "empty"))
    r = only(dr.run(Context.for_root(host.root), only=["discovery"]), "discovery")
    assert r.status == "warn" and r.fix


def test_agent_rules() -> None:
    good_address = {"domain": "0x0000", "bus": "0x3b", "slot": "0x00", "function": "0x0"}
    gpu: dict[str, Any] = {
        "pci_address": "3b:00.0", "vendor_id": "10de", "device_id": "2484", "vendor": "NVIDIA",
        "device": "GA104", "driver": "vfio-pci", "pci_class": "VGA compatible controller [0300]",
        "iommu_group": "12", "pci_root": "0000:3a:00.0", "numa_node": 0, "sriov_totalvfs": 0,
        "sriov_numvfs": 0, "max_instances": None, "video_ram": None, "max_heads": None,
        "max_resolution_x": None, "max_resolution_y": None,
        "full_passthrough": {"enabled": 1, "libvirt_address": good_address,
                             "used_by_vm": None},
        "vgpu_instances": [], "vf_instances": []}
    assert dr.agent_document_problems({"gpus": [gpu]}) == []
    bad = json.loads(json.dumps(gpu))
    bad["full_passthrough"]["enabled"] = True
    bad["vf_instances"] = [{"vf_pci_address": "3b:00.4", "vf_profile": None,
                            "libvirt_address": good_address, "used_by_vm": None}]
    problems = [p for _, p in dr.agent_document_problems({"gpus": [bad]})]
    assert any("getAsInt" in p for p in problems)
    assert any("vf_profile" in p for p in problems)


@pytest.mark.parametrize("os_release,family,grub", [
    ('ID=ubuntu\nID_LIKE=debian\n', "debian", "update-grub"),
    ('ID="almalinux"\nID_LIKE="rhel centos fedora"\n', "rhel", "grub2-mkconfig"),
    ('ID=fedora\n', "rhel", "grub2-mkconfig"),
    ('ID="opensuse-leap"\nID_LIKE="suse opensuse"\n', "suse", "grub2-mkconfig"),
    ('', "unknown", "update-grub"),
])
def test_distribution(tmp_path: Any, os_release: str, family: str, grub: str) -> None:
    host = FakeHost(str(tmp_path / "h"))
    host.write_file("etc/os-release", os_release)
    distro = dr.Distro.read(Context.for_root(host.root))
    assert distro.family == family
    assert grub in distro.grub_update()


# -- the command line ------------------------------------------------------------------


def cli_doctor(host: FakeHost, monkeypatch: Any, capsys: Any,
               args: Optional[list[str]] = None) -> tuple[int, str]:
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    monkeypatch.delenv("GPULIB_SIMULATE", raising=False)
    code = cli.main(["doctor", *(args if args is not None else ["--json"])])
    return code, capsys.readouterr().out


def test_cli_exit_codes(host: FakeHost, monkeypatch: Any, capsys: Any) -> None:
    code, out = cli_doctor(host, monkeypatch, capsys)
    assert code == 0
    assert json.loads(out)["summary"] == {c: "ok" for c in dr.CHECK_IDS}

    # warnings only: 5, never the 2 of a usage error
    agent = host.p("etc/cloudstack")
    os.rename(agent, agent + ".away")
    code, out = cli_doctor(host, monkeypatch, capsys)
    doc = json.loads(out)
    assert code == 5 and doc["status"] == "warn" and doc["exit_code"] == 5

    # usage errors: 2, the report not run
    for args in (["--check", "no-such-check"], ["--bogus"], ["--json", "extra"]):
        code, out = cli_doctor(host, monkeypatch, capsys, args)
        assert code == 2 and out == "", args

    # a failure: 1
    host.load_module("nouveau")
    code, out = cli_doctor(host, monkeypatch, capsys)
    doc = json.loads(out)
    assert code == 1 and doc["exit_code"] == 1 and doc["summary"]["nouveau"] == "fail"

    # the human report
    host.bind_driver(RTX_AUDIO, "snd_hda_intel")
    code, out = cli_doctor(host, monkeypatch, capsys, ["--check", "iommu-group",
                                                      "--check", "iommu"])
    assert code == 1
    assert f"FAIL  iommu-group  {RTX_AUDIO}:" in out
    assert f"fix: printf 'vfio-pci\\n' > /etc/driverctl.d/pci-{RTX_AUDIO}" in out
    assert "2 checks: 1 ok, 0 warn, 1 fail" in out


def test_fixes_are_the_rendered_actions(host: FakeHost) -> None:
    """One place decides: the fix text is the actions, the JSON carries both."""
    from gpulib.doctor.actions import KernelArgs, Reboot, RunCommand, WriteFile, render

    host.load_module("nouveau")
    os.unlink(host.p("etc/modprobe.d/blacklist-nouveau.conf"))
    host.set_cmdline("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro")
    host.write_file("proc/cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\n")
    shutil.rmtree(host.p("sys/class/iommu"))
    report = run(host, only=["iommu", "nouveau"])
    nouveau = only(report, "nouveau")
    assert nouveau.actions == [
        WriteFile("etc/modprobe.d/blacklist-nouveau.conf",
                  "blacklist nouveau\noptions nouveau modeset=0\n"),
        RunCommand(("update-initramfs", "-u", "-k", "all")), Reboot()]
    assert nouveau.fix == render(nouveau.actions, report.distro)
    iommu = only(report, "iommu")
    assert iommu.actions == [KernelArgs(add=("intel_iommu=on", "iommu=pt"))]
    doc = iommu.to_json()
    assert doc["actions"] == [{"kind": "kernel-args", "add": ["intel_iommu=on", "iommu=pt"],
                               "remove": []}]
    assert doc["fix"] == report.distro.kernel_args_fix(add="intel_iommu=on iommu=pt")


def test_cloudstack_host_without_the_qemu_hook_fails(host: FakeHost) -> None:
    # Under CloudStack the qemu hook is what stops a start the transformer refused.
    assert os.path.isdir(host.p("etc/cloudstack/agent"))
    os.unlink(host.p(dr.LIBVIRT_HOOK))
    report = run(host, only=["hooks"])
    r = assert_fault(report, "hooks", "fail", "/" + dr.LIBVIRT_HOOK)
    assert "the CloudStack agent is installed" in r.message
    assert report.exit_code == dr.EXIT_CODES[dr.FAIL]


def test_json_counts_checks_as_the_text_does(tmp_path: Any) -> None:
    """`counts` in `doctor --json` is the text's closing line: one per check, by its
    worst result; `result_counts` counts the results themselves."""
    host = healthy_host(str(tmp_path))
    # Two passthrough GPUs on a host driver: two results of one check.
    host.bind_driver(RTX, "nvidia")
    host.bind_driver("0000:65:00.0", "nvidia")
    report = run(host)
    assert len(report.results_for("driver-binding")) >= 2
    doc = report.to_json()
    last = report.text().splitlines()[-1]
    summary = list(report.summary().values())
    counts = doc["counts"]
    assert last == (f"{len(summary)} checks: {counts['ok']} ok, {counts['warn']} warn, "
                    f"{counts['fail']} fail")
    assert sum(doc["counts"].values()) == len(summary)
    assert sum(doc["result_counts"].values()) == len(doc["checks"])
    assert len(doc["checks"]) > len(summary)
