"""Task runners: the callables that Dask runs, one per task of a plan.

A runner holds a *copy* of its task's subgraph, with fresh input variables, and compiles
it on first use in each process:

* cheap stages and costly work with the line's own backend (C VM or Numba), without
  rewriting again (the graph was rewritten once, for the whole function);
* heavy nodes through ``perform`` (Python Ops such as remote calls), or, for an
  ``OpFromGraph`` (an annotated subgraph), with the backend and its rewrites -- or with the
  mode its :class:`~dasktensor._placement.Placement` names (``"JAX"``...): the runner
  compiles with it in the process that runs the task, so a block placed on a GPU worker is
  compiled there, for that worker's device.

A runner pickles as its token and the pickled subgraph (computed once), so shipping it to a
worker costs a few kilobytes, and a worker keeps one compiled runner per token.  PyTensor
compilation is not thread-safe: it happens under one process-wide lock.  A compiled
PyTensor function is not reentrant either: each runner keeps a small pool of compiled
copies, one per concurrent caller.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np
from dask.base import tokenize
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.io import In
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.basic import Variable
from pytensor.graph.replace import clone_replace

from dasktensor import _compat
from dasktensor._runtime import ProcessState, runtime

Backend = Literal["stage", "inner", "perform"]

_RESTORED_MAX = 512


class _Runners(ProcessState):
    """This process's compile lock, and the runners it unpickled (on a worker), by token:
    compiled once, reused by every later call that ships the same task."""

    def __init__(self):
        self.compile_lock = threading.RLock()
        self.restored: OrderedDict[str, TaskRunner] = OrderedDict()
        self.lock = threading.Lock()


def restored() -> list[TaskRunner]:
    """The runners this process unpickled and keeps, oldest first."""
    state = runtime.state(_Runners)
    with state.lock:
        return list(state.restored.values())


def _host_compile_lock():
    """A lock shared by every process of this host that compiles into PyTensor's cache.

    Worker processes on one host share PyTensor's compile directory; compiling into it
    concurrently has broken runs of PyMC on Dask (pymc-devs/pymc#7819).
    """
    import filelock
    import pytensor

    path = os.path.join(pytensor.config.compiledir, "dasktensor-compile.lock")
    return filelock.FileLock(path, timeout=600)


@contextlib.contextmanager
def compiling():
    """Hold while compiling PyTensor code (or unpickling a compiled function): one
    compilation at a time in this process (PyTensor's compilation is not thread-safe)
    and on this host (processes share its compile directory)."""
    with runtime.state(_Runners).compile_lock, _host_compile_lock():
        yield


def _aligned(value):
    """Arrays deserialised from a network frame may be unaligned; compiled code refuses those."""
    if isinstance(value, np.ndarray) and not value.flags.aligned:
        return value.copy()
    return value


def _as_numpy(value):
    """An output of another backend (a JAX or PyTorch array) as a writeable NumPy array.

    The stages after it are compiled by the line's own backend, which takes NumPy arrays
    only, and may overwrite its inputs in place.
    """
    arr = np.asarray(value)
    return arr if arr.flags.writeable else arr.copy()


def _fresh(value):
    """A private copy of a value that a task will overwrite in place."""
    if hasattr(value, "copy"):
        return value.copy()
    return copy.deepcopy(value)


class TaskRunner:
    """Run one task: values of its inputs in, a tuple of values of its outputs out.

    Parameters
    ----------
    inputs, outputs : sequence of Variable
        The task's boundary inputs and the outputs other tasks (or the caller) need.
    destroyed : sequence of int
        Positions of inputs the task overwrites in place; they are copied first.
    backend : {"stage", "inner", "perform"}
        How the subgraph is compiled (see the module docstring).
    name : str
        The task's name, used in error messages.
    mode : str or Mode, optional
        With ``backend="inner"``: the PyTensor mode that compiles the subgraph (default:
        the line's own backend).
    """

    def __init__(
        self,
        inputs: Sequence[Variable],
        outputs: Sequence[Variable],
        destroyed: Sequence[int] = (),
        backend: Backend = "stage",
        name: str = "task",
        mode=None,
    ):
        fresh = [v.type() for v in inputs]
        for new, old in zip(fresh, inputs):
            new.name = old.name
        cloned = clone_replace(list(outputs), replace=dict(zip(inputs, fresh)))
        self.name = name
        self.destroyed = tuple(destroyed)
        self.backend = backend
        self.mode = mode
        self._graph = (fresh, cloned)
        self._payload: bytes | None = None
        self._pool: list = []
        self._pool_lock = runtime.lock()

    @classmethod
    def for_task(cls, task) -> TaskRunner:
        """The runner of a :class:`dasktensor.engine._plan.Task`."""
        outputs = task.outputs
        backend: Backend = "stage"
        mode = None
        if task.kind == "heavy":
            (node,) = task.nodes
            if isinstance(node.op, OpFromGraph):
                # inline the inner graph: it is rewritten and compiled as one stage
                inner = _compat.inline_op_from_graph(node)
                outputs = [inner[node.outputs.index(o)] for o in task.outputs]
                backend = "inner"
                mode = task.placement.mode
            else:
                backend = "perform"
        return cls(task.inputs, outputs, task.destroyed_inputs, backend, task.name, mode)

    @property
    def graph(self) -> tuple[list, list]:
        """The runner's own copy of its subgraph: ``(inputs, outputs)``."""
        return self._graph

    # pickling: the token and the pickled subgraph, compiled again on the other side
    def __reduce__(self):
        if self._payload is None:
            fresh, cloned = self._graph
            state = (fresh, cloned, self.destroyed, self.backend, self.name, self.mode)
            self._payload = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
            self._token = tokenize(self._payload)
        return _restore, (self._token, self._payload)

    def _compile(self):
        fresh, outputs = self._graph
        backend = _compat.backend_mode()
        if self.backend == "stage":
            mode = Mode(linker=backend.linker, optimizer=None)
        elif self.backend == "inner":
            mode = backend if self.mode is None else get_mode(self.mode)
        else:
            mode = Mode(linker="py", optimizer=None)
        import pytensor

        ins = [In(v, mutable=i in self.destroyed) for i, v in enumerate(fresh)]
        with compiling():
            fn = pytensor.function(
                ins,
                outputs,
                mode=mode,
                accept_inplace=True,
                on_unused_input="ignore",
                name=self.name,
            )
        fn.trust_input = True
        return fn

    def _acquire(self):
        with self._pool_lock:
            if self._pool:
                return self._pool.pop()
        return self._compile()

    def _release(self, fn) -> None:
        with self._pool_lock:
            self._pool.append(fn)

    @property
    def compiled_functions(self) -> tuple:
        """The compiled PyTensor functions this runner holds now (one per idle caller)."""
        with self._pool_lock:
            return tuple(self._pool)

    def __call__(self, *values):
        values = [_aligned(v) for v in values]
        for i in self.destroyed:
            values[i] = _fresh(values[i])
        fn = self._acquire()
        try:
            out = fn(*values)
        finally:
            self._release(fn)
        out = tuple(out) if isinstance(out, list) else (out,)
        if self.mode is not None:  # JAX, PyTorch...: their arrays, as NumPy arrays
            out = tuple(_as_numpy(o) for o in out)
        return out

    def __repr__(self) -> str:
        mode = "" if self.mode is None else f", mode={self.mode!r}"
        return f"TaskRunner({self.name!r}, backend={self.backend!r}{mode})"


def _restore(token: str, payload: bytes) -> TaskRunner:
    state = runtime.state(_Runners)
    with state.lock:
        runner = state.restored.get(token)
        if runner is not None:
            state.restored.move_to_end(token)
            return runner
    fresh, cloned, destroyed, backend, name, mode = pickle.loads(payload)
    runner = TaskRunner.__new__(TaskRunner)
    runner.name = name
    runner.destroyed = destroyed
    runner.backend = backend
    runner.mode = mode
    runner._graph = (fresh, cloned)
    runner._payload = payload
    runner._token = token
    runner._pool = []
    runner._pool_lock = runtime.lock()
    with state.lock:
        runner = state.restored.setdefault(token, runner)
        while len(state.restored) > _RESTORED_MAX:
            state.restored.popitem(last=False)
    return runner
