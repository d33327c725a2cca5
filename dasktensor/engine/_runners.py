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
import re
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
def compiling(host: bool = True):
    """Hold while compiling PyTensor code (or unpickling a compiled function): one
    compilation at a time in this process (PyTensor's compilation is not thread-safe)
    and, with ``host``, on this host (processes share its compile directory)."""
    with runtime.state(_Runners).compile_lock, _host_compile_lock() if host else _nothing():
        yield


@contextlib.contextmanager
def _nothing():
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
        for new, old in zip(fresh, inputs, strict=True):
            new.name = old.name
        cloned = clone_replace(list(outputs), replace=dict(zip(inputs, fresh, strict=True)))
        self.name = name
        self.destroyed = tuple(destroyed)
        self.backend = backend
        self.mode = mode
        self._graph = (fresh, cloned)
        self._pickle: tuple[str, bytes] | None = None  # (token, payload), set at once
        self._identity: str | None = None
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

    @property
    def token(self) -> str:
        """What identifies this runner's payload (its pickled subgraph and how it
        compiles): a worker keeps one compiled runner per token."""
        return self._pickled()[0]

    @property
    def identity(self) -> str:
        """What the runner computes, the same in every process that builds the same
        graph (:func:`graph_identity`, and how it compiles).  Two functions compiled from
        one model -- copies, or the same code in another process -- get equal identities
        where their tokens differ."""
        if self._identity is None:
            fresh, cloned = self._graph
            how = (self.backend, self.destroyed, _describe(self.mode))
            self._identity = tokenize(graph_identity(fresh, cloned), how)
        return self._identity

    def _pickled(self) -> tuple[str, bytes]:
        # one assignment of both: threads that pickle one runner at once (a graph
        # submitted from several threads) never see a payload without its token
        if self._pickle is None:
            fresh, cloned = self._graph
            state = (fresh, cloned, self.destroyed, self.backend, self.name, self.mode)
            payload = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
            self._pickle = (tokenize(payload), payload)
        return self._pickle

    # pickling: the token and the pickled subgraph, compiled again on the other side
    def __reduce__(self):
        return _restore, self._pickled()

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


def graph_identity(inputs: Sequence[Variable], outputs: Sequence[Variable]) -> str:
    """A token of the computation from ``inputs`` to ``outputs``, equal for graphs that
    compute the same thing as PyTensor compares them -- Ops and types by their
    ``__props__``, constants by value, inner graphs (``Composite``) by their own
    structure -- whatever process built them and whatever it cached on them.

    Variable names do not count, nor PyTensor's automatic ones (``auto_<n>``, from a
    process-wide counter), which a pickle of the graph would hold.  Used to find what
    copies of a function share on the cluster (resident stages, data shards).

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> def graph():
    ...     x = pt.dvector("x")
    ...     return [x], [pt.exp(x).sum() * 2.0]
    >>> graph_identity(*graph()) == graph_identity(*graph())
    True
    >>> x = pt.dvector("x")
    >>> graph_identity(*graph()) == graph_identity([x], [pt.exp(x).sum() * 3.0])
    False
    """
    return tokenize(_describe_graph(list(inputs), list(outputs)))


def _describe_graph(inputs: list, outputs: list) -> tuple:
    from pytensor.graph.basic import Constant
    from pytensor.graph.traversal import io_toposort

    where: dict = {v: ("input", i) for i, v in enumerate(inputs)}
    nodes = []

    def ref(v):
        if v not in where:  # a constant (anything else would be an input)
            if not isinstance(v, Constant):
                raise ValueError(f"graph_identity: {v} is neither an input nor a constant")
            where[v] = ("constant", _describe(v.type), _describe(v.data))
        return where[v]

    for node in io_toposort(inputs, outputs):
        args = tuple(ref(v) for v in node.inputs)
        nodes.append((_describe(node.op), args, tuple(_describe(o.type) for o in node.outputs)))
        for j, out in enumerate(node.outputs):
            where[out] = ("node", len(nodes) - 1, j)
    return (
        tuple(_describe(v.type) for v in inputs),
        tuple(nodes),
        tuple(ref(v) for v in outputs),
    )


def _describe(value):
    """A value's description for :func:`graph_identity` (plain tuples, strings, numbers)."""
    if value is None or isinstance(value, str | bool | int | float | complex):
        return value
    if isinstance(value, tuple | list):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict) or hasattr(value, "items") and hasattr(value, "keys"):
        return ("mapping", tuple(sorted((repr(k), _describe(v)) for k, v in value.items())))
    if isinstance(value, np.ndarray | np.generic):
        return ("array", value.dtype.str, np.shape(value), tokenize(np.asarray(value)))
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    cls = ("class", type(value).__module__, type(value).__qualname__)
    props = getattr(type(value), "__props__", None)
    if props is not None:  # Ops and types: what PyTensor compares them by
        return (cls, tuple(_describe(getattr(value, p)) for p in props))
    if hasattr(value, "inputs") and hasattr(value, "outputs") and hasattr(value, "clients"):
        return (cls, _describe_graph(list(value.inputs), list(value.outputs)))  # a FunctionGraph
    inner = getattr(value, "fgraph", None)
    if inner is not None:  # an inner-graph Op without __props__ (Composite on 2.38)
        return (cls, _describe(inner))
    return (cls, tokenize(_canonical(pickle.dumps(value, protocol=5))))


_AUTO_NAME = re.compile(rb"[\x00-\xff]auto_\d+")  # with the string's length byte before it
_FRAME = re.compile(rb"\x95[\x00-\xff]{8}")  # a pickle frame's opcode and length


def _canonical(payload: bytes) -> bytes:
    """``payload`` with the automatic variable names renumbered in order of appearance,
    and the pickle's frame lengths (which the names' lengths change) left out: not a
    pickle any more, only what equal objects have in common (an Op that says nothing of
    what it compares by, see :func:`_describe`).

    >>> one = b"\\x06auto_7 \\x07auto_12 \\x06auto_7"  # names as one process numbered them
    >>> other = b"\\x06auto_3 \\x06auto_4 \\x06auto_3"  # as another did
    >>> _canonical(one) == _canonical(other)
    True
    """
    seen: dict[bytes, int] = {}

    def number(match) -> bytes:
        return b"#%d" % seen.setdefault(match.group(0)[1:], len(seen))

    return _FRAME.sub(b"\x95", _AUTO_NAME.sub(number, payload))


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
    runner._pickle = (token, payload)
    runner._identity = None
    runner._pool = []
    runner._pool_lock = runtime.lock()
    with state.lock:
        runner = state.restored.setdefault(token, runner)
        while len(state.restored) > _RESTORED_MAX:
            state.restored.popitem(last=False)
    return runner
