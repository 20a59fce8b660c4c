"""Discovery with gpulib's own knowledge folded in, as the CLI and hooks need it.

Discovery proper is pure (sysfs + libvirt files -> Inventory). Here it gets
what only the state file knows: allocations (the first source of "who uses
what"), the registry of VF types (so an idle VF that gpulib will give a type
at VM start still reports that profile), and NVIDIA type names learned
earlier (so a fully used card, whose creatable list is empty, still names its
profiles). Newly seen names are written back under the lock, best effort.
"""

from __future__ import annotations

from gpulib import logger, nvidiasmi
from gpulib.config import Config
from gpulib.context import Context
from gpulib.discovery import Discovery, Inventory, Known
from gpulib.errors import GpulibError
from gpulib.lifecycle import open_store
from gpulib.liveness import running_domains
from gpulib.occupancy import Occupancy
from gpulib.records import pool_of
from gpulib.state import State, StateStore

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

log = logger.get(__name__)


def allocations_view(state: State) -> dict[str, list[tuple[str, str]]]:
    return {vm: [(d.kind, d.id) for d in a.devices] for vm, a in state.allocations.items()}


def known_from_state(state: State, occupancy: Optional[Occupancy] = None) -> Known:
    return Known(
        learned=state.type_names,
        allocations=allocations_view(state),
        vf_types={a: (r.type_id, r.name) for a, r in state.vf_types.items()},
        registry={u: (r.parent, r.type_id) for u, r in state.vgpus.items()},
        occupancy=occupancy)


def discover_host(ctx: Context, config: Optional[Config] = None,
                  state: Optional[State] = None, learn: bool = True,
                  occupancy: Optional[Occupancy] = None,
                  keep_domains: bool = False) -> Inventory:
    """The host's GPUs; `occupancy` (who holds what) is built from `state` and the
    running domains when not given, so every caller asks the same model.

    `keep_domains`: leave what was parsed of the running domains' status files
    in their cross-process cache (`gpulib.domstatus`), for the reports run again
    and again (the agent's discovery, the metrics timer): on a host where no
    hook has run since boot, each would otherwise parse every status file
    again, importing lxml to do it."""
    if state is None:
        try:
            state = open_store(ctx, config).load()
        except GpulibError as exc:
            # A state file we cannot use must not hide the host's GPUs.
            log.error("discovery without gpulib state: %s", exc)
            state = State()
    if occupancy is None:
        occupancy = Occupancy.build(
            ctx.sysfs, state, running_domains(ctx.sysfs, save_cache=keep_domains),
            arrival_grace=config.get_float("release", "arrival_timeout") if config else None)
    disc = Discovery(ctx.sysfs, config, known_from_state(state, occupancy))
    inventory = disc.run()
    if learn and disc.new_names:
        # The same store as everywhere: a corrupt file found here is rebuilt
        # from the host, never replaced by an empty registry.
        _remember_names(open_store(ctx, config, timeout=2.0), disc.new_names)
    return inventory


def attach_type_numbers(inventory: Inventory, root: str,
                        timeout: float = nvidiasmi.DEFAULT_TIMEOUT) -> None:
    """Give each GPU with vendor-specific VFs the numbers of its types
    (`Gpu.nvidia_numbers`, from NVIDIA's tool, cached: `nvidiasmi.numbers`);
    the others are not asked about."""
    gpus = inventory.vendor_vf_gpus()
    if not gpus:
        return
    found = nvidiasmi.numbers(root, gpus, timeout)
    asked = set(gpus)
    for g in inventory.gpus:
        if g.address in asked:
            g.nvidia_numbers = found.get(g.address, {})


def pool_inventory(ctx: Context, state: State, occupancy: Occupancy) -> Inventory:
    """Only the GPUs that carry pool members, read from the registry and a few
    sysfs attributes of each GPU: what an allocation from pools needs (the
    parent's GPU, its NUMA node, its pool members for the load) at a fraction
    of a full discovery's cost. A request the pools cannot serve needs
    `discover_host`."""
    from gpulib.discovery import Gpu, Vgpu, VirtualFunction
    from gpulib.errors import InputError
    from gpulib.mdev import MdevType
    from gpulib.pci import PciAddress, PciFunction

    sysfs = ctx.sysfs
    gpus: dict[PciAddress, Gpu] = {}

    def gpu_of(parent: PciAddress) -> Optional[Gpu]:
        physfn = sysfs.link_name(f"sys/bus/pci/devices/{parent}/physfn")
        try:
            pf = PciAddress.parse(physfn) if physfn else parent
        except InputError:
            return None
        gpu = gpus.get(pf)
        if gpu is None:
            try:
                gpu = gpus[pf] = Gpu(PciFunction.read(sysfs, pf))
            except OSError:
                return None
        if parent != pf and all(vf.address != parent for vf in gpu.vfs):
            gpu.vfs.append(VirtualFunction(len(gpu.vfs), PciFunction(parent)))
        return gpu

    for uuid, rec in sorted(state.vgpus.items()):
        if pool_of(rec) is None:
            continue
        try:
            parent = PciAddress.parse(rec.parent)
        except InputError:
            continue
        gpu = gpu_of(parent)
        if gpu is not None:
            gpu.vgpus.append(Vgpu(uuid, parent, MdevType(sysfs, parent, rec.type_id), None))
    for addr, vrec in sorted(state.vf_types.items()):
        if pool_of(vrec) is not None:
            try:
                gpu_of(PciAddress.parse(addr))
            except InputError:
                continue
    return Inventory(sorted(gpus.values(), key=lambda g: g.address), occupancy)


def _remember_names(store: StateStore, names: dict[str, dict[str, str]]) -> None:
    try:
        with store.transaction() as st:
            for key, by_id in names.items():
                st.type_names.setdefault(key, {}).update(by_id)
    except (GpulibError, OSError) as exc:
        log.info("could not record learned vGPU type names: %s", exc)
