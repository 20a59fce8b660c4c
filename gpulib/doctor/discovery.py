"""`discovery`: the CloudStack discovery JSON is valid for the agent."""

from __future__ import annotations

import json
import re

from gpulib import cloudstack
from gpulib.context import CONFIG_FILE
from gpulib.doctor.core import FAIL, OK, WARN, Result, host_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

    from gpulib.doctor.facts import Facts


_LIBVIRT_KEYS = {"domain", "bus", "slot", "function"}
_NUMBER_KEYS = ("max_instances", "video_ram", "max_heads", "max_resolution_x",
                "max_resolution_y")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _address_problem(a: Any, where: str) -> Optional[str]:
    if not isinstance(a, dict) or set(a) != _LIBVIRT_KEYS:
        return f"{where}: libvirt_address must have domain, bus, slot, function"
    for k in sorted(_LIBVIRT_KEYS):
        if not (isinstance(a[k], str) and a[k].startswith("0x")):
            return f"{where}: libvirt_address {k} must be a 0x.. string, not {a[k]!r}"
    return None


def agent_document_problems(doc: Any) -> list[tuple[str, str]]:
    """What the CloudStack agent would choke on: [(subject, problem)]."""
    if not isinstance(doc, dict) or set(doc) != {"gpus"} or not isinstance(doc["gpus"], list):
        return [("discovery", 'the document must be {"gpus": [...]}')]
    out: list[tuple[str, str]] = []
    for g in doc["gpus"]:
        if not isinstance(g, dict):
            out.append(("discovery", "a GPU entry is not an object"))
            continue
        subject = str(g.get("pci_address", "?"))
        problems: list[Optional[str]] = []
        for key in ("pci_address", "vendor_id", "device_id", "vendor", "device", "driver",
                    "pci_class", "iommu_group", "pci_root"):
            if not isinstance(g.get(key), str):
                problems.append(f"{key} must be a string, not {g.get(key)!r}")
        for key in ("vendor_id", "device_id"):
            v = g.get(key)
            if isinstance(v, str) and not re.fullmatch(r"[0-9a-f]{4}", v):
                problems.append(f"{key} must be 4 lowercase hex digits, not {v!r}")
        for key in ("numa_node", "sriov_totalvfs", "sriov_numvfs"):
            if not _is_int(g.get(key)):
                problems.append(f"{key} must be a number, not {g.get(key)!r}")
        for key in _NUMBER_KEYS:
            if g.get(key) is not None and not _is_int(g.get(key)):
                problems.append(f"{key} must be a number or null, not {g.get(key)!r}")
        fp = g.get("full_passthrough")
        vgpus = g.get("vgpu_instances")
        vfs = g.get("vf_instances")
        if not isinstance(vgpus, list) or not isinstance(vfs, list):
            problems.append("vgpu_instances and vf_instances must be lists")
            vgpus, vfs = [], []
        if not isinstance(fp, dict):
            problems.append("full_passthrough must be an object")
        else:
            enabled = fp.get("enabled")
            if type(enabled) is not int or enabled not in (0, 1):
                problems.append(f"full_passthrough.enabled must be the number 0 or 1 "
                                f"(the agent reads it with getAsInt), not {enabled!r}")
            elif enabled == 1 and (vgpus or vfs or g.get("sriov_numvfs")):
                # Only one way round: a GPU whose VFs are enabled but offer
                # nothing yet (untyped vendor VFs, mdev-parent VFs without
                # vGPUs) or whose pool is not created yet is split, not whole.
                problems.append("full_passthrough.enabled must be 0 when the GPU has vGPU "
                                "or VF instances or enabled SR-IOV VFs")
            problems.append(_address_problem(fp.get("libvirt_address"), "full_passthrough"))
            if fp.get("used_by_vm") is not None and not isinstance(fp.get("used_by_vm"), str):
                problems.append("full_passthrough.used_by_vm must be a string or null")
        for v in vgpus:
            where = f"vGPU {v.get('mdev_uuid')}" if isinstance(v, dict) else "vGPU"
            if not isinstance(v, dict):
                problems.append(f"{where}: not an object")
                continue
            if not isinstance(v.get("mdev_uuid"), str) or not isinstance(v.get("profile_name"),
                                                                         str):
                problems.append(f"{where}: mdev_uuid and profile_name must be strings")
            for key in _NUMBER_KEYS:
                if v.get(key) is not None and not _is_int(v.get(key)):
                    problems.append(f"{where}: {key} must be a number or null")
            problems.append(_address_problem(v.get("libvirt_address"), where))
        for vf in vfs:
            where = f"VF {vf.get('vf_pci_address')}" if isinstance(vf, dict) else "VF"
            if not isinstance(vf, dict):
                problems.append(f"{where}: not an object")
                continue
            if not isinstance(vf.get("vf_pci_address"), str):
                problems.append(f"{where}: vf_pci_address must be a string")
            if not isinstance(vf.get("vf_profile"), str) or not vf.get("vf_profile"):
                problems.append(f"{where}: vf_profile must be a non-empty string, not "
                                f"{vf.get('vf_profile')!r}")
            problems.append(_address_problem(vf.get("libvirt_address"), where))
        out.extend((subject, p) for p in problems if p)
    return out


def check(d: Facts) -> list[Result]:
    cid = "discovery"
    inventory = d.inventory
    # The document as the agent reads it: through JSON (the same data model as
    # `cloudstack.dumps`' indented text, with json's C encoder: every `gpulib
    # metrics` runs this check).
    doc = json.loads(json.dumps(cloudstack.render(inventory)))
    problems = [Result(cid, FAIL, subject,
                       f"the CloudStack discovery JSON breaks the agent's rules: {problem}",
                       "report this as a gpulib bug, with the tarball of `gpulib snapshot` "
                       "attached")
                for subject, problem in agent_document_problems(doc)]
    for gpu in inventory.gpus:
        if gpu.errors:
            problems.append(Result(
                cid, WARN, str(gpu.address),
                f"{d.label(gpu)} could only be read in part: {'; '.join(gpu.errors)}",
                "run gpulib as root; check `dmesg` for errors from the GPU's driver"))
    if problems:
        return problems
    if not inventory.gpus:
        return [Result(cid, WARN, "GPUs",
                       "no GPU found: the CloudStack agent will report none",
                       "if a GPU is missing, name it in [discovery] include = <address> "
                       f"in {host_path(CONFIG_FILE)}")]
    vgpus = sum(len(g["vgpu_instances"]) for g in doc["gpus"])
    vfs = sum(len(g["vf_instances"]) for g in doc["gpus"])
    return [Result(cid, OK, "gpulib discover --format cloudstack",
                   f"valid for the CloudStack agent: {len(doc['gpus'])} GPU(s), "
                   f"{vgpus} vGPU instance(s), {vfs} VF instance(s)")]
