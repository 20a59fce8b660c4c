"""Packaging: the files under etc/ and packaging/, and the full check.

The fast tests keep the shipped files in step with the code (the config with
`example_config()`, the Debian and RPM packaging with each other; the man
pages are tests/test_manpages.py's). The test marked
`packaging` runs scripts/packaging-check: it builds the .deb and .rpm,
installs, exercises and purges them, so it needs root and the tools listed in
packaging/build-deps.txt, and is skipped (with the reason) otherwise.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulib.config import DEFAULTS, Config, example_config

REPO = Path(__file__).resolve().parents[1]
ETC = REPO / "etc"
PACKAGING = REPO / "packaging"
DEBIAN = PACKAGING / "debian"
SPEC = PACKAGING / "rpm" / "gpulib.spec"
CHECK = REPO / "scripts" / "packaging-check"
# The Python distributions gpulib imports, and their Debian/EL package names.
RUNTIME_IMPORTS = {"lxml", "click", "pyudev"}
RUNTIME_DEPS = {f"python3-{name}" for name in RUNTIME_IMPORTS}


def unit_directives(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of a systemd unit, repeated keys kept in order."""
    out: list[tuple[str, str, str]] = []
    section = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def values(directives: list[tuple[str, str, str]], section: str, key: str) -> list[str]:
    words: list[str] = []
    for s, k, v in directives:
        if s == section and k == key:
            words += v.split()
    return words


# --- etc/ ---------------------------------------------------------------------
def test_every_data_file_is_in_a_declared_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files beside the modules (the simulator's models) are package data of
    a package setup.cfg declares: setuptools warns at every build and
    editable install ("Package would be ignored") about a directory Python
    can import that the configuration leaves out."""
    setupcfg = pytest.importorskip("setuptools.config.setupcfg")
    monkeypatch.chdir(REPO)
    options = setupcfg.read_configuration("setup.cfg")["options"]
    packages, data = set(options["packages"]), options["package_data"]
    found = 0
    for directory, dirs, files in os.walk(REPO / "gpulib"):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        shipped = [f for f in files if not f.endswith((".py", ".pyc"))]
        if not shipped:
            continue
        # A directory Python cannot import (`nvidia-smi`) holds data of the
        # package above it, named by their path below that package.
        parts = os.path.relpath(directory, REPO).split(os.sep)
        depth = len(parts)
        while not all(part.isidentifier() for part in parts[:depth]):
            depth -= 1
        package = ".".join(parts[:depth])
        below = "/".join(parts[depth:])
        assert package in packages, f"{package} holds {shipped} but is no declared package"
        for name in shipped:
            found += 1
            rel = f"{below}/{name}" if below else name
            assert any(fnmatch.fnmatch(rel, p) for p in data.get(package, [])), \
                f"{package}/{rel} is not declared package data"
    assert found  # the models of gpulib.sim at least


def test_example_config_is_example_config() -> None:
    shipped = (ETC / "gpulib" / "gpulib.conf.example").read_text(encoding="utf-8")
    assert shipped == example_config(), (
        "etc/gpulib/gpulib.conf.example differs from gpulib.config.example_config(); "
        "regenerate it: python3 -c 'from gpulib.config import example_config as e; "
        "open(\"etc/gpulib/gpulib.conf.example\", \"w\").write(e())'")


def test_shipped_config_sets_nothing_and_never_changes() -> None:
    """Reproduction: the shipped /etc/gpulib/gpulib.conf listed every key, so a
    release adding one changed the conffile; on a host whose administrator
    edited it, `DEBIAN_FRONTEND=noninteractive apt-get install` stopped at
    dpkg's conffile prompt (exit 100, half-configured). The shipped file now
    sets nothing; preinst knows its md5 (to move an edited old full file to a
    drop-in), so it must never change. scripts/packaging-check step 9 runs the
    upgrade itself."""
    import hashlib

    text = (ETC / "gpulib" / "gpulib.conf").read_text(encoding="utf-8")
    assert [line for line in text.splitlines() if line.strip() and not line.startswith("#")] \
        == []
    assert "/etc/gpulib/gpulib.conf.d/" in text and "gpulib.conf(5)" in text
    assert "/usr/share/doc/gpulib/examples/gpulib.conf.example" in text
    preinst = (DEBIAN / "gpulib.preinst").read_text(encoding="utf-8")
    (md5,) = re.findall(r"^STUB_MD5=([0-9a-f]{32})$", preinst, re.M)
    assert md5 == hashlib.md5(text.encode()).hexdigest()
    (written,) = re.findall(r"<<'GPULIB_CONF'\n(.*?)^GPULIB_CONF$", preinst, re.M | re.S)
    assert written == text
    assert "etc/gpulib/gpulib.conf.example" in (DEBIAN / "gpulib.examples").read_text().split()
    assert (DEBIAN / "gpulib.dirs").read_text().split() == ["etc/gpulib/gpulib.conf.d"]
    spec = SPEC.read_text(encoding="utf-8")
    assert "%dir %{_sysconfdir}/gpulib/gpulib.conf.d" in spec
    assert "%{_docdir}/gpulib/examples/gpulib.conf.example" in spec


def test_shipped_config_is_the_previous_releases_byte_for_byte() -> None:
    """unattended-upgrades skips a package whose upgrade could prompt about a
    configuration file ("has conffile prompt and needs to be upgraded
    manually"), checking before any maintainer script runs: the shipped file
    must be the previous release's exact bytes (and postrm, which undoes the
    move of an edited file, must know the same md5)."""
    import hashlib

    check = CHECK.read_text(encoding="utf-8")
    (commit,) = re.findall(r"^PREV_COMMIT=([0-9a-f]{7,40})$", check, re.M)
    r = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:etc/gpulib/gpulib.conf"],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"no git history with {commit} here: {r.stderr.decode().strip()}")
    shipped = (ETC / "gpulib" / "gpulib.conf").read_bytes()
    assert r.stdout == shipped
    postrm = (DEBIAN / "gpulib.postrm").read_text(encoding="utf-8")
    (md5,) = re.findall(r"^STUB_MD5=([0-9a-f]{32})$", postrm, re.M)
    assert md5 == hashlib.md5(shipped).hexdigest()


def _built_maintainer_scripts(tmp_path: Path, version: str, state: Path) -> dict[str, Path]:
    """gpulib's preinst and prerm as debian/rules makes them for `version`
    (its own make target: the shared installation-lock.sh put in place, the
    version written in), with `state` as the state directory. Only ever run
    where they stop before touching the machine (a refusal; prerm upgrade)."""
    if shutil.which("make") is None or shutil.which("dpkg") is None:
        pytest.skip("make and dpkg are needed to build the maintainer scripts")
    shutil.copytree(DEBIAN, tmp_path / "debian")
    built = tmp_path / "debian" / "gpulib" / "DEBIAN"
    built.mkdir(parents=True)
    for name in ("preinst", "prerm"):
        shutil.copy(DEBIAN / f"gpulib.{name}", built / name)
    r = subprocess.run(["make", "-s", "-f", "debian/rules", "execute_after_dh_installdeb",
                        f"DEB_VERSION={version}"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    scripts = {}
    for name in ("preinst", "prerm"):
        text = (built / name).read_text(encoding="utf-8")
        assert "@GPULIB_VERSION@" not in text and "#GPULIB_INSTALLATION_LOCK#" not in text
        assert re.search(rf"^VERSION={re.escape(version)}$", text, re.M), name
        assert text.count("\nrefuse_downgrade() {") == 1, name
        assert subprocess.run(["sh", "-n"], input=text, text=True).returncode == 0, name
        # Runnable here: stop after the refusal, before the machine is touched.
        runnable = text.replace("STATEDIR=/var/lib/gpulib", f"STATEDIR={state}")
        runnable = re.sub(r'^(\s+refuse_downgrade "\$\{2:-\}" "\$VERSION")$', r"\1; exit 0",
                          runnable, flags=re.M)
        runnable = runnable.replace("hold_installation || true", "exit 0")
        scripts[name] = tmp_path / name
        scripts[name].write_text(runnable, encoding="utf-8")
    assert "; exit 0" in scripts["preinst"].read_text(encoding="utf-8")
    assert "hold_installation ||" not in scripts["prerm"].read_text(encoding="utf-8")
    return scripts


def test_downgrade_refusal_says_the_way_back(tmp_path: Path) -> None:
    """Reproduction: `dpkg -i` of an older gpulib was refused, and so was the
    way back its message gave (remove, move /var/lib/gpulib aside, install
    the older one): the older preinst looked only at the version whose
    configuration files the remove kept. A downgrade is refused while there
    is a state (the older gpulib may not read it), by the newer prerm and the
    older preinst alike; once the state is moved aside it goes through. Going
    back to a release from before the version scheme (whose preinst refuses
    any install over a newer one's kept files) takes a purge, and the message
    says how to keep /etc/gpulib through it."""
    newer, older = "0.2.0.500", "0.2.0.499"
    state = tmp_path / "var-lib-gpulib"
    scripts = _built_maintainer_scripts(tmp_path, older, state)
    prerm_of_newer = _built_maintainer_scripts(tmp_path / "newer", newer, state)["prerm"]

    def run(script: Path, *args: str) -> tuple[int, str]:
        r = subprocess.run(["sh", str(script), *args], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
        return r.returncode, r.stdout + r.stderr

    def refused(*args: str) -> tuple[int, str]:
        """The shared refusal alone (preinst goes on to change the machine)."""
        r = subprocess.run(["sh", "-c", f'. "$1"; STATEDIR={state}; shift; refuse_downgrade "$@"',
                            "sh", str(DEBIAN / "installation-lock.sh"), *args],
                           capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout + r.stderr

    # No state: going back goes through (the documented way back).
    assert refused(newer, older) == (0, "")
    assert run(prerm_of_newer, "upgrade", older) == (0, "")
    for kept in ("state.json", "state.json.bak"):
        state.mkdir(exist_ok=True)
        (state / kept).write_text("{}")
        rc, out = run(prerm_of_newer, "upgrade", older)
        assert rc == 1
        assert out.splitlines() == [
            f"gpulib: refusing to replace gpulib {newer} with the older {older}: {older} may "
            f"not read the state",
            f"gpulib: {newer} keeps in {state}, and would then bring no vGPU back at boot.",
            f"gpulib: To go back anyway (your /etc/gpulib stays): apt-get remove gpulib; "
            f"mv {state} {state}.{newer}; then install {older}."]
        assert run(scripts["preinst"], "install", newer) == (1, out)
        assert run(scripts["preinst"], "upgrade", newer) == (1, out)
        # dpkg then asks the older prerm, which refuses too, without a word.
        assert run(scripts["prerm"], "failed-upgrade", newer) == (1, "")
        (state / kept).unlink()
    state.mkdir(exist_ok=True)
    (state / "state.json").write_text("{}")
    # Upgrades and reinstalls are no downgrade.
    assert run(scripts["prerm"], "upgrade", newer) == (0, "")
    assert run(prerm_of_newer, "upgrade", newer) == (0, "")
    assert refused(older, newer) == (0, "") and refused(newer, newer) == (0, "")
    assert run(scripts["prerm"], "failed-upgrade", older) == (0, "")
    # A release from before the version scheme ("0.1.0"): the way back purges.
    rc, out = run(prerm_of_newer, "upgrade", "0.1.0")
    assert rc == 1
    assert out.splitlines()[-1] == (
        f"gpulib: To go back anyway (your /etc/gpulib stays): mv /etc/gpulib /etc/gpulib.keep; "
        f"mv {state} {state}.{newer}; apt-get purge gpulib; install 0.1.0; then rm -r "
        f"/etc/gpulib; mv /etc/gpulib.keep /etc/gpulib.")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True).stdout


def _builds_with_serial() -> list[tuple[str, str]]:
    """(commit, version) of every 0.2.0.N build below HEAD in this history."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("no git history here")
    if _git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip("a shallow clone: the builds' serials cannot be counted")
    head = _git("rev-parse", "HEAD").strip()
    out = []
    for commit in _git("rev-list", "HEAD").split():
        if commit == head:
            continue
        serial = int(_git("rev-list", "--count", commit))
        if serial < 451:  # 0.2.0.451: the first build of the version scheme
            continue
        out.append((commit, f"0.2.0.{serial}"))
    return out


def _refusal_of(commit: str, version: str) -> str:
    """That build's preinst refusal, runnable alone: its function(s) and the line that
    calls it for `install`/`upgrade` (the rest changes the machine)."""
    text = _git("show", f"{commit}:packaging/debian/gpulib.preinst")
    if "#GPULIB_INSTALLATION_LOCK#" in text:
        lock = _git("show", f"{commit}:packaging/debian/installation-lock.sh")
        text = text.replace("#GPULIB_INSTALLATION_LOCK#", lock)
    text = text.replace("@GPULIB_VERSION@", version)
    function = re.search(r"^refuse_downgrade\(\) \{\n.*?^\}\n", text, re.M | re.S)
    calls = re.findall(r"^\s+(refuse_downgrade .*)$", text, re.M)
    assert function and len(calls) == 1, commit
    constants = "".join(m + "\n" for m in re.findall(r"^[A-Z_]+=[^$\s`]*$", text, re.M))
    return f"{constants}VERSION={version}\n{function.group(0)}{calls[0]}\n"


def test_the_way_back_works_for_every_earlier_build(tmp_path: Path) -> None:
    """The refusal of a downgrade to any 0.2.0.N build below this one prints a way back;
    that build's own preinst is then run as dpkg runs it at the end of that way: after
    a remove (its configuration files kept: `install NEWER`) with the state moved aside,
    or after a purge (`install`). It must go through, for every build."""
    newer = "0.2.0.99999"
    state = tmp_path / "var-lib-gpulib"
    state.mkdir()
    (state / "state.json").write_text("{}")
    lock = DEBIAN / "installation-lock.sh"
    checked: dict[tuple[str, str], str] = {}
    builds = _builds_with_serial()
    assert builds, "no 0.2.0.N build below HEAD"
    for commit, version in builds:
        r = subprocess.run(["sh", "-c", f'. "$1"; STATEDIR={state}; shift; refuse_downgrade "$@"',
                            "sh", str(lock), newer, version], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 1, (version, r.stderr)
        (way,) = [line for line in r.stderr.splitlines() if "To go back anyway" in line]
        purge = "apt-get purge gpulib" in way
        script = _refusal_of(commit, version)
        key = (script.replace(version, "V"), str(purge))
        if key in checked:
            continue
        # at the end of the way back: the state moved aside, and dpkg runs the preinst
        moved = tmp_path / "aside"
        (state / "state.json").rename(moved)
        try:
            args = ["install"] if purge else ["install", newer]
            got = subprocess.run(["sh", "-c", f"STATEDIR={state}\nset -e\n{script}echo through",
                                  "preinst", *args], capture_output=True, text=True, timeout=60)
        finally:
            moved.rename(state / "state.json")
        assert (got.returncode, got.stdout.strip()) == (0, "through"), (version, way, got.stderr)
        checked[key] = version
    assert len(checked) >= 2  # the purge way (0.2.0.451) and the remove way


def test_shipped_config_loads_as_defaults(tmp_path: Path) -> None:
    cfg = Config.load(str(ETC / "gpulib" / "gpulib.conf"))
    for section, keys in DEFAULTS.items():
        for key, (default, _kind) in keys.items():
            assert cfg.get(section, key) == default
    assert cfg.pools == {}


def test_uncommenting_a_shipped_key_gives_a_valid_config(tmp_path: Path) -> None:
    lines: list[str] = []
    for line in (ETC / "gpulib" / "gpulib.conf.example").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^# ([a-z_]+ = .*)$", line)
        in_pool_example = lines and any(x.startswith("[pool") for x in lines)
        lines.append(m.group(1) if m and not in_pool_example else line)
    path = tmp_path / "gpulib.conf"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    Config.load(str(path))


def test_restore_unit() -> None:
    unit = ETC / "systemd" / "gpulib-restore.service"
    d = unit_directives(unit)
    assert values(d, "Service", "Type") == ["oneshot"]
    assert values(d, "Service", "RemainAfterExit") == ["yes"]
    assert [v for s, k, v in d if (s, k) == ("Service", "ExecStart")] == [
        "-/usr/bin/gpulib restore", "/usr/bin/gpulib pool apply"]
    nvidia = {"nvidia-vgpu-mgr.service", "nvidia-sriov.service"}
    assert nvidia <= set(values(d, "Unit", "Wants"))
    assert nvidia <= set(values(d, "Unit", "After"))
    # Absent on hosts without NVIDIA vGPU: never a hard dependency.
    assert not [k for s, k, _ in d if s == "Unit" and k in ("Requires", "Requisite", "BindsTo")]
    assert {"libvirtd.service", "cloudstack-agent.service"} <= set(values(d, "Unit", "Before"))
    assert values(d, "Unit", "Documentation") == ["man:gpulib(1)"]
    assert values(d, "Install", "WantedBy") == ["multi-user.target"]
    preset = (ETC / "systemd" / "50-gpulib.preset").read_text(encoding="utf-8")
    assert "enable gpulib-restore.service" in preset.splitlines()


def test_tmpfiles_state_directory() -> None:
    lines = [line.split() for line in
             (ETC / "tmpfiles.d" / "gpulib.conf").read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith("#")]
    assert ["d", "/var/lib/gpulib", "0700", "root", "root", "-"] in lines


# --- packaging/ ---------------------------------------------------------------
def _field(control: str, package: str, name: str) -> set[str]:
    stanza = control.split(f"Package: {package}\n", 1)[1].split("\n\n", 1)[0]
    m = re.search(rf"^{name}:(.*(?:\n .*)*)", stanza, flags=re.M)
    assert m, f"{package}: no {name}"
    return {w.split()[0] for w in m.group(1).replace("\n", " ").split(",") if w.strip()}


def test_debian_runtime_dependencies() -> None:
    control = (DEBIAN / "control").read_text(encoding="utf-8")
    assert _field(control, "gpulib", "Depends") >= RUNTIME_DEPS
    assert "gpulib" in _field(control, "gpulib-cloudstack-discovery", "Depends")
    spec = SPEC.read_text(encoding="utf-8")
    assert set(re.findall(r"^Requires:\s+(\S+)$", spec, flags=re.M)) >= RUNTIME_DEPS


def _outside_imports() -> dict[str, set[str]]:
    """Top-level modules gpulib's code imports from outside the stdlib and
    itself, with the files that import them."""
    import ast
    import importlib.util
    import sysconfig

    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "gpulib").rglob("*.py")) + sorted((REPO / "hooks").iterdir()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ("gpulib", "__future__"):
                    continue
                spec = importlib.util.find_spec(top)
                origin = spec.origin if spec else None
                if spec is not None and (origin in (None, "built-in", "frozen") or
                                         (os.path.realpath(origin).startswith(stdlib + os.sep)
                                         and "site-packages" not in origin)):
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_declared_runtime_dependencies_are_the_imported_ones() -> None:
    """filelock was declared everywhere long after gpulib stopped importing it:
    the deb, the rpm and setup.cfg declare exactly what the code imports."""
    imported = set(_outside_imports())
    assert imported == RUNTIME_IMPORTS, _outside_imports()
    control = (DEBIAN / "control").read_text(encoding="utf-8")
    assert {d for d in _field(control, "gpulib", "Depends") if d.startswith("python3-")} \
        == RUNTIME_DEPS
    spec = SPEC.read_text(encoding="utf-8")
    assert {r for r in re.findall(r"^Requires:\s+(python3-\S+)", spec, flags=re.M)} \
        == RUNTIME_DEPS
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg", encoding="utf-8")
    declared = {re.split(r"[<>=!~ ;]", line.strip())[0]
                for line in cfg.get("options", "install_requires").splitlines() if line.strip()}
    assert declared == RUNTIME_IMPORTS


def test_libraries_are_used_through_their_public_interface() -> None:
    """`pyudev._util` and the Context's `_libudev`: private names another pyudev
    release may drop. No private module or attribute of a dependency."""
    import ast

    for path in sorted((REPO / "gpulib").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] in RUNTIME_IMPORTS:
                    assert not any(p.startswith("_") for p in parts), (path, node.module)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_libudev"):
                raise AssertionError(f"{path}: {node.attr}")
        assert "pyudev._" not in text, path


def test_build_deps_list_covers_build_depends() -> None:
    control = (DEBIAN / "control").read_text(encoding="utf-8")
    source = control.split("\n\n", 1)[0]
    m = re.search(r"^Build-Depends:(.*(?:\n .*)*)", source, flags=re.M)
    assert m
    wanted = {w.split()[0] for w in m.group(1).replace("\n", " ").split(",") if w.strip()}
    wanted.discard("debhelper-compat")
    wanted |= {"debhelper", "dpkg-dev", "lintian", "rpm"}
    listed = {line.strip() for line in
              (PACKAGING / "build-deps.txt").read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("#")}
    assert wanted <= listed


def test_hook_links_are_the_same_in_deb_and_rpm() -> None:
    deb = {}
    for line in (DEBIAN / "gpulib.links").read_text(encoding="utf-8").splitlines():
        if line.strip():
            target, link = line.split()
            deb["/" + link] = "/" + target
    assert deb == {
        "/etc/cloudstack/agent/hooks/libvirt-vm-xml-transformer.sh":
            "/usr/libexec/gpulib/libvirt-vm-xml-transformer",
        "/etc/cloudstack/agent/hooks/libvirt-vm-state-change.sh":
            "/usr/libexec/gpulib/libvirt-vm-state-change",
        "/etc/libvirt/hooks/qemu.d/50-gpulib": "/usr/libexec/gpulib/gpulib-qemu-hook",
    }
    spec = SPEC.read_text(encoding="utf-8")
    macros = {"%{_libexecdir}": "/usr/libexec", "%{hooksdir}": "/etc/cloudstack/agent/hooks",
              "%{qemuhooksdir}": "/etc/libvirt/hooks/qemu.d", "%{buildroot}": ""}
    rpm = {}
    for target, link in re.findall(r"^ln -s (\S+) (\S+)$", spec, flags=re.M):
        for k, v in macros.items():
            target, link = target.replace(k, v), link.replace(k, v)
        rpm[link] = os.path.normpath(os.path.join(os.path.dirname(link), target))
    assert rpm == deb


def test_maintainer_scripts_parse() -> None:
    scripts = sorted(DEBIAN.glob("*.preinst")) + sorted(DEBIAN.glob("*.postinst")) + \
        sorted(DEBIAN.glob("*.postrm")) + sorted(DEBIAN.glob("*.prerm"))
    assert scripts
    for script in scripts:
        text = script.read_text(encoding="utf-8")
        assert text.startswith("#!/bin/sh\n"), script.name
        assert "\nset -e\n" in text and "#DEBHELPER#" in text, script.name
        r = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"
    for script in [CHECK, PACKAGING / "build-packages"]:
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"


def test_discovery_replacement_script(tmp_path: Path) -> None:
    text = (PACKAGING / "cloudstack" / "cloudstack-gpudiscovery").read_text(encoding="utf-8")
    assert text.startswith("#!/bin/sh\n")
    assert "/usr/bin/gpulib discover --format cloudstack" in text
    # The process the agent waits for is gpulib itself: a shell that kept the
    # report and printed it would block on the agent's full pipe (gpulib
    # writes a report of any size without waiting: tests/test_large_answers).
    # gpulib's output and exit status are the agent's as they are, the
    # report whole or nothing (tests/test_discovery, errors on one line).
    fake = tmp_path / "gpulib"
    script = tmp_path / "gpudiscovery"
    script.write_text(text.replace("/usr/bin/gpulib", str(fake)), encoding="utf-8")
    for body, code in (('printf \'{"gpus": []}\\n\\n\'; exit 0', 0),
                       ('echo "gpulib: gpulib is being upgraded" >&2; exit 3', 3)):
        guard = "[ \"$*\" = 'discover --format cloudstack' ] || exit 9"
        fake.write_text(f"#!/bin/sh\n{guard}\necho \"pid $$\" >&2\n{body}\n",
                        encoding="utf-8")
        fake.chmod(0o755)
        proc = subprocess.Popen(["sh", str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code, (body, err)
        assert out == (b'{"gpus": []}\n\n' if code == 0 else b"")
        # exec: gpulib runs as the very process the agent started
        assert err.decode().splitlines()[0] == f"pid {proc.pid}", err
    assert os.access(PACKAGING / "cloudstack" / "cloudstack-gpudiscovery", os.X_OK)
    stock = "/usr/share/cloudstack-common/scripts/vm/hypervisor/kvm/gpudiscovery.sh"
    for name in ("preinst", "postrm"):
        script = (DEBIAN / f"gpulib-cloudstack-discovery.{name}").read_text(encoding="utf-8")
        assert f"STOCK={stock}" in script
        assert "--package gpulib-cloudstack-discovery --rename" in script
        assert '--divert "$STOCK.stock"' in script


# --- the full check --------------------------------------------------------------
def _check_prerequisites() -> str:
    """Why the full check cannot run here, or '' when it can."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root: it installs and purges the packages"
    missing = [t for t in ("dpkg", "apt-get", "dpkg-query", "dpkg-buildpackage", "lintian",
                           "rpmbuild", "rpm") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {' '.join(missing)} (apt-get install $(grep -v '^#' " \
               "packaging/build-deps.txt))"
    pkgs = [line.strip() for line in
            (PACKAGING / "build-deps.txt").read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]
    r = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${Package}\n", *pkgs],
                       capture_output=True, text=True)
    have = {line.split()[-1] for line in r.stdout.splitlines() if line.startswith("ii")}
    absent = [p for p in pkgs if p not in have]
    if absent:
        return f"missing packages: {' '.join(absent)} (apt-get install {' '.join(absent)})"
    return ""


def test_packaging_check_never_lets_man_cache_a_page() -> None:
    """Reproduction: on a fresh Debian 12 machine, run scripts/packaging-check
    as root: `man gpulib` (its rendering check) and `systemd-analyze verify`
    (which runs man for the unit's Documentation=) leave man-db's formatted
    pages /var/cache/man/cat1/gpulib.1.gz, cat5/gpulib.conf.5.gz,
    cat8/gpulib-qemu-hook.8.gz, and the check then reports them as left
    behind. Every man call must either only locate (-w) or render a local
    file (--local-file, never cached); systemd-analyze runs with --man=no."""
    lines = [line.strip() for line in CHECK.read_text(encoding="utf-8").splitlines()]
    calls = [line for line in lines
             if re.search(r"(^|\$\(|=\S+ )man\s+-", line) and not line.startswith("#")]
    assert calls, "the check renders no man page any more"
    for line in calls:
        assert re.search(r"\bman (-w|--warnings --local-file)\b", line), line
    for line in CHECK.read_text(encoding="utf-8").splitlines():
        if re.match(r"\s*systemd-analyze verify", line):
            assert "--man=no" in line, line


def _man_cache() -> set[str]:
    """The formatted pages man-db keeps (what a rendering check may leave)."""
    root = Path("/var/cache/man")
    # Formatted pages live in cat<N>/ folders (per locale too); mandb's own
    # files (index.db, CACHEDIR.TAG for each locale folder it makes when any
    # package is installed) are not pages.
    return {str(p) for p in root.rglob("*") if p.is_file() and p.parent.name.startswith("cat")
            and p.name not in ("index.db", "CACHEDIR.TAG")} if root.is_dir() else set()


@pytest.mark.packaging
@pytest.mark.slow
@pytest.mark.heavy
def test_packaging_check() -> None:
    """Reproduction (issue: the README's test command fails on a fresh
    machine): run scripts/packaging-check twice in a row as root on a fresh
    Debian 12 machine; the first run left /var/cache/man/cat*/ pages and the
    second refused to start. The check must pass and leave the machine as it
    found it: what a second run's pre-flight would refuse (our packages,
    diversions, files with gpulib in their name, formatted man pages of our
    pages) the check itself compares before and after, and the man cache is
    compared here too. One run: CI runs this test on every change."""
    reason = _check_prerequisites()
    if reason:
        pytest.skip(f"scripts/packaging-check: {reason}")
    cache_before = _man_cache()
    # About 8 minutes on a busy two-core machine, 10 when it is very busy: it
    # builds five releases (four old ones in the background), upgrades from
    # three and downgrades to two while the hooks run in loops.
    r = subprocess.run([str(CHECK)], capture_output=True, text=True, timeout=1500,
                       stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    if r.returncode == 0 and out.startswith("SKIP"):
        pytest.skip(out.strip())
    assert r.returncode == 0 and "PASS: packaging-check" in r.stdout, out
    assert _man_cache() - cache_before == set(), "the check left formatted man pages"
    assert _left_for_a_second_run() == [], out


def _left_for_a_second_run() -> list[str]:
    """What the check's pre-flight refuses to start with, after its clean-up ran."""
    left = []
    r = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${Package}\n",
                        "gpulib", "gpulib-cloudstack-discovery"], capture_output=True, text=True)
    left += [line for line in r.stdout.splitlines() if line[:2] not in ("", "un", "pn")]
    diverted = subprocess.run(["dpkg-divert", "--list"], capture_output=True, text=True).stdout
    left += [line for line in diverted.splitlines()
             if "gpudiscovery.sh" in line or "/etc/cloudstack/agent/hooks/" in line]
    hooks = "/etc/cloudstack/agent/hooks"
    for path in (f"{hooks}/libvirt-vm-xml-transformer.sh.pre-gpulib",
                 f"{hooks}/libvirt-vm-state-change.sh.pre-gpulib",
                 "/usr/share/cloudstack-common/scripts/vm/hypervisor/kvm/gpudiscovery.sh.stock"):
        if os.path.lexists(path):
            left.append(path)
    return left


# --- SELinux (EL9) -------------------------------------------------------------
SELINUX = PACKAGING / "selinux"
SELINUX_MAKEFILE = Path("/usr/share/selinux/devel/Makefile")


def test_selinux_file_contexts_are_what_doctor_checks() -> None:
    """The module's file contexts, the labels `gpulib doctor` expects and the
    paths the packages install are the same four."""
    from gpulib.doctor import selinux

    contexts = {}
    for line in (SELINUX / "gpulib.fc").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            path, *_, context = line.split()
            m = re.fullmatch(r"gen_context\(system_u:object_r:(\w+),s0\)", context)
            assert m, line
            contexts[path.removesuffix("(/.*)?").lstrip("/").replace("\\.", ".")] = m.group(1)
    assert contexts == dict(selinux.LABELS)
    te = (SELINUX / "gpulib.te").read_text(encoding="utf-8")
    for selinux_type in contexts.values():
        assert re.search(rf"^type {selinux_type};$", te, re.M), selinux_type
    spec = SPEC.read_text(encoding="utf-8")
    assert "make -f /usr/share/selinux/devel/Makefile gpulib.pp" in spec
    assert "%selinux_modules_install" in spec and "%selinux_modules_uninstall" in spec


def _policy_blocks(te: str) -> dict[str, str]:
    """Each optional block of the module by the libvirt domain it requires."""
    out = {}
    for block in te.split("optional_policy(`")[1:]:
        m = re.search(r"type ([\w, ]+);", block)
        assert m, block
        out[m.group(1).split(",")[0].strip()] = block
    return out


def test_selinux_rules_cover_what_the_hooks_write() -> None:
    """Every path a hook writes, its type in the module's file contexts, and the rules
    that let libvirt's daemons write it (the hook runs in virtqemud_t under EL9's
    modular daemons, virtd_t under libvirtd): the same rules for both, and a file
    transition for each directory a hook may make anew."""
    from gpulib import domstatus, mdevctl
    from gpulib.context import LOG_DIR, LOG_FAILURES_FILE, STATE_DIR

    contexts = []
    for line in (SELINUX / "gpulib.fc").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            path, *_, context = line.split()
            m = re.fullmatch(r"gen_context\(system_u:object_r:(\w+),s0\)", context)
            assert m, line
            contexts.append((path, m.group(1)))

    def type_of(rel: str) -> str:
        found = [t for pattern, t in contexts if re.fullmatch(pattern, "/" + rel)]
        assert found, f"/{rel} has no type in gpulib.fc"
        return found[-1]

    written = {rel: type_of(rel) for rel in (
        STATE_DIR, STATE_DIR + "/state.json", LOG_DIR, LOG_DIR + "/gpulib.log",
        os.path.dirname(domstatus.CACHE_FILE), domstatus.CACHE_FILE, LOG_FAILURES_FILE,
        mdevctl.MDEVCTL_DIR, mdevctl.MDEVCTL_DIR + "/0000:3b:00.0/uuid")}
    te = (SELINUX / "gpulib.te").read_text(encoding="utf-8")
    blocks = _policy_blocks(te)
    for domain in ("virtqemud_t", "virtd_t"):
        rules = " ".join(blocks[domain].split())
        assert f"can_exec({domain}, gpulib_hook_exec_t)" in rules
        assert f"dev_rw_sysfs({domain})" in rules, "sysfs: vGPUs made and removed"
        for rel, selinux_type in written.items():
            for kind in ("dirs", "files"):
                assert f"manage_{kind}_pattern({domain}, {selinux_type}, {selinux_type})" \
                    in rules, (domain, rel, selinux_type)
        # each directory a hook may make: a file transition gives it gpulib's type
        for rel in (STATE_DIR, LOG_DIR, os.path.dirname(domstatus.CACHE_FILE), mdevctl.MDEVCTL_DIR):
            name = os.path.basename(rel)
            assert re.search(rf'filetrans\w*\({domain}, (\w+, )?{written[rel]}, dir, "{name}"\)',
                             rules), (domain, rel)
    # mdevctl reads the definitions again (udev at boot, libvirt's node device driver)
    for reader in ("udev_t", "virtnodedevd_t"):
        assert "gpulib_mdevctl_conf_t" in blocks[reader], reader


@pytest.mark.skipif(not SELINUX_MAKEFILE.exists() or shutil.which("checkmodule") is None
                    or shutil.which("semodule_package") is None,
                    reason="SELinux's policy build tools are missing (apt-get install "
                           "selinux-policy-dev checkpolicy semodule-utils)")
def test_selinux_module_compiles(tmp_path: Path) -> None:
    """The module the rpm builds from source (`make -f
    /usr/share/selinux/devel/Makefile gpulib.pp`), here against Debian's
    reference policy headers: its syntax, its interfaces, its file contexts."""
    for f in SELINUX.iterdir():
        shutil.copy(f, tmp_path / f.name)
    r = subprocess.run(["make", "-f", str(SELINUX_MAKEFILE), "gpulib.pp"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    pp = tmp_path / "gpulib.pp"
    assert pp.stat().st_size > 1000
    if shutil.which("sedismod") is None:
        return
    # What the compiled module declares: its four types.
    listing = subprocess.run(["sedismod", str(pp)], input="1\nq\n", capture_output=True,
                             text=True, timeout=60).stdout
    for selinux_type in ("gpulib_hook_exec_t", "gpulib_conf_t", "gpulib_var_lib_t",
                         "gpulib_log_t", "gpulib_var_run_t", "gpulib_mdevctl_conf_t"):
        assert selinux_type in listing, listing[-2000:]


def _stand_in(tmp_path: Path) -> tuple[Path, Path, Path]:
    """preinst's stand-in written over a fake old executable, with its lock
    directory and saved copies below tmp_path: (executable, hall, saved dir)."""
    preinst = (DEBIAN / "gpulib.preinst").read_text(encoding="utf-8")
    func = re.search(r"^write_stand_in\(\) \{\n.*?^\}\n", preinst, re.M | re.S)
    assert func
    hall = tmp_path / "pkg" / "hooks"
    hall.mkdir(parents=True)
    saved = tmp_path / "run" / "saved"
    saved.mkdir(parents=True)
    exe = tmp_path / "libexec" / "libvirt-vm-state-change"
    exe.parent.mkdir()
    exe.write_text("#!/usr/bin/python3\nprint('old release')\n")
    r = subprocess.run(["sh", "-c", f'{func.group(0)}\nwrite_stand_in "$1"', "sh", str(exe)],
                       env={**os.environ, "PKGDIR": str(tmp_path / "pkg"),
                            "RUNDIR": str(tmp_path / "run")}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe, hall, saved


def test_upgrade_stand_in_waits_then_runs_the_new_release(tmp_path: Path) -> None:
    """Reproduction: a hook started as the stand-in replaced the old file: the
    kernel had read the old file's `#!/usr/bin/python3`, python3 then opened
    the path and found a shell script (SyntaxError, exit 1). The stand-in is a
    Python program; it waits for the upgrade's lock and runs the new file."""
    exe, hall, _ = _stand_in(tmp_path)
    assert exe.read_text().startswith("#!/usr/bin/python3\n# gpulib-upgrade-stand-in\n")
    holder = subprocess.Popen(["flock", "-x", str(hall), "sleep", "1.5"])
    try:
        time.sleep(0.3)
        run = subprocess.Popen([sys.executable, str(exe), "onStart", "vm"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(0.5)
        assert run.poll() is None, "the stand-in did not wait for the upgrade"
        new = exe.with_name(exe.name + ".dpkg-new")
        new.write_text("#!/usr/bin/python3\nimport sys\nprint('new release', sys.argv[1:])\n")
        new.replace(exe)
    finally:
        holder.wait(timeout=10)
    out, err = run.communicate(timeout=30)
    assert (run.returncode, out, err) == (0, b"new release ['onStart', 'vm']\n", b"")


def test_upgrade_stand_in_after_a_failed_upgrade(tmp_path: Path) -> None:
    """dpkg put the stand-in back with the old files: it restores the saved
    old executable and runs it; with nothing saved, one line and exit 3."""
    exe, _, saved = _stand_in(tmp_path)
    r = subprocess.run([sys.executable, str(exe)], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (3, "")
    assert r.stderr == "libvirt-vm-state-change: gpulib is being upgraded: nothing was done; " \
                       "run it again\n"
    (saved / exe.name).write_text("#!/usr/bin/python3\nprint('old release')\n")
    r = subprocess.run([sys.executable, str(exe)], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "old release\n", "")
    assert exe.read_text() == "#!/usr/bin/python3\nprint('old release')\n"


def _spec_pre(tmp_path: Path) -> str:
    """The rpm's %pre as rpm runs it (its macros expanded)."""
    if shutil.which("rpmspec") is None:
        pytest.skip("rpmspec (rpm) is not installed")
    r = subprocess.run(["rpmspec", "-P", "--define", "gpulib_version 0.2.0.1", str(SPEC)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pre = re.search(r"^%pre\n(.*?)^%posttrans\n", r.stdout, re.M | re.S)
    assert pre
    return pre.group(1)


def test_the_rpm_has_the_deb_s_stand_in_for_old_executables(tmp_path: Path) -> None:
    """An rpm upgrade from an rpm without the installation lock: its executables, which
    do not wait, are replaced for the unpack by the .deb's stand-in (the same functions,
    word for word), and a hook run in a loop through the upgrade meets the old release,
    the stand-in (which waits, then runs the new one) or the new release: never a mix."""
    preinst = (DEBIAN / "gpulib.preinst").read_text(encoding="utf-8")
    pre = _spec_pre(tmp_path)
    assert subprocess.run(["sh", "-n"], input=pre, text=True).returncode == 0
    start = pre.index("# --- the Debian package's preinst, from here ---\n")
    end = pre.index("# --- to here ---\n")
    functions = pre[start:end].split("\n", 1)[1]
    for name in ("write_stand_in", "stand_in_for_old_executables", "old_runs"):
        theirs = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", preinst, re.M | re.S)
        ours = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", functions, re.M | re.S)
        assert theirs and ours and ours.group(0) == theirs.group(0), name
    # an installation of the rpm from before the lock: no installation.py
    pkg = tmp_path / "site" / "gpulib"
    (pkg / "hooks").mkdir(parents=True)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "libvirt-vm-state-change"
    exe.write_text("#!/usr/bin/python3\nprint('old release')\n")
    run = tmp_path / "run"
    # %pre calls it on an upgrade once it holds the installation
    assert re.search(r'-d "\$PKGDIR/hooks" \]; then\n\s+stand_in_for_old_executables\n', pre[end:])
    script = (f"PKGDIR={pkg}\nRUNDIR={run}\nEXECUTABLES={exe}\nHOOKS=/nonexistent\n"
              f"QEMUHOOK=/nonexistent\n{functions}stand_in_for_old_executables\n")
    # hooks in a loop, through the upgrade
    marker = tmp_path / "done"
    loop = subprocess.Popen(
        ["sh", "-c", f'while [ ! -e "{marker}" ]; do {sys.executable} "{exe}" 2>&1; '
                     'echo "rc=$?"; done'], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    holder = subprocess.Popen(["flock", "-x", str(pkg / "hooks"), "sh", "-c",
                               f'sh -c "$1" && sleep 1 && '
                               f'printf "#!/usr/bin/python3\\nprint(\'new release\')\\n" '
                               f'> "{exe}.rpmnew" && mv "{exe}.rpmnew" "{exe}"', "sh", script],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert (run / "saved" / exe.name).read_text() == "#!/usr/bin/python3\nprint('old release')\n"
    time.sleep(0.5)
    marker.touch()
    seen, _ = loop.communicate(timeout=60)
    runs = seen.strip().split("rc=")
    lines = [line for line in seen.splitlines() if not line.startswith("rc=")]
    assert set(lines) <= {"old release", "new release"}, seen[-2000:]
    assert "old release" in lines and "new release" in lines
    assert all(r.startswith("0") for r in runs[1:]), seen[-2000:]
