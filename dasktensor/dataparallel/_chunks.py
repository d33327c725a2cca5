"""The Dask side of data parallelism: a vectorised graph run chunk by chunk, as Dask arrays.

:func:`map_blocks` cuts the batch of a
:class:`~dasktensor.dataparallel._vectorize.Vectorized` graph into chunks and returns Dask
arrays of its outputs; each chunk is one Dask task calling the graph's runner (compiled
once per process) on one block of the batch.

* Unbatched inputs (``in_axes=None``, fixed inputs such as shared data) become one Dask
  key that every chunk reads, so a cluster sends them to a worker once, not once per
  chunk.
* Random variables: chunk ``i`` draws from generators spawned from
  ``SeedSequence(random_seed)`` for that chunk.  The same seed and chunking give the same
  numbers on any scheduler and any number of workers; different chunks draw independent
  streams.
* Chunk size is chosen by work (:func:`auto_chunk`: bytes of inputs and outputs per
  chunk), not by the number of workers: splitting a small job only adds overhead.

:func:`compute_arrays` computes such arrays into NumPy arrays allocated up front.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Sequence

import dask
import numpy as np
from dask.base import get_scheduler
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import Task, TaskRef
from dask.utils import parse_bytes

from dasktensor import _config
from dasktensor.cluster import default_client
from dasktensor.dataparallel._vectorize import Vectorized


def _run_chunk(runner, seed: np.random.SeedSequence | None, n_rngs: int, *values):
    """Task body: one chunk through the vectorised graph; the tuple of its outputs."""
    rngs = [np.random.default_rng(s) for s in seed.spawn(n_rngs)] if n_rngs else []
    return runner(*values, *rngs)


def _as_dask(x, chunks):
    """``x`` (a NumPy or Dask array) as a Dask array with these chunks."""
    import dask.array as da

    if isinstance(x, da.Array):
        return x.rechunk(chunks)
    return da.from_array(x, chunks=chunks)


def _split(n: int, size: int) -> tuple[int, ...]:
    """Chunks of ``size`` along an axis of length ``n`` (the last one shorter; one empty
    chunk for ``n == 0``, as Dask chunks an empty axis).

    >>> _split(5, 2), _split(0, 2)
    ((2, 2, 1), (0,))
    """
    full, rest = divmod(n, size)
    return (size,) * full + ((rest,) if rest or not n else ())


def auto_chunk(n: int, bytes_per_element: float) -> int:
    """Batch elements per chunk: about ``dasktensor.pmap.chunk-bytes`` of data each."""
    target = _config.get("pmap.chunk-bytes")
    if isinstance(target, str):
        target = parse_bytes(target)
    return max(1, min(n, int(target // max(bytes_per_element, 1))))


def map_blocks(
    vec: Vectorized,
    args: Sequence,
    batch_chunks: tuple[tuple[int, ...], ...],
    random_seed=None,
    name: str | None = None,
    *,
    fixed: Sequence,
):
    """Dask arrays of the vectorised graph's outputs, one task per block of the batch.

    ``args`` are numpy or Dask arrays, batched ones with ``vec.n_batch`` leading batch
    axes; ``batch_chunks`` the chunks of those axes; ``fixed`` the values of the fixed
    inputs, from ``vec.fixed_values()``.
    """
    import dask.array as da

    nb = vec.n_batch
    args = [*args, *fixed]
    arrays = []
    core_shapes = []
    for x, b in zip(args, vec.batched):
        shape = tuple(x.shape)
        if b:
            arrays.append(_as_dask(x, batch_chunks + tuple((s,) for s in shape[nb:])))
            core_shapes.append(shape[nb:])
        else:
            arrays.append(_as_dask(x, tuple((s,) for s in shape)))
            core_shapes.append(shape)
    out_cores = vec.output_core_shapes(core_shapes)
    token = uuid.uuid4().hex
    label = name or vec.name
    tuple_name = f"{label}-{token}"
    blocks = list(np.ndindex(*[len(c) for c in batch_chunks]))
    seeds = np.random.SeedSequence(random_seed).spawn(len(blocks)) if vec.rngs else None
    n_rngs = len(vec.rngs)
    layer = {}
    for i, block in enumerate(blocks):
        refs = []
        for a, b in zip(arrays, vec.batched):
            idx = block + (0,) * (a.ndim - nb) if b else (0,) * a.ndim
            refs.append(TaskRef((a.name, *idx)))
        key = (tuple_name, *block)
        seed = seeds[i] if seeds is not None else None
        layer[key] = Task(key, _run_chunk, vec.runner, seed, n_rngs, *refs)
    graph = HighLevelGraph.merge(*[a.dask for a in arrays])
    layers = dict(graph.layers)
    dependencies = dict(graph.dependencies)
    layers[tuple_name] = layer
    dependencies[tuple_name] = {a.name for a in arrays}
    outs = []
    for k, (t, core) in enumerate(zip(vec.out_types, out_cores)):
        out_name = f"{label}-out{k}-{token}" if len(vec.out_types) > 1 else f"{label}-out-{token}"
        out_layer = {}
        for block in blocks:
            key = (out_name, *block, *(0,) * len(core))
            out_layer[key] = Task(key, operator.getitem, TaskRef((tuple_name, *block)), k)
        layers[out_name] = out_layer
        dependencies[out_name] = {tuple_name}
        hlg = HighLevelGraph(dict(layers), dict(dependencies))
        chunks = batch_chunks + tuple((d,) for d in core)
        outs.append(da.Array(hlg, out_name, chunks, dtype=t.dtype))
    return outs


def compute_arrays(arrays: list, client, progressbar: bool) -> list[np.ndarray]:
    """Compute Dask arrays into NumPy arrays allocated up front, chunk by chunk.

    Every chunk is copied into its place as soon as it is computed, then freed: the peak
    memory is the result plus the chunks in flight.  ``dask.compute`` would keep every
    chunk until the end and then concatenate them: twice the result, which for results of
    several GB costs both memory and time (every page of both is touched once).

    On ``client`` (or Dask's default client) chunks are gathered as they complete, with
    ``distributed.progress``; on a local scheduler they are stored by Dask's own tasks
    (``dask.array.store``), with ``dask.diagnostics.ProgressBar`` (for runs over a
    second).  Chunks that several arrays share (the outputs of one pmap chunk) are
    computed once.
    """
    import dask.array as da
    from dask.array.core import slices_from_chunks

    outs = [np.empty(a.shape, dtype=a.dtype) for a in arrays]
    client = client if client is not None else default_client()
    if client is not None:
        from distributed import as_completed

        blocks, places = [], []
        for a, out in zip(arrays, outs):
            # unoptimised: chunks shared by several arrays keep one key (fusing them with
            # each array's getitem would compute them once per array)
            delayed = a.to_delayed(optimize_graph=False).ravel()
            for block, place in zip(delayed, slices_from_chunks(a.chunks)):
                blocks.append(block)
                places.append((out, place))
        futures = client.compute(blocks)
        where = {f.key: [] for f in futures}
        for f, place in zip(futures, places):
            where[f.key].append(place)
        if progressbar:
            from distributed import progress

            progress(futures)
        pending = as_completed(futures, loop=client.loop, with_results=True)
        del futures  # a chunk's result is released on the cluster once it is copied
        for future, value in pending:
            for out, place in where.pop(future.key, ()):
                out[place] = value
            del future, value
        return outs
    get = get_scheduler()
    if getattr(get, "__module__", "") == "dask.multiprocessing":  # no shared targets there
        computed = dask.compute(*arrays)
        for out, value in zip(outs, computed):
            out[...] = value
        return outs
    store = lambda: da.store(arrays, outs, lock=False)  # noqa: E731
    if progressbar:
        from dask.diagnostics import ProgressBar

        with ProgressBar(minimum=1.0):
            store()
    else:
        store()
    return outs
