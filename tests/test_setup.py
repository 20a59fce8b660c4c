"""`gpulib setup`: a plan that changes nothing, applied once, idempotent, never taking a GPU
from the host unasked."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import stat
import subprocess
from typing import Any, Optional

import pytest

from gpulib import cli, hostsetup
from gpulib import doctor as dr
from gpulib.context import Context
from gpulib.sim.fakehost import FakeHost
from tests.hookrun import BIN, hook_env
from tests.hosts import healthy_host, tree_contents, tree_state
from tests.setuphosts import (
    BTIME,
    DEBIAN_GRUB,
    EL9_GRUB,
    GPU,
    GPU_AUDIO,
    UBUNTU_GRUB,
    unprepared_host,
)

BLACKLIST = "etc/modprobe.d/blacklist-nouveau.conf"
DRACUT_BLACKLIST = "etc/dracut.conf.d/gpulib-blacklist-nouveau.conf"
VFIO_CONF = "etc/modprobe.d/gpulib-vfio.conf"

# distro -> (CPU vendor, /etc/default/grub after the edit, boot config command, initramfs)
EXPECTED = {
    "debian12": ("GenuineIntel",
                 DEBIAN_GRUB.replace('GRUB_CMDLINE_LINUX_DEFAULT="quiet"',
                                     'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on '
                                     'iommu=pt"'),
                 ["update-grub"], ["update-initramfs", "-u", "-k", "all"]),
    # An AMD host: the AMD IOMMU is on by default, iommu=pt is what it needs.
    "ubuntu2404": ("AuthenticAMD",
                   UBUNTU_GRUB.replace('GRUB_CMDLINE_LINUX_DEFAULT="quiet splash"',
                                       'GRUB_CMDLINE_LINUX_DEFAULT="quiet splash iommu=pt"'),
                   ["update-grub"], ["update-initramfs", "-u", "-k", "all"]),
    "el9": ("GenuineIntel",
            EL9_GRUB.replace('rd.lvm.lv=rl/swap"', 'rd.lvm.lv=rl/swap intel_iommu=on iommu=pt"'),
            ["grubby", "--update-kernel=ALL", "--args=intel_iommu=on iommu=pt"],
            ["dracut", "-f", "--regenerate-all"]),
}


def setup_cli(host: FakeHost, monkeypatch: Any, capsys: Any, *args: str) -> tuple[int, str]:
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    monkeypatch.delenv("GPULIB_SIMULATE", raising=False)
    code = cli.main(["setup", *args])
    return code, capsys.readouterr().out


def setup_json(host: FakeHost, monkeypatch: Any, capsys: Any,
               *args: str) -> tuple[int, dict[str, Any]]:
    code, out = setup_cli(host, monkeypatch, capsys, "--json", *args)
    return code, json.loads(out)


def doctor(host: FakeHost, only: Optional[list[str]] = None) -> dr.Report:
    return dr.run(Context.for_root(host.root), lock_timeout=0.1, only=only)


def read(host: FakeHost, rel: str) -> str:
    with open(host.p(rel), encoding="utf-8") as fh:
        return fh.read()


@pytest.mark.parametrize("distro", sorted(EXPECTED))
def test_unprepared_host_plan_apply_and_second_run(tmp_path: Any, monkeypatch: Any,
                                                  capsys: Any, distro: str) -> None:
    cpu, grub_after, boot_cmd, initramfs = EXPECTED[distro]
    host = unprepared_host(str(tmp_path / distro), distro, cpu=cpu)
    grub_before = read(host, "etc/default/grub")
    before = tree_state(host.root)

    # the doctor finds both problems, with fixes for this distribution
    report = doctor(host, ["iommu", "nouveau"])
    assert report.summary() == {"iommu": "fail", "nouveau": "fail"}

    # the plan: the right edits and commands, in a safe order; nothing changes
    code, plan = setup_json(host, monkeypatch, capsys)
    assert code == 0 and plan["commands_run"] is False
    assert tree_state(host.root) == before
    edits = {s["path"]: s for s in plan["steps"] if s["kind"] == "edit"}
    # dracut (EL's) gets the blacklist by name: its images hold /etc/modprobe.d only
    # where they are host-only
    dracut = {"/" + DRACUT_BLACKLIST} if initramfs[0] == "dracut" else set()
    assert set(edits) == {"/etc/default/grub", "/" + BLACKLIST} | dracut
    assert edits["/" + BLACKLIST]["new_file"] is True
    assert "+blacklist nouveau\n+options nouveau modeset=0\n" in edits["/" + BLACKLIST]["diff"]
    grub_diff = edits["/etc/default/grub"]["diff"]
    minus = [line for line in grub_diff.splitlines() if line.startswith("-") and
             not line.startswith("---")]
    plus = [line for line in grub_diff.splitlines() if line.startswith("+") and
            not line.startswith("+++")]
    assert len(minus) == 1 and len(plus) == 1, grub_diff
    commands = [s["argv"] for s in plan["steps"] if s["kind"] == "command"]
    assert commands == [boot_cmd, initramfs]
    kinds = [s["kind"] for s in plan["steps"]]
    assert kinds == sorted(kinds, key=lambda k: k != "edit"), "files before commands"
    assert plan["still_to_do"][-1] == "reboot the host"
    assert any("AMD-Vi" in t for t in plan["still_to_do"]) == (cpu == "AuthenticAMD")

    # the human plan says the commands are not run here
    code, text = setup_cli(host, monkeypatch, capsys)
    assert code == 0 and "commands are listed, not run" in text
    assert "nothing was changed" in text and tree_state(host.root) == before

    # apply: files edited diff-exact, a backup of the file that existed, reboot reported
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes")
    assert code == 0, done
    assert read(host, "etc/default/grub") == grub_after
    assert read(host, BLACKLIST) == "blacklist nouveau\noptions nouveau modeset=0\n"
    backups = glob.glob(host.p("etc/default/grub.gpulib-*.bak"))
    assert len(backups) == 1 and read(host, os.path.relpath(backups[0], host.root)) == \
        grub_before
    assert done["backups"] == ["/" + os.path.relpath(backups[0], host.root)]
    assert not glob.glob(host.p("etc/modprobe.d/*.bak"))  # a new file has nothing to keep
    assert [s["done"] for s in done["steps"]] == ["created"] * (1 + len(dracut)) + [
        "edited", "listed, not run", "listed, not run"]
    assert "reboot the host" in done["still_to_do"]
    assert set(done["pending_reboot"]) == {"iommu", "nouveau"}
    assert done["doctor"]["summary"]["iommu"] == "warn"

    # the doctor: what was fixed is no longer a failure; the reboot is pending, not done
    report = doctor(host)
    for check in ("iommu", "nouveau"):
        (r,) = report.results_for(check)
        assert r.status == "warn" and r.pending == "reboot", r.to_json()
        assert "reboot is pending" in r.message and r.fix == "reboot"
    # the GPU was not named: it stays with the host, the doctor still says so
    assert report.summary()["driver-binding"] == "fail"
    # its missing IOMMU group waits for the same reboot
    (group,) = report.results_for("iommu-group")
    assert group.status == "warn" and group.pending == "reboot"

    # a second run finds nothing to do and changes nothing
    after = tree_contents(host.root)
    code, again = setup_json(host, monkeypatch, capsys)
    assert code == 0 and again["steps"] == [] and again["still_to_do"] == ["reboot the host"]
    code, again = setup_json(host, monkeypatch, capsys, "--apply", "--yes")
    assert code == 0 and again["steps"] == [] and again["backups"] == []
    assert tree_contents(host.root) == after

    # after the reboot: the kernel has the arguments, nouveau is gone
    host.set_cmdline(host_cmdline(host) + " " + ("iommu=pt" if cpu == "AuthenticAMD" else
                                                   "intel_iommu=on iommu=pt"))
    host.write_file("proc/sys/kernel/random/boot_id", "a-new-boot\n")
    host.add_iommu_unit("ivhd0" if cpu == "AuthenticAMD" else "dmar0")
    host.set_iommu_group(GPU, 7)
    host.set_iommu_group(GPU_AUDIO, 7)
    os.rmdir(host.p("sys/module/nouveau"))
    host.bind_driver(GPU, None)
    host.bind_driver(GPU_AUDIO, None)
    summary = doctor(host, ["iommu", "nouveau"]).summary()
    assert summary == {"iommu": "ok", "nouveau": "ok"}


def host_cmdline(host: FakeHost) -> str:
    return read(host, "proc/cmdline").strip()


def test_reboot_without_the_change_is_not_pending(tmp_path: Any, monkeypatch: Any,
                                                  capsys: Any) -> None:
    """The journal counts only for the boot it was written in."""
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    assert setup_json(host, monkeypatch, capsys, "--apply", "--yes")[0] == 0
    host.write_file("proc/sys/kernel/random/boot_id", "booted-again\n")
    report = doctor(host, ["iommu", "nouveau"])
    (iommu,) = report.results_for("iommu")
    assert iommu.status == "fail" and iommu.pending is None
    assert "configured in /etc/default/grub" in iommu.message
    assert iommu.fix == "update-grub && reboot"
    (nouveau,) = report.results_for("nouveau")
    assert nouveau.status == "fail" and nouveau.fix == "update-initramfs -u -k all && reboot"
    # setup now plans exactly those commands, no file edit
    code, plan = setup_json(host, monkeypatch, capsys)
    assert code == 0
    assert [s.get("argv") for s in plan["steps"]] == [["update-grub"],
                                                      ["update-initramfs", "-u", "-k", "all"]]


def test_already_right_host_has_an_empty_plan(tmp_path: Any, monkeypatch: Any,
                                              capsys: Any) -> None:
    host = healthy_host(str(tmp_path))
    before = tree_contents(host.root)
    code, plan = setup_json(host, monkeypatch, capsys)
    assert code == 0 and plan["steps"] == [] and plan["still_to_do"] == []
    assert plan["refused"] == []
    code, plan = setup_json(host, monkeypatch, capsys, "--apply", "--yes")
    assert code == 0 and plan["steps"] == [] and plan["doctor"]["status"] == "ok"
    assert tree_contents(host.root) == before
    code, text = setup_cli(host, monkeypatch, capsys)
    assert code == 0 and "nothing to change" in text


def test_apply_without_yes_needs_a_terminal(tmp_path: Any, monkeypatch: Any,
                                            capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    before = tree_state(host.root)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    code = cli.main(["setup", "--apply"])  # pytest's stdin is no terminal
    assert code == 2 and "--yes" in capsys.readouterr().err
    assert tree_state(host.root) == before


def test_check_limits_the_plan(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "el9")
    code, plan = setup_json(host, monkeypatch, capsys, "--check", "nouveau")
    assert code == 0
    assert [s.get("path") or s["argv"] for s in plan["steps"]] == [
        "/" + BLACKLIST, "/" + DRACUT_BLACKLIST, ["dracut", "-f", "--regenerate-all"]]


# -- never take a GPU from the host unasked ----------------------------------------------------


def test_unnamed_gpu_stays_with_the_host(tmp_path: Any, monkeypatch: Any,
                                         capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    code, plan = setup_json(host, monkeypatch, capsys)
    assert code == 0
    assert not any("vfio" in json.dumps(s) or "driverctl" in json.dumps(s)
                   for s in plan["steps"])
    assert any(n.startswith(f"{GPU} stays with the host") for n in plan["notes"])


def test_named_gpu_goes_to_vfio_with_its_group(tmp_path: Any, monkeypatch: Any,
                                               capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 0 and plan["refused"] == []
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough",
                            "10de:2484")
    assert code == 0, done
    assert 'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on iommu=pt '\
        'vfio-pci.ids=10de:2484,10de:228b"' in read(host, "etc/default/grub")
    assert read(host, VFIO_CONF).splitlines()[1:] == [
        "options vfio-pci ids=10de:2484,10de:228b", "softdep nouveau pre: vfio-pci",
        "softdep snd_hda_intel pre: vfio-pci"]
    assert "driver-binding" in done["pending_reboot"]
    # the doctor: the GPU and its audio function wait for the reboot, nothing fails
    report = doctor(host, ["driver-binding", "iommu-group"])
    assert {r.check: (r.status, r.pending) for r in report.results} == {
        "driver-binding": ("warn", "reboot"), "iommu-group": ("warn", "reboot")}
    assert {r.subject for r in report.results} == {GPU, GPU_AUDIO}
    after = tree_contents(host.root)
    code, again = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough",
                             GPU)
    assert code == 0 and again["steps"] == []
    assert tree_contents(host.root) == after


def test_boot_vga_needs_a_second_flag(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file(os.path.relpath(os.path.join(host.device_dir(GPU), "boot_vga"), host.root),
                    "1\n", 0o444)
    before = tree_state(host.root)
    code, plan = setup_json(host, monkeypatch, capsys, "--apply", "--yes",
                            "--passthrough", GPU, "--check", "driver-binding")
    assert code == 1
    assert plan["refused"][0]["device"] == GPU and "boot VGA" in plan["refused"][0]["why"]
    assert plan["steps"] == [] and tree_state(host.root) == before
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU,
                            "--include-boot-vga")
    assert code == 0 and plan["refused"] == []
    assert any(s.get("path") == "/" + VFIO_CONF for s in plan["steps"])


@pytest.mark.parametrize("klass,what", [(0x010802, "storage"), (0x020000, "network")])
def test_group_with_host_devices_is_refused(tmp_path: Any, monkeypatch: Any, capsys: Any,
                                            klass: int, what: str) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    group = int(os.path.basename(os.readlink(os.path.join(host.device_dir(GPU),
                                                          "iommu_group"))))
    other = "0000:3c:00.0"
    host.add_function(other, 0x144D, 0xA808, klass, driver="nvme" if klass >> 16 == 1
                      else "ixgbe", iommu_group=group)
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 1
    (refused,) = plan["refused"]
    assert refused["device"] == GPU and other in refused["why"] and what in refused["why"]
    assert not any("vfio" in json.dumps(s) for s in plan["steps"])


def test_shared_id_needs_per_device_binding(tmp_path: Any, monkeypatch: Any,
                                            capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    twin = "0000:5e:00.0"
    host.add_function(twin, 0x10DE, 0x2484, 0x030000, driver="nouveau",
                      iommu_group=host.new_iommu_group())
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 1
    (refused,) = plan["refused"]
    assert twin in refused["why"] and "driverctl" in refused["why"]
    assert not any("vfio-pci.ids" in json.dumps(s) for s in plan["steps"])

    # with driverctl installed: per device, the twin untouched
    host.write_file("usr/sbin/driverctl", "#!/bin/sh\n", 0o755)
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 0 and plan["refused"] == []
    commands = [s["argv"] for s in plan["steps"] if s["kind"] == "command"]
    # driverctl's own record, applied at the next boot: driverctl itself is never run
    # (its set-override unbinds the device at once, --noprobe or not)
    edits = {s["path"]: s["diff"] for s in plan["steps"] if s["kind"] == "edit"}
    for address in (GPU, GPU_AUDIO):
        assert "+vfio-pci" in edits[f"/etc/driverctl.d/pci-{address}"]
    assert not any(argv[0] == "driverctl" for argv in commands)
    assert all(s["takes_effect"] == "at the next boot" for s in plan["steps"])
    assert f"/etc/driverctl.d/pci-{twin}" not in edits
    assert not any("vfio-pci.ids" in json.dumps(s) for s in plan["steps"])
    assert any(n.startswith(f"{GPU}: nothing is rebound now") and "driverctl list-persisted"
               in n for n in plan["notes"])


@pytest.mark.parametrize("word", ["0000:99:00.0", "10de:ffff", "not-a-device"])
def test_passthrough_of_nothing_is_bad_input(tmp_path: Any, monkeypatch: Any, capsys: Any,
                                             word: str) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    before = tree_state(host.root)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    code = cli.main(["setup", "--apply", "--yes", "--passthrough", word])
    assert code == 2 and word in capsys.readouterr().err
    assert tree_state(host.root) == before


def test_config_passthrough(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file("etc/gpulib/gpulib.conf", f"[setup]\npassthrough = {GPU}\n")
    code, plan = setup_json(host, monkeypatch, capsys)
    assert code == 0 and any(s.get("path") == "/" + VFIO_CONF for s in plan["steps"])
    # `all` would take every GPU: refused by the config reader
    host.write_file("etc/gpulib/gpulib.conf", "[setup]\npassthrough = all\n")
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    code = cli.main(["setup"])
    err = capsys.readouterr().err
    assert code != 0 and "[setup] passthrough" in err and "all" in err


# -- SR-IOV and the vGPU manager: reported, not guessed -----------------------------------------


def test_nvidia_vfs_named_with_the_vendor_tool(tmp_path: Any, monkeypatch: Any,
                                               capsys: Any) -> None:
    from tests.hosts import a10_host

    host = a10_host(str(tmp_path), numvfs=0)
    host.write_file("etc/os-release", "ID=debian\n")
    pf = "0000:41:00.0"
    code, plan = setup_json(host, monkeypatch, capsys, "--check", "sriov")
    # no vGPU manager installed: named, nothing downloaded or run
    assert code == 0 and plan["steps"] == []
    assert any(f"/usr/lib/nvidia/sriov-manage -e {pf}" in t and "downloads no driver" in t
               for t in plan["still_to_do"])

    host.write_file("usr/lib/nvidia/sriov-manage", "#!/bin/sh\n", 0o755)
    host.write_file("usr/lib/systemd/system/nvidia-sriov.service",
                    "[Service]\nType=oneshot\nExecStart=/usr/lib/nvidia/sriov-manage -e ALL\n")
    code, plan = setup_json(host, monkeypatch, capsys, "--check", "sriov")
    # nothing now: the unit enabled, the VFs there from the next boot on; running the
    # tool now is left to the operator
    assert [s["argv"] for s in plan["steps"]] == [["systemctl", "enable", "nvidia-sriov.service"]]
    assert all(s["takes_effect"] == "at the next boot" for s in plan["steps"])
    assert any(f"/usr/lib/nvidia/sriov-manage -e {pf}" in t for t in plan["still_to_do"])
    (r,) = doctor(host, ["sriov"]).results
    assert "nvidia-sriov.service runs sriov-manage at boot but is not enabled" in r.message

    os.makedirs(host.p("etc/systemd/system/multi-user.target.wants"))
    os.symlink("/usr/lib/systemd/system/nvidia-sriov.service",
               host.p("etc/systemd/system/multi-user.target.wants/nvidia-sriov.service"))
    code, plan = setup_json(host, monkeypatch, capsys, "--check", "sriov")
    assert plan["steps"] == []
    assert any(f"/usr/lib/nvidia/sriov-manage -e {pf}" in t and "systemctl status" in t
               for t in plan["still_to_do"])


def test_grub_that_cannot_be_edited_safely_is_refused(tmp_path: Any, monkeypatch: Any,
                                                      capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    host.write_file("etc/default/grub", 'GRUB_CMDLINE_LINUX_DEFAULT="quiet\n  splash"\n')
    code, plan = setup_json(host, monkeypatch, capsys, "--check", "iommu")
    assert code == 1 and plan["steps"] == []
    assert plan["refused"][0]["device"] == "/etc/default/grub"
    assert "by hand" in plan["refused"][0]["why"]


def test_backup_names_do_not_collide(tmp_path: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    ctx = Context.for_root(host.root)
    for expected in (1, 2):
        shutil.copy(host.p("etc/default/grub"), host.p("etc/default/grub.tmpcopy"))
        plan, reboot_for = hostsetup.make_plan(ctx, only=["iommu"])
        hostsetup.apply(ctx, plan, reboot_for, now=BTIME + 10)
        assert len(glob.glob(host.p("etc/default/grub.gpulib-*.bak*"))) == expected
        shutil.copy(host.p("etc/default/grub.tmpcopy"), host.p("etc/default/grub"))


def test_ubuntu_grub_d_override_is_named(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "ubuntu2404")
    host.write_file("etc/default/grub.d/50-cloudimg-settings.cfg",
                    'GRUB_CMDLINE_LINUX_DEFAULT="console=tty1 console=ttyS0"\n')
    _code, plan = setup_json(host, monkeypatch, capsys, "--check", "iommu")
    assert any("50-cloudimg-settings.cfg sets GRUB_CMDLINE_LINUX_DEFAULT" in n
               for n in plan["notes"])


def test_two_setups_at_once(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    import fcntl

    host = unprepared_host(str(tmp_path / "h"), "debian12")
    os.makedirs(host.p("var/lib/gpulib"), exist_ok=True)
    before = tree_contents(host.root)
    with open(host.p(hostsetup.SETUP_LOCK), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        monkeypatch.setenv("GPULIB_ROOT", host.root)
        code = cli.main(["setup", "--apply", "--yes"])
    assert code == 3 and "another gpulib setup" in capsys.readouterr().err
    after = tree_contents(host.root)
    assert {k: v for k, v in after.items() if not k.endswith("setup.lock")} == \
        {k: v for k, v in before.items() if not k.endswith("setup.lock")}


def test_libvirtd_restart_is_left_to_the_operator(tmp_path: Any, monkeypatch: Any,
                                                  capsys: Any) -> None:
    from tests.hosts import HOOKS_AT, start_libvirtd

    host = healthy_host(str(tmp_path))
    start_libvirtd(host, started=HOOKS_AT - 60)
    code, plan = setup_json(host, monkeypatch, capsys)
    assert code == 0 and plan["steps"] == []
    assert plan["still_to_do"] == ["systemctl restart libvirtd (running VMs keep running)"]


def test_a_failing_command_stops_the_apply(tmp_path: Any) -> None:
    """Files first, then commands; the first failure stops, and what did not finish is not
    recorded as waiting for the reboot."""
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx)
    assert [s.kind for s in plan.steps] == ["edit", "edit", "command", "command"]
    grub_cmd, initramfs_cmd = plan.steps[2], plan.steps[3]
    grub_cmd.argv = ("true",)  # the boot entries: fine
    initramfs_cmd.argv = ("false",)  # the initramfs: fails
    plan.run_commands = True
    with pytest.raises(hostsetup.SetupError, match="exit 1"):
        hostsetup.apply(ctx, plan, reboot_for)
    assert [s.done for s in plan.steps] == ["created", "edited", "ran", "failed (exit 1)"]
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    # a run that failed promises no reboot, not even for what it completed: the
    # initramfs never got built
    assert journal["pending_reboot"] == []
    report = doctor(host, ["iommu", "nouveau"])
    assert [r.pending for r in report.results] == [None, None]
    (iommu,) = report.results_for("iommu")
    assert "did not complete (`false`)" in iommu.message and "before rebooting" in iommu.message
    assert report.results_for("nouveau")[0].fix == "update-initramfs -u -k all && reboot"


def test_a_file_changed_after_planning_is_not_overwritten(tmp_path: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx, only=["iommu"])
    host.write_file("etc/default/grub", DEBIAN_GRUB + "GRUB_TIMEOUT=10\n")
    with pytest.raises(hostsetup.SetupError, match="changed since the plan"):
        hostsetup.apply(ctx, plan, reboot_for)
    assert read(host, "etc/default/grub") == DEBIAN_GRUB + "GRUB_TIMEOUT=10\n"
    assert not glob.glob(host.p("etc/default/grub.gpulib-*"))


class Waited(Exception):
    """An apply waited on a file: the test fails instead of hanging the suite."""


def _waited(signum: int, frame: Any) -> None:
    raise Waited()


def test_a_fifo_in_place_of_a_planned_file_is_never_waited_on(tmp_path: Any) -> None:
    """/etc/default/grub replaced by a FIFO between the plan and the apply:
    the apply stops with the file named and leaves it as it is."""
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx, only=["iommu"])
    os.unlink(host.p("etc/default/grub"))
    os.mkfifo(host.p("etc/default/grub"))
    # A hang guard only (a FIFO nobody writes blocks forever), not a speed limit.
    previous = signal.signal(signal.SIGALRM, _waited)
    signal.alarm(30)
    try:
        with pytest.raises(hostsetup.SetupError,
                           match="cannot read /etc/default/grub: a FIFO, not a file"):
            hostsetup.apply(ctx, plan, reboot_for)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    # checked before the first change: nothing edited, update-grub never reached
    assert [s.done for s in plan.steps] == [
        "refused: cannot read /etc/default/grub: a FIFO, not a file", ""]
    assert stat.S_ISFIFO(os.lstat(host.p("etc/default/grub")).st_mode)
    assert not glob.glob(host.p("etc/default/grub.gpulib-*"))
    assert not os.path.exists(host.p(dr.SETUP_JOURNAL))


def test_a_file_that_cannot_be_read_is_refused_not_planned(tmp_path: Any) -> None:
    """A FIFO where the nouveau blacklist goes: not taken for an absent file
    (a plan to create it, an apply that waits on it) but refused, by name;
    the other edits are applied. The command runs under a time limit."""
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    os.makedirs(host.p("etc/modprobe.d"), exist_ok=True)
    os.mkfifo(host.p(BLACKLIST))
    proc = subprocess.run([str(BIN / "gpulib"), "setup", "--apply", "--yes", "--json"],
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=60,
                          env=hook_env(host.root, simulate=False))
    assert proc.returncode == 1, proc.stderr
    done = json.loads(proc.stdout)
    assert done["refused"] == [{"kind": "file", "device": "/" + BLACKLIST,
                                "why": f"cannot read /{BLACKLIST}: a FIFO, not a file"}]
    assert [s["path"] for s in done["steps"] if s["kind"] == "edit"] == ["/etc/default/grub"]
    assert stat.S_ISFIFO(os.lstat(host.p(BLACKLIST)).st_mode)


def test_iommu_switched_off_is_removed_wherever_it_is(tmp_path: Any, monkeypatch: Any,
                                                      capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    host.write_file("etc/default/grub", DEBIAN_GRUB.replace('GRUB_CMDLINE_LINUX=""',
                                                            'GRUB_CMDLINE_LINUX="intel_iommu=off"'))
    host.set_cmdline("BOOT_IMAGE=/boot/vmlinuz root=/dev/sda1 ro intel_iommu=off quiet")
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0, done
    assert read(host, "etc/default/grub") == DEBIAN_GRUB.replace(
        'GRUB_CMDLINE_LINUX_DEFAULT="quiet"',
        'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on iommu=pt"')
    (r,) = doctor(host, ["iommu"]).results
    assert r.pending == "reboot"
