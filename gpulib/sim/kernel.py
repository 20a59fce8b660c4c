"""A simulated kernel: after a write to a sysfs attribute, do what Linux would.

Chosen at the entry point when GPULIB_SIMULATE=1 and GPULIB_ROOT is not `/`;
`gpulib.sysfs.Sysfs` hands it every write. It works on any tree laid out like
sysfs (a snapshot of a real host, a tree another tool built), not only trees
the fake host builder made: it reads what it needs from the tree itself.

Handled attributes and their effects:
* `.../mdev_supported_types/<type>/create` (a UUID): a new mdev below the
  parent with `mdev_type`, `remove`, `iommu_group`, `driver` links,
  `sys/bus/mdev/devices/<uuid>` and the type's `devices/<uuid>`;
  `available_instances` goes down. NVIDIA time-sliced vGPU: one physical GPU
  (the PF and its VFs) runs one type at a time, so the other types read 0
  until its last vGPU is removed.
* `sys/bus/mdev/devices/<uuid>/remove` (`1`): the reverse.
* an mdev's attribute files (the type's `.sim-mdev-attrs` names them and the
  values the driver accepts): EINVAL for any other value, ENOENT for a file
  the device does not have.
* `<VF>/nvidia/current_vgpu_type`: set (from the VF's creatable list) or clear
  (`0`); the creatable lists of the VF and its siblings shrink and grow. On
  a GPU in MIG mode (`gpulib.sim.migdriver`) a MIG-backed type takes a free
  GPU instance of its profile and 0 gives it back.
* `<PF>/sriov_numvfs`: VFs appear or vanish (EBUSY when changed without
  going through 0, as the kernel does).
Errors are raised as OSError with the errno the kernel returns: EEXIST for a
UUID already live anywhere, ENOSPC when no instance is left, EINVAL for a bad
UUID or type, ENODEV when the device went away.

State the kernel would keep in its own memory (the availability a type had
before the one-type rule zeroed it, a VF's full creatable list) is kept in
hidden `.sim-*` files next to the attribute it belongs to.
"""

from __future__ import annotations

import errno
import os
from typing import Optional

from gpulib import logger
from gpulib.lazyre import lazy
from gpulib.nvidia import parse_creatable
from gpulib.pci import group_number
from gpulib.sim.attrs import make_attr_files, mdev_attr_spec, relative_symlink
from gpulib.sim.attrs import read_attribute as _read
from gpulib.sim.attrs import rewrite_attribute as _write
from gpulib.sim.migdriver import MigGpu
from gpulib.validate import decimal

log = logger.get(__name__)

_UUID = lazy(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                   r"[0-9a-fA-F]{12}$")
_BDF = lazy(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_PROFILE_GB = lazy(r"-(\d+)([A-Z]{1,3})$")
SAVED_AVAILABLE = ".sim-available"
SAVED_CREATABLE = ".sim-creatable"
NVIDIA_VENDOR = "0x10de"


def _err(code: int, what: str) -> OSError:
    return OSError(code, os.strerror(code), what)


class SimulatedKernel:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        if self.root == "/":
            raise ValueError("the simulated kernel never runs on the real root")

    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    # -- dispatch ------------------------------------------------------------------
    def write(self, path: str, data: str) -> None:
        real_dir = os.path.realpath(os.path.dirname(path))
        name = os.path.basename(path)
        real = os.path.join(real_dir, name)
        if not (real == self.root or real.startswith(self.root + os.sep)):
            raise _err(errno.EACCES, path)
        value = data.strip()
        if name == "create" and os.path.basename(os.path.dirname(real_dir)) == \
                "mdev_supported_types":
            self._mdev_create(real_dir, value)
        elif name == "remove" and os.path.exists(os.path.join(real_dir, "mdev_type")):
            self._mdev_remove(real_dir, value)
        elif name == "current_vgpu_type" and os.path.basename(real_dir) == "nvidia":
            self._set_vgpu_type(os.path.dirname(real_dir), value)
        elif name == "sriov_numvfs":
            self._set_numvfs(real_dir, value)
        else:
            if not os.path.exists(real):
                raise _err(errno.ENOENT, path)
            self._check_mdev_attr(real, value)
            _write(real, data)

    def settle(self) -> list[str]:
        """Carry out writes another program made straight to the tree's files.

        A tool that does not go through gpulib (mdevctl in a mount namespace
        over this tree, say) writes a UUID into a type's `create` file or `1`
        into a device's `remove` file; this does what the kernel would have
        done then, and empties the file again. Returns the errors the kernel
        would have returned, one line each.
        """
        errors: list[str] = []
        bus = self.p("sys/class/mdev_bus")
        for parent in sorted(os.listdir(bus)) if os.path.isdir(bus) else []:
            types = os.path.join(os.path.realpath(os.path.join(bus, parent)),
                                 "mdev_supported_types")
            for t in sorted(os.listdir(types)) if os.path.isdir(types) else []:
                create = os.path.join(types, t, "create")
                value = _read(create)
                if value:
                    _write(create, "")
                    try:
                        self._mdev_create(os.path.join(types, t), value)
                    except OSError as exc:
                        errors.append(f"create {value} on {parent} {t}: {exc.strerror}")
        devices = self.p("sys/bus/mdev/devices")
        for uuid in sorted(os.listdir(devices)) if os.path.isdir(devices) else []:
            dev = os.path.realpath(os.path.join(devices, uuid))
            value = _read(os.path.join(dev, "remove"))
            if value:
                _write(os.path.join(dev, "remove"), "")
                try:
                    self._mdev_remove(dev, value)
                except OSError as exc:
                    errors.append(f"remove {uuid}: {exc.strerror}")
        return errors

    def _check_mdev_attr(self, real: str, value: str) -> None:
        """An mdev attribute file takes only what its driver accepts (EINVAL)."""
        import re

        dev = os.path.dirname(real)
        for _ in range(3):
            if os.path.islink(os.path.join(dev, "mdev_type")):
                break
            dev = os.path.dirname(dev)
        else:
            return
        spec = mdev_attr_spec(os.path.realpath(os.path.join(dev, "mdev_type")))
        pattern = spec.get(os.path.relpath(real, dev))
        if pattern is not None and not re.fullmatch(pattern, value):
            raise _err(errno.EINVAL, real)

    # -- mdev ------------------------------------------------------------------------
    def _gpu_of(self, parent_dir: str) -> str:
        """The physical GPU a parent belongs to: its PF, or itself."""
        physfn = os.path.join(parent_dir, "physfn")
        return os.path.realpath(physfn) if os.path.lexists(physfn) else parent_dir

    def _parents_of_gpu(self, gpu_dir: str) -> list[str]:
        out = [gpu_dir]
        for name in sorted(os.listdir(gpu_dir)):
            if name.startswith("virtfn"):
                out.append(os.path.realpath(os.path.join(gpu_dir, name)))
        return [d for d in out if os.path.isdir(os.path.join(d, "mdev_supported_types"))]

    def _live_on(self, parent_dir: str) -> list[str]:
        out = []
        for name in os.listdir(parent_dir):
            d = os.path.join(parent_dir, name)
            if _UUID.match(name) and os.path.islink(os.path.join(d, "mdev_type")):
                out.append(d)
        return out

    def _mdev_create(self, type_dir: str, value: str) -> None:
        if not _UUID.match(value):
            raise _err(errno.EINVAL, f"{type_dir}/create")
        uuid = value.lower()
        if os.path.lexists(self.p(f"sys/bus/mdev/devices/{uuid}")):
            raise _err(errno.EEXIST, uuid)
        parent_dir = os.path.dirname(os.path.dirname(type_dir))
        avail_path = os.path.join(type_dir, "available_instances")
        available = int(_read(avail_path, "0") or 0)
        if available <= 0:
            raise _err(errno.ENOSPC, f"{type_dir}/create")
        gpu_dir = self._gpu_of(parent_dir)
        nvidia = _read(os.path.join(parent_dir, "vendor")) == NVIDIA_VENDOR
        first_on_gpu = nvidia and not any(self._live_on(p) for p in
                                          self._parents_of_gpu(gpu_dir))

        dev = os.path.join(parent_dir, uuid)
        os.makedirs(dev)
        relative_symlink(type_dir, os.path.join(dev, "mdev_type"))
        with open(os.path.join(dev, "remove"), "w"):
            pass
        os.chmod(os.path.join(dev, "remove"), 0o200)
        with open(os.path.join(dev, "uevent"), "w") as fh:
            fh.write(f"MDEV_TYPE={os.path.basename(type_dir)}\n")
        drv = self.p("sys/bus/mdev/drivers/vfio_mdev")
        os.makedirs(drv, exist_ok=True)
        relative_symlink(drv, os.path.join(dev, "driver"))
        relative_symlink(self.p("sys/bus/mdev"), os.path.join(dev, "subsystem"))
        group = self._new_group()
        gdir = self.p(f"sys/kernel/iommu_groups/{group}/devices")
        os.makedirs(gdir, exist_ok=True)
        relative_symlink(os.path.dirname(gdir), os.path.join(dev, "iommu_group"))
        relative_symlink(dev, os.path.join(gdir, uuid))
        os.makedirs(self.p("sys/bus/mdev/devices"), exist_ok=True)
        relative_symlink(dev, self.p(f"sys/bus/mdev/devices/{uuid}"))
        os.makedirs(os.path.join(type_dir, "devices"), exist_ok=True)
        relative_symlink(dev, os.path.join(type_dir, "devices", uuid))
        make_attr_files(dev, type_dir)
        _write(avail_path, f"{available - 1}\n")
        if first_on_gpu:
            self._one_type_only(gpu_dir, type_dir)
        log.debug("sim: created mdev %s on %s", uuid, parent_dir)

    def _one_type_only(self, gpu_dir: str, keep_type_dir: str) -> None:
        keep = os.path.basename(keep_type_dir)
        for parent in self._parents_of_gpu(gpu_dir):
            types = os.path.join(parent, "mdev_supported_types")
            for t in os.listdir(types):
                if t == keep:
                    continue
                avail = os.path.join(types, t, "available_instances")
                saved = os.path.join(types, t, SAVED_AVAILABLE)
                if not os.path.exists(saved):
                    _write(saved, _read(avail, "0") + "\n")
                _write(avail, "0\n")

    def _restore_types(self, gpu_dir: str) -> None:
        for parent in self._parents_of_gpu(gpu_dir):
            types = os.path.join(parent, "mdev_supported_types")
            for t in os.listdir(types):
                saved = os.path.join(types, t, SAVED_AVAILABLE)
                if os.path.exists(saved):
                    _write(os.path.join(types, t, "available_instances"), _read(saved) + "\n")
                    os.unlink(saved)

    def _mdev_remove(self, dev: str, value: str) -> None:
        if value != "1":
            raise _err(errno.EINVAL, f"{dev}/remove")
        uuid = os.path.basename(dev)
        type_dir = os.path.realpath(os.path.join(dev, "mdev_type"))
        parent_dir = os.path.dirname(dev)
        for link in (self.p(f"sys/bus/mdev/devices/{uuid}"),
                     os.path.join(type_dir, "devices", uuid)):
            if os.path.lexists(link):
                os.unlink(link)
        group = os.path.realpath(os.path.join(dev, "iommu_group"))
        if os.path.isdir(group):
            for name in os.listdir(os.path.join(group, "devices")):
                os.unlink(os.path.join(group, "devices", name))
            os.rmdir(os.path.join(group, "devices"))
            os.rmdir(group)
        for name in os.listdir(dev):
            entry = os.path.join(dev, name)
            if os.path.isdir(entry) and not os.path.islink(entry):
                import shutil

                shutil.rmtree(entry)  # an attribute sub-directory (nvidia/)
            else:
                os.unlink(entry)
        os.rmdir(dev)
        avail_path = os.path.join(type_dir, "available_instances")
        _write(avail_path, f"{int(_read(avail_path, '0') or 0) + 1}\n")
        gpu_dir = self._gpu_of(parent_dir)
        if _read(os.path.join(parent_dir, "vendor")) == NVIDIA_VENDOR and \
                not any(self._live_on(p) for p in self._parents_of_gpu(gpu_dir)):
            self._restore_types(gpu_dir)
        log.debug("sim: removed mdev %s", uuid)

    def _new_group(self) -> int:
        base = self.p("sys/kernel/iommu_groups")
        os.makedirs(base, exist_ok=True)
        used = [n for n in map(group_number, os.listdir(base)) if n is not None]
        return max(used, default=-1) + 1

    # -- NVIDIA vendor-specific vGPU ---------------------------------------------
    def _siblings(self, vf_dir: str) -> tuple[Optional[str], list[str]]:
        physfn = os.path.join(vf_dir, "physfn")
        if not os.path.lexists(physfn):
            return None, [vf_dir]
        pf = os.path.realpath(physfn)
        vfs = []
        for name in sorted(os.listdir(pf), key=lambda n: (len(n), n)):
            if name.startswith("virtfn"):
                d = os.path.realpath(os.path.join(pf, name))
                if os.path.isdir(os.path.join(d, "nvidia")):
                    vfs.append(d)
        return pf, vfs or [vf_dir]

    @staticmethod
    def _catalog(vf_dir: str) -> dict[int, str]:
        """The VF's full creatable list as it was before any vGPU existed."""
        nv = os.path.join(vf_dir, "nvidia")
        saved = os.path.join(nv, SAVED_CREATABLE)
        text = _read(saved) if os.path.exists(saved) else _read(
            os.path.join(nv, "creatable_vgpu_types"))
        return parse_creatable(text)

    def _set_vgpu_type(self, vf_dir: str, value: str) -> None:
        nv = os.path.join(vf_dir, "nvidia")
        wanted = decimal(value, 10)
        if wanted is None:
            raise _err(errno.EINVAL, f"{nv}/current_vgpu_type")
        current = int(_read(os.path.join(nv, "current_vgpu_type"), "0") or 0)
        pf, vfs = self._siblings(vf_dir)
        gpu = MigGpu.load(pf) if pf is not None else None
        if gpu is not None and gpu.enabled:
            self._set_mig_type(gpu, vf_dir, current, wanted)
            return
        catalogs = {d: self._catalog(d) for d in vfs}
        # Remember every sibling's full list before the first change.
        for d in vfs:
            saved = os.path.join(d, "nvidia", SAVED_CREATABLE)
            if not os.path.exists(saved):
                _write(saved, _read(os.path.join(d, "nvidia", "creatable_vgpu_types")) + "\n")
        if wanted == 0:
            if current == 0:
                return
            _write(os.path.join(nv, "current_vgpu_type"), "0\n")
        else:
            if current != 0:
                raise _err(errno.EBUSY, f"{nv}/current_vgpu_type")
            creatable = parse_creatable(_read(os.path.join(nv, "creatable_vgpu_types")))
            if wanted not in creatable:
                raise _err(errno.EINVAL, f"{nv}/current_vgpu_type")
            _write(os.path.join(nv, "current_vgpu_type"), f"{wanted}\n")
        self._recompute_creatable(vfs, catalogs)

    @staticmethod
    def _set_mig_type(gpu: MigGpu, vf_dir: str, current: int, wanted: int) -> None:
        nv = os.path.join(vf_dir, "nvidia")
        vf = os.path.basename(vf_dir)
        if wanted == 0:
            if current == 0:
                return
            gpu.unbind(vf)
            _write(os.path.join(nv, "current_vgpu_type"), "0\n")
        else:
            if current != 0:
                raise _err(errno.EBUSY, f"{nv}/current_vgpu_type")
            if wanted not in parse_creatable(_read(os.path.join(nv, "creatable_vgpu_types"))):
                raise _err(errno.EINVAL, f"{nv}/current_vgpu_type")
            gpu.bind(vf, wanted)
            _write(os.path.join(nv, "current_vgpu_type"), f"{wanted}\n")
        gpu.save()
        gpu.refresh()

    def _recompute_creatable(self, vfs: list[str], catalogs: dict[str, dict[int, str]]) -> None:
        active = {}
        for d in vfs:
            t = int(_read(os.path.join(d, "nvidia", "current_vgpu_type"), "0") or 0)
            if t:
                active[d] = t
        full = catalogs[vfs[0]] if vfs else {}
        for d in vfs:
            catalog = catalogs[d]
            if d in active:
                offered: dict[int, str] = {}
            elif not active:
                offered = catalog
            else:
                # Time-sliced vGPUs on one GPU share a type and its capacity.
                in_use = next(iter(active.values()))
                cap = self._capacity(full, in_use)
                used = sum(1 for t in active.values() if t == in_use)
                offered = {in_use: catalog[in_use]} if in_use in catalog and used < cap else {}
            lines = ["ID    : vGPU Name"] + [f"{k:<5d} : {v}" for k, v in offered.items()]
            _write(os.path.join(d, "nvidia", "creatable_vgpu_types"), "\n".join(lines) + "\n")

    @staticmethod
    def _capacity(catalog: dict[int, str], type_id: int) -> int:
        """How many vGPUs of a type fit: the largest profile is the whole card."""
        sizes = {}
        for k, name in catalog.items():
            m = _PROFILE_GB.search(name)
            if m:
                sizes[k] = int(m.group(1))
        if type_id not in sizes or not sizes:
            return 1
        return max(1, max(sizes.values()) // sizes[type_id])

    # -- SR-IOV ------------------------------------------------------------------------
    def _set_numvfs(self, pf_dir: str, value: str) -> None:
        wanted = decimal(value, 10)
        if wanted is None:
            raise _err(errno.EINVAL, f"{pf_dir}/sriov_numvfs")
        current = int(_read(os.path.join(pf_dir, "sriov_numvfs"), "0") or 0)
        total = int(_read(os.path.join(pf_dir, "sriov_totalvfs"), "0") or 0)
        if wanted > total:
            raise _err(errno.ERANGE, f"{pf_dir}/sriov_numvfs")
        if wanted == current:
            return
        if current and wanted:
            raise _err(errno.EBUSY, f"{pf_dir}/sriov_numvfs")
        if wanted == 0:
            self._remove_vfs(pf_dir)
        else:
            self._add_vfs(pf_dir, wanted)
        _write(os.path.join(pf_dir, "sriov_numvfs"), f"{wanted}\n")

    def _remove_vfs(self, pf_dir: str) -> None:
        import shutil

        for name in list(os.listdir(pf_dir)):
            if not name.startswith("virtfn"):
                continue
            link = os.path.join(pf_dir, name)
            vf = os.path.realpath(link)
            bdf = os.path.basename(vf)
            for extra in (self.p(f"sys/bus/pci/devices/{bdf}"),):
                if os.path.lexists(extra):
                    os.unlink(extra)
            for sub in ("driver", "iommu_group"):
                target = os.path.join(vf, sub)
                if os.path.lexists(target):
                    back = os.path.join(os.path.realpath(target),
                                        "devices" if sub == "iommu_group" else "", bdf)
                    if os.path.lexists(back):
                        os.unlink(back)
            if os.path.lexists(self.p(f"sys/class/mdev_bus/{bdf}")):
                os.unlink(self.p(f"sys/class/mdev_bus/{bdf}"))
            shutil.rmtree(vf, ignore_errors=True)
            os.unlink(link)

    def _add_vfs(self, pf_dir: str, count: int) -> None:
        pf = os.path.basename(pf_dir)
        if not _BDF.match(pf):
            raise _err(errno.ENODEV, pf_dir)
        dom, bus, rest = pf.split(":")
        slot, fn = rest.split(".")
        offset = int(_read(os.path.join(pf_dir, "sriov_offset"), "1") or 1)
        stride = int(_read(os.path.join(pf_dir, "sriov_stride"), "1") or 1)
        vf_dev = _read(os.path.join(pf_dir, "sriov_vf_device")) or \
            _read(os.path.join(pf_dir, "device"))[2:]
        driver_link = os.path.join(pf_dir, "driver")
        driver = os.path.basename(os.readlink(driver_link)) if os.path.lexists(driver_link) \
            else None
        rid0 = int(bus, 16) << 8 | int(slot, 16) << 3 | int(fn)
        parent = os.path.dirname(pf_dir)
        copy = ("vendor", "class", "numa_node", "subsystem_vendor", "revision")
        for i in range(count):
            rid = rid0 + offset + i * stride
            bdf = f"{dom}:{rid >> 8:02x}:{(rid >> 3) & 0x1f:02x}.{rid & 7}"
            vf = os.path.join(parent, bdf)
            os.makedirs(vf, exist_ok=True)
            for name in copy:
                src = os.path.join(pf_dir, name)
                if os.path.exists(src):
                    _write(os.path.join(vf, name), _read(src) + "\n")
            _write(os.path.join(vf, "device"), f"0x{int(vf_dev, 16):04x}\n")
            _write(os.path.join(vf, "subsystem_device"), "0x0000\n")
            relative_symlink(pf_dir, os.path.join(vf, "physfn"))
            relative_symlink(vf, os.path.join(pf_dir, f"virtfn{i}"))
            relative_symlink(vf, self.p(f"sys/bus/pci/devices/{bdf}"))
            if driver:
                drv = self.p(f"sys/bus/pci/drivers/{driver}")
                os.makedirs(drv, exist_ok=True)
                relative_symlink(drv, os.path.join(vf, "driver"))
                relative_symlink(vf, os.path.join(drv, bdf))
            group = self._new_group()
            gdir = self.p(f"sys/kernel/iommu_groups/{group}/devices")
            os.makedirs(gdir, exist_ok=True)
            relative_symlink(os.path.dirname(gdir), os.path.join(vf, "iommu_group"))
            relative_symlink(vf, os.path.join(gdir, bdf))
