"""Data parallelism: a PyTensor graph mapped over leading batch axes, as Dask arrays.

``pmap(fn)`` vectorises a graph written for one element (PyTensor's ``vectorize_graph``,
which turns Ops into their batched forms: ``Blockwise``, ``Elemwise`` broadcasting, random
variables with a batched ``size``) and cuts the batch into chunks.  Each chunk is one Dask
task calling the vectorised graph, compiled once per process (a :class:`TaskRunner`:
shipped as a few kilobytes, kept compiled on the workers).

* Unbatched inputs (``in_axes=None``) become one Dask key that every chunk reads, so a
  cluster sends them to a worker once, not once per chunk.
* Random variables: every random generator of the graph becomes an input, and chunk ``i``
  draws from generators spawned from ``SeedSequence(random_seed)`` for that chunk.  The
  same seed and chunking give the same numbers on any scheduler and any number of
  workers; different chunks draw independent streams.
* Chunk size is chosen by work (bytes of inputs and outputs per chunk), not by the number
  of workers: splitting a small job only adds overhead.
"""

from __future__ import annotations

import math
import operator
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from dasktensor import _config
from dasktensor._cluster import default_client


def _rng_type():
    from pytensor.tensor.random.type import RandomGeneratorType

    return RandomGeneratorType


def _shared_data(outputs) -> list:
    """Shared variables other than random generators that the graph of ``outputs`` reads."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.traversal import graph_inputs

    rng_type = _rng_type()
    return [
        v
        for v in graph_inputs(outputs)
        if isinstance(v, SharedVariable) and not isinstance(v.type, rng_type)
    ]


_LARGE_CONSTANT_BYTES = 1 << 12


def _large_constants(outputs) -> list:
    """Tensor constants of 4 KiB or more in the graph of ``outputs``."""
    from pytensor.graph.traversal import graph_inputs
    from pytensor.tensor.variable import TensorConstant

    return [
        v
        for v in graph_inputs(outputs)
        if isinstance(v, TensorConstant) and v.data.nbytes >= _LARGE_CONSTANT_BYTES
    ]


def _random_generators(outputs) -> list:
    """Shared random generators the graph of ``outputs`` reads."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.traversal import graph_inputs

    rng_type = _rng_type()
    return [
        v
        for v in graph_inputs(outputs)
        if isinstance(v, SharedVariable) and isinstance(v.type, rng_type)
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
    import pytensor.tensor as pt
    from pytensor.graph.basic import Constant
    from pytensor.graph.replace import clone_replace
    from pytensor.graph.traversal import ancestors, applys_between, graph_inputs
    from pytensor.tensor.random.op import RandomVariable
    from pytensor.tensor.type_other import NoneTypeT

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
    import pytensor
    from pytensor.compile.mode import Mode

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
        import pytensor.tensor as pt
        from pytensor.graph.replace import clone_replace, vectorize_graph

        from dasktensor._runners import TaskRunner

        self.n_batch = n_batch
        self.name = name
        self.batched = tuple(bool(b) for b in batched)
        # inputs may be inner variables (PyMC conditions on random variables' outputs):
        # cut the graph there, so that nothing above them is cloned or recomputed
        roots = [v.type() for v in inputs]
        for root, v in zip(roots, inputs):
            root.name = v.name
        outputs = clone_replace(list(outputs), replace=dict(zip(inputs, roots)))
        # data in shared variables (pm.Data...) becomes an unbatched input whose value
        # is read at each call (``fixed_values``): a lazy result does not change when the
        # variable does later; so do large constants (data given to PyMC as arrays): kept
        # out of the compiled graph, they travel once per worker as a Dask key, not
        # inside every runner
        shared = _shared_data(outputs)
        large = _large_constants(outputs)
        fixed = [v.type() for v in shared + large]
        outputs = clone_replace(outputs, replace=dict(zip(shared + large, fixed)))
        self._shared = shared
        self._constants = [c.data for c in large]
        fixed_values = self._fixed_values()
        inputs = roots + fixed
        self.batched = self.batched + (False,) * len(fixed)
        batched = self.batched
        new_inputs, replace = [], {}
        for v, b in zip(inputs, self.batched):
            if b:
                bv = pt.tensor(
                    dtype=v.type.dtype, shape=(None,) * n_batch + tuple(v.type.shape), name=v.name
                )
                replace[v] = bv
                new_inputs.append(bv)
            else:
                new_inputs.append(v)
        outputs, checks = _freeze_sizes(
            list(outputs), list(replace), dict(zip(fixed, fixed_values))
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
                for o, out in zip(outs, outputs)
            ]
        self.rngs = _random_generators(outs)
        rng_inputs = [r.type() for r in self.rngs]
        if self.rngs:
            outs = clone_replace(outs, replace=dict(zip(self.rngs, rng_inputs)))
        self.out_types = [o.type for o in outs]
        self.runner = TaskRunner([*new_inputs, *rng_inputs], outs, backend="inner", name=name)
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


def _run_chunk(runner, seed: np.random.SeedSequence | None, n_rngs: int, *values):
    """Task body: one chunk through the vectorised graph; the tuple of its outputs."""
    rngs = [np.random.default_rng(s) for s in seed.spawn(n_rngs)] if n_rngs else []
    return runner(*values, *rngs)


# ----------------------------------------------------------------------------- dask arrays


def _as_dask(x, chunks):
    import dask.array as da

    if isinstance(x, da.Array):
        return x.rechunk(chunks)
    return da.from_array(x, chunks=chunks)


def auto_chunk(n: int, bytes_per_element: float) -> int:
    """Batch elements per chunk: about ``dasktensor.pmap.chunk-bytes`` of data each."""
    target = _config.get("pmap.chunk-bytes")
    if isinstance(target, str):
        from dask.utils import parse_bytes

        target = parse_bytes(target)
    return max(1, min(n, int(target // max(bytes_per_element, 1))))


def _output_core_shapes(vec: Vectorized, core_shapes_in: list[tuple]) -> list[tuple]:
    """Shapes of one element's outputs (after the batch axes), from static types or by
    evaluating the graph's shape on zero-strided dummies of one element (once per
    vectorised graph and input shapes)."""
    static = [t.shape[vec.n_batch :] for t in vec.out_types]
    if all(d is not None for s in static for d in s):
        return [tuple(int(d) for d in s) for s in static]
    key = tuple(core_shapes_in)
    if key not in vec._out_cores:
        vec._out_cores[key] = _evaluate_core_shapes(vec, core_shapes_in)
    return vec._out_cores[key]


def _evaluate_core_shapes(vec: Vectorized, core_shapes_in: list[tuple]) -> list[tuple]:
    fresh, outs = vec.runner._graph
    dummies = []
    for v, b, shape in zip(fresh, vec.batched, core_shapes_in):
        full = (1,) * vec.n_batch + tuple(shape) if b else tuple(shape)
        dummies.append(np.broadcast_to(np.zeros((), dtype=v.type.dtype), full))
    rng_vars = fresh[len(vec.batched) :]
    # the shape rewrites of fast_run reduce the graph to shape arithmetic; Python thunks
    # run that at once (a backend would compile the whole graph, large constants included)
    shape_fn = _py_function(
        fresh[: len(vec.batched)] + rng_vars, [o.shape for o in outs], optimizer="fast_run"
    )
    shapes = shape_fn(*dummies, *[np.random.default_rng(0) for _ in rng_vars])
    return [tuple(int(d) for d in s[vec.n_batch :]) for s in shapes]


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
    from dask.highlevelgraph import HighLevelGraph
    from dask.task_spec import Task, TaskRef

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
    out_cores = _output_core_shapes(vec, core_shapes)
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


# ----------------------------------------------------------------------------- pmap


class PMapped:
    """A graph mapped over a leading batch axis; see :func:`pmap`."""

    def __init__(self, fn, in_axes, chunks, name: str | None, random_seed):
        if not (callable(fn) or (isinstance(fn, tuple) and len(fn) == 2)):
            raise TypeError(
                "pmap expected a function building a PyTensor graph from input variables, "
                f"or a graph as (inputs, outputs), got {fn!r}"
            )
        if not (chunks == "auto" or (isinstance(chunks, int) and chunks > 0)):
            raise ValueError(f"pmap(chunks=...) expected 'auto' or an int > 0, got {chunks!r}")
        self.fn = fn
        self.in_axes = in_axes
        self.chunks = chunks
        self.name = name
        self.random_seed = random_seed
        self._cache: dict = {}

    def _axes(self, args: list) -> list[int | None]:
        """Per argument: its batch axis (normalised to >= 0), or None."""
        n = len(args)
        axes = self.in_axes
        axes = [axes] * n if axes is None or isinstance(axes, int) else list(axes)
        if len(axes) != n:
            raise ValueError(f"pmap: in_axes has {len(axes)} entries for {n} inputs")
        out = []
        for i, (a, x) in enumerate(zip(axes, args)):
            if a is None:
                out.append(None)
                continue
            if isinstance(a, bool) or not isinstance(a, int | np.integer):
                raise ValueError(
                    "pmap: in_axes entries must be an int (the input's batch axis) or None "
                    f"(the same for every element), got {a!r}"
                )
            if not -x.ndim <= a < x.ndim:
                raise ValueError(
                    f"pmap: in_axes[{i}]={a} is out of range for input {i} of shape "
                    f"{tuple(x.shape)}"
                )
            out.append(int(a) % x.ndim)
        return out

    def _graph(self, args, batched):
        """The element-wise graph for these arguments (built once per signature)."""
        import pytensor.tensor as pt

        if isinstance(self.fn, tuple):
            inputs, outputs = self.fn
            inputs = list(inputs)
            if len(inputs) != len(args):
                raise TypeError(f"pmap: the graph has {len(inputs)} inputs, got {len(args)}")
            single = not isinstance(outputs, list | tuple)
            return inputs, [outputs] if single else list(outputs), single
        inputs = []
        for i, (x, b) in enumerate(zip(args, batched)):
            shape = tuple(x.shape[1:] if b else x.shape)
            inputs.append(pt.tensor(dtype=str(x.dtype), shape=shape, name=f"x{i}"))
        outputs = self.fn(*inputs)
        single = not isinstance(outputs, list | tuple)
        outputs = [outputs] if single else list(outputs)
        return inputs, [pt.as_tensor_variable(o) for o in outputs], single

    def __call__(self, *args, compute: bool = False, random_seed=None, progressbar: bool = True):
        import dask.array as da

        args = [x if isinstance(x, da.Array) else np.asarray(x) for x in args]
        axes = self._axes(args)
        if all(a is None for a in axes):
            raise ValueError("pmap needs at least one batched input (in_axes not None)")
        # the batch axis first: the vectorised graph batches leading axes
        args = [
            x if a in (None, 0) else (da if isinstance(x, da.Array) else np).moveaxis(x, a, 0)
            for x, a in zip(args, axes)
        ]
        batched = [a is not None for a in axes]
        sizes = {x.shape[0] for x, b in zip(args, batched) if b}
        if len(sizes) != 1:
            raise ValueError(
                "pmap: batched inputs must have the same length along their batch axes, "
                f"got {sorted(sizes)}"
            )
        (n,) = sizes
        signature = tuple(
            (str(x.dtype), tuple(x.shape[1:] if b else x.shape), b) for x, b in zip(args, batched)
        )
        vec, single = self._cache.get(signature, (None, None))
        fixed = vec.fixed_values() if vec is not None else None
        if fixed is None:  # first call with this signature, or shared data changed sizes
            inputs, outputs, single = self._graph(args, batched)
            vec = Vectorized(inputs, outputs, batched, 1, name=self.name or "pmap")
            self._cache[signature] = (vec, single)
            fixed = vec.fixed_values()
        chunks = self.chunks
        if chunks == "auto":
            dask_chunks = [
                x.chunks[0] for x, b in zip(args, batched) if b and isinstance(x, da.Array)
            ]
            if dask_chunks:
                batch = (dask_chunks[0],)
            else:
                per = sum(
                    x.dtype.itemsize * math.prod(x.shape[1:]) for x, b in zip(args, batched) if b
                )
                per += sum(
                    np.dtype(t.dtype).itemsize * math.prod(d or 1 for d in t.shape[1:])
                    for t in vec.out_types
                )
                batch = (_split(n, auto_chunk(n, per)),)
        else:
            batch = (_split(n, chunks),)
        seed = random_seed if random_seed is not None else self.random_seed
        outs = map_blocks(vec, args, batch, seed, name=self.name, fixed=fixed)
        if compute:
            outs = compute_arrays(outs, None, progressbar)
        return outs[0] if single else tuple(outs)


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
    import dask
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
    from dask.base import get_scheduler

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


def _split(n: int, size: int) -> tuple[int, ...]:
    full, rest = divmod(n, size)
    return (size,) * full + ((rest,) if rest else ())


def pmap(
    fn: Callable | tuple,
    in_axes=0,
    chunks: int | str = "auto",
    *,
    name: str | None = None,
    random_seed=None,
) -> PMapped:
    """Map a PyTensor graph over the first axis of its inputs, in parallel chunks on Dask.

    Parameters
    ----------
    fn : callable or (inputs, outputs)
        A function taking PyTensor variables (one element of each input) and returning
        the output variable(s), or the graph itself as ``(inputs, outputs)``.
    in_axes : int, None or sequence of them
        Per input: an int maps over that axis (``0``: the first), ``None`` passes it
        whole to every element (it is sent once, not copied per chunk).  The outputs
        carry the batch axis first.
    chunks : int or "auto"
        Elements per chunk (one Dask task each).  ``"auto"`` follows the chunks of a Dask
        array input, else aims at ``dasktensor.pmap.chunk-bytes`` of data per chunk.
    name : str, optional
        Prefix of the task keys (``pmap`` by default).
    random_seed : int or SeedSequence, optional
        Seed of the random variables in the graph: chunk ``i`` draws from the ``i``-th
        generator spawned from it.  Fixed seed and chunks give fixed results on any
        scheduler.

    Returns
    -------
    PMapped
        ``g(*arrays)`` returns a lazy Dask array (a tuple of them for several outputs);
        ``g(*arrays, compute=True)`` NumPy arrays, computed with Dask's progress bar
        (``progressbar=False`` turns it off).

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> g = dt.pmap(lambda x, w: pt.tanh(x @ w).sum(), in_axes=(0, None), chunks=2)
    >>> y = g(np.ones((5, 3)), np.full((3, 4), 0.1))
    >>> y.chunks
    ((2, 2, 1),)
    >>> np.round(y.compute(), 3)
    array([1.165, 1.165, 1.165, 1.165, 1.165])
    """
    return PMapped(fn, in_axes, chunks, name, random_seed)
