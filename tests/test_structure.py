"""The package's shape: its layers, no import cycles, modules that import alone, one fork hook.

The layers, from top to bottom; a unit imports only from units of lower layers (and from
itself).  Units side by side in one layer do not import each other.  A subpackage's
private modules are its own: other units import what it exports in its ``__init__``, and
no unit imports another's private names.  ``dasktensor_worker`` imports nothing of
dasktensor.  Size is a guideline (a few hundred lines a module, see the contributor
guide), not a test: a cap makes code move to get under it, not to where it belongs.

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

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dasktensor", "dasktensor_worker")

#: top to bottom; a unit is a subpackage of dasktensor, or a group of top-level modules
LAYERS: list[dict[str, set[str]]] = [
    {"cli": {"dasktensor.cli", "dasktensor.__main__"}},
    {"api": {"dasktensor", "dasktensor._function", "dasktensor._linker"}},
    {
        "sampling": {"dasktensor.sampling"},
        "dataparallel": {"dasktensor.dataparallel"},
        "sharding": {"dasktensor.sharding"},
    },
    {"engine": {"dasktensor.engine"}},
    {"remote": {"dasktensor.remote"}},
    {"cluster": {"dasktensor.cluster"}, "ops": {"dasktensor.ops"}},
    {
        "placement": {"dasktensor._placement"},
        "display": {"dasktensor._display"},
        "config": {"dasktensor._config"},
        "compat": {"dasktensor._compat"},
        "runtime": {"dasktensor._runtime"},
    },
]
#: the worker side, a package of its own below everything (it imports nothing of dasktensor)
WORKER = "dasktensor_worker"


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


def unit_of(module: str) -> str | None:
    """The unit of ``module``: the layer table's name for it, ``WORKER``, or None."""
    if module == WORKER or module.startswith(WORKER + "."):
        return WORKER
    for layer in LAYERS:
        for unit, roots in layer.items():
            if any(
                module == r or (r != "dasktensor" and module.startswith(r + ".")) for r in roots
            ):
                return unit
    return None


def rank(unit: str) -> int:
    """The layer of ``unit``, 0 at the top."""
    if unit == WORKER:
        return len(LAYERS)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def import_statements(name: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, imported module, imported names)`` of every import in ``name``'s body
    (function-level ones included), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.append((node.lineno, base, [a.name for a in node.names]))
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that module ``name`` imports, anywhere in its body."""
    out = set()
    for _, base, names in import_statements(name, path):
        submodules = [f"{base}.{n}" for n in names]
        # `from package import module` imports the module, not the package's own names
        targets = submodules if names and all(m in known for m in submodules) else [base]
        targets += submodules
        out.update(t for t in targets if t in known and t != name and t not in PACKAGES)
    return out


def layering_problems(mods: dict[str, Path]) -> list[str]:
    """What breaks the layering rules (the module docstring), one line each."""
    problems = []
    for name, path in sorted(mods.items()):
        here = unit_of(name)
        if here is None:
            problems.append(f"{name}: in no layer of LAYERS (add its unit there)")
            continue
        for line, base, names in import_statements(name, path):
            if base.split(".")[0] not in PACKAGES or base == name:
                continue
            there = unit_of(base)
            if base == "dasktensor" and names and all(f"dasktensor.{n}" in mods for n in names):
                # `from dasktensor import _config`: the modules themselves
                targets = [f"dasktensor.{n}" for n in names]
                pairs = [(t, unit_of(t), []) for t in targets]
            else:
                pairs = [(base, there, names)]
            for target, unit, imported in pairs:
                where = f"{path.relative_to(ROOT)}:{line}"
                if here == WORKER:
                    if unit != WORKER:
                        problems.append(f"{where}: the worker side imports {target}")
                    continue
                if unit in (here, WORKER):
                    continue
                if rank(unit) <= rank(here):
                    problems.append(
                        f"{where}: {here} (layer {rank(here)}) imports {target} of {unit} "
                        f"(layer {rank(unit)}): only lower layers may be imported"
                    )
                private = [p for p in target.split(".")[1:] if p.startswith("_")]
                if private and not _top_level_module(target):
                    problems.append(f"{where}: imports {target}, private to {unit}")
                private_names = [n for n in imported if n.startswith("_")]
                if private_names:
                    problems.append(f"{where}: imports private {private_names} of {target}")
    return problems


def _top_level_module(module: str) -> bool:
    """A module directly in dasktensor (``dasktensor._config``): the package's own, shared
    by its subpackages."""
    return module.count(".") == 1 and module.startswith("dasktensor.")


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


def test_every_unit_imports_only_from_the_layers_below_it():
    problems = layering_problems(modules())
    assert not problems, "\n".join(problems)


def test_the_layering_check_finds_what_it_is_for(tmp_path):
    """The check itself can fail: an upward import, a private module and a private name
    of another unit, and the worker side importing dasktensor are each reported."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "_runners.py").write_text(
        "from dasktensor.sampling import sample\n"  # up: engine is below sampling
        "from dasktensor.remote._calls import call\n"  # a private module of remote
        "from dasktensor.cluster import _Clients\n"  # a private name of cluster
        "from dasktensor.engine._plan import Plan\n"  # its own unit: fine
    )
    (tmp_path / "wire.py").write_text("from dasktensor import _config\n")
    mods = {
        "dasktensor.engine._runners": tmp_path / "engine" / "_runners.py",
        "dasktensor_worker.wire": tmp_path / "wire.py",
    }
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = layering_problems(mods)
    finally:
        ROOT = saved
    assert len(problems) == 4, problems
    assert "only lower layers may be imported" in problems[0]
    assert "private to remote" in problems[1]
    assert "private ['_Clients']" in problems[2]
    assert "the worker side imports dasktensor" in problems[3]


def test_the_import_graph_has_no_cycle():
    mods = modules()
    graph = {m: imports_of(m, p, set(mods)) for m, p in mods.items()}
    # the check itself can fail: a two-module cycle is found
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """``import M`` of a module of ``dasktensor`` first runs the package's
    ``__init__``, which imports most modules: for those ``import M`` is exactly
    ``import dasktensor``, run once here.  Every other module (those the package
    imports lazily, and ``dasktensor_worker``'s, whose package imports nothing of
    dasktensor) is imported alone in an interpreter of its own."""

    def run(code):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        return code, done.returncode, done.stdout, done.stderr[-2000:]

    code, rc, out, err = run("import sys, dasktensor; print(' '.join(sorted(sys.modules)))")
    assert rc == 0, f"import dasktensor failed:\n{err}"
    with_package = set(out.split())
    alone = [
        m
        for m in modules()
        if m != "dasktensor" and not (m.startswith("dasktensor.") and m in with_package)
    ]
    assert 0 < len(alone) < len(modules())  # (the package does import some of its modules)
    with ThreadPoolExecutor(2) as pool:
        failed = [r for r in pool.map(run, [f"import {m}" for m in alone]) if r[1] != 0]
    assert not failed, "\n\n".join(f"{c} failed:\n{err}" for c, _, _, err in failed)


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


def fork_state_problems(mods: dict[str, Path]) -> list[str]:
    """Module-level locks, thread pools and fork hooks outside ``dasktensor._runtime``."""
    made_per_process = {"Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition"}
    made_per_process |= {"ThreadPoolExecutor", "register_at_fork"}
    problems = []
    for name, path in sorted(mods.items()):
        if name == "dasktensor._runtime" or unit_of(name) == WORKER:
            continue  # the runtime itself; the worker side keeps its own (one lock, one hook)
        tree = ast.parse(path.read_text())
        at_import = _run_at_import(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if isinstance(node.func, ast.Name):
                called = node.func.id
            if called == "register_at_fork":
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: a fork hook")
            elif called in made_per_process and id(node) in at_import:
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: a module-level {called}")
    return problems


def _run_at_import(tree: ast.Module) -> set[int]:
    """The ids of the nodes that run when the module is imported: outside functions
    (class bodies included: a class attribute is shared by the process)."""
    found: set[int] = set()

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        found.add(id(node))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_per_process_state_lives_in_the_runtime():
    """Locks, pools and fork hooks kept per module would each need a reset after fork;
    they come from ``dasktensor._runtime`` instead (its docstring says why)."""
    problems = fork_state_problems(modules())
    assert not problems, "\n".join(
        problems
        + ["keep such state in a dasktensor._runtime.ProcessState, locks from runtime.lock()"]
    )


def test_the_fork_state_check_finds_a_module_lock(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os, threading\n_lock = threading.Lock()\n"
        "def f():\n    return threading.Lock()\n"
        "os.register_at_fork(after_in_child=f)\n"
        "class C:\n    lock = threading.RLock()\n"
        "    def m(self):\n        self.lock = threading.Lock()\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = fork_state_problems({"dasktensor.bad": bad})
    finally:
        ROOT = saved
    assert problems == [
        "bad.py:2: a module-level Lock",
        "bad.py:5: a fork hook",
        "bad.py:7: a module-level RLock",
    ]


def test_the_top_level_holds_few_modules_and_the_families_have_folders():
    top = [p.name for p in (ROOT / "dasktensor").glob("*.py")]
    subpackages = [p.name for p in (ROOT / "dasktensor").iterdir() if (p / "__init__.py").exists()]
    assert len(top) <= 12, sorted(top)
    assert len(subpackages) >= 5, subpackages
