"""`gpulib setup` on the layouts real distributions ship: where the kernel command line
really comes from, what a failed step leaves, which GPUs may go, and what the doctor says
about it. Each test is one way a host went wrong; the real Debian root is
tests/test_setup_debian.py."""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import subprocess
from typing import Any

import pytest

from gpulib import bootconfig, hostsetup
from gpulib import doctor as dr
from gpulib.context import Context
from gpulib.doctor import passthrough as pt
from gpulib.doctor.actions import RunCommand, WriteFile, render
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.hosts import DEMO_T4
from tests.hosts import demo_host, t4_host, tree_contents, tree_state
from tests.setuphosts import DEBIAN_GRUB, GPU, GPU_AUDIO, UBUNTU_GRUB, unprepared_host
from tests.test_setup import doctor, read, setup_cli, setup_json

CLOUDIMG = "etc/default/grub.d/50-cloudimg-settings.cfg"
CLOUDIMG_TEXT = ("# Cloud Image specific Grub settings for Generic Cloud Images\n"
                 "# CLOUD_IMG: This file was created/modified by the Cloud Image build process\n"
                 "\n# Set the recordfail timeout\nGRUB_RECORDFAIL_TIMEOUT=0\n\n"
                 "# Do not wait on grub prompt\nGRUB_TIMEOUT=0\n\n"
                 "# Set the default commandline\n"
                 'GRUB_CMDLINE_LINUX_DEFAULT="console=tty1 console=ttyS0"\n\n'
                 "# Set the grub console type\nGRUB_TERMINAL=console\n")
OWN_DROP_IN = bootconfig.GPULIB_DROP_IN
TWIN = "0000:5e:00.0"
TWIN_AUDIO = "0000:5e:00.1"


def effective(host: FakeHost, family: str = "debian") -> list[str]:
    ctx = Context.for_root(host.root)
    return bootconfig.read_config(bootconfig.text_reader(ctx.sysfs.read_bytes),
                                  ctx.sysfs.listdir, family).args()


# -- 1, 2: the effective boot configuration ---------------------------------------------


def test_a_grub_d_drop_in_gets_the_edit_that_takes_effect(tmp_path: Any, monkeypatch: Any,
                                                          capsys: Any) -> None:
    """Ubuntu cloud images set GRUB_CMDLINE_LINUX_DEFAULT in a drop-in that grub-mkconfig
    sources after /etc/default/grub. That file is the image's, not gpulib's: the
    arguments go to gpulib's own drop-in, sourced last, and are read back."""
    host = unprepared_host(str(tmp_path / "h"), "ubuntu2404", cpu="GenuineIntel")
    host.write_file(CLOUDIMG, CLOUDIMG_TEXT)
    assert "intel_iommu=on" not in effective(host)
    # the doctor's fix names the file and the variable setup edits
    (before,) = doctor(host, ["iommu"]).results
    assert f"to GRUB_CMDLINE_LINUX_DEFAULT in /{OWN_DROP_IN}" in (before.fix or "")
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0, done
    edits = [s["path"] for s in done["steps"] if s["kind"] == "edit"]
    assert edits == ["/" + OWN_DROP_IN]
    assert read(host, "etc/default/grub") == UBUNTU_GRUB  # its value is overridden anyway
    assert read(host, CLOUDIMG) == CLOUDIMG_TEXT  # the image's file, untouched
    assert read(host, OWN_DROP_IN).splitlines()[1:] == [
        'GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT intel_iommu=on iommu=pt"']
    assert effective(host)[-4:] == ["console=tty1", "console=ttyS0", "intel_iommu=on",
                                    "iommu=pt"]
    assert any("50-cloudimg-settings.cfg sets GRUB_CMDLINE_LINUX_DEFAULT" in n and
               OWN_DROP_IN in n for n in done["notes"])
    (r,) = doctor(host, ["iommu"]).results
    assert r.pending == "reboot"
    # the doctor reads the same files: nothing left to do, a second run changes nothing
    after = tree_contents(host.root)
    code, again = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0 and again["steps"] == [] and tree_contents(host.root) == after


def test_a_drop_in_that_overrides_the_edit_fails_the_apply(tmp_path: Any) -> None:
    """The effective value is read back after the edit: a drop-in that appeared after the
    plan and cancels it is a failure, not a reboot promise."""
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx, only=["iommu"])
    host.write_file("etc/default/grub.d/90-site.cfg", 'GRUB_CMDLINE_LINUX_DEFAULT="quiet"\n')
    with pytest.raises(hostsetup.SetupError, match="lacks intel_iommu=on iommu=pt"):
        hostsetup.apply(ctx, plan, reboot_for)
    assert "reboot the host" not in plan.todo
    assert [s.done for s in plan.steps] == ["edited", ""]  # update-grub not run
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    assert journal["pending_reboot"] == []
    assert [o["argv"] for o in journal["outstanding"]] == [["update-grub"]]


@pytest.mark.parametrize("text,why", [
    ('GRUB_CMDLINE_LINUX_DEFAULT="quiet"\nif [ -d /sys/firmware/efi ]; then\n'
     '  GRUB_CMDLINE_LINUX_DEFAULT="quiet splash"\nfi\n', "under a condition"),
    ('GRUB_CMDLINE_LINUX_DEFAULT="quiet"\n[ -e /etc/x ] && GRUB_CMDLINE_LINUX_DEFAULT=""\n',
     "under a condition"),
    ('GRUB_CMDLINE_LINUX_DEFAULT="quiet $(cat /etc/kernel-args)"\n', "command substitution"),
    ('GRUB_CMDLINE_LINUX_DEFAULT="quiet"\n. /etc/default/grub.local\n', "runs other shell"),
    ('GRUB_CMDLINE_LINUX_DEFAULT="quiet $EXTRA"\n', "refers to $EXTRA"),
])
def test_a_value_that_cannot_be_known_is_refused(tmp_path: Any, monkeypatch: Any, capsys: Any,
                                                 text: str, why: str) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    host.write_file("etc/default/grub", text)
    before = tree_state(host.root)
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 1 and done["steps"] == [] and tree_state(host.root) == before
    (refused,) = done["refused"]
    assert refused["kind"] == "file" and refused["device"] == "/etc/default/grub"
    assert why in refused["why"] and "by hand" in refused["why"]
    code, out = setup_cli(host, monkeypatch, capsys, "--check", "iommu")
    assert "not edited: /etc/default/grub:" in out and "not taken from the host" not in out


def test_a_condition_that_does_not_touch_the_command_line_is_fine(tmp_path: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    host.write_file("etc/default/grub", DEBIAN_GRUB + 'if [ -d /sys/firmware/efi ]; then\n'
                    '  GRUB_TERMINAL=console\nfi\nGRUB_CMDLINE_XEN="$GRUB_CMDLINE_LINUX"\n')
    ctx = Context.for_root(host.root)
    plan, _ = hostsetup.make_plan(ctx, only=["iommu"])
    assert plan.refusals == [] and [s.path for s in plan.steps if s.path] == ["etc/default/grub"]


# -- 3, 4, 5: which GPUs may go, and how ----------------------------------------------------


def _with_driverctl(host: FakeHost) -> None:
    host.write_file("usr/sbin/driverctl", "#!/bin/sh\n", 0o755)


def test_a_vgpu_parent_is_not_taken_by_address_without_the_flag(tmp_path: Any,
                                                               monkeypatch: Any,
                                                               capsys: Any) -> None:
    live = "4b20d080-1b54-4048-b3bb-0000000000a1"
    host = t4_host(str(tmp_path), live=(live,))
    host.write_file("etc/os-release", "ID=debian\n")
    host.add_running_domain("i-2-7-VM", "8e9a2c51-3d4f-4b6a-9c0e-1f2a3b4c5d6e", mdevs=(live,))
    _with_driverctl(host)
    before = tree_state(host.root)
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough",
                            "0000:3b:00.0", "--check", "driver-binding")
    assert code == 1 and done["steps"] == [] and tree_state(host.root) == before
    (refused,) = done["refused"]
    assert "used for vGPU" in refused["why"] and "1 in use" in refused["why"]
    assert "--include-vgpu-gpu" in refused["why"]
    # named by address and confirmed: planned for the next boot, nothing rebound now
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", "0000:3b:00.0",
                            "--include-vgpu-gpu", "--check", "driver-binding")
    assert code == 0 and plan["refused"] == []
    assert all(s["takes_effect"] == "at the next boot" for s in plan["steps"])
    assert not any(s.get("argv", [""])[0] == "driverctl" and "--noprobe" not in s["argv"]
                   for s in plan["steps"])


def test_a_vendor_device_id_never_takes_a_pool_parent(tmp_path: Any, monkeypatch: Any,
                                                      capsys: Any) -> None:
    """The demo host's T4 pool: `--passthrough 10de:1eb8` matches the pooled T4 too."""
    host = demo_host(str(tmp_path))
    host.write_file("etc/os-release", "ID=debian\n")
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", "10de:1eb8",
                            "--check", "driver-binding")
    assert code == 1
    refused = {r["device"]: r["why"] for r in plan["refused"]}
    assert "pool t4-desktops" in refused[DEMO_T4] and "by its PCI address" in refused[DEMO_T4]
    assert not any("vfio-pci.ids" in json.dumps(s) and "10de:1eb8" in json.dumps(s)
                   for s in plan["steps"])
    # by address and with the flag it may go (the other T4 is on vfio-pci already)
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", DEMO_T4,
                            "--include-vgpu-gpu", "--check", "driver-binding")
    assert code == 0 and plan["refused"] == [], plan
    assert any("vfio-pci.ids=10de:1eb8" in s.get("diff", "") for s in plan["steps"])


def _twins(tmp_path: Any) -> FakeHost:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    group = host.new_iommu_group()
    host.add_bridge("0000:5d:00.0", iommu_group=host.new_iommu_group())
    host.add_function(TWIN, 0x10DE, 0x2484, 0x030000, driver="nouveau", iommu_group=group,
                      parent="0000:5d:00.0")
    host.add_function(TWIN_AUDIO, 0x10DE, 0x228B, 0x040300, driver="snd_hda_intel",
                      iommu_group=group, parent="0000:5d:00.0")
    return host


def test_two_identical_gpus_go_together(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = _twins(tmp_path)
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 1 and TWIN in plan["refused"][0]["why"]  # alone, it would take its twin
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes",
                            "--passthrough", GPU, "--passthrough", TWIN)
    assert code == 0 and done["refused"] == [], done
    assert "options vfio-pci ids=10de:2484,10de:228b" in read(host, pt.VFIO_CONF)
    report = doctor(host, ["driver-binding", "iommu-group"])
    assert {r.subject for r in report.results} == {GPU, GPU_AUDIO, TWIN, TWIN_AUDIO}
    assert all(r.pending == "reboot" for r in report.results)


# -- 6, 7: a plan that survives a failed step ------------------------------------------------


def _script(tmp_path: Any, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_failed_initramfs_is_planned_again(tmp_path: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx)
    plan.run_commands = True
    grub, initramfs = plan.steps[2], plan.steps[3]
    assert initramfs.argv == ("update-initramfs", "-u", "-k", "all")
    grub.argv = (_script(tmp_path, "update-grub", "echo Generating grub configuration\n"),)
    initramfs.argv = (_script(tmp_path, "update-initramfs",
                              "echo 'update-initramfs: Generating /boot/initrd.img-6.1.0-18'\n"
                              "echo 'E: /etc/initramfs-tools/hooks/zz-site failed with "
                              "return 1.' >&2\nexit 1\n"),)
    with pytest.raises(hostsetup.SetupError, match="failed with exit 1") as failed:
        hostsetup.apply(ctx, plan, reboot_for)
    # the command's own message, not only its exit code; no reboot promised
    assert "zz-site failed with return 1" in failed.value.output
    assert "reboot the host" not in plan.todo and any("again" in t for t in plan.todo)
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    assert journal["pending_reboot"] == []  # a failed run promises no reboot
    assert [(o["argv"][0].rsplit("/", 1)[-1], o["checks"]) for o in journal["outstanding"]] \
        == [("update-initramfs", ["nouveau"])]
    # nouveau not loaded (the doctor has nothing against it) and the blacklist in place:
    # only the journal knows the initramfs lacks it, and the next plan rebuilds it
    os.rmdir(host.p("sys/module/nouveau"))
    host.bind_driver(GPU, None)
    (r,) = doctor(host, ["nouveau"]).results
    assert r.status == "warn" and "did not complete" in r.message
    # the IOMMU arguments wait for the apply to complete, not for a reboot
    (r,) = doctor(host, ["iommu"]).results
    assert r.status == "fail" and r.pending is None and "did not complete" in r.message
    # the doctor's fix and the journal's step are one step of the plan; the boot entries
    # are made again (and read back)
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx)
    assert [s.argv for s in plan.steps] == [("update-grub",),
                                            ("update-initramfs", "-u", "-k", "all"),
                                            initramfs.argv]
    assert plan.steps[2].resumed and plan.expect is not None
    assert plan.expect.add == ["intel_iommu=on", "iommu=pt"]
    plan.steps = [plan.steps[0], plan.steps[2]]  # the scripts stand for the real ones
    plan.steps[0].argv = grub.argv
    assert "not completed by an earlier run" in plan.text()
    plan.run_commands = True
    _script(tmp_path, "update-initramfs", "exit 0\n")  # the site's hook fixed
    hostsetup.apply(Context.for_root(host.root), plan, reboot_for)
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    assert journal["outstanding"] == [] and set(journal["pending_reboot"]) == {"iommu",
                                                                             "nouveau"}
    assert hostsetup.make_plan(Context.for_root(host.root))[0].steps == []
    assert doctor(host, ["nouveau"]).summary() == {"nouveau": "ok"}


def test_the_cli_shows_the_failing_command_s_output(tmp_path: Any, monkeypatch: Any,
                                                   capsys: Any) -> None:
    from gpulib.cli import setup as cli_setup

    host = unprepared_host(str(tmp_path / "h"), "debian12")
    fail = _script(tmp_path, "update-grub", "echo '/usr/sbin/grub-probe: error: failed to "
                   "get canonical path of /dev/root.' >&2\nexit 1\n")
    real_make = hostsetup.make_plan

    def make(*args: Any, **kwargs: Any) -> Any:
        plan, reboot_for = real_make(*args, **kwargs)
        plan.run_commands = True
        plan.steps = [s for s in plan.steps if s.path or s.argv == ("update-grub",)]
        for s in plan.steps:
            if s.argv:
                s.argv = (fail,)
        return plan, reboot_for

    monkeypatch.setattr(cli_setup.hostsetup, "make_plan", make)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    from gpulib import cli

    code = cli.main(["setup", "--apply", "--yes", "--check", "iommu"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "failed with exit 1" in err and "failed to get canonical path" in err
    assert "- reboot the host" not in out


@pytest.mark.parametrize("problem", ["symlink", "immutable", "tool"])
def test_every_step_is_checked_before_the_first_change(tmp_path: Any, monkeypatch: Any,
                                                       problem: str) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    grub = host.p("etc/default/grub")
    if problem == "symlink":
        os.rename(grub, host.p("etc/default/grub.real"))
        os.symlink("grub.real", grub)
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx)
    plan.run_commands = True
    for s in plan.steps:  # the tools setup would run: present unless the case removes one
        if s.argv:
            s.argv = (_script(tmp_path, s.argv[0], "exit 0\n"),)
    if problem == "immutable":
        if os.geteuid() != 0 or shutil.which("chattr") is None:
            pytest.skip("chattr +i needs root and chattr")
        if subprocess.run(["chattr", "+i", grub], capture_output=True).returncode != 0:
            pytest.skip(f"the file system of {tmp_path} has no immutable flag")
    if problem == "tool":
        plan.steps[-1].argv = ("update-initramfs-not-installed",)
    before = tree_state(host.root)
    try:
        with pytest.raises(hostsetup.SetupError, match="nothing was changed") as failed:
            hostsetup.apply(ctx, plan, reboot_for)
    finally:
        if problem == "immutable":
            subprocess.run(["chattr", "-i", grub], check=True)
    words = {"symlink": "symbolic link", "immutable": "immutable (chattr)",
             "tool": "update-initramfs-not-installed is not installed"}[problem]
    assert words in failed.value.message
    after = tree_state(host.root)
    for lock in ("var", "var/lib", "var/lib/gpulib", hostsetup.SETUP_LOCK):
        after.pop(lock, None)  # the lock taken before the checks
    assert after == before and not os.path.exists(host.p(dr.SETUP_JOURNAL))


def test_a_second_apply_in_the_same_boot_keeps_the_first_one_s_record(
        tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    assert setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")[0] == 0
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "nouveau")
    assert code == 0 and set(done["pending_reboot"]) == {"iommu", "nouveau"}
    report = doctor(host, ["iommu", "nouveau"])
    assert [r.pending for r in report.results] == ["reboot", "reboot"]
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    assert len(journal["runs"]) == 2
    # after the reboot the record is of another boot: nothing pending any more
    host.write_file("proc/sys/kernel/random/boot_id", "booted-again\n")
    assert [r.pending for r in doctor(host, ["iommu", "nouveau"]).results] == [None, None]


# -- 8, 9: every kernel's initramfs, vfio-pci early --------------------------------------------


@pytest.mark.parametrize("distro,initramfs,early", [
    ("debian12", ["update-initramfs", "-u", "-k", "all"],
     {pt.MODULES_LOAD: "vfio-pci", pt.INITRAMFS_MODULES: "vfio_pci"}),
    ("el9", ["dracut", "-f", "--regenerate-all"],
     {pt.MODULES_LOAD: "vfio-pci", pt.DRACUT_CONF: 'force_drivers+=" vfio vfio_iommu_type1 '
      'vfio_pci "'}),
])
def test_vfio_pci_is_loaded_early_for_every_kernel(tmp_path: Any, monkeypatch: Any,
                                                   capsys: Any, distro: str,
                                                   initramfs: list[str],
                                                   early: dict[str, str]) -> None:
    """With nouveau blacklisted, `softdep nouveau pre: vfio-pci` never fires: vfio-pci is
    loaded from the initramfs and by systemd-modules-load, with the ids in modprobe.d."""
    host = unprepared_host(str(tmp_path / "h"), distro, iommu=True)
    host.write_file(pt.INITRAMFS_MODULES, "# List of modules to include in the initramfs\n"
                    "dm-crypt\n") if distro == "debian12" else None
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)
    assert code == 0, done
    commands = [s["argv"] for s in done["steps"] if s["kind"] == "command"]
    assert initramfs in commands and commands.count(initramfs) == 1
    for rel, line in early.items():
        assert line in read(host, rel).splitlines()
    if distro == "debian12":  # the operator's own lines stay
        assert read(host, pt.INITRAMFS_MODULES).startswith(
            "# List of modules to include in the initramfs\ndm-crypt\n")
    else:  # EL9: grubby edits every installed kernel's BLS entry
        assert ["grubby", "--update-kernel=ALL",
                "--args=intel_iommu=on iommu=pt vfio-pci.ids=10de:2484,10de:228b"] in \
            commands or any(c[0] == "grubby" and "vfio-pci.ids=10de:2484,10de:228b" in c[-1]
                            for c in commands)
    assert "options vfio-pci ids=10de:2484,10de:228b" in read(host, pt.VFIO_CONF)


# -- 10: the doctor and setup agree ---------------------------------------------------------


def test_the_doctor_s_fix_is_what_setup_applies(tmp_path: Any, monkeypatch: Any,
                                               capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file(pt.INITRAMFS_MODULES, "")
    # the nouveau blacklist is another check's; here only the GPU's binding
    host.write_file("etc/modprobe.d/blacklist-nouveau.conf",
                    "blacklist nouveau\noptions nouveau modeset=0\n")
    (result,) = doctor(host, ["driver-binding"]).results
    assert result.status == "fail"
    assert result.fix == render(result.actions, dr.Distro.read(Context.for_root(host.root)))
    writes = {a.path: a.content for a in result.actions if isinstance(a, WriteFile)}
    commands = [a.argv for a in result.actions if isinstance(a, RunCommand)]
    # the GPU with its audio function, in the variable setup edits
    assert "vfio-pci.ids=10de:2484,10de:228b\" to GRUB_CMDLINE_LINUX_DEFAULT" in result.fix
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU, "--check",
                            "driver-binding")
    assert code == 0 and plan["refused"] == []
    ctx = Context.for_root(host.root)
    planned, _ = hostsetup.make_plan(ctx, passthrough=(GPU,), only=["driver-binding"])
    assert {s.path: s.new for s in planned.steps if s.path and s.path != "etc/default/grub"} \
        == writes
    assert [s.argv for s in planned.steps if s.argv and s.argv[0] != "update-grub"] == commands
    grub = next(s for s in planned.steps if s.path == "etc/default/grub")
    assert 'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on iommu=pt '\
        'vfio-pci.ids=10de:2484,10de:228b"' in (grub.new or "")
    # after the apply a plain setup knows the GPU is kept for passthrough
    assert setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)[0] == 0
    code, plain = setup_json(host, monkeypatch, capsys)
    assert code == 0 and plain["steps"] == []
    assert any(n.startswith(f"{GPU} is kept for passthrough") for n in plain["notes"])
    assert not any("stays with the host" in n for n in plain["notes"])


# -- 11: files keep owner, group and mode ------------------------------------------------------


def test_an_edited_file_and_its_backup_keep_owner_group_and_mode(tmp_path: Any,
                                                                 monkeypatch: Any,
                                                                 capsys: Any) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    grub = host.p("etc/default/grub")
    os.chown(grub, 0, 4)  # root:adm, as some images ship it
    os.chmod(grub, 0o640)
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0, done
    (backup,) = glob.glob(host.p("etc/default/grub.gpulib-*.bak"))
    for path in (grub, backup):
        st = os.stat(path)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 4, 0o640), path
    assert "intel_iommu=on" in read(host, "etc/default/grub")


def test_a_driverctl_override_waits_for_the_next_boot(tmp_path: Any, monkeypatch: Any,
                                                      capsys: Any) -> None:
    """gpulib setup writes driverctl's override files, never runs driverctl (whose
    set-override unbinds the device at once, --noprobe or not): the GPU stays on its
    driver until the next boot, and the doctor says so rather than asking again."""
    host = _twins(tmp_path)
    _with_driverctl(host)
    before = tree_state(host.p("sys"))
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)
    assert code == 0 and done["refused"] == [], done
    assert not any(s.get("argv", [""])[0] == "driverctl" for s in done["steps"])
    for address in (GPU, GPU_AUDIO):  # what driverctl itself records
        assert read(host, f"etc/driverctl.d/pci-{address}") == "vfio-pci\n"
    assert not os.path.exists(host.p(f"etc/driverctl.d/pci-{TWIN}"))
    assert tree_state(host.p("sys")) == before  # no unbind, no new_id, no driver_override
    (result,) = [r for r in doctor(host, ["driver-binding"]).results if r.subject == GPU]
    assert result.status == "warn" and "driverctl overrides it to vfio-pci" in result.message
    assert result.pending == "reboot"
    code, again = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert again["steps"] == []
    assert not any(n.startswith(f"{TWIN} is kept") for n in again["notes"])


def test_a_read_only_file_system_is_found_before_the_first_change(tmp_path: Any) -> None:
    """/etc/default read-only (a bind mount in a private mount namespace): the apply
    stops before it edits anything, the blacklist in the writable /etc/modprobe.d
    included."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only bind mount needs root and unshare")
    from tests.hookrun import BIN, hook_env

    host = unprepared_host(str(tmp_path / "h"), "debian12")
    before = tree_state(host.root)
    etc_default = host.p("etc/default")
    script = (f"mount --make-rprivate / && mount --bind {etc_default} {etc_default} && "
              f"mount -o remount,bind,ro {etc_default} && exec {BIN / 'gpulib'} setup "
              "--apply --yes --json")
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=hook_env(host.root, simulate=False))
    assert proc.returncode == 1, proc.stderr
    done = json.loads(proc.stdout)
    assert "/etc/default/grub is on a read-only file system" in done["error"]
    assert done["error"].startswith("nothing was changed")
    after = tree_state(host.root)
    for lock in ("var", "var/lib", "var/lib/gpulib", hostsetup.SETUP_LOCK):
        after.pop(lock, None)
    assert after == before


def test_a_refused_grub_file_applies_nothing(tmp_path: Any, monkeypatch: Any,
                                             capsys: Any) -> None:
    """The plan's parts hang together: vfio-pci's ids in gpulib's modprobe file lose to an
    administrator's file that sorts later unless the command line gives them too. With the
    grub file refused, no file is written, no initramfs is made, no reboot is promised,
    and no GPU is said to leave the host."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file("etc/default/grub", 'GRUB_CMDLINE_LINUX_DEFAULT="quiet $EXTRA"\n')
    host.write_file("etc/modprobe.d/zz-site-vfio.conf", "options vfio-pci ids=8086:10ed\n")
    before = tree_state(host.root)
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 1 and plan["steps"], plan
    assert all(s["takes_effect"].startswith("never") for s in plan["steps"])
    assert "reboot the host" not in plan["still_to_do"]
    assert not any("vfio-pci takes it at the next boot" in n for n in plan["notes"])
    assert any("nothing is applied while /etc/default/grub is refused" in n
               for n in plan["notes"])
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough",
                            GPU)
    assert code == 1
    assert done["error"].startswith("nothing was changed: not edited: /etc/default/grub")
    assert {s.get("done") for s in done["steps"]} == {None}
    code, out = setup_cli(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)
    assert "[edited]" not in out and "[created]" not in out and "[ran]" not in out
    assert tree_state(host.root) == before
    assert not os.path.exists(os.path.join(host.root, dr.SETUP_JOURNAL))


def test_the_command_line_s_ids_win_over_a_later_modprobe_file(tmp_path: Any,
                                                               monkeypatch: Any,
                                                               capsys: Any) -> None:
    """An administrator's `options vfio-pci ids=` in a file that sorts after gpulib's:
    the next boot's effective ids (the last one modprobe passes: the command line's)
    hold theirs and the GPU's, in one `vfio-pci.ids=`."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file("etc/modprobe.d/zz-site-vfio.conf", "options vfio-pci ids=8086:10ed\n")
    code, _ = setup_cli(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)
    assert code == 0
    ctx = Context.for_root(host.root)
    facts = dr.Doctor(ctx)
    sources = facts.next_boot.vfio_ids_sources()
    assert sources[-1].shown == "the kernel command line"
    assert sources[-1].keys == ["8086:10ed", "10de:2484", "10de:228b"]
    assert sum(a.startswith("vfio-pci.ids=") for a in facts.next_boot.args()) == 1
    assert read(host, "etc/modprobe.d/zz-site-vfio.conf") == "options vfio-pci ids=8086:10ed\n"


def test_a_failed_initramfs_after_an_earlier_apply_is_named_not_pending(
        tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    """An apply completed (nouveau's blacklist waits for the reboot); a second one in the
    same boot fails at the initramfs. The doctor names that step, not the earlier
    apply's reboot."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    code, _ = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "nouveau")
    assert code == 0
    (r,) = doctor(host, ["nouveau"]).results
    assert r.pending == "reboot"
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx, passthrough=(GPU,))
    plan.run_commands = True
    for step in plan.steps:
        if step.argv is not None:
            name = step.argv[0]
            step.argv = (_script(tmp_path, name, "exit 1\n" if name == "update-initramfs"
                                 else "exit 0\n"),)
    with pytest.raises(hostsetup.SetupError, match="failed with exit 1"):
        hostsetup.apply(ctx, plan, reboot_for)
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    assert "nouveau" in journal["pending_reboot"]  # the earlier apply's record stays
    assert [o["argv"][0].rsplit("/", 1)[-1] for o in journal["outstanding"]] == \
        ["update-initramfs"]
    (r,) = doctor(host, ["nouveau"]).results
    assert r.pending is None and r.status == "fail", r.message
    assert "a reboot is pending" not in r.message
    assert "did not complete" in r.message and "update-initramfs" in r.message
    binding = [r for r in doctor(host, ["driver-binding"]).results if r.subject == GPU]
    assert binding and binding[0].pending is None
    assert "did not complete" in binding[0].message and "a reboot is pending" not in \
        binding[0].message


ADMIN_BLACKLIST = "etc/modprobe.d/nvidia-blacklists-nouveau.conf"


def _debian_dracut(host: FakeHost) -> None:
    host.write_file("usr/bin/dracut", "#!/bin/sh\n", 0o755)
    host.write_file(ADMIN_BLACKLIST, "blacklist nouveau\n")


def test_dracut_puts_the_administrator_s_blacklist_in_the_initramfs(
        tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    """Debian with dracut (its images are not host-only): the blacklist is in a file of
    the administrator's; dracut's configuration names that file, not gpulib's (which
    does not exist)."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    _debian_dracut(host)
    (r,) = doctor(host, ["nouveau"]).results
    assert r.status == "fail" and "although blacklisted" in r.message
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "nouveau")
    assert code == 0, done
    assert [s.get("path") or s["argv"] for s in done["steps"]] == [
        "/etc/dracut.conf.d/gpulib-blacklist-nouveau.conf", ["dracut", "-f", "--regenerate-all"]]
    conf = read(host, "etc/dracut.conf.d/gpulib-blacklist-nouveau.conf")
    assert f'install_items+=" /{ADMIN_BLACKLIST} "' in conf
    assert not os.path.exists(host.p("etc/modprobe.d/blacklist-nouveau.conf"))
    (r,) = doctor(host, ["nouveau"]).results
    assert r.pending == "reboot"
    # after the reboot: nouveau not loaded, and nothing outstanding
    host.write_file("proc/sys/kernel/random/boot_id", "booted-again\n")
    os.rmdir(host.p("sys/module/nouveau"))
    host.bind_driver(GPU, None)
    assert doctor(host, ["nouveau"]).summary() == {"nouveau": "ok"}
    code, again = setup_json(host, monkeypatch, capsys, "--check", "nouveau")
    assert code == 0 and again["steps"] == []


def test_the_doctor_names_a_blacklist_dracut_leaves_out(tmp_path: Any, monkeypatch: Any,
                                                         capsys: Any) -> None:
    """nouveau not loaded and blacklisted, but dracut's images would not hold the file:
    the doctor names it; on a host-only dracut (EL's) /etc/modprobe.d is in anyway."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    _debian_dracut(host)
    os.rmdir(host.p("sys/module/nouveau"))
    host.bind_driver(GPU, None)
    (r,) = doctor(host, ["nouveau"]).results
    assert r.status == "warn" and f"/{ADMIN_BLACKLIST}" in r.message and "dracut" in r.message
    _, done = setup_json(host, monkeypatch, capsys, "--check", "nouveau")
    assert [s.get("path") or s["argv"] for s in done["steps"]] == [
        "/etc/dracut.conf.d/gpulib-blacklist-nouveau.conf", ["dracut", "-f", "--regenerate-all"]]
    host.write_file("etc/dracut.conf.d/10-site.conf", 'hostonly="yes"\n')
    assert doctor(host, ["nouveau"]).summary() == {"nouveau": "ok"}


def test_on_ubuntu_s_layout_the_ids_advice_names_the_file_that_wins(
        tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    """A cloud image's drop-in supersedes /etc/default/grub's value: the doctor's advice
    for vfio-pci.ids names gpulib's drop-in (what setup edits), not the overridden file,
    and runs after the first leave /etc/default/grub alone."""
    host = unprepared_host(str(tmp_path / "h"), "ubuntu2404", iommu=True)
    host.write_file(CLOUDIMG, CLOUDIMG_TEXT)
    binding = [r for r in doctor(host, ["driver-binding"]).results if r.subject == GPU]
    assert binding and f"GRUB_CMDLINE_LINUX_DEFAULT in /{OWN_DROP_IN}" in (binding[0].fix or "")
    assert "in /etc/default/grub," not in (binding[0].fix or "")
    grub = read(host, "etc/default/grub")
    for args in (("--check", "iommu"), ("--passthrough", GPU), ("--passthrough", GPU), ()):
        code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", *args)
        assert code == 0, done
        assert "/etc/default/grub" not in [s.get("path") for s in done["steps"]]
    assert read(host, "etc/default/grub") == grub
    assert "vfio-pci.ids=10de:2484,10de:228b" in read(host, OWN_DROP_IN)
