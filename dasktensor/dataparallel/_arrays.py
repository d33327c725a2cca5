"""The Dask array type of a pipelined pmap's outputs (imported on first use: ``dask.array``
is not imported with dasktensor).

With low-level fusion on (Dask's default for arrays), ``dask.array.optimize`` returns a
plain dict of tasks, and every layer's annotations are gone with the layers: the
resources of a pipeline's stages would never reach the scheduler, and the stages would
run wherever.  :class:`PipelinedArray` optimises as Dask does and puts the annotations
of the tasks that survive back on the result (stage tasks block fusion, so they all do).
"""

from __future__ import annotations

import uuid

import dask.array as da
from dask.array.optimization import optimize
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer


class ByKey:
    """A per-key Dask annotation: the value for a key of the layer, or None (none)."""

    def __init__(self, values: dict):
        self.values = values

    def __call__(self, key):
        return self.values.get(key)


def optimize_keeping_annotations(dsk, keys, **kwargs):
    """``dask.array.optimize``, with the per-key annotations of ``dsk``'s layers kept for
    the tasks that survive it."""
    out = optimize(dsk, keys, **kwargs)
    if isinstance(out, HighLevelGraph) or not isinstance(dsk, HighLevelGraph):
        return out  # fusion off: the layers, and their annotations, are still there
    kept: dict[str, dict] = {}
    for layer in dsk.layers.values():
        for name, value in (layer.annotations or {}).items():
            for key in layer:
                if key in out:
                    v = value(key) if callable(value) else value
                    if v is not None:
                        kept.setdefault(name, {})[key] = v
    if not kept:
        return out
    name = f"optimized-{uuid.uuid4().hex}"
    annotations = {n: ByKey(values) for n, values in kept.items()}
    return HighLevelGraph({name: MaterializedLayer(out, annotations=annotations)}, {name: set()})


class PipelinedArray(da.Array):
    """A Dask array whose chunks come out of placed stages: computing it keeps their
    resources and priorities.  Arrays derived from it (``y + 1``, ``y[:10]``) are plain
    Dask arrays, whose optimisation drops them: compute the result itself, or with
    ``compute=True``."""

    __dask_optimize__ = staticmethod(optimize_keeping_annotations)
