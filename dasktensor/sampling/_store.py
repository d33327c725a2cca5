"""Checkpoints of ``dt.sample``: draws and chain states on disk, so a run outlives its caller.

A store is a zarr group (zarr 3) written as segments finish:

* ``attrs["dasktensor"]``: what the run is: the store format, a fingerprint of the model
  (its log-density graph and every value it reads: data, ``pm.Data``), and the
  arguments that decide the draws (chains, tune, draws, random seed, init, initial
  values, step options).  A store is continued only by the same run: anything else is
  refused, naming what differs.
* ``draws/<value variable>``: ``(chains, tune + draws, *shape)``, the points of each chain
  as the sampler sees them (transformed variables, e.g. ``sigma_log__``); readable with
  zarr or xarray while the run goes on.
* ``segments/chain-<c>/<first>-<last>.pkl`` (plain files beside zarr's): each finished
  segment's sampler statistics and the chain's state after it (the step method's
  ``sampling_state``, random generators included, and the last point).

**Commit order.**  A segment's draws are written into ``draws/`` first (zarr writes each
chunk atomically), then its segment file, written to a temporary name and renamed: a
segment is committed when its file exists.  A caller killed half-way through a segment
leaves draws past the last committed segment, which are never read back, and no segment
file for it, so that segment runs again.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: version of the layout above
FORMAT = 1
_SEGMENT = re.compile(r"^(\d+)-(\d+)\.pkl$")


class StoreMismatchError(ValueError):
    """A store that holds another run than the one asked for."""


@dataclass
class Checkpoint:
    """What a store holds of one chain: draws ``[0, done)`` and the state after them."""

    done: int
    #: the sampler statistics of each committed draw, in order
    stats: list
    #: the step method's ``sampling_state`` after the last committed draw (None: none)
    state: object
    #: the chain's point after the last committed draw (None: none)
    point: dict | None


class SampleStore:
    """A run's checkpoint store (see the module docstring).

    Parameters
    ----------
    path : str or Path
        The store's directory (``"run.zarr"``).
    identity : dict
        JSON values that identify the run (model fingerprint, arguments).
    layout : dict
        ``{value variable: (shape, dtype)}`` of the points.
    chains, length : int
        Chains, and draws per chain including tuning.
    resume : bool
        Continue a store that exists (``True``) or refuse to touch it (``False``).

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> path = tempfile.mkdtemp() + "/run.zarr"
    >>> store = SampleStore(path, {"seed": 1}, {"x": ((2,), "float64")}, chains=1, length=4)
    >>> store.commit(0, 0, 2, {"x": np.ones((2, 2))}, [["a"], ["b"]], "state", {"x": 1})
    >>> again = SampleStore(path, {"seed": 1}, {"x": ((2,), "float64")}, 1, 4, resume=True)
    >>> ck = again.checkpoint(0)
    >>> ck.done, ck.stats, ck.state, again.points(0, ck.done)["x"].shape
    (2, [['a'], ['b']], 'state', (2, 2))
    >>> SampleStore(path, {"seed": 2}, {"x": ((2,), "float64")}, 1, 4, resume=True)
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dasktensor.sampling._store.StoreMismatchError: the store ... holds another run: ...
    """

    def __init__(self, path, identity: dict, layout: dict, chains: int, length: int,
                 resume: bool = False):  # fmt: skip
        zarr = _zarr()
        self.path = Path(path)
        self.layout = {name: (tuple(shape), str(dtype)) for name, (shape, dtype) in layout.items()}
        wanted = {"format": FORMAT, **identity, "chains": chains, "length": length,
                  "layout": {k: [list(s), d] for k, (s, d) in self.layout.items()}}  # fmt: skip
        wanted = _json(wanted)
        if self.path.exists():
            self.group = self._open_existing(zarr, wanted, resume)
        else:
            self.group = zarr.open_group(str(self.path), mode="w")
            for name, (shape, dtype) in self.layout.items():
                self.group.create_array(
                    f"draws/{name}",
                    shape=(chains, length, *shape),
                    chunks=(1, min(length, 256), *shape),
                    dtype=dtype,
                    fill_value=np.nan if np.dtype(dtype).kind in "fc" else 0,
                )
            self.group.attrs["dasktensor"] = wanted
        self.identity = wanted

    def _open_existing(self, zarr, wanted: dict, resume: bool):
        try:
            group = zarr.open_group(str(self.path), mode="r+")
            found = dict(group.attrs).get("dasktensor")
        except Exception as e:  # not a zarr group at all
            raise StoreMismatchError(
                f"{self.path} exists and is not a dt.sample store ({type(e).__name__}: {e}); "
                "expected a store written by dt.sample(..., store=...), or a new path"
            ) from e
        if found is None:
            raise StoreMismatchError(
                f"{self.path} is a zarr store but not one of dt.sample (no 'dasktensor' "
                "attribute); give dt.sample a new path"
            )
        if not resume:
            raise FileExistsError(
                f"the store {self.path} exists already; pass resume=True to continue the "
                "run it holds, or give a new path (nothing was written)"
            )
        differs = [
            f"{k} is {_short(found.get(k))} there, {_short(v)} here"
            for k, v in wanted.items()
            if found.get(k) != v
        ]
        if differs:
            raise StoreMismatchError(
                f"the store {self.path} holds another run: {'; '.join(differs)}; expected "
                "the model, data and arguments of the run that wrote it (or a new path)"
            )
        return group

    # -- writing ----------------------------------------------------------------------

    def commit(self, chain: int, first: int, last: int, points: dict, stats: list,
               state, point: dict) -> None:  # fmt: skip
        """Store draws ``[first, last)`` of ``chain`` and its state after them."""
        for name, values in points.items():
            self.group[f"draws/{name}"][chain, first:last] = values
        folder = self._folder(chain)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"{first:09d}-{last:09d}.pkl"
        partial = final.with_suffix(".tmp")
        with open(partial, "wb") as f:
            pickle.dump({"stats": stats, "state": state, "point": point}, f, protocol=5)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, final)  # the commit: a segment file is whole or absent

    # -- reading ----------------------------------------------------------------------

    def checkpoint(self, chain: int) -> Checkpoint:
        """The committed draws of ``chain``: segments that follow each other from draw 0."""
        segments = {}
        folder = self._folder(chain)
        for entry in folder.iterdir() if folder.exists() else ():
            found = _SEGMENT.match(entry.name)
            if found:
                segments[int(found[1])] = (int(found[2]), entry)
        done, stats, state, point = 0, [], None, None
        while done in segments:
            last, entry = segments[done]
            with open(entry, "rb") as f:
                saved = pickle.load(f)
            stats.extend(saved["stats"])
            state, point, done = saved["state"], saved["point"], last
        return Checkpoint(done, stats, state, point)

    def points(self, chain: int, n: int) -> dict[str, np.ndarray]:
        """The first ``n`` points of ``chain``, ``{value variable: (n, *shape)}``."""
        return {name: self.group[f"draws/{name}"][chain, :n] for name in self.layout}

    def _folder(self, chain: int) -> Path:
        return self.path / "segments" / f"chain-{chain}"


def _zarr():
    try:
        import zarr
    except ImportError as e:  # pragma: no cover - zarr is in the test extra
        raise ImportError(
            "dt.sample(store=...) writes a zarr store; install zarr>=3 "
            "(`pip install zarr`, or `pip install 'dasktensor[zarr]'`)"
        ) from e
    if int(zarr.__version__.split(".")[0]) < 3:  # pragma: no cover - both lines have 3
        raise ImportError(f"dt.sample(store=...) needs zarr>=3, found {zarr.__version__}")
    return zarr


def _json(value):
    """``value`` as JSON gives it back (tuples as lists), to compare with what was stored."""
    import json

    return json.loads(json.dumps(value))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
