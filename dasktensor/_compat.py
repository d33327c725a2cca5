"""Differences between the two supported lines, in one place.

* PyTensor 3.x / PyMC 6.x (Python >= 3.12): the default backend is Numba.
* PyTensor 2.38 / PyMC 5.28 (Python 3.11): the default backend is the C VM; PyMC's
  ArviZ (0.23) warns of its refactor on its first import each day.

Everything else in dasktensor imports version-dependent names from here.
"""

from __future__ import annotations

import warnings
from importlib.metadata import version

import pytensor
from pytensor.compile.mode import Mode, get_mode

PYTENSOR_VERSION = tuple(int(p) for p in pytensor.__version__.split(".")[:2])
PYTENSOR_3 = PYTENSOR_VERSION >= (3, 0)
PYMC_VERSION = tuple(int(p) for p in version("pymc").split(".")[:2])
PYMC_6 = PYMC_VERSION >= (6, 0)


def backend_mode() -> Mode:
    """The line's own fast mode ("FAST_RUN"), with which dasktensor compiles stages.

    Resolved by name rather than through ``pytensor.config.mode``, which may itself
    be set to the DASK mode.
    """
    return get_mode("FAST_RUN")


def import_pymc():
    """``import pymc`` without ArviZ 0.23's daily ``FutureWarning`` (PyMC 5.28 imports
    ArviZ, which says on its first import each day that it is being refactored: nothing
    a user of dasktensor's command line can act on).  For dasktensor's own programs
    (``dasktensor demo``); a user's ``import pymc`` keeps its warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning
        )
        import pymc
    return pymc


def inline_op_from_graph(node) -> list:
    """The outputs of an ``OpFromGraph`` node's inner graph, applied to the node's inputs.

    PyTensor 3 freezes inner graphs (``FrozenFunctionGraph.bind`` rebuilds them); 2.38
    keeps an ordinary graph, copied here node by node onto the node's own inputs (its
    ``clone_replace`` would also copy the ancestry of the replacements).
    """
    return inner_graph_on(node.op, node.inputs)


def inner_graph_on(op, inputs) -> list:
    """The outputs of ``OpFromGraph`` ``op``'s inner graph, built anew on ``inputs`` (an
    ordinary graph on either line, which rewrites and ``vectorize_graph`` can work on)."""
    if hasattr(op.fgraph, "bind"):
        return list(op.fgraph.bind(list(inputs)))
    from pytensor.graph.basic import clone_get_equiv

    memo = dict(zip(op.inner_inputs, inputs, strict=True))
    equiv = clone_get_equiv(op.inner_inputs, op.inner_outputs, copy_inputs=False, memo=memo)
    return [equiv[o] for o in op.inner_outputs]


def register_vectorize(op_type: type):
    """Decorator: ``fn(op, node, *batched_inputs) -> Apply`` is how ``vectorize_graph``
    vectorises nodes of ``op_type``.  PyTensor's dispatcher for it is private
    (``pytensor.graph.replace._vectorize_node``, the same on both lines); this is the one
    place that names it."""
    from pytensor.graph.replace import _vectorize_node

    return _vectorize_node.register(op_type)


_numba_registered: set[type] = set()


def register_python_ops_with_numba(*op_types: type) -> None:
    """Run these Python Ops in Numba's object mode without a warning (PyTensor 3).

    The Numba backend has no implementation of a Python Op and falls back to object mode
    with a UserWarning, meant for Ops that would be faster in Numba.  dasktensor's callable
    Ops and ``ParallelCallsOp`` call Python functions by design, so the same fallback is
    registered for them without the warning.  Each module registers its own Op class,
    when the first such Op is made (importing the Numba dispatch imports Numba); a class
    registered already is skipped, so calling this for every new Op costs a set look-up.
    """
    if not PYTENSOR_3:
        return
    new = [t for t in op_types if t not in _numba_registered]
    if not new:
        return
    import warnings

    # Numba is a dependency of PyTensor 3
    from pytensor.link.numba.dispatch.basic import generate_fallback_impl, numba_funcify

    def object_mode(op, node=None, storage_map=None, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Numba will use object mode")
            return generate_fallback_impl(op, node, storage_map, **kwargs)

    for op_type in new:
        numba_funcify.register(op_type)(object_mode)
        _numba_registered.add(op_type)


def setup_chain(step, rng, tune: int, draws: int) -> None:
    """Prepare a step method for one chain, as ``pm.sample`` does before its first draw.

    PyMC 6 has ``step.setup_chain(rng, tune, draws)``; PyMC 5 sets the random generator
    only (``step.set_rng(rng)``).
    """
    if PYMC_6:
        step.setup_chain(rng, tune, draws)
    else:
        step.set_rng(rng)
