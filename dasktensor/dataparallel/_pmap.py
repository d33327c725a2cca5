"""Data parallelism: ``pmap``, a PyTensor graph mapped over a leading batch axis on Dask.

``pmap(fn)`` builds the graph for one element (from ``fn`` called on variables of one
element's shape, or given as ``(inputs, outputs)``), vectorises it over the batch axis
(:mod:`dasktensor.dataparallel._vectorize`) and runs it in chunks, one Dask task each
(:mod:`dasktensor.dataparallel._chunks`).  A :class:`PMapped` keeps its vectorised graphs
per argument signature (dtypes, shapes of one element, which inputs are batched), so a
later call with new values reuses the compiled runners, here and on the workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dasktensor.dataparallel._chunks import _split, auto_chunk, compute_arrays, map_blocks
from dasktensor.dataparallel._vectorize import Vectorized


class PMapped:
    """A graph mapped over a leading batch axis; see :func:`pmap`."""

    def __init__(self, fn, in_axes, chunks, name: str | None, random_seed):
        if not (callable(fn) or (isinstance(fn, tuple) and len(fn) == 2)):
            raise TypeError(
                "pmap expected a function building a PyTensor graph from input variables, "
                f"or a graph as (inputs, outputs), got {fn!r}"
            )
        if not (
            chunks == "auto"
            or (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks > 0)
        ):
            raise ValueError(f"pmap(chunks=...) expected 'auto' or an int > 0, got {chunks!r}")
        self.fn = fn
        self.in_axes = in_axes
        self.chunks = chunks
        self.name = name
        self.random_seed = random_seed
        self._cache: dict = {}
        self._last = None  # the Vectorized graph of the latest call

    @property
    def plan(self):
        """How the latest call runs each chunk: its :class:`~dasktensor.Pipeline` of
        placed stages (printable) when the graph has ``dt.annotate`` blocks, else None
        (one task per chunk).  The graph is built per argument signature, at a call."""
        if self._last is None:
            raise RuntimeError(
                "pmap: no plan yet; the graph is built for the arguments of a call: call "
                "the pmap first (g(x) builds a lazy result without computing anything)"
            )
        return self._last.pipeline

    def __repr__(self) -> str:
        name = self.name or "pmap"
        if self._last is None:
            return f"<pmap {name!r}, not called yet>"
        if self._last.pipeline is None:
            return f"<pmap {name!r}: one task per chunk>"
        return f"<{self._last.pipeline.describe()}>"

    def _axes(self, args: list) -> list[int | None]:
        """Per argument: its batch axis (normalised to >= 0), or None."""
        n = len(args)
        axes = self.in_axes
        axes = [axes] * n if axes is None or isinstance(axes, int) else list(axes)
        if len(axes) != n:
            raise ValueError(f"pmap: in_axes has {len(axes)} entries for {n} inputs")
        out: list[int | None] = []
        for i, (a, x) in enumerate(zip(axes, args, strict=True)):
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
            for i, (v, x, b) in enumerate(zip(inputs, args, batched, strict=True)):
                # the compiled graph takes the values as they are: check them here
                shape = tuple(x.shape[1:] if b else x.shape)
                fits = len(shape) == v.type.ndim and all(
                    d is None or d == s for d, s in zip(v.type.shape, shape, strict=True)
                )
                if str(x.dtype) != v.type.dtype or not fits:
                    raise TypeError(
                        f"pmap: input {i} ({v}) expected elements of dtype {v.type.dtype} "
                        f"and shape {v.type.shape} (None: any length), got dtype {x.dtype} "
                        f"and shape {shape}" + (" after the batch axis" if b else "")
                    )
            single = not isinstance(outputs, list | tuple)
            return inputs, [outputs] if single else list(outputs), single
        inputs = []
        for i, (x, b) in enumerate(zip(args, batched, strict=True)):
            shape = tuple(x.shape[1:] if b else x.shape)
            inputs.append(pt.tensor(dtype=str(x.dtype), shape=shape, name=f"x{i}"))
        outputs = self.fn(*inputs)
        single = not isinstance(outputs, list | tuple)
        outputs = [outputs] if single else list(outputs)
        return inputs, [pt.as_tensor_variable(o) for o in outputs], single

    def __call__(self, *args, compute: bool = False, random_seed=None, progressbar: bool = True):
        import dask.array as da

        arrays = [x if isinstance(x, da.Array) else np.asarray(x) for x in args]
        for i, x in enumerate(arrays):
            if x.dtype.kind not in "biufc":
                raise TypeError(
                    f"pmap: input {i} expected a numeric array (bool, int, float or "
                    f"complex), got dtype {x.dtype}"
                )
        axes = self._axes(arrays)
        if all(a is None for a in axes):
            raise ValueError("pmap needs at least one batched input (in_axes not None)")
        # the batch axis first: the vectorised graph batches leading axes
        arrays = [
            x if a in (None, 0) else (da if isinstance(x, da.Array) else np).moveaxis(x, a, 0)
            for x, a in zip(arrays, axes, strict=True)
        ]
        batched = [a is not None for a in axes]
        sizes = {x.shape[0] for x, b in zip(arrays, batched, strict=True) if b}
        if len(sizes) != 1:
            raise ValueError(
                "pmap: batched inputs must have the same length along their batch axes, "
                f"got {sorted(sizes)}"
            )
        (n,) = sizes
        if math.isnan(n):
            raise ValueError(
                "pmap: a Dask array input of unknown length along its batch axis (its chunk "
                "sizes are unknown); expected known chunks: call x.compute_chunk_sizes() first"
            )
        signature = tuple(
            (str(x.dtype), tuple(x.shape[1:] if b else x.shape), b)
            for x, b in zip(arrays, batched, strict=True)
        )
        vec, single = self._cache.get(signature, (None, None))
        fixed = vec.fixed_values() if vec is not None else None
        if fixed is None:  # first call with this signature, or shared data changed sizes
            inputs, outputs, single = self._graph(arrays, batched)
            vec = Vectorized(inputs, outputs, batched, 1, name=self.name or "pmap")
            self._cache[signature] = (vec, single)
            fixed = vec.fixed_values_of_new()
        self._last = vec
        chunks = self.chunks
        if chunks == "auto":
            dask_chunks = [
                x.chunks[0]
                for x, b in zip(arrays, batched, strict=True)
                if b and isinstance(x, da.Array)
            ]
            if dask_chunks:
                batch = (dask_chunks[0],)
            else:
                per = sum(
                    x.dtype.itemsize * math.prod(x.shape[1:])
                    for x, b in zip(arrays, batched, strict=True)
                    if b
                )
                per += sum(
                    np.dtype(t.dtype).itemsize * math.prod(d or 1 for d in t.shape[1:])
                    for t in vec.out_types
                )
                batch = (_split(n, auto_chunk(n, per)),)
        else:
            batch = (_split(n, chunks),)
        seed = random_seed if random_seed is not None else self.random_seed
        outs = map_blocks(vec, arrays, batch, seed, name=self.name, fixed=fixed)
        if compute:
            outs = compute_arrays(outs, None, progressbar)
        return outs[0] if single else tuple(outs)


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
