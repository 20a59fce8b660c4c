"""`driver-binding`: passthrough GPUs on vfio-pci (or no driver), vGPU GPUs on their
vendor driver; `vfio-pci.ids=`/`pci-stub.ids=` on the command line are shown."""

from __future__ import annotations

from gpulib.doctor import passthrough as pt
from gpulib.doctor.actions import Manual, Reboot
from gpulib.doctor.core import FAIL, HOST_DISPLAY_DRIVERS, OK, WARN, Result, is_free_for_vfio

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.doctor.actions import Action
    from gpulib.doctor.facts import Facts


def check(d: Facts) -> list[Result]:
    cid = "driver-binding"
    tokens, stub = d.stub_ids()
    on_cmdline = (f"the kernel command line has {' '.join(tokens)}" if tokens else
                  "no vfio-pci.ids= or pci-stub.ids= on the kernel command line")
    problems: list[Result] = []
    passthrough = vgpu = console = 0
    for gpu in d.inventory.gpus:
        drv = gpu.fn.driver
        ids = (gpu.fn.vendor_id, gpu.fn.device_id)
        if gpu.console and not d.is_vgpu_gpu(gpu):
            # never offered whole: the host's driver is where it belongs
            console += 1
            continue
        if d.is_vgpu_gpu(gpu):
            vgpu += 1
            if drv is None:
                problems.append(Result(
                    cid, WARN, str(gpu.address),
                    f"{d.label(gpu)} offers vGPU ({gpu.mode}) but has no driver",
                    "load the vendor's vGPU host driver (NVIDIA vGPU manager, AMD gim)"))
            elif ids in stub and not is_free_for_vfio(drv) and \
                    pt.override_of(d, gpu.address) is None:
                # (a driverctl override keeps it on its driver whatever the ids say)
                problems.append(Result(
                    cid, WARN, str(gpu.address),
                    f"vGPU GPU {d.label(gpu)} on {drv} matches "
                    f"{ids[0]:04x}:{ids[1]:04x} in {' '.join(tokens)}: at the next boot "
                    "vfio-pci or pci-stub may claim it and its vGPUs disappear",
                    d.distro.kernel_args_fix(remove=' '.join(tokens)) +
                    "\n(keep the passthrough GPUs away from the host per device instead: "
                    "driverctl --noprobe set-override <address> vfio-pci)"))
            continue
        passthrough += 1
        if is_free_for_vfio(drv):
            continue
        applied = d.vfio_pending({ids})
        if applied:
            problems.append(d.result(
                cid, WARN, str(gpu.address),
                f"{d.label(gpu)} is offered for passthrough and still on {drv}; gpulib setup "
                f"configured vfio-pci for it at {applied}: a reboot is pending",
                [Reboot()], pending="reboot"))
            continue
        if pt.overridden(d, gpu.address):
            # driverctl --noprobe recorded it: vfio-pci gets it when it is probed again
            applied = d.setup_pending(cid)
            when = (f" by gpulib setup at {applied}: a reboot is pending" if applied else
                    ": it moves when the device is probed again (at the next boot)")
            problems.append(d.result(
                cid, WARN, str(gpu.address),
                f"{d.label(gpu)} is offered for passthrough and still on {drv}; driverctl "
                f"overrides it to vfio-pci{when}", [Reboot()],
                pending="reboot" if applied else None))
            continue
        if drv in HOST_DISPLAY_DRIVERS:
            # the fix is what `gpulib setup --passthrough ADDR` would apply, rendered
            found = pt.plan(d, [gpu], {gpu.address})
            if ids in stub:
                msg = (f"{d.label(gpu)} is offered for passthrough but bound to the host "
                       f"driver {drv}, although {on_cmdline}: {drv} claimed it first")
            else:
                msg = (f"{d.label(gpu)} is offered for passthrough but bound to the host "
                       f"driver {drv}; {on_cmdline}")
            actions: list[Action] = list(found.actions)
            for _, why in found.refusals:
                msg += f"; gpulib setup would not take it: {why}"
            unfinished = d.setup_outstanding(cid)
            if unfinished:
                msg += (f"; gpulib setup's `{unfinished}` did not complete: run gpulib setup "
                        "--apply again before rebooting")
            if actions:
                actions.append(Manual(f"(gpulib setup --apply --passthrough {gpu.address} "
                                      "does this; nothing is rebound before the reboot)"))
            actions.append(Manual("(or, if the host needs this GPU, exclude it: [discovery] "
                                  f"exclude = {gpu.address} in /etc/gpulib/gpulib.conf)"))
            problems.append(d.result(cid, FAIL, str(gpu.address), msg, actions))
        else:
            problems.append(Result(
                cid, WARN, str(gpu.address),
                f"{d.label(gpu)} is offered for passthrough but bound to {drv}, not "
                "vfio-pci: starting a VM with it takes it from that driver",
                d.rebind_fix(gpu.address)))
    if problems:
        return problems
    msg = (f"{passthrough} passthrough GPU(s) on vfio-pci or free, {vgpu} vGPU GPU(s) on "
           f"their vendor driver" + (f", {console} boot VGA GPU kept for the host's console"
                                     if console else "") + f"; {on_cmdline}")
    return [Result(cid, OK, "GPUs", msg)]
