"""The import rules the reports' speed and the core's shape rest on
(ARCHITECTURE.md, "Module map" and "Layers").

`gpulib discover` and `gpulib metrics` load neither `typing` nor `logging`:
names for type checkers sit under `if TYPE_CHECKING:` with `TYPE_CHECKING =
False`, which mypy reads as typing's, so mypy cannot see such a name used at
runtime. The static check below can.

The import graph, read from the source, is held to ARCHITECTURE.md's Layers:
no cycles (a function's import and a type checker's count too), every module
in a layer and importing only from its own layer or below, the simulator
plugged in at one place, nothing importing the command line, no click on the
hooks' paths; and the GPU start path loads none of the standard library's
heavy modules beyond what lxml.etree loads itself. The analyser is checked on
synthetic graphs and trees first, so a rule that could not fail would show.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpulib.context import LOG_DIR
from tests.hookrun import hook_env
from tests.hosts import demo_host, t4_farm, t4_host

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gpulib"


def _type_checking_blocks(tree: ast.AST) -> list[ast.If]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.If) and
            isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"]


def _bound(nodes: list[ast.stmt]) -> set[str]:
    """The module-level names `nodes` bind (imports, assignments, classes,
    functions; not what the bodies of classes and functions bind)."""
    names: set[str] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo.extend(c for c in ast.iter_child_nodes(n) if isinstance(c, ast.stmt))
    return names


def names_for_type_checkers_used_at_runtime(source: str) -> list[tuple[int, str]]:
    """(line, name) of each name bound only under `if TYPE_CHECKING:` and
    read outside annotations (postponed: never evaluated) and such blocks."""
    tree = ast.parse(source)
    blocks = _type_checking_blocks(tree)
    checker_only = _bound([s for b in blocks for s in b.body])
    runtime: list[ast.stmt] = []
    for stmt in tree.body:
        runtime.extend(stmt.orelse if isinstance(stmt, ast.If) and stmt in blocks else [stmt])
    checker_only -= _bound(runtime)
    skipped: set[int] = set()
    for b in blocks:
        skipped.update(id(x) for s in b.body for x in ast.walk(s))
    # A function's own import binds the name where it is used.
    checker_only -= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped
                     for a in n.names}
    for n in ast.walk(tree):
        annotations: list[ast.expr] = []
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            annotations += [x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs,
                                                   a.vararg, a.kwarg]
                            if x is not None and x.annotation is not None]
            if n.returns is not None:
                annotations.append(n.returns)
        elif isinstance(n, ast.AnnAssign):
            annotations.append(n.annotation)
        skipped.update(id(x) for e in annotations for x in ast.walk(e))
    return sorted((n.lineno, n.id) for n in ast.walk(tree)
                  if isinstance(n, ast.Name) and n.id in checker_only and id(n) not in skipped)


def test_no_module_uses_a_name_for_type_checkers_at_runtime() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, name in names_for_type_checkers_used_at_runtime(
                 path.read_text(encoding="utf-8"))]
    assert found == []


def test_the_check_finds_a_runtime_use() -> None:
    source = textwrap.dedent("""
        from __future__ import annotations
        TYPE_CHECKING = False
        if TYPE_CHECKING:
            from typing import Optional, cast
            Alias = dict[str, int]
            class Fields: ...
        else:
            Fields = tuple

        def f(x: Optional[int], y: Alias) -> Fields:
            z: Optional[int] = cast(int, x)
            return Fields((z, Alias))
    """)
    assert names_for_type_checkers_used_at_runtime(source) == [(12, "cast"), (13, "Alias")]


@pytest.mark.parametrize("args", [["discover", "--format", "cloudstack"], ["discover"],
                                  ["metrics"]])
def test_the_reports_load_neither_logging_nor_typing(tmp_path: Path, args: list[str]) -> None:
    """What the agent and the metrics timer run every minute, on a host with
    vGPUs, VMs and a declared pool."""
    host = t4_farm(str(tmp_path))
    # Against what the interpreter loaded before gpulib: a development
    # install's import finder loads typing on older Pythons (importlib.abc).
    code = textwrap.dedent(f"""
        import sys
        before = set(sys.modules)
        from gpulib.cli import main
        rc = main({args!r})
        sys.stdout.flush()
        loaded = [m for m in ("logging", "typing") if m in sys.modules and m not in before]
        if loaded:
            sys.stderr.write(f"loaded {{loaded}}")
            sys.exit(99)
        sys.exit(rc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=hook_env(host.root))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert not Path(host.root, LOG_DIR).exists()


# == the import graph ==========================================================================

TOP, LAZY, TYPING = "import", "lazy", "typing"


# -- the analyser ----------------------------------------------------------------------------

def modules_of(package: Path) -> dict[str, Path]:
    """Every module of the package below `package` (a directory), by dotted name."""
    out = {}
    base = package.parent
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(package: Path) -> dict[str, dict[str, str]]:
    """module -> {imported module: how}, how being the strongest of TOP (at
    import), LAZY (inside a function) and TYPING (under TYPE_CHECKING).
    Modules of the package are named exactly (`from gpulib import mdev` is
    gpulib.mdev); outside ones by their top-level name (click, lxml)."""
    mods = modules_of(package)
    root = package.name
    rank = {TOP: 0, LAZY: 1, TYPING: 2}
    graph: dict[str, dict[str, str]] = {m: {} for m in mods}

    def known(name: str) -> str:
        if not (name == root or name.startswith(root + ".")):
            return name.split(".")[0]
        while name not in mods and "." in name:
            name = name.rpartition(".")[0]
        return name

    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"

        def add(target: str, how: str, mod: str = mod) -> None:
            target = known(target)
            if target == mod:
                return
            old = graph[mod].get(target)
            if old is None or rank[how] < rank[old]:
                graph[mod][target] = how

        def visit(node: ast.AST, how: str, is_pkg: bool = is_pkg, mod: str = mod) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.body:
                    visit(child, TYPING)
                for child in node.orelse:
                    visit(child, how)
                return
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and \
                    how == TOP:
                how = LAZY
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, how)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in mods else base, how)
            for child in ast.iter_child_nodes(node):
                visit(child, how)

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), TOP)
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def reachable(graph: dict[str, dict[str, str]], start: list[str],
              kinds: tuple[str, ...] = (TOP, LAZY)) -> set[str]:
    seen = set(start)
    todo = list(start)
    while todo:
        for target, how in graph.get(todo.pop(), {}).items():
            if how in kinds and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def layers_of(architecture: str) -> list[tuple[str, list[str]]]:
    """The layers ARCHITECTURE.md lists under "## Layers", bottom first: a line
    `N. **name**: `module`, `package/`, ...`."""
    section = architecture.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in re.split(r"\n(?=\d+\. )", section):
        m = re.match(r"\d+\. \*\*([a-z -]+)\*\*[^:]*:(.*)", line.split("\n\n")[0], re.S)
        if m:
            out.append((m.group(1), re.findall(r"`([a-z_./]+)`", m.group(2))))
    return out


def layer_map(mods: list[str], layers: list[tuple[str, list[str]]],
              root: str = "gpulib") -> tuple[dict[str, int], list[str]]:
    """Each module's layer (its position, bottom 0) and the modules no layer names.
    A name ending in `/` is a subpackage and everything in it."""
    where: dict[str, int] = {}
    for i, (_, names) in enumerate(layers):
        for name in names:
            where[f"{root}.{name.rstrip('/').replace('/', '.')}" if name != root else root] = i
    out, missing = {}, []
    for m in mods:
        probe = m
        while probe not in where and "." in probe:
            probe = probe.rpartition(".")[0]
        if probe in where and (probe == m or probe != root):
            out[m] = where[probe]
        else:
            missing.append(m)
    return out, missing


def upward(graph: dict[str, dict[str, str]], layer: dict[str, int],
           kinds: tuple[str, ...] = (TOP, LAZY, TYPING)) -> list[str]:
    """Every import of a module from a higher layer than its own."""
    return [f"{m} -> {t} ({how})" for m, targets in sorted(graph.items())
            for t, how in sorted(targets.items())
            if how in kinds and t in layer and m in layer and layer[t] > layer[m]]


# -- the analyser can fail --------------------------------------------------------------------

def test_a_cycle_in_a_synthetic_graph_is_found() -> None:
    graph = {"a": {"b": TOP}, "b": {"c": LAZY}, "c": {"a": TYPING}, "d": {"a": TOP}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    del graph["c"]["a"]
    assert find_cycles(graph) == []


def test_the_reader_counts_a_functions_import_and_a_type_checkers(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (pkg / "b.py").write_text("TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from .c import X\n")
    (pkg / "c.py").write_text("import pkg.a\nimport click\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b": LAZY}
    assert graph["pkg.b"] == {"pkg.c": TYPING}
    assert graph["pkg.c"] == {"pkg.a": TOP, "click": TOP}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert "click" in reachable(graph, ["pkg.a"], (TOP, LAZY, TYPING))
    assert "click" not in reachable(graph, ["pkg.a"])  # only through a type checker's import


def test_an_upward_import_and_an_unplaced_module_are_found() -> None:
    layers = layers_of("intro\n## Layers\n\n1. **low**: `x`, `sub/`\n2. **high**: `y`\n"
                       "\nBesides: `z`.\n\n## Next\n3. **not**: `z`\n")
    assert layers == [("low", ["x", "sub/"]), ("high", ["y"])]
    layer, missing = layer_map(["gpulib.x", "gpulib.sub.deep", "gpulib.y", "gpulib.z"], layers)
    assert layer == {"gpulib.x": 0, "gpulib.sub.deep": 0, "gpulib.y": 1}
    assert missing == ["gpulib.z"]
    graph = {"gpulib.x": {"gpulib.y": LAZY}, "gpulib.y": {"gpulib.x": TOP}}
    assert upward(graph, layer) == ["gpulib.x -> gpulib.y (lazy)"]


# -- the package ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, str]]:
    return import_graph(PACKAGE)


def test_the_package_has_no_import_cycle(graph: dict[str, dict[str, str]]) -> None:
    cycles = find_cycles(graph)
    shown = ["; ".join(f"{m} -> {t} ({how})" for m in c for t, how in graph[m].items()
                       if t in c) for c in cycles]
    assert cycles == [], "import cycles:\n" + "\n".join(shown)


def test_every_module_imports_from_its_own_layer_or_below(
        graph: dict[str, dict[str, str]]) -> None:
    layers = layers_of((REPO / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert [name for name, _ in layers][:2] == ["base", "host"], layers
    layer, missing = layer_map(sorted(graph), layers)
    assert missing == [], f"modules ARCHITECTURE.md's Layers do not place: {missing}"
    assert upward(graph, layer) == []


def test_only_gpulib_simulates_entry_point_names_the_simulator(
        graph: dict[str, dict[str, str]]) -> None:
    users = sorted(m for m, targets in graph.items() if not m.startswith("gpulib.sim")
                   for t in targets if t == "gpulib.sim" or t.startswith("gpulib.sim."))
    assert users == ["gpulib.entry"]
    # One import there, inside the function that honours GPULIB_SIMULATE.
    tree = ast.parse((PACKAGE / "entry.py").read_text(encoding="utf-8"))
    sim_imports = [(n, f.name) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                   for n in ast.walk(f) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("gpulib.sim")]
    assert [name for _, name in sim_imports] == ["context_for_root"]
    assert graph["gpulib.entry"]["gpulib.sim.plug"] == LAZY
    # The executables the package installs do not name it either.
    for hook in (REPO / "hooks").iterdir():
        assert "gpulib.sim" not in hook.read_text(encoding="utf-8"), hook


def test_nothing_outside_the_command_line_imports_it(graph: dict[str, dict[str, str]]) -> None:
    users = sorted(f"{m} -> {t}" for m, targets in graph.items()
                   if not (m == "gpulib.cli" or m.startswith("gpulib.cli."))
                   for t in targets if t == "gpulib.cli" or t.startswith("gpulib.cli."))
    assert users == []


def test_the_hooks_paths_never_reach_click(graph: dict[str, dict[str, str]]) -> None:
    # Every import a hook's run could make, a function's included (a type
    # checker's is never run).
    starts = ["gpulib.hooks.transformer", "gpulib.hooks.qemu", "gpulib.hooks.statechange"]
    found = reachable(graph, starts)
    assert "gpulib.hooks.prepare" in found and "lxml" in found  # the walk goes deep
    assert "click" not in found
    assert not any(m.startswith("gpulib.cli") for m in found)


def test_what_runs_is_asked_of_liveness_alone(graph: dict[str, dict[str, str]]) -> None:
    askers = []
    for mod, path in modules_of(PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "gpulib.domstatus" and \
                    {"running_domains", "running_names"} & {a.name for a in node.names}:
                askers.append(mod)
            if isinstance(node, ast.Attribute) and node.attr in ("running_domains",
                                                                 "running_names") and \
                    isinstance(node.value, ast.Name) and node.value.id == "usage":
                askers.append(mod)
    assert sorted(set(askers)) == ["gpulib.liveness"]


# -- the GPU start path's modules ----------------------------------------------------------------

# What gpulib must not load on a start: the standard library's code-reading
# modules (inspect and what it brings), gzip, and click (the CLI's).
HEAVY = ("inspect", "ast", "dis", "tokenize", "gzip", "click", "dataclasses")

DRIVER = """
import os, sys
out = sys.argv.pop(1)
sys.argv.pop(0)
import lxml.etree  # the floor: what lxml loads itself is not gpulib's
floor = set(sys.modules)
# Every import statement gpulib's code runs, of a module loaded already or not
# (lxml may have loaded it first: gpulib asking for it still counts).
import builtins
real_import = builtins.__import__
asked = set()
def spy(name, globals=None, locals=None, fromlist=(), level=0):
    caller = (globals or {}).get("__name__") or ""
    if caller.startswith("gpulib") and not level:
        asked.add(name.split(".")[0])
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = spy
def dump():
    with open(out, "w") as fh:
        fh.write("\\n".join(sorted(set(sys.modules) - floor)) + "\\n--\\n"
                 + "\\n".join(sorted(sys.modules)) + "\\n--\\n" + "\\n".join(sorted(asked)))
real_exit = os._exit
os._exit = lambda code: (dump(), real_exit(code))
import atexit
atexit.register(dump)
path = sys.argv[0]
exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__", "__file__": path})
"""


UUID = "6c3f9a1e-2d4b-4f8a-b5c7-0e1d2a3b4c5d"  # the vGPU the fixture's hostdev names


def start_path_modules(tmp_path: Path, hook: str, args: list[str], stdin: bytes | None
                       ) -> tuple[set[str], set[str], set[str]]:
    """The modules a GPU start through `hook` loads beyond `import lxml.etree`
    alone, all it has loaded, and the top-level names gpulib's own import
    statements asked for (a T4 host whose vGPU the domain names)."""
    host = t4_host(str(tmp_path), live=(UUID,))
    xml = (REPO / "tests" / "data" / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    listing = tmp_path / "modules.txt"
    argv = [a.replace("{xml}", xml) for a in args]
    r = subprocess.run([sys.executable, str(driver), str(listing), str(REPO / "hooks" / hook),
                        *argv], env=hook_env(host.root),
                       input=stdin.replace(b"{xml}", xml.encode()) if stdin else None,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    added, everything, asked = listing.read_text().split("\n--\n")
    return set(added.split()), set(everything.split()), set(asked.split())


@pytest.mark.parametrize("hook,args,stdin", [
    ("libvirt-vm-xml-transformer", ["transform", "{xml}"], None),
    ("gpulib-qemu-hook", ["i-2-52-VM", "prepare", "begin", "-"], b"{xml}"),
], ids=["transformer", "prepare-begin"])
def test_the_gpu_start_path_loads_no_heavy_module(tmp_path: Path, hook: str, args: list[str],
                                                  stdin: bytes | None) -> None:
    added, everything, asked = start_path_modules(tmp_path, hook, args, stdin)
    assert "gpulib.hooks.prepare" in added and "gpulib.domain" in added  # a GPU start ran
    assert {"lxml", "os"} <= asked  # the spy saw gpulib's imports
    assert sorted(set(HEAVY) & asked) == []  # gpulib asks for none of them
    assert sorted(set(HEAVY) & added) == []  # nor does what it loads, beyond lxml
    assert "click" not in everything


def loaded_by(argv: list[str], env: dict[str, str]) -> set[str]:
    """The modules a run of a hook executable imported (python -X importtime)."""
    res = subprocess.run([sys.executable, "-X", "importtime", *argv], env=env,
                         capture_output=True, timeout=60)
    return {line.rpartition("|")[2].strip()
            for line in res.stderr.decode(errors="replace").splitlines()
            if line.startswith("import time:")}


def test_a_start_with_nothing_to_log_never_loads_logging(tmp_path: Path) -> None:
    """The first start of a VM logs the vGPU it makes (logging loaded, the
    lines in the log); the same start again has nothing to say and loads no
    logging, nor what logging brings."""
    host = demo_host(str(tmp_path))
    xml = (Path(__file__).parent / "data" / "cloudstack-xml" / "vgpu-mdev.xml").read_text()
    argv = [str(Path(__file__).resolve().parents[1] / "hooks" / "libvirt-vm-xml-transformer"),
            "transform", xml]
    env = hook_env(host.root)
    log = Path(host.root, LOG_DIR, "gpulib.log")
    first = loaded_by(argv, env)
    assert "logging" in first and "created mdev" in log.read_text()
    logged = log.read_text()
    again = loaded_by(argv, env)
    assert "gpulib.hooks.prepare" in again
    assert not again & {"logging", "traceback", "threading"}
    assert log.read_text() == logged
