"""`mig`: GPUs in MIG mode can run the MIG-backed vGPUs gpulib.conf declares.

For each NVIDIA GPU with vendor-specific VFs, from NVIDIA's tool (the layout
the reports cached, else asked now and not kept: the doctor never writes):

* MIG mode set to change at the GPU's next reset (`Pending` differs from
  `Current`): warn, the GPU's vGPUs change kind after the reset;
* a GPU instance without a compute instance: a MIG-backed vGPU cannot run on
  it (fail);
* a GPU in MIG mode for which the driver offers no MIG-backed type (the
  cached `nvidia-smi vgpu -s -v` names none, or its idle VFs list none while
  an instance is free): the vGPU host driver does not support MIG-backed
  vGPU there (fail);
* a GPU instance a pool needs (gpulib's record) that is gone: warn, `gpulib
  restore` makes it again (the boot unit does);
* a GPU that left MIG mode (off, and not going on at its next reset) under
  a pool's recorded instances: fail;
* a GPU whose layout is unknown (NVIDIA's tool fails, hangs or is missing)
  while gpulib records GPU instances or MIG-backed types on it: fail,
  saying what is recorded and what is not known; with nothing recorded the
  check says the mode is unknown, never that no GPU is in MIG mode.
"""

from __future__ import annotations

from gpulib import mig, migtool, nvidiasmi
from gpulib.doctor.core import FAIL, OK, WARN, Result

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.discovery import Gpu
    from gpulib.doctor.facts import Facts

CID = "mig"


def _layouts(d: Facts) -> tuple[dict[str, mig.Layout], list[Gpu], list[str]]:
    """The layouts known, the GPUs whose layout is not (NVIDIA's tool did
    not answer, or answered `N/A`: no MIG), and why the tool did not answer."""
    gpus = migtool.wanted(d.inventory)
    have = {str(g.address): g.mig for g in gpus if g.mig is not None}
    missing = [g for g in gpus if g.mig is None]
    why: list[str] = []
    if missing:
        timeout = d.config.get_float("discovery", "nvidia_smi_timeout")
        found = migtool.layouts(d.ctx.root, missing, timeout, save=False, unknown=why)
        have.update({str(a): layout for a, layout in found.items()
                     if layout.current in (mig.ENABLED, mig.DISABLED)})
        if why:
            return have, [g for g in missing if str(g.address) not in have], why
    return have, [], why


def _mig_records(d: Facts, gpu: Gpu) -> tuple[list[str], int, int]:
    """What gpulib's records and the VFs say of MIG on a GPU: the pools
    with GPU instances on it, how many instances, how many VFs carry (or
    are recorded with) a MIG-backed type."""
    addr = str(gpu.address)
    recs = [r for r in d.state.gpu_instances if r.gpu == addr]
    vfs = {str(vf.address): vf for vf in gpu.vfs}
    typed = {a for a, r in d.state.vf_types.items() if a in vfs and r.gi_profile is not None}
    typed |= {a for a, vf in vfs.items() if vf.nvidia is not None and vf.nvidia.current_type
              and vf.nvidia.gpu_instance is not None and vf.nvidia.gpu_instance >= 0}
    return sorted({r.pool or "-" for r in recs}), len(recs), len(typed)


def _mig_backed_types(d: Facts, gpu: Gpu) -> tuple[bool, bool]:
    """(known, offered): whether the cached numbers of NVIDIA's tool say
    anything of the GPU's types, and whether one of them is MIG-backed."""
    import os

    numbers = gpu.nvidia_numbers
    if not numbers:
        cache = nvidiasmi.Cache.load(os.path.join(d.ctx.root, nvidiasmi.CACHE_FILE))
        numbers = cache.gpus.get(gpu.address, {}) if cache is not None else {}
    return bool(numbers), any(n.gi_profile is not None for n in numbers.values())


def _label(gpu: Gpu) -> str:
    return f"{gpu.address} ({gpu.device_name or 'GPU'})"


def check(d: Facts) -> list[Result]:
    layouts, unknown, why = _layouts(d)
    gpus = {str(g.address): g for g in d.inventory.gpus}
    problems: list[Result] = []
    enabled = 0
    reason = "; ".join(why)
    quiet = []
    for lost in unknown:
        pools, instances, typed = _mig_records(d, lost)
        if not (instances or typed):
            quiet.append(lost)
            continue
        held = []
        if instances:
            held.append(f"pool(s) {', '.join(pools)} record {instances} GPU instance(s) on it")
        if typed:
            held.append(f"{typed} of its VFs carry or are recorded with a MIG-backed type")
        problems.append(Result(
            CID, FAIL, str(lost.address), f"{_label(lost)}: MIG mode and GPU instances unknown "
            f"({reason}); {' and '.join(held)}: whether MIG mode is on and those instances "
            "exist is not known", "make NVIDIA's tool answer (`nvidia-smi -q`, `nvidia-smi mig "
            "-lgi`: the driver loaded and not hung), then: gpulib doctor --check mig"))
    for addr, layout in sorted(layouts.items()):
        gpu = gpus.get(addr)
        if gpu is None:
            continue
        bus = gpu.address.bus_id
        if layout.reset_pending:
            after = "on" if layout.pending == mig.ENABLED else "off"
            problems.append(Result(
                CID, WARN, addr, f"{_label(gpu)}: MIG mode is {layout.current.lower()} and "
                f"goes {after} at the GPU's next reset; its VFs offer "
                f"{'MIG-backed' if after == 'off' else 'time-sliced'} vGPU types until then",
                f"stop the VMs on it, then: nvidia-smi -i {bus} -r (or reboot the host)"))
        if not layout.enabled:
            pools, instances, typed = _mig_records(d, gpu)
            if instances and not layout.reset_pending:
                problems.append(Result(
                    CID, FAIL, addr, f"{_label(gpu)} left MIG mode (it is "
                    f"{layout.current.lower()}): the {instances} GPU instance(s) pool(s) "
                    f"{', '.join(pools)} record on it are gone, and its VFs offer time-sliced "
                    "types, not the pools' MIG-backed ones", f"stop the VMs on it, then: "
                    f"nvidia-smi -i {bus} -mig 1 && nvidia-smi -i {bus} -r (or reboot the "
                    "host), then: gpulib restore && gpulib pool apply"))
            continue
        enabled += 1
        for gi in layout.instances:
            if not gi.compute:
                problems.append(Result(
                    CID, FAIL, addr, f"{_label(gpu)}: GPU instance {gi.id} ({gi.profile_name} "
                    f"at {gi.start}:{gi.size}) has no compute instance: no MIG-backed vGPU "
                    "runs on it", f"nvidia-smi mig -i {bus} -gi {gi.id} -cci"))
        known, offered = _mig_backed_types(d, gpu)
        free_with_ci = [gi for gi in layout.instances if gi.compute and not any(
            vf.nvidia is not None and vf.nvidia.gpu_instance == gi.id for vf in gpu.vfs)]
        idle = [vf.nvidia for vf in gpu.vfs
                if vf.nvidia is not None and not vf.nvidia.current_type]
        unoffered = bool(free_with_ci and idle and not any(nv.creatable for nv in idle))
        if (known and not offered) or (unoffered and not offered):
            problems.append(Result(
                CID, FAIL, addr, f"{_label(gpu)} is in MIG mode, but its driver offers no "
                "MIG-backed vGPU type on it", "install NVIDIA's vGPU for Compute host driver "
                "(NVIDIA AI Enterprise) of a release that supports MIG-backed vGPU on this GPU"))
        for rec in d.state.gpu_instances:
            if rec.gpu == addr and layout.at(rec.start, rec.profile) is None:
                problems.append(Result(
                    CID, WARN, addr, f"{_label(gpu)}: the GPU instance (profile {rec.profile} "
                    f"at {rec.start}:{rec.size}) of pool {rec.pool or '-'} is gone (after a "
                    "reboot or a GPU reset)", "gpulib restore (the boot unit runs it), then "
                    "gpulib pool apply"))
    if problems:
        return problems
    if quiet:
        what = (f"{enabled} GPU(s) in MIG mode; " if enabled else "")
        return [Result(CID, OK, "GPUs", f"{what}MIG mode of {len(quiet)} GPU(s) unknown "
                       f"({reason}); gpulib records no GPU instance and no MIG-backed type "
                       "on them")]
    if enabled:
        total = sum(len(layout.instances) for layout in layouts.values())
        return [Result(CID, OK, "GPUs", f"{enabled} GPU(s) in MIG mode, {total} GPU "
                                        "instance(s), each with a compute instance")]
    return [Result(CID, OK, "GPUs", "no GPU is in MIG mode")]
