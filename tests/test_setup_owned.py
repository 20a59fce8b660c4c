"""`gpulib setup` and the doctor leave the administrator's configuration theirs and change
nothing before the next boot, judged by one reading of the running and the next boot
(`gpulib.bootstate`). One test per way it went wrong; the distributions' own tools run on
these cases in tests/test_setup_debian.py."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import pytest

from gpulib import bootconfig, hostsetup
from gpulib import doctor as dr
from gpulib.bootstate import KERNEL_CMDLINE, NextBoot
from gpulib.context import Context
from gpulib.doctor import passthrough as pt
from gpulib.sim.fakehost import FakeHost
from tests.hosts import t4_host, tree_state
from tests.setuphosts import DEBIAN_GRUB, EL9_GRUB, GPU, GPU_AUDIO, unprepared_host
from tests.test_setup import doctor, read, setup_json
from tests.test_setup_cases import TWIN, TWIN_AUDIO, _script, _twins, _with_driverctl, effective

OWN_DROP_IN = bootconfig.GPULIB_DROP_IN
KDUMP = "etc/default/grub.d/kdump-tools.cfg"
KDUMP_TEXT = 'GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT crashkernel=512M-:192M"\n'
ADMIN_VFIO = "etc/modprobe.d/vfio.conf"
NIC_IDS = "8086:10ed"  # an administrator's own passthrough device (an 82599 VF)
IDS = "10de:2484,10de:228b"


def _next_boot(host: FakeHost) -> NextBoot:
    ctx = Context.for_root(host.root)
    return NextBoot(ctx.sysfs, dr.Distro.read(ctx).family)


# -- 3: nothing unbound now (driverctl's own records) ----------------------------------------
# tests/test_setup_cases.py: test_a_driverctl_override_waits_for_the_next_boot


# -- 4: a twin with no driver is not taken by vfio-pci.ids ------------------------------------


def test_a_driverless_twin_is_not_swept_along(tmp_path: Any, monkeypatch: Any,
                                              capsys: Any) -> None:
    host = _twins(tmp_path)
    host.bind_driver(TWIN, None)
    host.bind_driver(TWIN_AUDIO, None)
    before = tree_state(host.root)
    code, plan = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU,
                            "--check", "driver-binding")
    assert code == 1 and plan["steps"] == [] and tree_state(host.root) == before
    (refused,) = plan["refused"]
    assert f"{TWIN} (10de:2484, no driver)" in refused["why"] and "driverctl" in refused["why"]
    # with driverctl: by address, the twin's ids never written anywhere
    _with_driverctl(host)
    code, plan = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU,
                            "--check", "driver-binding")
    assert code == 0 and plan["refused"] == [], plan
    assert not any("vfio-pci.ids" in json.dumps(s) for s in plan["steps"])
    assert sorted(os.listdir(host.p("etc/driverctl.d"))) == [f"pci-{GPU}", f"pci-{GPU_AUDIO}"]


def test_a_twin_driverctl_keeps_elsewhere_is_not_swept_along(tmp_path: Any, monkeypatch: Any,
                                                             capsys: Any) -> None:
    """driverctl's override beats every id match: such a twin stays where it is kept, so
    vfio-pci.ids may name the id (and the doctor knows the override is there)."""
    host = _twins(tmp_path)
    host.bind_driver(TWIN, None)
    for address in (TWIN, TWIN_AUDIO):
        host.write_file(f"etc/driverctl.d/pci-{address}", "nouveau\n")
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 0 and plan["refused"] == [], plan
    assert any(f"vfio-pci.ids={IDS}" in s.get("diff", "") for s in plan["steps"])


# -- 5: an administrator's own vfio-pci ids stay -----------------------------------------------


def test_an_administrator_s_vfio_ids_stay(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    """Their `options vfio-pci ids=` in another modprobe.d file, and their vfio-pci.ids= on
    the command line: modprobe passes every value and the module keeps the last (the
    command line's), so gpulib's value holds theirs too, and their files stay as they
    are."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file(ADMIN_VFIO, f"options vfio-pci ids={NIC_IDS}\n")
    assert _next_boot(host).vfio_ids() == [NIC_IDS]
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)
    assert code == 0, done
    assert read(host, ADMIN_VFIO) == f"options vfio-pci ids={NIC_IDS}\n"
    assert f"options vfio-pci ids={NIC_IDS},{IDS}" in read(host, pt.VFIO_CONF)
    assert f"vfio-pci.ids={NIC_IDS},{IDS}" in effective(host)
    nb = _next_boot(host)
    assert [s.shown for s in nb.vfio_ids_sources()] == [
        "/" + pt.VFIO_CONF, "/" + ADMIN_VFIO, "the kernel command line"]
    assert nb.vfio_ids() == [NIC_IDS, "10de:2484", "10de:228b"]


def test_an_administrator_s_command_line_ids_stay(tmp_path: Any, monkeypatch: Any,
                                                  capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file("etc/default/grub", bootconfig.edit_cmdline(
        read(host, "etc/default/grub"), "GRUB_CMDLINE_LINUX", [f"vfio-pci.ids={NIC_IDS}"]))
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)
    assert code == 0, done
    args = effective(host)
    assert [a for a in args if a.startswith("vfio-pci.ids=")] == [f"vfio-pci.ids={NIC_IDS},{IDS}"]


# -- 6: the initramfs tool that is installed ---------------------------------------------------


def test_debian_with_dracut_gets_dracut_conf(tmp_path: Any, monkeypatch: Any,
                                             capsys: Any) -> None:
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file("usr/bin/dracut", "#!/bin/sh\n", 0o755)
    assert _next_boot(host).initramfs_tool() == "dracut"
    # the nouveau check's rebuild too
    (r,) = doctor(host, ["nouveau"]).results
    assert "dracut -f --regenerate-all" in (r.fix or "") and "update-initramfs" not in \
        (r.fix or "")
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU)
    assert code == 0, done
    commands = [s["argv"] for s in done["steps"] if s["kind"] == "command"]
    assert ["dracut", "-f", "--regenerate-all"] in commands
    assert not any(c[0] == "update-initramfs" for c in commands)
    assert 'force_drivers+=" vfio vfio_iommu_type1 vfio_pci "' in read(host, pt.DRACUT_CONF)
    assert not os.path.exists(host.p(pt.INITRAMFS_MODULES))
    # installed initramfs-tools wins over the family's guess the other way round too
    el = unprepared_host(str(tmp_path / "el"), "el9", iommu=True)
    el.write_file("usr/sbin/update-initramfs", "#!/bin/sh\n", 0o755)
    assert _next_boot(el).initramfs_tool() == "initramfs-tools"


# -- 7: the IOMMU judged on the running and the next boot ------------------------------------


def test_an_iommu_enabled_for_this_boot_only_is_made_permanent(tmp_path: Any,
                                                               monkeypatch: Any,
                                                               capsys: Any) -> None:
    """A boot-menu edit: the running kernel has the arguments, the configuration not."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file("etc/default/grub", DEBIAN_GRUB)
    (r,) = doctor(host, ["iommu"]).results
    assert r.status == "fail"
    assert "the running kernel has intel_iommu=on iommu=pt" in r.message
    assert "next boot's configuration (/etc/default/grub" in r.message
    assert "loses the IOMMU at its next reboot" in r.message
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0, done
    assert {"intel_iommu=on", "iommu=pt"} <= set(effective(host))
    assert [s["argv"] for s in done["steps"] if s["kind"] == "command"] == [["update-grub"]]
    (r,) = doctor(host, ["iommu"]).results
    assert r.status == "ok" and "the next boot gets it from /etc/default/grub" in r.message


def test_an_iommu_the_configuration_switches_off_is_found(tmp_path: Any, monkeypatch: Any,
                                                          capsys: Any) -> None:
    """intel_iommu=off in the configuration, not on the running command line."""
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file("etc/default/grub", bootconfig.edit_cmdline(
        DEBIAN_GRUB, "GRUB_CMDLINE_LINUX", ["intel_iommu=off"]))
    (r,) = doctor(host, ["iommu"]).results
    assert r.status == "fail" and "the next boot switches the IOMMU off" in r.message
    assert "intel_iommu=off" in r.message and "running kernel was booted without it" in \
        r.message
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0, done
    assert "intel_iommu=off" not in effective(host)
    assert doctor(host, ["iommu"]).results[0].status == "ok"


# -- 8: the smaller ones -----------------------------------------------------------------------


def _grub_cfg_script(tmp_path: Any, host: FakeHost, args: str) -> str:
    """An update-grub that writes grub.cfg with `args` on its linux lines."""
    cfg = host.p("boot/grub/grub.cfg")
    linux = "\\tlinux\\t/boot/vmlinuz-6.1.0-18-amd64 root=/dev/sda1 ro"
    return _script(tmp_path, "update-grub", f"mkdir -p {os.path.dirname(cfg)}\n"
                   f"printf '{linux} {args}\\n{linux} single\\n' > {cfg}\n")


def test_a_failed_read_back_is_read_back_again(tmp_path: Any, monkeypatch: Any) -> None:
    """The boot entries update-grub made lack the arguments (another generator's
    configuration in use): the apply fails, and the next run, with nothing else to
    change, runs it again and reads the entries back again rather than succeed."""
    host = unprepared_host(str(tmp_path / "h"), "debian12")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")  # the scripts' update-grub
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx, only=["iommu"])
    plan.run_commands = True
    _grub_cfg_script(tmp_path, host, "quiet")
    with pytest.raises(hostsetup.SetupError, match=r"boot entry in /boot/grub/grub\.cfg lacks "
                       "intel_iommu=on iommu=pt"):
        hostsetup.apply(ctx, plan, reboot_for)
    assert "reboot the host" not in plan.todo
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    assert journal["pending_reboot"] == [] and journal["expect"]["add"] == ["intel_iommu=on",
                                                                           "iommu=pt"]
    # the files have the arguments: only the journal knows the entries do not
    for attempt in ("quiet", "quiet intel_iommu=on iommu=pt"):
        plan, reboot_for = hostsetup.make_plan(Context.for_root(host.root), only=["iommu"])
        assert [s.argv for s in plan.steps] == [("update-grub",)] and plan.expect is not None
        plan.run_commands = True
        _grub_cfg_script(tmp_path, host, attempt)
        if attempt == "quiet":
            with pytest.raises(hostsetup.SetupError, match="lacks"):
                hostsetup.apply(Context.for_root(host.root), plan, reboot_for)
            continue
        hostsetup.apply(Context.for_root(host.root), plan, reboot_for)
    journal = json.loads(read(host, dr.SETUP_JOURNAL))
    assert journal["expect"] is None and journal["outstanding"] == []
    assert journal["pending_reboot"] == ["iommu"]
    assert hostsetup.make_plan(Context.for_root(host.root), only=["iommu"])[0].steps == []


def test_the_doctor_sees_driverctl_overrides(tmp_path: Any, monkeypatch: Any,
                                             capsys: Any) -> None:
    # a named GPU driverctl keeps on another driver: vfio-pci.ids would not get it
    host = unprepared_host(str(tmp_path / "h"), "debian12", iommu=True)
    host.write_file(f"etc/driverctl.d/pci-{GPU}", "nouveau\n")
    code, plan = setup_json(host, monkeypatch, capsys, "--passthrough", GPU)
    assert code == 1 and plan["steps"] == [s for s in plan["steps"] if "vfio" not in
                                           json.dumps(s)]
    (refused,) = plan["refused"]
    assert f"driverctl keeps it on nouveau (/etc/driverctl.d/pci-{GPU})" in refused["why"]
    # an overridden group peer waits for the next boot: no failure
    host = unprepared_host(str(tmp_path / "p"), "debian12", iommu=True)
    host.bind_driver(GPU, "vfio-pci")
    host.write_file(f"etc/driverctl.d/pci-{GPU_AUDIO}", "vfio-pci\n")
    (r,) = doctor(host, ["iommu-group"]).results
    assert r.status == "warn" and r.pending == "reboot"
    assert "driverctl overrides it to vfio-pci" in r.message
    # a vGPU GPU whose id vfio-pci.ids names, kept on its driver by driverctl: no warning
    t4 = t4_host(str(tmp_path / "t4"))
    t4.set_cmdline("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro vfio-pci.ids=10de:1eb8")
    (r,) = doctor(t4, ["driver-binding"]).results
    assert r.status == "warn" and "vfio-pci or pci-stub may claim it" in r.message
    t4.write_file("etc/driverctl.d/pci-0000:3b:00.0", "nvidia\n")
    assert doctor(t4, ["driver-binding"]).summary() == {"driver-binding": "ok"}


def test_another_package_s_drop_in_is_never_edited(tmp_path: Any, monkeypatch: Any,
                                                   capsys: Any) -> None:
    """Ubuntu's kdump-tools.cfg extends the value: /etc/default/grub's edit takes effect,
    the package's file stays as it is."""
    host = unprepared_host(str(tmp_path / "h"), "ubuntu2404")
    host.write_file(KDUMP, KDUMP_TEXT)
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0, done
    assert [s["path"] for s in done["steps"] if s["kind"] == "edit"] == ["/etc/default/grub"]
    assert read(host, KDUMP) == KDUMP_TEXT
    assert "crashkernel=512M-:192M" in effective(host) and "iommu=pt" in effective(host)


@pytest.mark.parametrize("off,edited", [("intel_iommu=off", True), ("iommu=off", False)])
def test_an_argument_in_another_package_s_drop_in(tmp_path: Any, monkeypatch: Any, capsys: Any,
                                                  off: str, edited: bool) -> None:
    """intel_iommu=off there: gpulib's drop-in, sourced last, switches it on again (the
    kernel takes the last intel_iommu=). iommu=off there: no later argument undoes it,
    and the file is not gpulib's: refused, the file named."""
    host = unprepared_host(str(tmp_path / "h"), "ubuntu2404", cpu="GenuineIntel", iommu=True)
    text = KDUMP_TEXT.replace('192M"', f'192M {off}"')
    host.write_file(KDUMP, text)
    before = tree_state(host.root)
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert read(host, KDUMP) == text
    if edited:
        assert code == 0, done
        assert [s["path"] for s in done["steps"] if s["kind"] == "edit"] == ["/" + OWN_DROP_IN]
        grub = _next_boot(host).grub
        assert grub is not None
        words = grub.words()  # in order: the kernel takes the last intel_iommu=
        assert [w for w in words if w.startswith("intel_iommu=")] == ["intel_iommu=on",
                                                                       "intel_iommu=off",
                                                                       "intel_iommu=on"]
        assert doctor(host, ["iommu"]).results[0].status != "fail"
        return
    assert code == 1 and done["steps"] == [] and tree_state(host.root) == before
    (refused,) = done["refused"]
    assert refused["device"] == "/" + KDUMP
    assert "iommu=off is set in /" + KDUMP in refused["why"] and "by hand" in refused["why"]


def test_lines_an_administrator_added_to_gpulib_s_modprobe_file_stay(
        tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = _twins(tmp_path)
    host.write_file(pt.VFIO_CONF, f"{pt.VFIO_CONF_HEADER}\noptions vfio-pci ids={IDS}\n"
                    "softdep nouveau pre: vfio-pci\n# our NIC, by hand\n"
                    "options vfio-pci disable_idle_d3=1\n")
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--passthrough", GPU,
                            "--passthrough", TWIN)
    assert code == 0, done
    lines = read(host, pt.VFIO_CONF).splitlines()
    assert lines[-2:] == ["# our NIC, by hand", "options vfio-pci disable_idle_d3=1"]
    assert lines.count(f"options vfio-pci ids={IDS}") == 1


# -- EL9: /etc/kernel/cmdline, which kernel-install gives kernels installed later -----------


def _el9(tmp_path: Any, iommu_in_grub: bool) -> FakeHost:
    host = unprepared_host(str(tmp_path / "el9"), "el9", iommu=True)
    if not iommu_in_grub:
        host.write_file("etc/default/grub", EL9_GRUB)
    running = read(host, "proc/cmdline").split()
    host.write_file(KERNEL_CMDLINE, " ".join(a for a in running if not a.startswith(
        ("BOOT_IMAGE=", "intel_iommu=", "iommu="))) + "\n")
    host.write_file("boot/loader/entries/a1b2-5.14.0-427.13.1.el9_4.x86_64.conf",
                    "title Rocky Linux (5.14.0-427.13.1.el9_4.x86_64) 9.4 (Blue Onyx)\n"
                    "version 5.14.0-427.13.1.el9_4.x86_64\n"
                    "linux /vmlinuz-5.14.0-427.13.1.el9_4.x86_64\n"
                    "options root=/dev/mapper/rl-root ro crashkernel=1G-4G:192M,4G-64G:256M,"
                    "64G-:512M resume=/dev/mapper/rl-swap rd.lvm.lv=rl/root rd.lvm.lv=rl/swap\n")
    return host


def test_el9_kernel_cmdline_is_read_and_written(tmp_path: Any, monkeypatch: Any,
                                                capsys: Any) -> None:
    host = _el9(tmp_path, iommu_in_grub=True)
    # /etc/default/grub has the arguments, /etc/kernel/cmdline not: the next kernel
    # installed would boot without them
    nb = _next_boot(host)
    assert [w for w, _ in nb.sources()] == ["/etc/default/grub", "/" + KERNEL_CMDLINE]
    assert "intel_iommu=on" not in nb.args()
    (r,) = doctor(host, ["iommu"]).results
    assert r.status == "fail" and "/" + KERNEL_CMDLINE in r.message
    old = read(host, KERNEL_CMDLINE)
    mode = stat.S_IMODE(os.stat(host.p(KERNEL_CMDLINE)).st_mode)
    code, done = setup_json(host, monkeypatch, capsys, "--apply", "--yes", "--check", "iommu")
    assert code == 0, done
    assert [s["path"] for s in done["steps"] if s["kind"] == "edit"] == ["/" + KERNEL_CMDLINE]
    assert read(host, KERNEL_CMDLINE) == old.rstrip("\n") + " intel_iommu=on iommu=pt\n"
    assert stat.S_IMODE(os.stat(host.p(KERNEL_CMDLINE)).st_mode) == mode
    commands = [s["argv"] for s in done["steps"] if s["kind"] == "command"]
    assert commands == [["grubby", "--update-kernel=ALL", "--args=intel_iommu=on iommu=pt"]]
    assert {"intel_iommu=on", "iommu=pt"} <= set(_next_boot(host).args())
    (r,) = doctor(host, ["iommu"]).results
    assert r.status == "ok"
    # both files in one plan where neither has them; and read back from the BLS entries
    # when grubby runs
    host = _el9(tmp_path / "b", iommu_in_grub=False)
    ctx = Context.for_root(host.root)
    plan, reboot_for = hostsetup.make_plan(ctx, only=["iommu"])
    assert sorted(s.path or "" for s in plan.steps if s.path) == ["etc/default/grub",
                                                                 KERNEL_CMDLINE]
    plan.run_commands = True
    (grubby,) = [s for s in plan.steps if s.argv]
    grubby.argv = (_script(tmp_path, "grubby", "exit 0\n"),)  # touches no entry
    with pytest.raises(hostsetup.SetupError, match=r"loader/entries/a1b2-.* lacks intel_iommu"):
        hostsetup.apply(ctx, plan, reboot_for)
