"""The package's shape: no import cycles, modules that import alone, sizes a reader can hold.

An import cycle held together by imports inside functions works until someone imports the
modules in another order; these tests read the imports (function-level ones included) and
import every module alone in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dasktensor", "dasktensor_worker")
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 200


def modules() -> dict[str, Path]:
    """``{module name: path}`` of every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name and t not in PACKAGES)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    mods = modules()
    graph = {m: imports_of(m, p, set(mods)) for m, p in mods.items()}
    # the check itself can fail: a two-module cycle is found
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    def run(module):
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        return module, done.returncode, done.stderr[-2000:]

    with ThreadPoolExecutor(2) as pool:
        failed = [r for r in pool.map(run, modules()) if r[1] != 0]
    assert not failed, "\n\n".join(f"import {m} failed:\n{err}" for m, _, err in failed)


def test_the_worker_side_imports_neither_pytensor_nor_dasktensor():
    worker_modules = [m for m in modules() if m.split(".")[0] == "dasktensor_worker"]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in worker_modules)
        + "print(sorted(m for m in ('pytensor', 'pymc', 'dasktensor') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("module", sorted(modules()))
def test_modules_and_classes_stay_small_enough_to_read(module):
    path = modules()[module]
    source = path.read_text()
    n_lines = source.count("\n")
    assert n_lines <= MAX_MODULE_LINES, f"{path.name}: {n_lines} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{module}.{node.name}: {size} lines"
