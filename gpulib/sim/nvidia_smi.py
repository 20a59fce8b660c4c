"""`nvidia-smi` as the simulator answers it on a host with MIG-capable GPUs.

`FakeHost.install_nvidia_smi` installs `usr/bin/nvidia-smi` below the
host's root; on a host with a MIG-capable GPU that script runs this module
(`python -m gpulib.sim.nvidia_smi ROOT ARGS...`). It answers in NVIDIA's
layouts as real captures show them (`gpulib.sim.captured`, which learns
them from the captures, never through gpulib's own code):

* `vgpu -s -v`: the supported vGPU types (the text the builder rendered);
* `-q [-i ID]`: each GPU's product, MIG mode (current, pending) and
  virtualization mode;
* `-i ID -mig 0|1`: MIG mode for the next reset (pending);
* `mig [-i ID] -lgip | -lgipp | -lgi | -lci`;
* `mig [-i ID] -cgi PROFILE[:START][,...] [-C]`, `-cci [-gi ID]`,
  `-dci [-gi ID] [-ci ID]`, `-dgi [-gi ID]`.

GPUs are the NVIDIA physical functions on the `nvidia` driver, numbered in
PCI address order; `-i` takes that index or the bus id (`00000000:41:00.0`).
The MIG state is `gpulib.sim.migdriver`'s; changes end with its `refresh()`,
so the VFs' creatable lists follow the free GPU instances. Anything else
gets nvidia-smi's own refusal and exit 2.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from gpulib import mig
from gpulib.pci import PciAddress
from gpulib.sim import captured
from gpulib.sim.attrs import read_attribute as _read
from gpulib.sim.migdriver import NOT_FOUND, MigError, MigGpu

INVALID = ("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
OUTPUT = "usr/share/gpulib-sim/nvidia-smi-vgpu-s-v.txt"  # fakehost.NVIDIA_SMI_OUTPUT


class Gpu:
    def __init__(self, index: int, address: PciAddress, pf_dir: str) -> None:
        self.index = index
        self.address = address
        self.pf_dir = pf_dir
        self.mig = MigGpu.load(pf_dir)


def gpus(root: str) -> list[Gpu]:
    base = os.path.join(root, "sys/bus/pci/devices")
    out: list[Gpu] = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        d = os.path.realpath(os.path.join(base, name))
        driver = os.path.join(d, "driver")
        if _read(os.path.join(d, "vendor")) != "0x10de" or \
                os.path.lexists(os.path.join(d, "physfn")) or not os.path.islink(driver) or \
                os.path.basename(os.readlink(driver)) != "nvidia":
            continue
        out.append(Gpu(len(out), PciAddress.parse(name), d))
    return out


def select(all_gpus: list[Gpu], ident: Optional[str]) -> Optional[list[Gpu]]:
    if ident is None:
        return all_gpus
    if ident.isascii() and ident.isdigit():
        found = [g for g in all_gpus if g.index == int(ident)]
    else:
        try:
            address = PciAddress.parse(ident.lower())
        except Exception:
            return None
        found = [g for g in all_gpus if g.address == address]
    return found or None


def _product(root: str, gpu: Gpu) -> str:
    state = MigGpu.load(gpu.pf_dir)
    if state is not None and state.product:
        return state.product
    device = _read(os.path.join(gpu.pf_dir, "device"))
    return {"0x2331": "NVIDIA H100 PCIe", "0x2236": "NVIDIA A10",
            "0x26b9": "NVIDIA L40S", "0x20f1": "NVIDIA A100-PCIE-40GB"}.get(device, "NVIDIA GPU")


def query(root: str, selected: list[Gpu], everything: list[Gpu]) -> str:
    """`nvidia-smi -q`, the lines gpulib reads (and a few around them)."""
    f = captured.query_line
    lines = ["", "==============NVSMI LOG==============", "",
             f("Timestamp", "Mon Jan 19 07:00:00 2026", 0),
             f("Driver Version", _read(os.path.join(root, "sys/module/nvidia/version")), 0),
             f("CUDA Version", "Not Found", 0), "", f("Attached GPUs", len(everything), 0)]
    for g in selected:
        lines.append(f"GPU {g.address.bus_id}")
        lines.append(f("Product Name", _product(root, g)))
        lines.append(f("Product Brand", "NVIDIA"))
        lines.append("    MIG Mode")
        lines.append(f("Current", g.mig.current if g.mig else "N/A", 8))
        lines.append(f("Pending", g.mig.pending if g.mig else "N/A", 8))
        lines.append("    GPU Virtualization Mode")
        lines.append(f("Virtualization Mode", "Host VGPU", 8))
        lines.append(f("Host VGPU Mode", "SR-IOV", 8))
    return "\n".join(lines) + "\n"


def _opt(args: list[str], *names: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            return args[i + 1]
    return None


def _ids(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    return [int(x) for x in text.split(",") if x.strip().isdigit()]


def run_mig(args: list[str], selected: list[Gpu]) -> tuple[int, str]:
    migs = [g for g in selected if g.mig is not None and g.mig.enabled]
    if not migs:
        return NOT_FOUND, "No MIG-enabled devices found.\n"
    gis = _ids(_opt(args, "-gi", "--gpu-instance-id"))
    cis = _ids(_opt(args, "-ci", "--compute-instance-id"))
    if "-lgip" in args or "--list-gpu-instance-profiles" in args:
        return 0, captured.profiles_table().render([
            [[g.index, p.name, p.id, f"{p.free}/{p.total}", p.memory_gib, p.p2p, p.sm, p.dec,
              p.enc], [p.ce, p.jpeg, p.ofa]]
            for g in migs if g.mig for p in g.mig.model()[0]])
    if "-lgipp" in args or "--list-gpu-instance-possible-placements" in args:
        return 0, "".join(captured.placements_line(g.index, p.id, p.placements, p.size) + "\n"
                          for g in migs if g.mig for p in g.mig.model()[0])
    if "-lgi" in args or "--list-gpu-instances" in args:
        listed = [(g.index, g.mig.model()[1]) for g in migs if g.mig]
        if not any(r for _, r in listed):
            return NOT_FOUND, "No GPU instances found: Not Found\n"
        return 0, captured.instances_table().render([
            [[gpu, i.profile_name, i.profile_id, i.id, f"{i.start}:{i.size}"]]
            for gpu, instances in listed for i in instances])
    if "-lci" in args or "--list-compute-instances" in args:
        out: list[tuple[int, list[tuple[mig.Instance, int, int, int]]]] = []
        for g in migs:
            assert g.mig is not None
            rows: list[tuple[mig.Instance, int, int, int]] = []
            for i in g.mig.model()[1]:
                p = g.mig.profile(str(i.profile_id)) or {}
                rows += [(i, int(p.get("ci_profile", 0)), ci, mig.slices_of(i.profile_name) or 1)
                         for ci in i.compute]
            out.append((g.index, rows))
        if not any(r for _, r in out):
            return NOT_FOUND, "No compute instances found: Not Found\n"
        return 0, captured.compute_table().render([
            [[gpu, gi.id, gi.profile_name, ci_profile, ci, f"0:{slices}"]]
            for gpu, rows in out for gi, ci_profile, ci, slices in rows])
    create = _opt(args, "-cgi", "--create-gpu-instance")
    if create is not None:
        return _create(migs, create, "-C" in args or "--default-compute-instance" in args)
    if "-cci" in args or "--create-compute-instance" in args:
        return _each(migs, gis, lambda g, gi: [captured.created_ci(
            ci, g.index, gi, _name(g, gi), prof) for ci, prof in [g.mig.create_ci(gi)]])
    if "-dci" in args or "--destroy-compute-instance" in args:
        def destroy_ci(g: Gpu, gi: int) -> list[str]:
            assert g.mig is not None
            gone: list[int] = []
            for ci in cis if cis else [None]:
                gone += g.mig.destroy_ci(gi, ci)
            return [captured.destroyed_ci(ci, g.index, gi) for ci in gone]
        return _each(migs, gis, destroy_ci, what="compute instance")
    if "-dgi" in args or "--destroy-gpu-instance" in args:
        def destroy(g: Gpu, gi: int) -> list[str]:
            assert g.mig is not None
            g.mig.destroy_gi(gi)
            return [captured.destroyed_gi(gi, g.index)]
        return _each(migs, gis, destroy, what="GPU instance")
    return 2, INVALID + "\n"


def _name(g: Gpu, gi: int) -> str:
    assert g.mig is not None
    inst = g.mig.instance(gi)
    p = g.mig.profile(str(inst["profile"])) if inst else None
    return str(p["name"]) if p else "?"


def _create(migs: list[Gpu], spec: str, with_ci: bool) -> tuple[int, str]:
    lines = []
    for g in migs:
        assert g.mig is not None
        for item in spec.split(","):
            ident, _, start = item.strip().partition(":")
            try:
                gi, p = g.mig.create_gi(ident.strip(), int(start) if start.isdigit() else None)
                lines.append(captured.created_gi(gi, g.index, p["name"], p["id"]))
                if with_ci:
                    ci, prof = g.mig.create_ci(gi)
                    lines.append(captured.created_ci(ci, g.index, gi, p["name"], prof))
            except MigError as exc:
                return _refused(g, lines, exc, f"Unable to create a GPU instance on GPU "
                                f"{g.index:2d} using profile {ident.strip()}",
                                "Failed to create GPU instances")
        g.mig.save()
        g.mig.refresh()
    return 0, "\n".join(lines) + "\n"


def _refused(g: Gpu, lines: list[str], exc: MigError, unable: str, failed: str
             ) -> tuple[int, str]:
    """What the tool prints when the driver refuses a step (what was done
    before it stays, as the driver keeps it)."""
    assert g.mig is not None
    g.mig.save()
    g.mig.refresh()
    lines += [f"{unable}: {exc.reason}", f"{failed}: {exc.reason}"]
    return exc.code, "\n".join(lines) + "\n"


def _each(migs: list[Gpu], gis: Optional[list[int]], act: object,
          what: str = "compute instance") -> tuple[int, str]:
    lines = []
    for g in migs:
        assert g.mig is not None
        targets = gis if gis is not None else [i["id"] for i in g.mig.instances()]
        if not targets:
            return NOT_FOUND, f"No {what}s found: Not Found\n"
        for gi in targets:
            try:
                lines += act(g, gi)  # type: ignore[operator]
            except MigError as exc:
                return _refused(g, lines, exc, f"Unable to destroy {what} ID {gi:2d} from GPU "
                                f"{g.index:2d}", f"Failed to destroy {what}s")
        g.mig.save()
        g.mig.refresh()
    return 0, "\n".join(lines) + "\n"


def run(root: str, args: list[str]) -> tuple[int, str]:
    everything = gpus(root)
    selected = select(everything, _opt(args, "-i", "--id"))
    if args == ["vgpu", "-s", "-v"]:
        return 0, _read_raw(os.path.join(root, OUTPUT))
    if selected is None:
        return NOT_FOUND, "No devices were found\n"
    if args[:1] == ["mig"]:
        return run_mig(args[1:], selected)
    if "-q" in args or "--query" in args:
        return 0, query(root, selected, everything)
    mode = _opt(args, "-mig", "--multi-instance-gpu")
    if mode in ("0", "1"):
        out: list[str] = []
        for g in selected:
            if g.mig is None:
                return 3, (f"Unable to enable MIG Mode for GPU {g.address.bus_id}: "
                           "Not Supported\n")
            g.mig.set_pending(mode == "1")
            g.mig.save()
            out.append(f"{'Enabled' if mode == '1' else 'Disabled'} MIG Mode for GPU "
                       f"{g.address.bus_id}")
        return 0, "\n".join(out) + "\nAll done.\n"
    return 2, INVALID + "\n"


def _read_raw(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    root, args = argv[0], argv[1:]
    code, out = run(root, args)
    sys.stdout.write(out)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
