"""The reports run on a schedule (`gpulib discover`, `gpulib metrics`) keep
the running domains' cache (`run/gpulib/domains.json`), so a host on which
no hook has run since boot parses each status file once, not every run, and
the runs after the first import no XML parser; a changed status file is
still read again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpulib.sim.hosts import build_demo

CACHE = "run/gpulib/domains.json"
# Runs the CLI and says afterwards whether lxml was loaded.
PROBE = ("import sys\nfrom gpulib.cli import main\ncode = main(sys.argv[1:])\n"
         "sys.stderr.write('lxml loaded\\n' if 'lxml' in sys.modules else 'no lxml\\n')\n"
         "sys.exit(code)\n")


def _run(root: str, *args: str) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULIB_")}
    env.update(GPULIB_ROOT=root, GPULIB_SIMULATE="1")
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True,
                          text=True, check=True)
    return proc.stdout, proc.stderr.splitlines()[-1]


def _used_by(doc: dict[str, object], address: str) -> object:
    gpus = doc["gpus"]
    assert isinstance(gpus, list)
    return next(g["full_passthrough"]["used_by_vm"] for g in gpus
                if g["pci_address"] == address)


def test_discover_keeps_the_cache_and_follows_a_changed_status_file(tmp_path: Path) -> None:
    host = build_demo(str(tmp_path / "demo"))
    status = host.add_running_domain("i-7-1-VM", "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53",
                                     pci=("0000:3b:00.0",))
    assert not os.path.exists(host.p(CACHE))
    first, loaded = _run(host.root, "discover", "--format", "cloudstack")
    assert loaded == "lxml loaded"  # parsed once, and kept
    assert json.loads(Path(host.p(CACHE)).read_text())["i-7-1-VM"][5] == ["0000:3b:00.0"]
    again, loaded = _run(host.root, "discover", "--format", "cloudstack")
    assert (again, loaded) == (first, "no lxml")
    assert _used_by(json.loads(again), "3b:00.0") == "i-7-1-VM"
    # libvirt rewrites a status file by rename: the VM now holds another GPU.
    new = status + ".new"
    Path(new).write_text(Path(status).read_text().replace("bus='0x3b'", "bus='0x65'"))
    os.replace(new, status)
    changed, loaded = _run(host.root, "discover", "--format", "cloudstack")
    assert loaded == "lxml loaded"
    assert _used_by(json.loads(changed), "3b:00.0") is None
    assert _used_by(json.loads(changed), "65:00.0") == "i-7-1-VM"
    assert json.loads(Path(host.p(CACHE)).read_text())["i-7-1-VM"][5] == ["0000:65:00.0"]


def test_metrics_keeps_the_cache(tmp_path: Path) -> None:
    host = build_demo(str(tmp_path / "demo"))
    host.add_running_domain("i-7-1-VM", "0f7d9b3e-5a1c-4e28-b6f4-9d2a8c1e7b53",
                            pci=("0000:3b:00.0",))
    first, loaded = _run(host.root, "metrics")
    assert loaded == "lxml loaded" and os.path.exists(host.p(CACHE))
    again, loaded = _run(host.root, "metrics")
    assert (again, loaded) == (first, "no lxml")
    assert 'gpulib_gpu_in_use{pci_bus_id="00000000:3B:00.0"} 1' in again
