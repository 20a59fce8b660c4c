"""gpulib.installation: a hook or command that meets a package upgrade waits
for it and starts again from the new files, or exits 3; an upgrade is never
kept waiting by a stream of runs. The "package" here is flock(1) on a copy of
the gpulib package, as the maintainer scripts take it."""

from __future__ import annotations

import json
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


def _install(site: Path) -> None:
    """gpulib's modules under `site` as an installation without byte code has
    them (pip install --no-compile, an rpm built without it): no __pycache__,
    and the version file every build writes."""
    shutil.copytree(os.path.dirname(gpulib.__file__), site / "gpulib",
                    ignore=shutil.ignore_patterns("__pycache__", "_version.py"))
    (site / "gpulib" / "_version.py").write_text('VERSION = "0.1.0.1"\n', encoding="utf-8")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    _install(site)
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
    body = cli.split("def _main(", 1)[1]
    assert body.index('hold("gpulib")') < body.index("from gpulib.cli import inventory")
    for exe in (TOP / "hooks").iterdir():
        text = exe.read_text(encoding="utf-8")
        imports = [line.strip() for line in text.splitlines()
                   if line.strip().startswith(("from gpulib", "import gpulib"))]
        if exe.name == "gpulib":  # gpulib.cli, then main() as above
            assert imports == ["from gpulib.cli import run"]
            continue
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
        _install(site)
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


def test_byte_code_written_by_the_first_runs_is_no_upgrade(site: Path, tmp_path: Path) -> None:
    """Reproduction: installed without byte code (pip install --no-compile, an
    rpm built without it), the first hooks write __pycache__ beside the
    modules; the upgrade guard compared the directories' ctime, so 1 to 3 of
    12 concurrent first starts exited 3 "gpulib was upgraded while this hook
    waited". The guard looks at the build's version file only."""
    from gpulib.sim import hosts

    root = tmp_path / "root"
    hosts.build("demo", str(root))
    env = {**_env(site, tmp_path), "GPULIB_SIMULATE": "1"}
    del env["PYTHONDONTWRITEBYTECODE"]  # as on a host: the runs write byte code
    xml = (TOP / "tests" / "data" / "cloudstack-xml" / "vgpu-mdev.xml").read_text(encoding="utf-8")
    runs = [subprocess.Popen([sys.executable, str(TOP / "hooks" / "libvirt-vm-xml-transformer"),
                              "transform", xml], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, cwd=tmp_path)
            for _ in range(12)]
    results = [(p.communicate(timeout=60)[1].decode(), p.returncode) for p in runs]
    assert [rc for _, rc in results] == [0] * 12, results
    assert list((site / "gpulib").glob("__pycache__/*.pyc")), "no run wrote byte code"


def test_the_stamp_is_the_builds_version_file(site: Path, tmp_path: Path) -> None:
    """Byte code, a relabel (ctime) or a new file beside the modules is no
    upgrade; a version file renamed into place (dpkg, rpm) is, and none at
    all is a removal."""
    code = ("import json, os, sys\n"
            "from gpulib import installation\n"
            "print(json.dumps(installation.stamp()))\n")

    def stamp() -> list[int]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=_env(site, tmp_path), cwd=tmp_path, timeout=30, check=True)
        return list(json.loads(r.stdout))

    pkg = site / "gpulib"
    before = stamp()
    assert len(before) == 4
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "state.cpython-39.pyc").write_bytes(b"\0" * 16)
    (pkg / "hooks" / "__pycache__").mkdir()
    os.chmod(pkg / "_version.py", 0o600)
    assert stamp() == before
    new = pkg / "_version.py.dpkg-new"
    new.write_text('VERSION = "0.1.0.1"\n', encoding="utf-8")
    os.replace(new, pkg / "_version.py")
    assert stamp() != before
    (pkg / "_version.py").unlink()
    assert stamp() == []


def test_a_run_that_waited_for_a_removal_says_so_in_one_line(site: Path, tmp_path: Path) -> None:
    """Remove and purge hold the installation as an upgrade does: a hook that
    started meanwhile waits, then finds the package gone and exits 3 with one
    line, never with an ImportError of a module the removal took."""
    marker = tmp_path / "released"
    holder = _upgrade_lock(site, marker)
    try:
        hook = subprocess.Popen(
            [sys.executable, str(TOP / "hooks" / "libvirt-vm-state-change"), "onStop", "vm1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(site, tmp_path))
        time.sleep(0.5)
        assert hook.poll() is None, "the hook did not wait for the removal"
        shutil.rmtree(site / "gpulib")
    finally:
        marker.touch()
        holder.wait(timeout=10)
    out, err = hook.communicate(timeout=30)
    assert (hook.returncode, out) == (3, b"")
    assert err.decode() == ("libvirt-vm-state-change: gpulib was removed while this run waited "
                            "for it: nothing was done\n")


@pytest.mark.parametrize("exe,gone", [("libvirt-vm-xml-transformer", "installation.py"),
                                      ("gpulib-qemu-hook", "installation.py"),
                                      ("libvirt-vm-state-change", "installation.py"),
                                      ("gpulib", "cli")])
def test_an_executable_whose_modules_are_gone_says_so(site: Path, tmp_path: Path, exe: str,
                                                      gone: str) -> None:
    """dpkg removes the modules before /usr/bin/gpulib: a run started in
    between finds the executable without its modules. One line, exit 3."""
    path = site / "gpulib" / gone
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    # -S: without site-packages, whose editable-install finder would find the
    # module in the source tree.
    r = subprocess.run([sys.executable, "-S", str(TOP / "hooks" / exe), "status"],
                       capture_output=True,
                       text=True, env=_env(site, tmp_path), cwd=tmp_path, timeout=30)
    assert (r.returncode, r.stdout) == (3, "")
    assert r.stderr == f"{exe}: gpulib is being installed or removed: nothing was done\n"


VM_XML = (TOP / "tests" / "data" / "cloudstack-xml" / "passthrough-1gpu.xml").read_text(
    encoding="utf-8")
# Each executable as its callers run it, on a path that reaches far into gpulib.
RUNS = {
    "libvirt-vm-xml-transformer": (["transform", VM_XML], ""),
    "gpulib-qemu-hook": (["{vm}", "prepare", "begin", "-"], VM_XML),
    "libvirt-vm-state-change": (["onStart", "{vm}"], ""),
    "gpulib": (["doctor"], ""),
}


def _gpulib_modules(site: Path, tmp_path: Path, exe: str) -> list[str]:
    """The gpulib modules a run of `exe` imports (`-X importtime`), as files under site."""
    args, stdin = RUNS[exe]
    r = _run_exe(site, tmp_path, exe, ["-X", "importtime"], args, stdin)
    names = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
             if line.startswith("import time:")}
    out = []
    for name in sorted(n for n in names if n.split(".")[0] == "gpulib"):
        rel = name.replace(".", "/")
        if (site / rel).is_dir() or name.endswith("._version"):
            continue  # a package without __init__ still imports (a namespace package)
        out.append(rel + ".py")
    return out


def _run_exe(site: Path, tmp_path: Path, exe: str, flags: list[str], args: list[str],
             stdin: str) -> subprocess.CompletedProcess[str]:
    import re

    vm = re.search(r"<name>([^<]+)</name>", VM_XML)
    assert vm is not None
    return subprocess.run([sys.executable, "-S", *flags, str(TOP / "hooks" / exe),
                           *(a.replace("{vm}", vm.group(1)) for a in args)],
                          input=stdin, capture_output=True, text=True,
                          env=_env(site, tmp_path), cwd=tmp_path, timeout=60)


@pytest.mark.parametrize("exe", sorted(RUNS))
def test_every_module_missing_gives_one_line_and_exit_3(site: Path, tmp_path: Path,
                                                         exe: str) -> None:
    """An install or a removal between files: whichever of gpulib's modules a run reaches
    for is missing, the run says so in one line and exits 3 (never a traceback)."""
    modules = _gpulib_modules(site, tmp_path, exe)
    assert len(modules) > 5, modules
    args, stdin = RUNS[exe]
    bad = []
    for rel in modules:
        path = site / rel
        aside = path.with_name(path.name + ".aside")
        os.replace(path, aside)
        try:
            r = _run_exe(site, tmp_path, exe, [], args, stdin)
        finally:
            os.replace(aside, path)
        line = "gpulib is being installed or removed: nothing was done\n"
        # the qemu hook's own messages name gpulib (libvirt shows the hook's path beside)
        names = {exe, "gpulib"} if exe == "gpulib-qemu-hook" else {exe}
        if (r.returncode, r.stdout) != (3, "") or r.stderr not in {f"{n}: {line}" for n in names}:
            bad.append(f"{rel}: exit {r.returncode}: {r.stderr[-300:]!r}")
    assert not bad, bad
