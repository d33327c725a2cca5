"""The ``dasktensor bench`` command: the benchmarks of the source tree, listed or run.

The benchmarks are not part of the installed package: they sit in ``benchmarks/`` beside
the package directory of a clone (installed with ``pip install -e``).
:func:`benchmarks_dir` finds them, :func:`list_benchmarks` reads what ``run_all.py``
knows without importing anything, and the command runs ``run_all.py`` in a subprocess
with this interpreter.  Its arguments are declared with the others in
:func:`dasktensor.cli.main`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from dasktensor.cli._info import table


def benchmarks_dir() -> Path:
    """Where ``dasktensor bench`` finds the benchmarks: ``benchmarks/`` of the source tree.

    The benchmarks are not part of the installed package: they sit beside the
    ``dasktensor`` package directory in a clone of the repository (installed with
    ``pip install -e``).

    Returns
    -------
    pathlib.Path
        The directory holding ``run_all.py``.

    Raises
    ------
    FileNotFoundError
        There is no ``benchmarks/run_all.py`` beside the package (installed from a wheel).
    """
    package = Path(__file__).resolve().parent.parent  # the dasktensor package
    where = package.parent / "benchmarks"
    if not (where / "run_all.py").is_file():
        raise FileNotFoundError(
            f"The benchmarks are not installed with dasktensor: `dasktensor bench` looks "
            f"for them in the source tree, beside the package ({where}), and found no "
            "run_all.py there (dasktensor was installed from a wheel, not from a clone). "
            'Clone the repository, `pip install -e ".[benchmarks]"` in it, and run '
            "`dasktensor bench` (or `python benchmarks/run_all.py`) there."
        )
    return where


def list_benchmarks(where: Path) -> dict[str, tuple[str, str]]:
    """The benchmarks ``run_all.py`` knows: key -> (module, one-line description).

    Read from the source files (``run_all.BENCHMARKS`` and each module's docstring)
    without importing them, so listing costs no import of the benchmarks' dependencies.

    Parameters
    ----------
    where : pathlib.Path
        The benchmarks directory (:func:`benchmarks_dir`).

    Returns
    -------
    dict
        ``{"a": ("bench_a_overhead", "Overhead of the DASK mode ..."), ...}``, in
        ``run_all.py``'s order.
    """
    tree = ast.parse((where / "run_all.py").read_text())
    modules = None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "BENCHMARKS" for t in targets):
            modules = ast.literal_eval(node.value)
    if not isinstance(modules, dict):
        raise ValueError(f"no BENCHMARKS dict in {where / 'run_all.py'}")
    found = {}
    for key, module in modules.items():
        source = where / f"{module}.py"
        doc = ast.get_docstring(ast.parse(source.read_text())) if source.is_file() else None
        line = (doc or "(no description)").strip().splitlines()[0]
        # "(a) Overhead ..." / "P1: one remote ..." -> the key is shown beside it already
        line = re.sub(rf"^(\({re.escape(key)}\)|{re.escape(key)}:)\s*", "", line, flags=re.I)
        found[key] = (module, line)
    return found


def run(args) -> int:
    """The ``bench`` command: list the benchmarks, or run ``run_all.py``; the exit code."""
    try:
        where = benchmarks_dir()
        known = list_benchmarks(where)
    except (FileNotFoundError, ValueError, SyntaxError) as e:
        print(f"dasktensor bench: {e}", file=sys.stderr)
        return 1
    if args.list:
        print(f"Benchmarks in {where} (`dasktensor bench KEY ...`; none given: all):")
        rows = [(key, f"{module}.py", line) for key, (module, line) in known.items()]
        print("\n".join(table(rows)))
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(
            f"dasktensor bench: unknown benchmark(s) {', '.join(unknown)}; "
            f"known: {', '.join(known)} (`dasktensor bench --list` describes them)",
            file=sys.stderr,
        )
        return 2
    command = [sys.executable, str(where / "run_all.py"), *args.names]
    print(
        f"Running {', '.join(args.names or known)} in a subprocess ({' '.join(command)})"
        + ("" if args.names else "; all of them take a long time"),
        flush=True,
    )
    process = subprocess.Popen(command)
    try:
        code = process.wait()
    except KeyboardInterrupt:  # the benchmarks got the Ctrl+C too: let them stop
        code = process.wait()
    if code < 0:  # ended by a signal: the shell's convention
        code = 128 - code
    if code:
        print(
            f"dasktensor bench: run_all.py exited with code {code} (the benchmarks need "
            'the benchmarks extra: pip install -e ".[benchmarks]")',
            file=sys.stderr,
        )
    return code
