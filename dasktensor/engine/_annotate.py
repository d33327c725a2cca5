"""``dt.annotate``: a subgraph that runs as one task with its own :class:`Placement`.

Tags on variables do not survive PyTensor's rewrites, so the marked subgraph is wrapped in
an Op of its own: :class:`Placed`, an ``OpFromGraph`` that the planner treats as heavy (one
task) and whose placement (resources, retries, priority, workers, compiling mode) becomes
the task's.

How the context manager finds the subgraph: while an ``annotate`` block is open in a
thread, every ``Apply`` node and every ``Variable`` created in that thread is recorded.
PyTensor builds throw-away "dummy" nodes while it constructs a graph (the core node of a
``Blockwise``, the scalar node of an ``Elemwise``): they hang from unnamed root variables
created inside the block, and are dropped.  When the block closes, the remaining nodes whose
outputs are not used inside the block (the values the block produced last) are replaced by
one ``Placed`` node computing them from the block's inputs.
The variables the caller holds are rewired in place to that node, so code after the block
uses the placed computation.  Intermediate values of the block that are also used after it
stay outside the placement (they are computed where the planner puts them).
"""

from __future__ import annotations

import functools
import threading

from pytensor.compile.builders import OpFromGraph
from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.replace import clone_replace, vectorize_graph

from dasktensor import _compat
from dasktensor._placement import Placement, check_name
from dasktensor._runtime import runtime
from dasktensor.engine._plan import op_label


class Placed(OpFromGraph):
    """A subgraph that runs as one task with its own placement.

    Built by :class:`annotate`; rarely constructed directly.

    Parameters
    ----------
    inputs, outputs
        The inner graph, as for ``OpFromGraph``.
    placement : Placement
        Where the task runs and which mode compiles it.
    label : str
        Prefix of the task's keys on the dashboard.
    """

    dasktensor_heavy = True

    def __init__(self, inputs, outputs, *, placement=None, label="annotated", **kwargs):
        self.dasktensor_placement = placement or Placement()
        self.dasktensor_name = label
        super().__init__(inputs, outputs, **kwargs)

    def _placement_key(self):
        return (self.dasktensor_name, self.dasktensor_placement)

    def __eq__(self, other):
        return (
            type(self) is type(other)
            and self._placement_key() == other._placement_key()
            and super().__eq__(other)
        )

    def __hash__(self):
        return hash((super().__hash__(), self._placement_key()))

    def __str__(self):
        return f"Placed{{{self.dasktensor_name}, {self.dasktensor_placement}}}"

    # Gradients of a placed subgraph are placed the same way (the backward pass of a GPU
    # surrogate belongs on the GPU worker too), under the name "<name>-grad".

    @property
    def derivative_op_type(self):  # PyTensor 3 builds derivative graphs with this type
        return functools.partial(
            Placed, placement=self.dasktensor_placement, label=self._grad_label()
        )

    def _grad_label(self) -> str:
        return f"{self.dasktensor_name}-grad"

    if not _compat.PYTENSOR_3:  # PyTensor 2.38 wraps derivatives in a plain OpFromGraph

        def L_op(self, inputs, outputs, output_grads):
            grads = super().L_op(inputs, outputs, output_grads)
            replaced: dict = {}
            for g in grads:
                node = getattr(g, "owner", None)
                if node is None or type(node.op) is not OpFromGraph or node in replaced:
                    continue
                op = Placed(
                    node.op.inner_inputs,
                    node.op.inner_outputs,
                    placement=self.dasktensor_placement,
                    label=self._grad_label(),
                    inline=node.op.is_inline,
                    on_unused_input="ignore",
                )
                replaced[node] = op(*node.inputs, return_list=True)
            return [
                replaced[g.owner][g.owner.outputs.index(g)]
                if getattr(g, "owner", None) in replaced
                else g
                for g in grads
            ]


@_compat.register_vectorize(Placed)
def _vectorize_placed(op: Placed, node: Apply, *batched_inputs) -> Apply:
    """A placed block over a batch is the placed block of its inner graph vectorised.

    PyTensor's fallback would wrap the block in a ``Blockwise``, which hides the placement
    from the planners (``dt.pmap``'s stages, the DASK mode's heavy tasks) and loops over
    the batch in Python.  Here the block keeps its placement and name and runs its
    vectorised inner graph once per chunk.
    """
    if all(b.type == i.type for b, i in zip(batched_inputs, node.inputs, strict=True)):
        return op.make_node(*batched_inputs)
    element = [i.type() for i in node.inputs]
    inner = [b.type() for b in batched_inputs]
    outputs = vectorize_graph(
        _compat.inner_graph_on(op, element), replace=dict(zip(element, inner, strict=True))
    )
    vectorised = Placed(
        inner,
        list(outputs),
        placement=op.dasktensor_placement,
        label=op.dasktensor_name,
        on_unused_input="ignore",
    )
    return vectorised.make_node(*batched_inputs)


# ----------------------------------------------------------------------------- recording

_local = threading.local()
_hook_lock = runtime.lock()
_hook_users = 0
_original_apply_init = Apply.__init__
_original_variable_init = Variable.__init__


def _recording_apply_init(self, *args, **kwargs):
    _original_apply_init(self, *args, **kwargs)
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1]._nodes.append(self)


def _recording_variable_init(self, *args, **kwargs):
    _original_variable_init(self, *args, **kwargs)
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1]._variables.append(self)


# The hook replaces the constructors of PyTensor's graph objects while annotate() records
# (hence the method assignments mypy is told to accept below).
def _install_hook() -> None:
    global _hook_users
    with _hook_lock:
        _hook_users += 1
        if _hook_users == 1:
            Apply.__init__ = _recording_apply_init  # type: ignore[method-assign]
            Variable.__init__ = _recording_variable_init  # type: ignore[method-assign]


def _remove_hook() -> None:
    global _hook_users
    with _hook_lock:
        _hook_users -= 1
        if _hook_users == 0:
            Apply.__init__ = _original_apply_init  # type: ignore[method-assign]
            Variable.__init__ = _original_variable_init  # type: ignore[method-assign]


class annotate:
    """Run the subgraph built inside the block as one task with this placement.

    The marks survive PyTensor's rewrites (the subgraph becomes a :class:`Placed` Op) and
    become the task's :class:`~dasktensor.Placement`, which the distributed scheduler
    honours: a task asking for ``resources={"GPU": 1}`` only runs on workers started with
    that resource.  ``mode="JAX"`` compiles the block (and its gradient) with JAX in the
    process that runs it: with ``resources={"GPU": 1}``, the GPU stage of a model whose
    other stages stay on the line's own backend on CPU workers.

    Parameters
    ----------
    resources : dict, optional
        Worker resources each run of the subgraph needs, e.g. ``{"GPU": 1}``.
    retries : int, optional
        How many times the task is retried after an exception.
    priority : int, optional
        Scheduling priority (higher runs first).
    workers : str or list of str, optional
        Addresses of the workers allowed to run the task.
    allow_other_workers : bool
        With ``workers``: other workers may run it when those are busy or gone.
    mode : str or pytensor.compile.mode.Mode, optional
        PyTensor mode compiling the block where it runs (``"JAX"``, ``"NUMBA"``...); by
        default the line's own backend.  An unknown name fails here, listing the known ones.
    name : str, optional
        Prefix of the task's keys on the dashboard (letters and dashes).  Defaults to
        ``"annotated-<op>"`` after the subgraph's main op.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> x = pt.matrix("x")
    >>> with dt.annotate(resources={"GPU": 1}, retries=2, name="surrogate"):
    ...     y = pt.tanh(x @ x.T)
    >>> f = dt.function([x], y.sum())
    >>> [t.name for t in f.plan.tasks if t.kind == "heavy"]
    ['surrogate']
    >>> f.plan.tasks[0].placement
    Placement(resources={'GPU': 1}, retries=2)

    It also decorates a function that builds a graph:

    >>> @dt.annotate(retries=1)
    ... def block(v):
    ...     return pt.exp(v) + 1
    """

    def __init__(self, *, name=None, **placement):
        self.placement = Placement.of("annotate", **placement)
        self.name = None if name is None else check_name(name, "annotate(name=...)")
        self._nodes: list[Apply] = []
        self._variables: list[Variable] = []

    def _copy(self) -> annotate:
        new = annotate.__new__(annotate)
        new.placement = self.placement
        new.name = self.name
        new._nodes = []
        new._variables = []
        return new

    def __enter__(self) -> annotate:
        self._nodes = []
        self._variables = []
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        _install_hook()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.stack.remove(self)
        _remove_hook()
        if exc_type is None:
            self._wrap()

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self._copy():
                return fn(*args, **kwargs)

        return wrapper

    def _wrap(self) -> None:
        # drop PyTensor's dummy nodes: those hanging from unnamed roots made in the block
        dummy_roots = {
            v
            for v in self._variables
            if v.owner is None and v.name is None and not isinstance(v, Constant)
        }
        dummy_outputs: set[Variable] = set()
        nodes = []
        for n in self._nodes:  # creation order is a topological order
            if any(i in dummy_roots or i in dummy_outputs for i in n.inputs):
                dummy_outputs.update(n.outputs)
            else:
                nodes.append(n)
        self._nodes, self._variables = [], []
        if not nodes:
            return
        produced = {o for n in nodes for o in n.outputs}
        consumed = {i for n in nodes for i in n.inputs}
        frontier = [o for n in nodes for o in n.outputs if o not in consumed]
        inputs, seen = [], set()
        for n in nodes:
            for i in n.inputs:
                if i not in produced and i not in seen and not isinstance(i, Constant):
                    seen.add(i)
                    inputs.append(i)
        if not frontier:
            return
        inner_inputs = [v.type() for v in inputs]
        inner_outputs = clone_replace(
            frontier, replace=dict(zip(inputs, inner_inputs, strict=True))
        )
        label = self.name or f"annotated-{op_label(nodes[-1].op)}"
        op = Placed(inner_inputs, inner_outputs, placement=self.placement, label=label)
        for o in frontier:  # rewire the caller's variables to the placed node
            o.owner = None
            o.index = None
        Apply(op, inputs, frontier)
