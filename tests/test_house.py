"""The house rules of issue 19, checked on every run: the package root shows its rooms (folders)
and at most three modules; no module over 400 lines and no function over 60; no import cycle
among cmoe's modules (imports inside functions included: a lazy import that closes a cycle is
still a cycle; `if TYPE_CHECKING:` imports and a module's own packages, which Python imports
before it, are not counted); and nothing a dead-code finder (vulture) reports, past the
whitelist of names only Python or a library reads."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "cmoe"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def test_the_root_shows_folders_and_at_most_three_modules():
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert len(loose) <= 3, loose
    assert len([p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()]) >= 8


def test_no_module_over_400_lines_and_no_function_over_60():
    long_files, long_fns = [], []
    for name, p in _modules().items():
        text = p.read_text()
        if text.count("\n") > 400:
            long_files.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long_fns.append((name, node.name, n))
    assert not long_files and not long_fns, (long_files, long_fns)


def _imports(tree: ast.AST, mods: dict) -> set[str]:
    """The cmoe modules a module imports, anywhere in it but under `if TYPE_CHECKING:`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("cmoe."):
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods)
            if node.module in mods:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("cmoe.") and a.name in mods)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(u, path):
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path)
        path.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [])
    return found


def test_no_import_cycle():
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        # a module's own packages (the root among them) are imported before it: never a cycle
        graph[m] = {t for t in _imports(ast.parse(p.read_text()), mods) if t != m and not m.startswith(t + ".")}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_cycle():
    """The check above can fail: two modules importing each other, one of them inside a function."""
    a = ast.parse("from cmoe.x.b import f\n")
    b = ast.parse("def g():\n    from cmoe.x.a import h\n")
    mods = {"cmoe.x.a": None, "cmoe.x.b": None}
    graph = {"cmoe.x.a": _imports(a, mods), "cmoe.x.b": _imports(b, mods)}
    assert _cycles(graph) == [["cmoe.x.a", "cmoe.x.b", "cmoe.x.a"]]
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cmoe.x.a import h\n")
    assert _imports(hidden, mods) == set()


@pytest.mark.skipif(importlib.util.find_spec("vulture") is None, reason="needs vulture (the test extra)")
def test_no_dead_code():
    """vulture over the package, the tests and the benchmarks (a name only tests use is alive)."""
    r = subprocess.run([sys.executable, "-m", "vulture", "cmoe", "tests", "benchmarks", "scripts",
                        "tests/vulture_whitelist.py", "--min-confidence", "60"],
                       cwd=ROOT, capture_output=True, text=True)
    dead = [line for line in r.stdout.splitlines() if line.startswith("cmoe/")]
    assert dead == [], "\n".join(dead)


def _module_aliases(tree: ast.AST, mods: dict) -> dict[str, str]:
    """Names a module binds to another cmoe module (`from cmoe.x import y as z`, `import cmoe.x as z`)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("cmoe"):
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname and a.name in mods})
    return out


def test_every_name_read_through_a_module_alias_exists():
    """`hp.C_SKIPPED` in an engine module that no CPU test runs is an AttributeError found only on the
    GPU (it was, in the twenty-third session): every `alias.NAME` read anywhere in cmoe must name
    something the aliased module defines or re-exports."""
    mods, missing, loaded = _modules(), [], {}
    for name, p in mods.items():
        tree = ast.parse(p.read_text())
        aliases = _module_aliases(tree, mods)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                continue
            target = aliases[node.value.id]
            if target not in loaded:
                try:
                    loaded[target] = importlib.import_module(target)
                except ModuleNotFoundError as e:        # a GPU-only module (triton) on a CPU machine;
                    if (e.name or "").startswith("cmoe"):   # a cmoe import that fails is a failure
                        raise
                    loaded[target] = None
            if loaded[target] is not None and not hasattr(loaded[target], node.attr):
                missing.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not missing, missing


def test_pytest_without_simpy_stops_with_one_line():
    """Where simpy is missing (a GPU machine's bare shell), pytest stops at once with one line
    that says what to do, not with dozens of failed tests (`conftest.NO_SIMPY`)."""
    from tests.conftest import NO_SIMPY
    code = ("import sys; sys.modules['simpy'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '--collect-only', 'tests/test_noise.py', '-p', 'no:cacheprovider']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                       timeout=120)
    assert r.returncode == 4 and f"Exit: {NO_SIMPY}" in r.stdout + r.stderr
