"""Differences between the two supported lines, in one place.

* PyTensor 3.x / PyMC 6.x (Python >= 3.12): the default backend is Numba.
* PyTensor 2.38 / PyMC 5.28 (Python 3.11): the default backend is the C VM.

Everything else in dasktensor imports version-dependent names from here.
"""

from __future__ import annotations

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


def versions() -> dict[str, str]:
    """Versions of the libraries dasktensor builds on, for reports and ``dasktensor info``."""
    names = ("dasktensor", "pytensor", "pymc", "dask", "distributed", "numpy")
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except Exception:  # pragma: no cover - dasktensor itself when not installed
            out[name] = "not installed"
    return out


def inline_op_from_graph(node) -> list:
    """The outputs of an ``OpFromGraph`` node's inner graph, applied to the node's inputs.

    PyTensor 3 freezes inner graphs (``FrozenFunctionGraph.bind`` rebuilds them); 2.38
    keeps an ordinary graph, copied here node by node onto the node's own inputs (its
    ``clone_replace`` would also copy the ancestry of the replacements).
    """
    op = node.op
    if hasattr(op.fgraph, "bind"):
        return list(op.fgraph.bind(list(node.inputs)))
    from pytensor.graph.basic import clone_get_equiv

    memo = dict(zip(op.inner_inputs, node.inputs))
    equiv = clone_get_equiv(op.inner_inputs, op.inner_outputs, copy_inputs=False, memo=memo)
    return [equiv[o] for o in op.inner_outputs]
