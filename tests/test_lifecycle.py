"""mdev and NVIDIA VF vGPU lifecycle against the simulated kernel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulib import mdev, nvidia
from gpulib.entry import context_for_root
from gpulib.errors import DeviceError, InputError, NotAvailableError
from gpulib.pci import PciAddress
from tests.hosts import a10_host, simulated, t4_host, tree_contents

T4 = PciAddress.parse("0000:3b:00.0")
U1 = "11111111-2222-4333-8444-555555555555"
U2 = "21111111-2222-4333-8444-555555555555"


def test_create_and_remove_mdev_like_the_kernel(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    ctx = simulated(host)
    made = mdev.create(ctx.sysfs, T4, "nvidia-232", U1)
    assert (made.uuid, made.parent, made.type_id) == (U1, T4, "nvidia-232")
    link = os.path.join(host.root, f"sys/bus/mdev/devices/{U1}")
    assert os.path.islink(link) and not os.path.isabs(os.readlink(link))
    assert os.path.realpath(link) == os.path.join(host.device_dir(T4), U1)
    t = mdev.MdevType(ctx.sysfs, T4, "nvidia-232")
    assert t.available_instances == 3 and t.live_uuids() == [U1]
    # one type per time-sliced NVIDIA GPU
    assert mdev.MdevType(ctx.sysfs, T4, "nvidia-231").available_instances == 0
    assert mdev.remove(ctx.sysfs, U1) is True
    assert not os.path.lexists(link)
    assert t.available_instances == 4
    assert mdev.MdevType(ctx.sysfs, T4, "nvidia-231").available_instances == 8
    assert mdev.remove(ctx.sysfs, U1) is False


def test_create_is_idempotent_for_the_same_device(tmp_path: Path) -> None:
    ctx = simulated(t4_host(str(tmp_path)))
    mdev.create(ctx.sysfs, T4, "nvidia-232", U1)
    again = mdev.create(ctx.sysfs, T4, "nvidia-232", U1)
    assert again.uuid == U1
    assert mdev.MdevType(ctx.sysfs, T4, "nvidia-232").available_instances == 3


def test_kernel_errors_become_clear_messages(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    ctx = simulated(host)
    mdev.create(ctx.sysfs, T4, "nvidia-232", U1)
    with pytest.raises(NotAvailableError, match=r"No available instances of nvidia-231 "
                                                r"\(GRID T4-2Q\) on 0000:3b:00.0"):
        mdev.create(ctx.sysfs, T4, "nvidia-231", U2)
    with pytest.raises(DeviceError, match="already exists"):
        mdev.create(ctx.sysfs, T4, "nvidia-231", U1)
    with pytest.raises(DeviceError, match="does not offer mdev type nvidia-999"):
        mdev.create(ctx.sysfs, T4, "nvidia-999", U2)
    with pytest.raises(DeviceError, match=r"no PCI device 0000:3c:00\.0"):
        mdev.create(ctx.sysfs, PciAddress.parse("0000:3c:00.0"), "nvidia-232", U2)


def test_kernel_enospc_is_mapped_when_the_file_lies(tmp_path: Path) -> None:
    # available_instances says 1 but the kernel refuses: the write's errno decides.
    host = t4_host(str(tmp_path))
    ctx = simulated(host)
    for i in range(4):
        mdev.create(ctx.sysfs, T4, "nvidia-232", f"0000000{i}-2222-4333-8444-555555555555")
    avail = os.path.join(host.device_dir(T4), "mdev_supported_types/nvidia-232/"
                         "available_instances")
    with open(avail, "w") as fh:
        fh.write("1\n")
    os.unlink(avail)
    with open(avail, "w") as fh:
        fh.write("0\n")
    with pytest.raises(NotAvailableError):
        mdev.create(ctx.sysfs, T4, "nvidia-232", U2)


@pytest.mark.parametrize("bad_uuid", ["not-a-uuid", "11111111-2222-4333-8444-55555555555",
                                      "../../etc", "11111111-2222-4333-8444-555555555555/x"])
def test_bad_uuid_refused_before_any_write(tmp_path: Path, bad_uuid: str) -> None:
    host = t4_host(str(tmp_path))
    ctx = simulated(host)
    before = tree_contents(host.root)
    with pytest.raises(InputError):
        mdev.create(ctx.sysfs, T4, "nvidia-232", bad_uuid)
    assert tree_contents(host.root) == before


@pytest.mark.parametrize("bad_type", ["../nvidia-232", "nvidia-232/..", "..", "a/b", "x\n"])
def test_bad_type_refused_before_any_write(tmp_path: Path, bad_type: str) -> None:
    host = t4_host(str(tmp_path))
    ctx = simulated(host)
    before = tree_contents(host.root)
    with pytest.raises(InputError):
        mdev.create(ctx.sysfs, T4, bad_type, U1)
    assert tree_contents(host.root) == before


def test_simulated_kernel_rejects_bad_uuid_with_einval(tmp_path: Path) -> None:
    host = t4_host(str(tmp_path))
    ctx = simulated(host)
    with pytest.raises(OSError) as exc:
        ctx.sysfs.write(f"sys/bus/pci/devices/{T4}/mdev_supported_types/nvidia-232/create",
                        "nope")
    assert exc.value.errno == 22


A10_VF = PciAddress.parse("0000:41:00.4")
A10_VF2 = PciAddress.parse("0000:41:00.5")


def test_vendor_vf_type_set_and_clear(tmp_path: Path) -> None:
    host = a10_host(str(tmp_path))
    ctx = simulated(host)
    assert nvidia.current_type(ctx.sysfs, A10_VF) == 0
    nvidia.set_type(ctx.sysfs, A10_VF, 594)
    assert nvidia.current_type(ctx.sysfs, A10_VF) == 594
    # the card now runs A10-6Q: siblings may only take the same type (4 fit in 24 GB)
    assert nvidia.creatable_types(ctx.sysfs, A10_VF2) == {594: "NVIDIA A10-6Q"}
    with pytest.raises(NotAvailableError, match="not creatable"):
        nvidia.set_type(ctx.sysfs, A10_VF2, 597)
    with pytest.raises(DeviceError, match="already has vGPU type 594"):
        nvidia.set_type(ctx.sysfs, A10_VF, 597)
    assert nvidia.clear_type(ctx.sysfs, A10_VF, retry_seconds=0) is True
    assert nvidia.current_type(ctx.sysfs, A10_VF) == 0
    assert len(nvidia.creatable_types(ctx.sysfs, A10_VF2)) == 18
    assert nvidia.clear_type(ctx.sysfs, A10_VF, retry_seconds=0) is False


def test_vendor_vf_capacity_runs_out(tmp_path: Path) -> None:
    host = a10_host(str(tmp_path), numvfs=4)
    ctx = simulated(host)
    vfs = [PciAddress.parse(f"0000:41:00.{f}") for f in (4, 5)]
    for vf in vfs:
        nvidia.set_type(ctx.sysfs, vf, 597)  # A10-24Q: the whole card
        break
    assert nvidia.creatable_types(ctx.sysfs, vfs[1]) == {}


def test_clear_retries_while_the_driver_is_busy(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    host = a10_host(str(tmp_path))
    ctx = simulated(host)
    nvidia.set_type(ctx.sysfs, A10_VF, 594)
    real = ctx.sysfs._kernel_write
    calls = {"n": 0}

    def busy_twice(path: str, data: str) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(16, "Device or resource busy")
        real(path, data)

    monkeypatch.setattr(ctx.sysfs, "_kernel_write", busy_twice)
    assert nvidia.clear_type(ctx.sysfs, A10_VF, retry_seconds=5) is True
    assert calls["n"] == 3


def test_sriov_numvfs_needs_to_go_through_zero(tmp_path: Path) -> None:
    host = a10_host(str(tmp_path), numvfs=2)
    ctx = simulated(host)
    rel = "sys/bus/pci/devices/0000:41:00.0/sriov_numvfs"
    with pytest.raises(OSError) as exc:
        ctx.sysfs.write(rel, "4")
    assert exc.value.errno == 16
    ctx.sysfs.write(rel, "0")
    assert not os.path.lexists(os.path.join(host.root, "sys/bus/pci/devices/0000:41:00.4"))
    ctx.sysfs.write(rel, "3")
    from gpulib.pci import virtfn_links
    assert [str(a) for _, a in virtfn_links(ctx.sysfs, PciAddress.parse("0000:41:00.0"))] == [
        "0000:41:00.4", "0000:41:00.5", "0000:41:00.6"]
    with pytest.raises(OSError) as exc:
        ctx.sysfs.write(rel, "0\n")
        ctx.sysfs.write(rel, "64")
    assert exc.value.errno == 34


def test_simulation_is_never_active_on_the_real_root() -> None:
    ctx = context_for_root("/", simulate=True)
    assert ctx.sysfs.simulated is False


# -- the parsers of what the drivers print ------------------------------------------------

names = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                min_size=1, max_size=30).map(str.strip).filter(bool)


@given(st.dictionaries(st.integers(1, 99999), names, max_size=30))
def test_creatable_list_round_trips_in_the_drivers_format(types: dict[int, str]) -> None:
    # nvidia-vgpu-vfio prints "ID    : vGPU Name" then "%-5d : %s" per type.
    text = "ID    : vGPU Name\n" + "".join(f"{k:<5d} : {v}\n" for k, v in types.items())
    assert nvidia.parse_creatable(text) == types
    assert nvidia.parse_creatable("ID    : vGPU Name\n") == {}


@given(heads=st.integers(1, 16), fb=st.integers(1, 98304), w=st.integers(640, 16384),
       h=st.integers(480, 16384), inst=st.integers(1, 64), unit=st.sampled_from(["M", ""]),
       order=st.permutations(range(4)))
def test_nvidia_description_numbers(heads: int, fb: int, w: int, h: int, inst: int,
                                    unit: str, order: list[int]) -> None:
    fields = [f"num_heads={heads}", f"framebuffer={fb}{unit}", f"max_resolution={w}x{h}",
              f"max_instance={inst}"]
    d = mdev.Description(", ".join([*(fields[i] for i in order), "frl_config=60"]))
    assert (d.num_heads, d.framebuffer_mb, d.max_resolution, d.max_instance) == (
        heads, fb, (w, h), inst)


def test_gvt_description_gives_resolution_only() -> None:
    d = mdev.Description("low_gm_size: 128MB\nhigh_gm_size: 512MB\nfence: 4\n"
                         "resolution: 1920x1200\nweight: 4\n")
    assert d.max_resolution == (1920, 1200)
    assert (d.max_instance, d.framebuffer_mb, d.num_heads) == (None, None, None)
