"""The notebooks in ``notebooks/`` run from top to bottom in a kernel of this interpreter.

Each notebook is executed with nbclient in a fresh IPython kernel.  The kernel is started
from a kernel spec written for this test into a temporary directory, whose command is
``sys.executable``: a ``python3`` kernel spec found elsewhere (in ``~/.local/share/jupyter``
for instance) may run another interpreter, without the dasktensor under test.

A notebook starts its own cluster and shuts it down in its last cell: when the last cell
has run, the kernel must have no child processes left (worker processes still running
there mean the notebook leaks them), and after the kernel has stopped, no process of its
session may remain.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from traitlets import default

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 120  # seconds, per cell
KERNEL_NAME = "dasktensor-test"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> Path:
    """A directory with one kernel spec, ``dasktensor-test``, running ``sys.executable``."""
    from ipykernel.kernelspec import write_kernel_spec

    kernels = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(kernels / KERNEL_NAME, overrides={"display_name": "dasktensor test"})
    return kernels


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return _ANSI.sub("", "\n".join(output.traceback))
    data = output.get("data", {})
    return data.get("text/plain", "")


def _cell_report(nb, index: int | None) -> str:
    if index is None:
        return "(no cell had started)"
    cell = nb.cells[index]
    outputs = "".join(_text(o) for o in cell.get("outputs", []))
    return f"cell {index}:\n{cell.source}\n\n--- its output ---\n{outputs}"


def _session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def _live_children(pid: int) -> list[str]:
    """Child processes of ``pid`` still running, other than multiprocessing's helpers."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmdline and "forkserver" not in cmdline:
            found.append(f"{child.pid}: {cmdline[:200]}")
    return found


def _wait_for(check, seconds: float):
    """Poll ``check()`` until it returns something empty or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while True:
        left = check()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _kernel_manager_class(kernel_dir: Path):
    """An AsyncKernelManager that finds kernel specs in ``kernel_dir`` only."""

    class KernelManager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _test_kernels_only(self):
            return KernelSpecManager(kernel_dirs=[str(kernel_dir)])

    return KernelManager


def _run(nb, kernel_dir: Path, cwd: Path):
    """Execute ``nb`` in place; returns (error or None, index of the last cell started,
    children the kernel still had after the last cell, the kernel's session id)."""
    state = {"cell": None, "pid": None, "sid": None, "leftover": []}
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    last = code_cells[-1] if code_cells else None

    def on_start(notebook):
        state["pid"] = client.km.provisioner.pid
        # the kernel leads its own session (jupyter_client starts it with setsid)
        state["sid"] = os.getsid(state["pid"])

    def on_cell_start(cell, cell_index):
        state["cell"] = cell_index

    def on_cell_executed(cell, cell_index, execute_reply):
        if cell_index == last:  # the kernel is still running: its children are not
            state["leftover"] = _wait_for(lambda: _live_children(state["pid"]), 10)

    client = NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        kernel_manager_class=_kernel_manager_class(kernel_dir),
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(cwd)}},
        on_notebook_start=on_start,
        on_cell_start=on_cell_start,
        on_cell_executed=on_cell_executed,
    )
    error = None
    try:
        client.execute(env={**os.environ, "IPYTHONDIR": str(cwd / ".ipython")})
    except Exception as e:  # noqa: BLE001  (CellExecutionError, CellTimeoutError, ...)
        error = e
    return error, state["cell"], state["leftover"], state["sid"]


def _kill_session(sid: int | None) -> list[str]:
    """Wait for the processes of the kernel's session to end; kill and name the rest."""
    if sid is None or sid == os.getsid(0):  # never this process's own session
        return []
    left = _wait_for(lambda: _session_processes(sid), 15)
    names = []
    for proc in left:
        try:
            names.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        except psutil.Error:
            pass
    return names


def test_notebooks_are_stored_without_outputs():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, (
                    f"{path.name}, cell {i}: outputs are stored; strip them "
                    "(e.g. `jupyter nbconvert --clear-output --inplace`)"
                )


@pytest.mark.slow
def test_kernel_runs_this_interpreter(kernel_dir, tmp_path):
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("import sys\nprint(sys.executable)\nprint(sys.prefix)")]
    )
    error, _, _, sid = _run(nb, kernel_dir, tmp_path)
    stray = _kill_session(sid)
    assert error is None, error
    assert not stray, f"processes left after the kernel stopped: {stray}"
    printed = "".join(o.text for o in nb.cells[0].outputs if o.output_type == "stream").split()
    assert printed == [sys.executable, sys.prefix]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_dir, tmp_path):
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    error, cell, leftover, sid = _run(nb, kernel_dir, tmp_path)
    seconds = time.perf_counter() - start
    stray = _kill_session(sid)
    if error is not None:
        pytest.fail(
            f"{path.name} failed after {seconds:.0f} s ({type(error).__name__}) in "
            f"{_cell_report(nb, cell)}",
            pytrace=False,
        )
    assert not leftover, (
        f"{path.name}: processes still running after the last cell (close the cluster "
        f"there): {leftover}"
    )
    assert not stray, f"{path.name}: processes left after the kernel stopped: {stray}"
