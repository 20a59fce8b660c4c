"""The import rules the reports' speed rests on (ARCHITECTURE.md, "Module map").

`gpulib discover` and `gpulib metrics` load neither `typing` nor `logging`:
names for type checkers sit under `if TYPE_CHECKING:` with `TYPE_CHECKING =
False`, which mypy reads as typing's, so mypy cannot see such a name used at
runtime. The static check below can.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpulib.context import LOG_DIR
from tests.hookrun import hook_env
from tests.hosts import t4_farm

PACKAGE = Path(__file__).resolve().parents[1] / "gpulib"


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
