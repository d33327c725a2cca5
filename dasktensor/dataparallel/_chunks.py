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
from dasktensor.cluster import check_resources, default_client
from dasktensor.dataparallel._vectorize import Vectorized
from dasktensor.engine import FromInput, FromTask, picked


def _run_chunk(runner, seeds: tuple, *values):
    """Task body: one chunk through the vectorised graph; the tuple of its outputs.

    ``seeds`` are the chunk's seeds, one per random generator of the graph: spawned when
    the graph is built, so that computing a lazy result twice (on a local scheduler, where
    the task holds the very objects of the graph) draws the same numbers.
    """
    return runner(*values, *[np.random.default_rng(s) for s in seeds])


def _run_stage(runner, picks: tuple, seeds: tuple, *deps):
    """Task body: one chunk through one stage of a pipeline; the tuple of its outputs.

    ``picks`` say which output of which dependency feeds which input (dependencies after
    those the picks name are markers of backpressure, read for their order only).
    """
    return runner(*picked(picks, deps), *[np.random.default_rng(s) for s in seeds])


def _handed_on(_outputs) -> None:
    """Task body of a backpressure marker: a stage has finished a chunk (it runs where
    that stage's outputs are, and hands on ``None``, not them)."""
    return


class _StageTask(Task):
    """A stage's task: never fused with its neighbours by Dask's array optimisation
    (fusing a chain of stages would run them as one task, on one worker)."""

    @property
    def block_fusion(self) -> bool:
        return True


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
    client=None,
):
    """Dask arrays of the vectorised graph's outputs, one task per block of the batch.

    ``args`` are numpy or Dask arrays, batched ones with ``vec.n_batch`` leading batch
    axes; ``batch_chunks`` the chunks of those axes; ``fixed`` the values of the fixed
    inputs, from ``vec.fixed_values()``; ``client`` (else Dask's default client) is
    asked whether some worker offers the resources of a pipeline's stages.
    """
    import dask.array as da

    nb = vec.n_batch
    args = [*args, *fixed]
    arrays = []
    core_shapes = []
    for x, b in zip(args, vec.batched, strict=True):
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
    # per chunk, one seed per random generator
    n_rngs = len(vec.rngs)
    seeds = [
        tuple(s.spawn(n_rngs)) if n_rngs else ()
        for s in np.random.SeedSequence(random_seed).spawn(len(blocks))
    ]

    def chunk_of(j: int, block: tuple) -> TaskRef:
        a = arrays[j]
        idx = block + (0,) * (a.ndim - nb) if vec.batched[j] else (0,) * a.ndim
        return TaskRef((a.name, *idx))

    graph = HighLevelGraph.merge(*[a.dask for a in arrays])
    layers = dict(graph.layers)
    dependencies = dict(graph.dependencies)
    if vec.pipeline is None:  # one task per chunk
        layer = {}
        for i, block in enumerate(blocks):
            key = (tuple_name, *block)
            refs = [chunk_of(j, block) for j in range(len(arrays))]
            layer[key] = Task(key, _run_chunk, vec.runner, seeds[i], *refs)
        layers[tuple_name] = layer
        dependencies[tuple_name] = {a.name for a in arrays}

        def output_of(block: tuple, k: int) -> tuple:
            return (operator.getitem, TaskRef((tuple_name, *block)), k)
    else:
        client = client if client is not None else default_client()
        if client is not None:  # a stage whose resources no worker offers would hang
            check_resources(client, vec.pipeline.placements)
        layers[tuple_name] = _pipeline_layer(vec.pipeline, blocks, seeds, chunk_of, label, token)
        dependencies[tuple_name] = {a.name for a in arrays}
        sources = vec.pipeline.output_sources

        def output_of(block: tuple, k: int) -> tuple:
            src = sources[k]
            if isinstance(src, FromInput):
                return (_identity, chunk_of(src.position, block))
            stage = vec.pipeline.stages[src.task]
            return (
                operator.getitem,
                TaskRef((_stage_key(label, stage, token), *block)),
                src.output,
            )

    outs = []
    for k, (t, core) in enumerate(zip(vec.out_types, out_cores, strict=True)):
        out_name = f"{label}-out{k}-{token}" if len(vec.out_types) > 1 else f"{label}-out-{token}"
        out_layer = {}
        for block in blocks:
            key = (out_name, *block, *(0,) * len(core))
            out_layer[key] = Task(key, *output_of(block, k))
        layers[out_name] = out_layer
        dependencies[out_name] = {tuple_name}
        hlg = HighLevelGraph(dict(layers), dict(dependencies))
        chunks = batch_chunks + tuple((d,) for d in core)
        if vec.pipeline is None:
            cls = da.Array
        else:  # (_arrays imports dask.array at its top: not at dasktensor's import)
            from dasktensor.dataparallel._arrays import PipelinedArray as cls
        outs.append(cls(hlg, out_name, chunks, dtype=t.dtype))
    return outs


def _identity(x):
    return x


def _stage_key(label: str, stage, token: str) -> str:
    return f"{label}-{stage.name}-{token}"


#: a backpressure marker runs before any stage task waiting on its worker
_MARKER_PRIORITY = 1 << 40


def _pipeline_layer(pipeline, blocks, seeds, chunk_of, label: str, token: str):
    """The tasks of every chunk's stages, and of the markers that bound how many chunks
    wait between stages (``dasktensor.pmap.inflight``), as one layer (a stage's tasks
    wait on markers of later stages: layers per stage would depend on each other in a
    circle).  Each stage's tasks carry its placement as per-key annotations."""
    inflight = _config.get("pmap.inflight")
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 1:
        raise ValueError(
            f"dask.config 'dasktensor.pmap.inflight' expected an int >= 1, got {inflight!r}"
        )
    n = len(blocks)
    layer: dict = {}
    per_key: dict[str, dict] = {}
    names = [_stage_key(label, st, token) for st in pipeline.stages]
    done_names = [f"{label}-{st.name}-done-{token}" for st in pipeline.stages]
    for st in pipeline.stages:
        for i, block in enumerate(blocks):
            ann = st.placement.annotations()
            picks, deps, where = [], [], {}
            for src in st.sources:
                if isinstance(src, FromTask):
                    ref, out = TaskRef((names[src.task], *block)), src.output
                else:
                    ref, out = chunk_of(src.position, block), None
                if ref.key not in where:
                    where[ref.key] = len(deps)
                    deps.append(ref)
                picks.append((where[ref.key], out))
            if i >= inflight:  # wait until the readers of chunk i - inflight are done
                earlier = blocks[i - inflight]
                deps += [TaskRef((done_names[c], *earlier)) for c in st.consumers]
            key = (names[st.index], *block)
            chunk_seeds = tuple(seeds[i][j] for j in st.rngs) if seeds[i] else ()
            layer[key] = _StageTask(key, _run_stage, st.runner, tuple(picks), chunk_seeds, *deps)
            # chunks in order (Dask's own order of such a graph interleaves them), unless
            # the block asks for a priority of its own
            ann.setdefault("priority", -i)
            for name, value in ann.items():
                per_key.setdefault(name, {})[key] = value
            if st.deps and i + inflight < n:  # a later chunk of a producer waits on this
                done = (done_names[st.index], *block)
                layer[done] = Task(done, _handed_on, TaskRef(key))
                # at once: not queued behind the stage's next chunks on its worker
                per_key.setdefault("priority", {})[done] = _MARKER_PRIORITY
    from dask.highlevelgraph import MaterializedLayer

    from dasktensor.dataparallel._arrays import ByKey

    annotations = {name: ByKey(values) for name, values in per_key.items()}
    return MaterializedLayer(layer, annotations=annotations or None)


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
        for a, out in zip(arrays, outs, strict=True):
            # unoptimised: chunks shared by several arrays keep one key (fusing them with
            # each array's getitem would compute them once per array)
            delayed = a.to_delayed(optimize_graph=False).ravel()
            for block, place in zip(delayed, slices_from_chunks(a.chunks), strict=True):
                blocks.append(block)
                places.append((out, place))
        futures = client.compute(blocks)
        where = {f.key: [] for f in futures}
        for f, place in zip(futures, places, strict=True):
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
        for out, value in zip(outs, computed, strict=True):
            out[...] = value
        return outs

    def store():
        return da.store(arrays, outs, lock=False)

    if progressbar:
        from dask.diagnostics import ProgressBar

        with ProgressBar(minimum=1.0):
            store()
    else:
        store()
    return outs
