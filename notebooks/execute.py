"""Execute the notebooks and store them with their outputs.

    python notebooks/execute.py                   # every notebook
    python notebooks/execute.py 02-remote-models-pymc.ipynb

Each notebook runs from top to bottom in a fresh kernel of this interpreter, in a temporary
directory (what it writes stays out of the repository), and is stored with its outputs and,
in its metadata, a hash of its code cells.  ``tests/test_notebooks.py`` reads both: a
notebook whose code cells no longer match the hash is stale (run this script again), and
stored outputs must stay within the budgets below and show nothing of the machine that ran
them (addresses with ports, paths, memory addresses).  A cell tagged ``remove-output``
(printing the dashboard's address, say) is run but stored without its output.

The stored outputs are those of the interpreter that ran this script; the README says
which line that was (the last cell of each notebook prints the versions).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat

NOTEBOOK_DIR = Path(__file__).resolve().parent
#: bytes of stored outputs per notebook, and per figure
BUDGET = 300_000
FIGURE_BUDGET = 90_000
#: tag of cells whose outputs are not stored
REMOVE_OUTPUT = "remove-output"
#: what stored outputs must not show: addresses with ports, paths, memory addresses
MACHINE_SPECIFIC = re.compile(
    r"\b(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\d+\.\d+\.\d+\.\d+):\d+"
    r"|\b(?:tcp|tls|inproc|ucx|ws)://"
    r"|(?:^|[\s'\"(=])/(?:tmp|home|root|work|Users|var|opt|usr)/"
    r"|site-packages|dask-scratch-space"
    r"| at 0x[0-9a-f]{6,}"
)
CELL_TIMEOUT = 180  # seconds


def code_hash(nb) -> str:
    """SHA-256 of the notebook's code cells, in order (outputs and markdown left out)."""
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def staleness(nb) -> str | None:
    """Why the stored outputs are not those of the stored code, or None."""
    stored = nb.metadata.get("dasktensor", {}).get("code_sha256")
    if stored is None:
        return "it holds no record of an execution (metadata.dasktensor.code_sha256)"
    if stored != code_hash(nb):
        return "its code cells changed since it was executed"
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    if counts != list(range(1, len(counts) + 1)):
        return f"its code cells were not run once each from the top (counts {counts})"
    return None


def _texts(output) -> list[str]:
    """The text of an output, images left out."""
    if output.output_type == "stream":
        return [output.text]
    if output.output_type == "error":
        return ["\n".join(output.traceback)]
    data = output.get("data", {})
    return [
        v if isinstance(v, str) else json.dumps(v)
        for k, v in data.items()
        if "image/" not in k or k == "image/svg+xml"
    ]


def output_problems(nb) -> list[str]:
    """What is wrong with a notebook's stored outputs: errors, sizes, machine details."""
    problems = []
    total = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tags = cell.metadata.get("tags", [])
        if REMOVE_OUTPUT in tags and cell.outputs:
            problems.append(f"cell {i} is tagged {REMOVE_OUTPUT} but stores outputs")
        total += len(json.dumps(cell.outputs))
        for output in cell.outputs:
            if output.output_type == "error":
                problems.append(f"cell {i} stores an error: {output.ename}: {output.evalue}")
            for mime, value in output.get("data", {}).items():
                if mime.startswith("image/") and len(value) > FIGURE_BUDGET:
                    problems.append(
                        f"cell {i}: a figure of {len(value):,} bytes (budget {FIGURE_BUDGET:,}): "
                        "make it smaller (figsize, dpi)"
                    )
            for text in _texts(output):
                for match in MACHINE_SPECIFIC.finditer(text):
                    around = text[max(match.start() - 40, 0) : match.end() + 40]
                    problems.append(
                        f"cell {i} shows {match.group()!r} of this machine: {around!r}"
                    )
    if total > BUDGET:
        problems.append(f"outputs of {total:,} bytes (budget {BUDGET:,})")
    return problems


def execute(path: Path):
    """Run the notebook at ``path`` in a kernel of this interpreter; the executed notebook."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from traitlets import default

    nb = nbformat.read(path, as_version=4)
    kernelspec = nb.metadata.get("kernelspec")
    with tempfile.TemporaryDirectory(prefix="dasktensor-notebook-") as work:
        # a kernel spec of this interpreter, found nowhere else (a "python3" spec may run
        # another interpreter, without this dasktensor)
        kernels = Path(work) / "kernels"
        write_kernel_spec(kernels / "dasktensor-notebook", overrides={"display_name": "run"})

        class KernelManager(AsyncKernelManager):
            @default("kernel_spec_manager")
            def _these_kernels_only(self):
                return KernelSpecManager(kernel_dirs=[str(kernels)])

        client = NotebookClient(
            nb,
            kernel_name="dasktensor-notebook",
            kernel_manager_class=KernelManager,
            timeout=CELL_TIMEOUT,
            record_timing=False,
            resources={"metadata": {"path": work}},
        )
        client.execute(env={**os.environ, "IPYTHONDIR": str(Path(work) / ".ipython")})
    for cell in nb.cells:
        if cell.cell_type == "code" and REMOVE_OUTPUT in cell.metadata.get("tags", []):
            cell.outputs = []
    if kernelspec is not None:  # the kernel a reader opens it with, not this run's
        nb.metadata["kernelspec"] = kernelspec
    nb.metadata["dasktensor"] = {"code_sha256": code_hash(nb)}
    return nb


def main(argv: list[str]) -> int:
    paths = [NOTEBOOK_DIR / a for a in argv] or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    failed = False
    for path in paths:
        print(f"{path.name}: executing", flush=True)
        nb = execute(path)
        nbformat.write(nb, path)
        problems = output_problems(nb)
        size = sum(len(json.dumps(c.outputs)) for c in nb.cells if c.cell_type == "code")
        print(f"{path.name}: stored, outputs {size:,} bytes")
        for problem in problems:
            print(f"  problem: {problem}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
