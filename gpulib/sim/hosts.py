"""Sample hosts built from real GPU models' sysfs facts (`data/models.json`).

* `demo`: one of each layout an operator meets — a T4 (mdev on the PF), an
  A100 (SR-IOV, mdev on each VF), an A10 and an L40S (NVIDIA vendor-specific
  vGPU on VFs), a GeForce with its HDMI audio function in the same IOMMU
  group, an Intel iGPU with GVT-g types, AMD Instinct cards (one on PCI
  domain 0001), an AMD MxGPU card with plain SR-IOV VFs, and what is not a
  GPU: the server's ASPEED BMC display and a NIC; NVIDIA's tool
  (`nvidia-smi`) answers for the A10 and L40S. Addresses match the
  CloudStack agent fixtures, so their domain XML works against this host.
* `large`: 8 GPUs x 16 VFs x 24 vGPU types with 64 running VMs, the size the
  discovery budget is measured on; `large-nvidia` the same size with NVIDIA's
  vendor-specific VFs and its tool (`nvidia-smi`). `large-16`, `large-32`,
  `large-64`: the same in proportion (16 VFs a GPU, 24 types a VF, 8 running
  VMs a GPU), eight GPUs to a PCI domain, for the curve of cost against size
  and the reports that pass the pipe's 64 KiB.
* `pool64`: four T4s with a declared pool of 64 vGPUs, for the concurrency budget.
* `mig`: two H100 PCIe 80GB with NVIDIA's vendor-specific vGPU VFs, one in
  MIG mode (MIG-backed types, no GPU instance yet), one not (time-sliced
  types), NVIDIA's tool answering MIG's questions, and a declared pool of two
  `NVIDIA H100-1-10C` vGPUs that `gpulib pool apply` makes (GPU instances,
  then VF types). `build_mig(root, model=...)` puts another MIG-capable GPU
  of `data/mig_models.json` in its place (A100 40GB and 80GB, A30, H100 NVL, H200 NVL,
  RTX PRO 6000 Blackwell Server Edition), with that model's profiles and MIG-backed
  types and a pool of two of its first type.
"""

from __future__ import annotations

import json
import os
import uuid as uuidlib
from typing import Any, Callable, Optional

from gpulib.nvidiasmi import TypeNumbers
from gpulib.pci import PciAddress
from gpulib.sim import captured
from gpulib.sim.fakehost import FakeHost
from gpulib.sim.migdriver import MigGpu

_DATA = os.path.join(os.path.dirname(__file__), "data")

# UUIDs the CloudStack fixtures name (vgpu-mdev.xml, vgpu-mdev-display.xml):
# known to gpulib's registry but not live, as after a host reboot.
DEMO_POOL_MDEVS = ("6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d", "a3d5f7e9-1b2c-4d6e-8f0a-2c4e6a8b0d13")
DEMO_T4 = "0000:af:00.0"
DEMO_A10 = "0000:41:00.0"
DEMO_A10_VF_TYPE = (594, "NVIDIA A10-6Q")
DEMO_A100_MDEV = "3f0d5c4e-8a2b-4c1d-9e6f-7a8b9c0d1e2f"


def models() -> dict[str, dict[str, Any]]:
    with open(os.path.join(_DATA, "models.json"), encoding="utf-8") as fh:
        data: dict[str, dict[str, Any]] = json.load(fh)
    return data


def add_model(host: FakeHost, model: dict[str, Any], address: str, numa: int,
              parent: Optional[str] = None, driver: Optional[str] = None,
              group: Optional[int] = None) -> str:
    """One function of a catalog model; returns its address."""
    host.add_function(
        address, model["vendor"], model["device"], model["class"],
        driver=driver if driver is not None else model.get("driver"),
        iommu_group=host.new_iommu_group() if group is None else group,
        numa_node=numa, parent=parent, subsystem=tuple(model.get("subsystem", (0, 0))),
        revision=model.get("revision", 0xA1), vendor_name=model["vendor_name"],
        device_name=model["device_name"])
    return address


def add_sriov_gpu(host: FakeHost, model: dict[str, Any], address: str, numa: int,
                  parent: Optional[str], numvfs: int) -> list[str]:
    add_model(host, model, address, numa, parent)
    host.set_sriov_capability(address, model.get("sriov_totalvfs", numvfs),
                              model.get("vf_device", model["device"]),
                              offset=model.get("vf_offset", 1))
    vf_driver = model.get("vf_driver", model.get("driver"))
    vfs = host.enable_sriov(address, numvfs, vf_driver=vf_driver)
    if model.get("vf_device_name"):
        host.name_ids(model["vendor"], model["vendor_name"], model["vf_device"],
                      model["vf_device_name"])
    return vfs


# What NVIDIA's tables give each series of vGPU type: (class, display heads,
# maximum resolution); a 1 GB Q profile drives 5120x2880 at most.
_SERIES = {"Q": ("Quadro", 4, (7680, 4320)), "B": ("NVS", 4, (5120, 2880)),
           "A": ("NVS", 1, (1280, 1024)), "C": ("Compute", 1, (4096, 2160))}


def mig_type_numbers(model: dict[str, Any], name: str, profile_id: int, per_gi: int = 1
                     ) -> tuple[str, TypeNumbers]:
    """(class, numbers) of a MIG-backed VF type (`NVIDIA H100-1-10C`): its frame
    buffer from the name, as many instances as its GPU instance profile has
    (times the vGPUs one instance runs), one head at 4096x2160 (a compute
    type; a Q type has its series' class), the profile it runs on."""
    from gpulib.lazyre import lazy

    m = lazy(r"-\d+-(\d+)[A-Z]+$").search(name)
    gb = int(m.group(1)) if m else 1
    total = next((p["total"] for p in model["mig_profiles"] if p["id"] == profile_id), 1)
    klass = "Compute" if lazy(r"\dCM?E?$").search(name) else _SERIES.get(name[-1], _SERIES["C"])[0]
    return klass, TypeNumbers(name, total * per_gi, gb * 1024, 1, (4096, 2160), profile_id,
                              per_gi)


def vf_type_numbers(model: dict[str, Any], name: str) -> tuple[str, TypeNumbers]:
    """(class, numbers) of a vendor-specific VF type of a catalog model, as
    `nvidia-smi vgpu -s -v` reports them: the frame buffer from the name
    (`NVIDIA A10-6Q`: 6 GB), as many instances as fit in the GPU's memory,
    heads and resolution by series."""
    size, series = name.rsplit("-", 1)[1][:-1], name[-1]
    gb = int(size) if size.isdigit() else 1
    klass, heads, res = _SERIES.get(series, ("NVS", 1, (1280, 1024)))
    if series == "Q" and gb == 1:
        res = (5120, 2880)
    return klass, TypeNumbers(name, model["framebuffer_gb"] // gb, gb * 1024, heads, res, None)


def nvidia_smi_output(host: FakeHost) -> str:
    """What `nvidia-smi vgpu -s -v` prints on this host: each NVIDIA GPU whose
    VFs carry the vendor-specific framework, with every type its catalog model
    supports."""
    by_device = {m["device"]: m for m in [*models().values(), *mig_catalog().values()]
                 if m["vendor"] == 0x10DE
                 and (m.get("nvidia_vf_types") or m.get("nvidia_mig_vf_types"))}
    gpus: dict[PciAddress, dict[int, tuple[str, TypeNumbers]]] = {}
    base = host.p("sys/bus/pci/devices")
    for name in sorted(os.listdir(base)):
        d = os.path.join(base, name)

        def read(attr: str, d: str = d) -> str:
            with open(os.path.join(d, attr), encoding="utf-8") as fh:
                return fh.read().strip()

        if read("vendor") != "0x10de" or os.path.lexists(os.path.join(d, "physfn")):
            continue
        model = by_device.get(int(read("device"), 16))
        vendor_vfs = [v for v in os.listdir(d) if v.startswith("virtfn")
                      and os.path.isdir(os.path.join(d, v, "nvidia"))]
        if model is None or not vendor_vfs:
            continue
        gpu = MigGpu.load(d)
        if gpu is not None and gpu.enabled:
            # In MIG mode the driver supports the MIG-backed types only.
            gpus[PciAddress.parse(name)] = {
                int(tid): mig_type_numbers(model, str(t[0]), int(t[1]),
                                           int(t[2]) if len(t) > 2 else 1)
                for tid, t in model["nvidia_mig_vf_types"].items()}
            continue
        gpus[PciAddress.parse(name)] = {
            int(tid): vf_type_numbers(model, tname)
            for tid, tname in model["nvidia_vf_types"].items()}
    return captured.vgpu_types(gpus)


def install_nvidia_smi(host: FakeHost, behaviour: str = "answer") -> None:
    """NVIDIA's tool on a host with vendor-specific VFs (see FakeHost.install_nvidia_smi)."""
    host.install_nvidia_smi(nvidia_smi_output(host), behaviour)


def _numa(bus: int) -> int:
    return 0 if bus < 0x80 else 1


def build_demo(root: str) -> FakeHost:
    m = models()
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    host.add_iommu_unit("dmar1")
    for mod in ("vfio", "vfio_pci", "vfio_iommu_type1", "nvidia", "nvidia_vgpu_vfio", "kvm",
                "kvm_intel", "i915", "kvmgt", "mdev"):
        host.load_module(mod)
    host.write_file("etc/modprobe.d/blacklist-nouveau.conf",
                    "blacklist nouveau\noptions nouveau modeset=0\n")
    host.write_file("etc/os-release", 'ID=debian\nVERSION_ID="12"\nPRETTY_NAME="Debian 12"\n')

    # Intel iGPU with GVT-g (mdev on the PF), host bridge bus 00.
    host.add_function("0000:00:00.0", 0x8086, 0x3E30, 0x060000, numa_node=0,
                      iommu_group=host.new_iommu_group())
    add_model(host, m["uhd630"], "0000:00:02.0", 0)
    host.populate_mdev_parent("0000:00:02.0", m["uhd630"]["mdev_types"])

    # The BMC's display adapter behind a bridge: not a GPU.
    host.add_bridge("0000:00:1c.0", numa_node=0, iommu_group=host.new_iommu_group())
    add_model(host, m["aspeed"], "0000:02:00.0", 0, parent="0000:00:1c.0")

    # AMD Instinct MI210 for passthrough (Display controller class).
    host.add_bridge("0000:16:01.0", numa_node=0, iommu_group=host.new_iommu_group())
    add_model(host, m["mi210"], "0000:17:00.0", 0, parent="0000:16:01.0", driver="vfio-pci")
    # A NIC on the same socket: not a GPU.
    host.add_bridge("0000:16:02.0", numa_node=0, iommu_group=host.new_iommu_group())
    add_model(host, m["x710"], "0000:18:00.0", 0, parent="0000:16:02.0")

    # GeForce RTX 3070 + HDMI audio in one IOMMU group, both on vfio-pci.
    host.add_bridge("0000:3a:00.0", numa_node=0, iommu_group=host.new_iommu_group())
    group = host.new_iommu_group()
    add_model(host, m["rtx3070"], "0000:3b:00.0", 0, parent="0000:3a:00.0", group=group)
    audio = dict(m["rtx3070"], **m["rtx3070"]["audio"])
    add_model(host, audio, "0000:3b:00.1", 0, parent="0000:3a:00.0", group=group)

    # A10 with vendor-specific vGPU VFs (the layout of Ubuntu 24.04 hosts).
    host.add_bridge("0000:40:03.1", numa_node=0, iommu_group=host.new_iommu_group())
    vfs = add_sriov_gpu(host, m["a10"], DEMO_A10, 0, "0000:40:03.1", 8)
    a10_types = {int(k): v for k, v in m["a10"]["nvidia_vf_types"].items()}
    for vf in vfs:
        host.add_nvidia_vf_types(vf, a10_types)

    # A T4 bound to vfio-pci: the common whole-GPU passthrough case.
    host.add_bridge("0000:64:00.0", numa_node=0, iommu_group=host.new_iommu_group())
    add_model(host, m["t4"], "0000:65:00.0", 0, parent="0000:64:00.0", driver="vfio-pci")

    # L40S with vendor-specific VFs; one VF already carries L40S-6Q for a running VM.
    host.add_bridge("0000:80:01.2", numa_node=1, iommu_group=host.new_iommu_group())
    vfs = add_sriov_gpu(host, m["l40s"], "0000:82:00.0", 1, "0000:80:01.2", 8)
    l40s_types = {int(k): v for k, v in m["l40s"]["nvidia_vf_types"].items()}
    for i, vf in enumerate(vfs):
        if i == 0:
            host.add_nvidia_vf_types(vf, {}, current=1151)
        else:
            host.add_nvidia_vf_types(vf, {k: v for k, v in l40s_types.items() if k == 1151})
    host.add_running_domain("i-4-20-VM", "5a0f1c2e-9b3d-4e7a-8c6f-1d2e3f4a5b6c",
                            pci=(vfs[0],), managed=False)

    # T4: mdev on the PF. Its pool vGPUs are in the registry but not live.
    host.add_bridge("0000:ae:00.0", numa_node=1, iommu_group=host.new_iommu_group())
    add_model(host, m["t4"], DEMO_T4, 1, parent="0000:ae:00.0")
    host.set_sriov_capability(DEMO_T4, 16, 0, offset=4)
    host.populate_mdev_parent(DEMO_T4, m["t4"]["mdev_types"])

    # AMD MxGPU (V620): plain SR-IOV VFs on vfio-pci.
    host.add_bridge("0000:c0:01.1", numa_node=1, iommu_group=host.new_iommu_group())
    add_sriov_gpu(host, m["v620"], "0000:c1:00.0", 1, "0000:c0:01.1", 4)

    # A100: SR-IOV with mdev types on each VF; one live vGPU for a defined VM
    # (gpulib keeps it: _write_demo_state), which holds nothing while stopped.
    host.add_bridge("0000:c9:00.0", numa_node=1, iommu_group=host.new_iommu_group())
    vfs = add_sriov_gpu(host, m["a100"], "0000:ca:00.0", 1, "0000:c9:00.0", 4)
    for vf in vfs:
        host.populate_mdev_parent(vf, m["a100"]["vf_mdev_types"])
    live = DEMO_A100_MDEV
    host.add_mdev(live, vfs[0], "nvidia-470")
    for vf in vfs[1:]:
        # One type per physical GPU while time-sliced vGPUs run.
        _only_type_left(host, vf, "nvidia-470")
    host.add_defined_domain("i-3-12-VM", "2b7e4c1d-6f3a-4d8e-9b0c-5e1f2a3d4c6b", mdevs=(live,))

    # AMD Instinct MI300X (Processing accelerators) on PCI domain 0001.
    host.add_bridge("0001:d5:00.0", numa_node=1, iommu_group=host.new_iommu_group())
    add_model(host, m["mi300x"], "0001:d6:00.0", 1, parent="0001:d5:00.0")

    _write_demo_state(host)
    install_nvidia_smi(host)
    host.write_file("etc/gpulib/gpulib.conf",
                    "# Demo host: the T4's desktop vGPUs are a pool gpulib keeps alive.\n"
                    "[pool t4-desktops]\nparents = 10de:1eb8\ntype = nvidia-232\n"
                    "count = 2\n")
    return host


def _only_type_left(host: FakeHost, parent: str, keep: str) -> None:
    base = os.path.join(host.device_dir(parent), "mdev_supported_types")
    for t in os.listdir(base):
        if t != keep:
            with open(os.path.join(base, t, "available_instances"), "w") as fh:
                fh.write("0\n")


def _write_demo_state(host: FakeHost) -> None:
    created = "2026-01-19T07:00:00Z"
    # Schema 2, as a host that ran an earlier gpulib has it (the first change
    # writes the current schema; the previous release reads this one).
    state = {
        "version": 2,
        "vgpus": {**{u: {"parent": DEMO_T4, "type_id": "nvidia-232", "pool": "t4-desktops",
                         "on_demand": False, "created": created}
                     for u in DEMO_POOL_MDEVS},
                  # Persistent, in no pool: gpulib keeps it (a live vGPU
                  # nobody knows would be a stray, which `gpulib reconcile`
                  # reports as a failure).
                  DEMO_A100_MDEV: {"parent": "0000:ca:00.4", "type_id": "nvidia-470",
                                   "pool": None, "on_demand": False, "created": created}},
        "vf_types": {"0000:41:00.4": {"type_id": DEMO_A10_VF_TYPE[0],
                                      "name": DEMO_A10_VF_TYPE[1], "pool": None,
                                      "on_demand": False}},
        "type_names": {},
        "allocations": {},
        "unmanaged": [],
    }
    host.write_file("var/lib/gpulib/state.json", json.dumps(state, indent=1, sort_keys=True)
                    + "\n", 0o600)
    os.chmod(host.p("var/lib/gpulib"), 0o700)


def large_types() -> list[dict[str, Any]]:
    """24 time-sliced L40S-class types as an mdev-era driver lists them on each VF."""
    sizes = [(1, "B"), (2, "B"), (1, "Q"), (2, "Q"), (3, "Q"), (4, "Q"), (6, "Q"), (8, "Q"),
             (12, "Q"), (16, "Q"), (24, "Q"), (48, "Q"), (1, "A"), (2, "A"), (3, "A"),
             (4, "A"), (6, "A"), (8, "A"), (12, "A"), (16, "A"), (24, "A"), (48, "A"),
             (4, "C"), (8, "C")]
    out = []
    for i, (gb, series) in enumerate(sizes):
        out.append({
            "type_id": f"nvidia-{1145 + i}", "name": f"NVIDIA L40S-{gb}{series}",
            "description": f"num_heads=4, frl_config=60, framebuffer={gb * 1024}M, "
                           f"max_resolution=7680x4320, max_instance={48 // gb}",
            "available_instances": 1})
    return out


def _large_gpu(host: FakeHost, model: dict[str, Any], g: int, vfs: int) -> list[str]:
    """The large hosts' GPU number `g` behind a root port of its own: its VFs.
    Eight GPUs to a PCI domain (a bus range of 0x20 each), as a host with
    several PCI segments (VMD, multi-socket) numbers them past the eighth."""
    domain, bus = g // 8, 0x11 + (g % 8) * 0x20
    root_port = f"{domain:04x}:{bus - 1:02x}:01.0"
    host.add_bridge(root_port, numa_node=_numa(bus), iommu_group=host.new_iommu_group())
    return add_sriov_gpu(host, model, f"{domain:04x}:{bus:02x}:00.0", _numa(bus), root_port,
                         vfs)


# The GPUs of the large hosts: `large` and the sizes in proportion to it.
LARGE_SIZES = (8, 16, 32, 64)


def build_large(root: str, gpus: int = 8, vfs_per_gpu: int = 16, vms: Optional[int] = None
                ) -> FakeHost:
    """`gpus` L40S x `vfs_per_gpu` VFs x 24 types and `vms` running VMs (8 a
    GPU unless given), each with a vGPU on a VF of its own."""
    if vms is None:
        vms = 8 * gpus
    m = models()
    model = dict(m["l40s"], sriov_totalvfs=32)
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    types = large_types()
    live_by_gpu = vms // gpus
    n = 0
    for g in range(gpus):
        vfs = _large_gpu(host, model, g, vfs_per_gpu)
        for vf in vfs:
            host.populate_mdev_parent(vf, types)
        for i in range(live_by_gpu):
            u = str(uuidlib.UUID(int=(g << 64) | i | (0x4 << 76)))
            host.add_mdev(u, vfs[i], "nvidia-1150")
            host.add_running_domain(f"i-2-{100 + n}-VM", str(uuidlib.UUID(int=n + 1)),
                                    mdevs=(u,), pid=10000 + n)
            n += 1
    return host


def build_large_nvidia(root: str, gpus: int = 8, vfs_per_gpu: int = 16, vms: int = 64
                       ) -> FakeHost:
    """The large host with NVIDIA's vendor-specific framework instead of mdev:
    8 L40S x 16 VFs, on each GPU 8 VFs typed L40S-4Q for running VMs and the
    others able to take any of its 23 types, and NVIDIA's tool installed (the
    discovery budget with the numbers of those types asked for)."""
    model = dict(models()["l40s"], sriov_totalvfs=32)
    types = {int(k): v for k, v in model["nvidia_vf_types"].items()}
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    host.load_module("nvidia")
    per_gpu = vms // gpus
    n = 0
    for g in range(gpus):
        for i, vf in enumerate(_large_gpu(host, model, g, vfs_per_gpu)):
            if i < per_gpu:
                host.add_nvidia_vf_types(vf, {}, current=1150)
                host.add_running_domain(f"i-2-{100 + n}-VM", str(uuidlib.UUID(int=n + 1)),
                                        pci=(vf,), managed=False, pid=10000 + n)
                n += 1
            else:
                host.add_nvidia_vf_types(vf, types)
    install_nvidia_smi(host)
    return host


def build_pool64(root: str, gpus: int = 4, per_parent: int = 16) -> FakeHost:
    """`gpus` T4s and a pool of GRID T4-1B vGPUs on each (16 fit on one T4): the
    host of the "64 VMs start at once against a pool of 64" budget. The pool is
    declared, not created: `gpulib pool apply` creates it."""
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    m = models()["t4"]
    for g in range(gpus):
        domain, bus = g // 8, 0x3B + (g % 8) * 0x10  # eight to a PCI domain, as `large`
        port = f"{domain:04x}:{bus - 1:02x}:00.0"
        host.add_bridge(port, numa_node=g % 2, iommu_group=host.new_iommu_group())
        add_model(host, m, f"{domain:04x}:{bus:02x}:00.0", g % 2, parent=port)
        host.populate_mdev_parent(f"{domain:04x}:{bus:02x}:00.0", m["mdev_types"])
    host.write_file("etc/gpulib/gpulib.conf",
                    "[pool desktops]\nparents = 10de:1eb8\nprofile = GRID T4-1B\n"
                    f"per_parent = {per_parent}\n")
    return host


MIG_GPU = "0000:41:00.0"
PLAIN_H100 = "0000:c1:00.0"
MIG_POOL = ("[pool mig]\nparents = all\nprofile = NVIDIA H100-1-10C\ncount = 2\n")

# NOT NVIDIA's numbers. A MIG-backed vGPU type whose number no public capture
# gives (`type_id` null in data/mig_models.json) is numbered from here, in the
# table's order, so the simulated driver can list it; gpulib never knows a
# type number in advance (pools name types, the driver's creatable_vgpu_types
# gives their numbers), so nothing of gpulib depends on these.
PLACEHOLDER_TYPE_IDS = 9001


def mig_models() -> dict[str, dict[str, Any]]:
    """data/mig_models.json: the MIG-capable models besides the H100 PCIe, each fact sourced."""
    with open(os.path.join(_DATA, "mig_models.json"), encoding="utf-8") as fh:
        data: dict[str, dict[str, Any]] = json.load(fh)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def mig_catalog() -> dict[str, dict[str, Any]]:
    """Every MIG-capable model as a catalog model (models.json's fields), the
    H100 PCIe's included; a type without a public number gets a placeholder
    (`PLACEHOLDER_TYPE_IDS`)."""
    out = {"h100": models()["h100"]}
    h100 = out["h100"]
    placeholder = PLACEHOLDER_TYPE_IDS
    for key, m in mig_models().items():
        types: dict[str, list[Any]] = {}
        for t in m["vgpu_types"]:
            tid = t["type_id"]
            if tid is None:
                tid, placeholder = placeholder, placeholder + 1
            types[str(tid)] = [t["name"], t["profile"], t["per_gi"]]
        out[key] = dict(
            h100, device=m["pci"]["device"], vf_device=m["pci"]["device"],
            device_name=m["pci"]["device_name"], subsystem=m["pci"]["subsystem"],
            framebuffer_gb=m["framebuffer_gb"], product_name=m["product_name"],
            nvidia_vf_types={}, nvidia_mig_vf_types=types, mig_profiles=m["profiles"],
            instance_ids={int(k): v for k, v in m["instance_ids"].items()})
    return out


def add_mig_gpu(host: FakeHost, key: str, address: str, root_port: str, numa: int,
                numvfs: int, mig_mode: bool) -> list[str]:
    """A MIG-capable GPU of `mig_catalog()` behind its own root port, on the
    NVIDIA vGPU host driver with `numvfs` vendor-specific VFs; in MIG mode its
    VFs offer the MIG-backed types of its free GPU instances (none yet), else
    the time-sliced ones (none for a model without them in the catalog)."""
    model = mig_catalog()[key]
    host.add_bridge(root_port, numa_node=numa, iommu_group=host.new_iommu_group())
    vfs = add_sriov_gpu(host, model, address, numa, root_port, numvfs)
    mig_types = {k: list(v) for k, v in model["nvidia_mig_vf_types"].items()}
    gpu = MigGpu.create(host.device_dir(address), model["mig_profiles"], mig_types, mig_mode,
                        model.get("instance_ids"),
                        model["product_name"] if key != "h100" else None)
    types = {} if mig_mode else {int(k): v for k, v in model["nvidia_vf_types"].items()}
    for vf in vfs:
        host.add_nvidia_vf_types(vf, types, instance_files=True)
    gpu.refresh()
    return vfs


def mig_pool(key: str) -> str:
    """The sample pool of a MIG model: two vGPUs of its first MIG-backed type."""
    first = next(iter(mig_catalog()[key]["nvidia_mig_vf_types"].values()))[0]
    return f"[pool mig]\nparents = all\nprofile = {first}\ncount = 2\n"


def add_h100(host: FakeHost, address: str, root_port: str, numa: int, numvfs: int,
             mig_mode: bool) -> list[str]:
    """An H100 PCIe 80GB behind its own root port, on the NVIDIA vGPU host
    driver with `numvfs` vendor-specific VFs; in MIG mode its VFs offer the
    MIG-backed types of its free GPU instances (none yet), else the
    time-sliced ones."""
    model = models()["h100"]
    host.add_bridge(root_port, numa_node=numa, iommu_group=host.new_iommu_group())
    vfs = add_sriov_gpu(host, model, address, numa, root_port, numvfs)
    mig_types = {k: [v[0], v[1]] for k, v in model["nvidia_mig_vf_types"].items()}
    gpu = MigGpu.create(host.device_dir(address), model["mig_profiles"], mig_types, mig_mode)
    types = {} if mig_mode else {int(k): v for k, v in model["nvidia_vf_types"].items()}
    for vf in vfs:
        host.add_nvidia_vf_types(vf, types, instance_files=True)
    gpu.refresh()
    return vfs


def build_mig(root: str, numvfs: int = 8, mig_mode: bool = True, model: str = "h100"
              ) -> FakeHost:
    """Two H100 PCIe 80GB on an Ubuntu 24.04 host (kernel 6.8: NVIDIA's
    vendor-specific VFIO framework), `MIG_GPU` in MIG mode (unless
    `mig_mode` is False: a host booted after it was switched off) and
    `PLAIN_H100` not, each with `numvfs` VFs (from .4, as the agent's
    fixtures name them); NVIDIA's tool installed; the pool `mig` declared,
    not made. `model` (a key of `mig_catalog()`) puts another model at
    `MIG_GPU`, its pool two vGPUs of its first MIG-backed type."""
    host = FakeHost(root)
    host.add_iommu_unit("dmar0")
    for mod in ("vfio", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1", "nvidia", "kvm",
                "kvm_intel"):
        host.load_module(mod)
    host.write_file("etc/modprobe.d/blacklist-nouveau.conf",
                    "blacklist nouveau\noptions nouveau modeset=0\n")
    host.write_file("etc/os-release", 'ID=ubuntu\nVERSION_ID="24.04"\n'
                                      'PRETTY_NAME="Ubuntu 24.04 LTS"\n')
    if model == "h100":
        add_h100(host, MIG_GPU, "0000:40:03.1", 0, numvfs, mig_mode=mig_mode)
    else:
        add_mig_gpu(host, model, MIG_GPU, "0000:40:03.1", 0, numvfs, mig_mode=mig_mode)
    add_h100(host, PLAIN_H100, "0000:c0:01.1", 1, numvfs, mig_mode=False)
    install_nvidia_smi(host)
    host.write_file("etc/gpulib/gpulib.conf",
                    "# MIG-backed vGPUs: two 1g.10gb GPU instances, two VFs typed for them.\n"
                    + MIG_POOL if model == "h100" else mig_pool(model))
    return host


SAMPLE_HOSTS: dict[str, Callable[[str], FakeHost]] = {
    "demo": build_demo, "large": build_large, "large-nvidia": build_large_nvidia,
    "pool64": build_pool64, "mig": build_mig}


def _large_of(gpus: int) -> Callable[[str], FakeHost]:
    def build_sized(root: str) -> FakeHost:
        return build_large(root, gpus=gpus)

    return build_sized


SAMPLE_HOSTS.update({f"large-{n}": _large_of(n) for n in LARGE_SIZES if n != 8})


def build(name: str, root: str) -> FakeHost:
    try:
        builder = SAMPLE_HOSTS[name]
    except KeyError:
        raise ValueError(f"unknown sample host {name!r} (known: "
                         f"{', '.join(sorted(SAMPLE_HOSTS))})") from None
    return builder(root)
