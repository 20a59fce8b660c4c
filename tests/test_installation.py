"""gpulib.installation: a hook or command that meets a package upgrade waits
for it and starts again from the new files, or exits 3; an upgrade is never
kept waiting by a stream of runs. The "package" here is flock(1) on a copy of
the gpulib package, as the maintainer scripts take it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpulib

TOP = Path(__file__).resolve().parent.parent
NO_GPU_XML = (TOP / "tests" / "data" / "cloudstack-xml" / "no-gpu.xml").read_text(encoding="utf-8")

pytestmark = pytest.mark.skipif(shutil.which("flock") is None,
                                reason="flock(1) (util-linux) missing")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    shutil.copytree(os.path.dirname(gpulib.__file__), site / "gpulib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _env(site: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULIB_")}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1",
               GPULIB_ROOT=str(tmp_path / "root"))
    return env


def _upgrade_lock(site: Path, marker: Path) -> subprocess.Popen[bytes]:
    """The maintainer scripts' hold: gate and hall exclusive, until `marker` exists."""
    pkg = site / "gpulib"
    proc = subprocess.Popen(
        ["flock", "-x", str(pkg), "flock", "-x", str(pkg / "hooks"), "sh", "-c",
         'echo held; while [ ! -e "$1" ]; do sleep 0.05; done', "sh", str(marker)],
        stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    return proc


def _unpack(site: Path, new_text: str) -> None:
    """Every module renamed into place as dpkg does; the transformer's answer changes."""
    for module in sorted((site / "gpulib").rglob("*.py")):
        text = module.read_text(encoding="utf-8")
        if module.name == "transformer.py":
            text = text.replace('USAGE = f"usage:', f'USAGE = "{new_text}" or f"usage:', 1)
        new = module.with_name(module.name + ".dpkg-new")
        new.write_text(text, encoding="utf-8")
        os.replace(new, module)


def test_a_hook_started_during_an_upgrade_runs_the_new_release(site: Path, tmp_path: Path) -> None:
    marker = tmp_path / "released"
    holder = _upgrade_lock(site, marker)
    try:
        hook = subprocess.Popen(
            [sys.executable, str(TOP / "hooks" / "libvirt-vm-xml-transformer"), "bogus"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(site, tmp_path))
        time.sleep(0.5)
        assert hook.poll() is None, "the hook did not wait for the upgrade"
        _unpack(site, "new release")
    finally:
        marker.touch()
        holder.wait(timeout=10)
    out, err = hook.communicate(timeout=30)
    # Usage error (exit 2) in the new release's words: it started over from the new files.
    assert hook.returncode == 2, err
    assert err.decode() == "libvirt-vm-xml-transformer: new release\n"
    assert out == b""


def test_a_hook_that_met_no_upgrade_answers_at_once(site: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(TOP / "hooks" / "libvirt-vm-xml-transformer"),
                        "transform", NO_GPU_XML], capture_output=True, text=True,
                       env=_env(site, tmp_path), timeout=30)
    assert r.returncode == 0 and r.stderr == "" and "<domain" in r.stdout


def test_an_upgrade_that_does_not_end_gives_exit_3(site: Path, tmp_path: Path) -> None:
    marker = tmp_path / "released"
    holder = _upgrade_lock(site, marker)
    try:
        began = time.monotonic()
        r = subprocess.run([sys.executable, "-c",
                            "from gpulib.installation import hold; hold('gpulib', wait=0.5); "
                            "print('ran')"],
                           capture_output=True, text=True, env=_env(site, tmp_path), timeout=30,
                           cwd=tmp_path)
        took = time.monotonic() - began
    finally:
        marker.touch()
        holder.wait(timeout=10)
    assert r.returncode == 3 and r.stdout == ""
    assert r.stderr.startswith("gpulib: gpulib is being upgraded") and "run it again" in r.stderr
    assert len(r.stderr.splitlines()) == 1
    assert 0.4 < took < 10


def test_runs_in_a_loop_never_keep_an_upgrade_waiting(site: Path, tmp_path: Path) -> None:
    """flock has no queue: without the gate, overlapping shared holders would
    starve the exclusive lock. Four loops of runs that each hold for 0.2 s."""
    loop = ("import sys, time\n"
            "from gpulib.installation import hold\n"
            "hold('gpulib'); time.sleep(0.2)\n")
    stop = tmp_path / "stop"
    script = f'while [ ! -e "{stop}" ]; do "{sys.executable}" -c "$1"; done'
    loops = [subprocess.Popen(["sh", "-c", script, "sh", loop], env=_env(site, tmp_path),
                              cwd=tmp_path)
             for _ in range(4)]
    try:
        time.sleep(1.0)
        pkg = site / "gpulib"
        began = time.monotonic()
        r = subprocess.run(["flock", "-w", "10", "-x", str(pkg), "flock", "-w", "10", "-x",
                            str(pkg / "hooks"), "true"], timeout=30)
        took = time.monotonic() - began
    finally:
        stop.touch()
        for p in loops:
            p.wait(timeout=30)
    assert r.returncode == 0
    assert took < 2.0, f"the upgrade waited {took:.1f} s for the runs"


def test_the_cli_takes_hold_first() -> None:
    """`gpulib` (the console script's main) and each hook executable hold the
    installation before they import anything else of gpulib."""
    cli = (TOP / "gpulib" / "cli" / "__init__.py").read_text(encoding="utf-8")
    body = cli.split("def main(", 1)[1]
    assert body.index('hold("gpulib")') < body.index("from gpulib.cli import inventory")
    for exe in (TOP / "hooks").iterdir():
        text = exe.read_text(encoding="utf-8")
        imports = [line for line in text.splitlines()
                   if line.startswith(("from gpulib", "import gpulib"))]
        assert imports[0] == "from gpulib.installation import hold", exe.name
        assert text.index(f'hold("{exe.name}")') < text.index(imports[1]), exe.name


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to hold the lock as another user")
def test_a_lock_another_user_holds_keeps_no_hook_waiting() -> None:
    """Any user may flock a directory they can read: `flock -x .../gpulib
    sleep 1d` by an unprivileged user must not make every VM start wait and
    fail. Only root's locks (the package's) and one's own are waited for."""
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="gpulib-installation-"))
    try:
        top.chmod(0o755)
        site = top / "site"
        shutil.copytree(os.path.dirname(gpulib.__file__), site / "gpulib",
                        ignore=shutil.ignore_patterns("__pycache__"))
        holder = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "flock", "-x",
             str(site / "gpulib"), "sh", "-c", "echo held; exec sleep 60"],
            stdout=subprocess.PIPE, start_new_session=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            began = time.monotonic()
            r = subprocess.run([sys.executable, "-c",
                                "from gpulib.installation import hold; hold('gpulib', wait=5); "
                                "print('ran')"],
                               capture_output=True, text=True, env=_env(site, top), timeout=30,
                               cwd=top)
            took = time.monotonic() - began
        finally:
            os.killpg(holder.pid, 9)  # flock and the sleep under it
            holder.wait(timeout=10)
        assert (r.returncode, r.stdout, r.stderr) == (0, "ran\n", "")
        assert took < 4
    finally:
        shutil.rmtree(top)
