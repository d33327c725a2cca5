"""The notebooks in ``notebooks/``: stored executed, and run from top to bottom here.

The notebooks are stored with their outputs (``python notebooks/execute.py`` executes and
stores them), so that a reader browsing the repository sees results.  Checks on the stored
files: each holds the hash of the code cells it was executed from (a notebook whose code
changed since is stale), its outputs stay within a size budget, and they show nothing of
the machine that ran them (addresses with ports, paths) that a reader would copy.

Each notebook is also executed with nbclient in a fresh IPython kernel, on each supported
line.  The kernel is started from a kernel spec written for this test into a temporary
directory, whose command is ``sys.executable``: a ``python3`` kernel spec found elsewhere
(in ``~/.local/share/jupyter`` for instance) may run another interpreter, without the
dasktensor under test.  The cells that show figures or HTML in the stored notebook must
show as many when run here (a plot that stops drawing on one line fails).

A notebook starts its own cluster and shuts it down in its last cell: when the last cell
has run, the kernel must have no child processes left (worker processes still running
there mean the notebook leaks them), and after the kernel has stopped, no process of its
session may remain.
"""

from __future__ import annotations

import copy
import importlib.util
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
RICH = ("image/png", "image/svg+xml", "text/html")


def _load_execute():
    """``notebooks/execute.py``, which stores the notebooks and says what a stored one must be."""
    spec = importlib.util.spec_from_file_location("notebooks_execute", NOTEBOOK_DIR / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


execute = _load_execute()


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


def _rich_outputs(nb) -> dict[int, tuple[int, ...]]:
    """Per code cell whose outputs are stored, how many figures and HTML outputs it shows."""
    shown = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or execute.REMOVE_OUTPUT in cell.metadata.get("tags", []):
            continue
        data = [o.get("data", {}) for o in cell.outputs]
        shown[i] = tuple(sum(kind in d for d in data) for kind in RICH)
    return shown


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_notebook_was_executed_from_its_current_code(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    reason = execute.staleness(nb)
    assert reason is None, (
        f"{path.name} is stale: {reason}; store it executed with "
        f"`python notebooks/execute.py {path.name}`"
    )
    assert any(sum(counts) for counts in _rich_outputs(nb).values()), "no figure stored"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_are_small_and_show_nothing_of_the_machine(path):
    problems = execute.output_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_the_stored_notebook_checks_catch_what_they_are_for():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]

    edited = copy.deepcopy(nb)
    next(c for c in edited.cells if c.cell_type == "code").source += "\nprint(1)"
    assert "code cells changed" in execute.staleness(edited)
    unrecorded = copy.deepcopy(nb)
    del unrecorded.metadata["dasktensor"]
    assert "no record" in execute.staleness(unrecorded)
    rerun = copy.deepcopy(nb)
    next(c for c in rerun.cells if c.cell_type == "code").execution_count = len(code) + 1
    assert "not run once each" in execute.staleness(rerun)

    leaky = copy.deepcopy(nb)
    cell = next(c for c in leaky.cells if c.cell_type == "code")
    for text in ["dashboard: http://127.0.0.1:8787/status", "tcp://10.0.0.5", "/tmp/x.zarr"]:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        assert any("of this machine" in p for p in execute.output_problems(leaky)), text
    cell.outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="no", traceback=[])]
    assert any("stores an error" in p for p in execute.output_problems(leaky))
    big = "A" * (execute.FIGURE_BUDGET + 1)
    cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": big})]
    assert any("a figure of" in p for p in execute.output_problems(leaky))
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="x" * execute.BUDGET)]
    assert any("budget" in p for p in execute.output_problems(leaky))


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
    stored = _rich_outputs(nb)
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
    shown = _rich_outputs(nb)
    differ = {i: (stored[i], shown[i]) for i in stored if stored[i] != shown[i]}
    assert not differ, (
        f"{path.name}: cells show other figures/HTML ({', '.join(RICH)}) than stored "
        f"(cell: (stored, now)): {differ}"
    )
