"""A graph written for one element, vectorised over leading batch axes and compiled.

:class:`Vectorized` is what one chunk of a ``pmap`` (or of the posterior predictive) runs.
It vectorises the one-element graph with PyTensor's ``vectorize_graph``, which turns Ops
into their batched forms (``Blockwise``, ``Elemwise`` broadcasting, random variables with a
batched ``size``), and compiles it once per process as a :class:`TaskRunner` (shipped as a
few kilobytes, kept compiled on the workers).  What the graph reads besides its inputs
becomes inputs of the vectorised graph too:

* Data in shared variables (``pm.Data``) and large constants (data given to PyMC as
  arrays) become unbatched *fixed* inputs, read at each call
  (:meth:`Vectorized.fixed_values`): a lazy result does not change when the variable does
  later, and the data travel once per worker as a Dask key, not inside every runner.
* Every random generator becomes an input, so that each chunk draws from its own
  generators (spawned per chunk by :mod:`dasktensor.dataparallel._chunks`).
* Random variables' sizes read from data (as PyMC builds them) are frozen to constants,
  which ``vectorize_graph`` needs to extend them by the batch axes, and checked again at
  each call.

The Dask side (chunks, tasks, seeds, computing) is
:mod:`dasktensor.dataparallel._chunks`; the public ``pmap`` is
:mod:`dasktensor.dataparallel._pmap`.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import Mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant
from pytensor.graph.replace import clone_replace, vectorize_graph
from pytensor.graph.traversal import ancestors, applys_between, graph_inputs
from pytensor.tensor.random.op import RandomVariable
from pytensor.tensor.random.type import RandomGeneratorType
from pytensor.tensor.type_other import NoneTypeT
from pytensor.tensor.variable import TensorConstant

from dasktensor.dataparallel._pipeline import Pipeline
from dasktensor.engine import TaskRunner

_LARGE_CONSTANT_BYTES = 1 << 12


def _shared_variables(outputs, rngs: bool) -> list:
    """Shared variables the graph of ``outputs`` reads: its random generators (``rngs``),
    or the others (data)."""
    return [
        v
        for v in graph_inputs(outputs)
        if isinstance(v, SharedVariable) and isinstance(v.type, RandomGeneratorType) == rngs
    ]


def _large_constants(outputs) -> list:
    """Tensor constants of 4 KiB or more in the graph of ``outputs``."""
    return [
        v
        for v in graph_inputs(outputs)
        if isinstance(v, TensorConstant) and v.data.nbytes >= _LARGE_CONSTANT_BYTES
    ]


def _freeze_sizes(outputs: list, batched_inputs: list, values: dict) -> tuple[list, list]:
    """Random variables' ``size`` arguments evaluated to constants where they do not depend
    on the batched inputs (a size read from a data variable's shape, as PyMC builds them).

    ``vectorize_graph`` extends a random variable's size by the new batch dimensions only
    when the vectorised size is the same computation as the old one; a symbolic size is
    rebuilt on the way (``MakeVector`` becomes ``ExpandDims``) and no longer compares
    equal, which leaves the size short of the batch dimensions.  ``values`` are the
    values of the unbatched root inputs a size may read.

    Returns the new outputs and, per frozen size, ``(function, inputs, value)``: the
    function of those inputs gives the size again, to check that a later call's values
    (new data in a shared variable) still give the sizes frozen here.
    """
    batched = set(batched_inputs)
    frozen, checks = {}, []
    for node in applys_between(batched_inputs, outputs):
        if not isinstance(node.op, RandomVariable):
            continue
        size = node.op.size_param(node)
        if isinstance(size, Constant) or isinstance(size.type, NoneTypeT) or size in frozen:
            continue
        if batched.intersection(ancestors([size])):
            continue
        roots = [v for v in graph_inputs([size]) if not isinstance(v, Constant)]
        if not all(v in values for v in roots):  # reads an input given only at run time
            continue
        fn = _py_function(roots, size)
        value = np.asarray(fn(*[values[v] for v in roots]), dtype=size.dtype)
        frozen[size] = pt.constant(value, dtype=size.dtype)
        checks.append((fn, roots, value))
    return (clone_replace(outputs, replace=frozen) if frozen else outputs), checks


def _py_function(inputs, outputs, optimizer: str = "fast_compile"):
    """A PyTensor function run by Python thunks: for small helper graphs (sizes, shapes),
    which a backend would spend far longer compiling than running."""
    return pytensor.function(
        list(inputs),
        outputs,
        on_unused_input="ignore",
        accept_inplace=True,
        mode=Mode(linker="py", optimizer=optimizer),
    )


class Vectorized:
    """A graph for one element, vectorised over ``n_batch`` leading axes of some inputs.

    Parameters
    ----------
    inputs, outputs : sequence of Variable
        The element-wise graph.
    batched : sequence of bool
        Which inputs carry the batch axes.
    n_batch : int
        Number of leading batch axes.
    name : str
        Prefix of the task keys.

    The compiled callable takes the batched and unbatched input values (in input order)
    followed by one ``numpy.random.Generator`` per random generator of the graph.
    """

    def __init__(self, inputs, outputs, batched, n_batch: int = 1, name: str = "pmap"):
        self.n_batch = n_batch
        self.name = name
        self.batched = tuple(bool(b) for b in batched)
        # inputs may be inner variables (PyMC conditions on random variables' outputs):
        # cut the graph there, so that nothing above them is cloned or recomputed
        roots = [v.type() for v in inputs]
        for root, v in zip(roots, inputs, strict=True):
            root.name = v.name
        outputs = clone_replace(list(outputs), replace=dict(zip(inputs, roots, strict=True)))
        # data in shared variables (pm.Data...) becomes an unbatched input whose value
        # is read at each call (``fixed_values``): a lazy result does not change when the
        # variable does later; so do large constants (data given to PyMC as arrays): kept
        # out of the compiled graph, they travel once per worker as a Dask key, not
        # inside every runner
        shared = _shared_variables(outputs, rngs=False)
        large = _large_constants(outputs)
        fixed = [v.type() for v in shared + large]
        outputs = clone_replace(outputs, replace=dict(zip(shared + large, fixed, strict=True)))
        self._shared = shared
        self._constants = [c.data for c in large]
        fixed_values = self._fixed_values()
        inputs = roots + fixed
        self.batched = self.batched + (False,) * len(fixed)
        new_inputs, replace = [], {}
        for v, b in zip(inputs, self.batched, strict=True):
            if b:
                bv = pt.tensor(
                    dtype=v.type.dtype, shape=(None,) * n_batch + tuple(v.type.shape), name=v.name
                )
                replace[v] = bv
                new_inputs.append(bv)
            else:
                new_inputs.append(v)
        outputs, checks = _freeze_sizes(
            list(outputs), list(replace), dict(zip(fixed, fixed_values, strict=True))
        )
        self._size_checks = [
            (fn, [fixed.index(v) for v in roots], value) for fn, roots, value in checks
        ]
        outs = vectorize_graph(outputs, replace=replace) if replace else list(outputs)
        # every output carries the batch axes, also those that do not depend on the batch
        ref = next(iter(replace.values()), None)
        if ref is not None:
            batch_shape = tuple(ref.shape[i] for i in range(n_batch))
            outs = [
                o
                if o.ndim == out.ndim + n_batch
                else pt.broadcast_to(o, batch_shape + tuple(o.shape))
                for o, out in zip(outs, outputs, strict=True)
            ]
        self.rngs = _shared_variables(outs, rngs=True)
        rng_inputs = [r.type() for r in self.rngs]
        if self.rngs:
            outs = clone_replace(outs, replace=dict(zip(self.rngs, rng_inputs, strict=True)))
        self.out_types = [o.type for o in outs]
        self.runner = TaskRunner([*new_inputs, *rng_inputs], outs, backend="inner", name=name)
        #: the placed stages of a graph with ``dt.annotate`` blocks (None without blocks:
        #: one task per chunk runs ``runner``)
        self.pipeline = (
            Pipeline(new_inputs, rng_inputs, outs, name)
            if Pipeline.needed([*new_inputs, *rng_inputs], outs)
            else None
        )
        self._out_cores: dict[tuple, list[tuple]] = {}

    def _fixed_values(self) -> list:
        return [v.get_value(borrow=False) for v in self._shared] + self._constants

    def fixed_values(self) -> list | None:
        """The values of the fixed inputs (shared data, large constants) for a call now,
        or None when the data in a shared variable changed such that a random variable's
        size frozen at construction no longer holds (the graph must be built again)."""
        values = self._fixed_values()
        for fn, positions, frozen in self._size_checks:
            if not np.array_equal(fn(*[values[i] for i in positions]), frozen):
                return None
        return values

    def fixed_values_of_new(self) -> list:
        """:meth:`fixed_values` of a graph built just now, from the data as it is."""
        values = self.fixed_values()
        if values is None:
            raise RuntimeError(
                f"{self.name}: the data in a shared variable changed sizes while the graph "
                "was built from it"
            )
        return values

    def output_core_shapes(self, core_shapes_in: list[tuple]) -> list[tuple]:
        """Shapes of one element's outputs (after the batch axes), given the inputs'
        shapes without their batch axes: from static types, or by evaluating the graph's
        shape on zero-strided dummies of one element (once per input shapes)."""
        static = [t.shape[self.n_batch :] for t in self.out_types]
        if all(d is not None for s in static for d in s):
            return [tuple(int(d) for d in s) for s in static]
        key = tuple(core_shapes_in)
        if key not in self._out_cores:
            self._out_cores[key] = self._evaluate_core_shapes(core_shapes_in)
        return self._out_cores[key]

    def _evaluate_core_shapes(self, core_shapes_in: list[tuple]) -> list[tuple]:
        fresh, outs = self.runner.graph
        dummies = []
        # fresh ends with the random generators' inputs (rng_vars below), not zipped here
        for v, b, shape in zip(fresh, self.batched, core_shapes_in, strict=False):
            full = (1,) * self.n_batch + tuple(shape) if b else tuple(shape)
            dummies.append(np.broadcast_to(np.zeros((), dtype=v.type.dtype), full))
        rng_vars = fresh[len(self.batched) :]
        # the shape rewrites of fast_run reduce the graph to shape arithmetic; Python
        # thunks run that at once (a backend would compile the whole graph, large
        # constants included)
        shape_fn = _py_function(
            fresh[: len(self.batched)] + rng_vars, [o.shape for o in outs], optimizer="fast_run"
        )
        shapes = shape_fn(*dummies, *[np.random.default_rng(0) for _ in rng_vars])
        return [tuple(int(d) for d in s[self.n_batch :]) for s in shapes]
