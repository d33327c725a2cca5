"""Placement: where and how one task runs, as one value.

Every place that accepts placement options (``dt.annotate``, the callable Ops,
``RemoteModel``) builds a :class:`Placement`; the planner copies it onto the task, and the
engine turns it into Dask's vocabulary with :meth:`Placement.submit_kwargs` (``client.submit``)
or :meth:`Placement.annotations` (layer annotations of ``f.to_dask``).  Adding an option
touches this class and its test, nothing else.

``mode`` is not a Dask annotation: it names the PyTensor mode (``"JAX"``, ``"NUMBA"``, a
``Mode``) that compiles the task's subgraph in the process that runs it, so that the stage
placed on a GPU worker is compiled for that device while the rest stays on the line's own
backend.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any

_LABEL = re.compile(r"[A-Za-z]+(-[A-Za-z]+)*\Z")


def check_name(name, owner: str, what: str = "it prefixes Dask keys") -> str:
    """``name`` if it is letters and dashes (a readable Dask key prefix), else ValueError.

    Examples
    --------
    >>> check_name("ode-solve", "annotate(name=...)")
    'ode-solve'
    >>> check_name("solve_1", "annotate(name=...)")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: annotate(name=...) expected letters and dashes (...), got 'solve_1'
    """
    if not (isinstance(name, str) and _LABEL.match(name)):
        raise ValueError(f"{owner} expected letters and dashes ({what}), got {name!r}")
    return name


def _known_modes() -> list[str]:
    from pytensor.compile.mode import predefined_modes

    return sorted({"FAST_RUN", "FAST_COMPILE", *predefined_modes} - {"DASK"})


def _check_mode(mode):
    """A PyTensor mode name or ``Mode`` that ``get_mode`` accepts (not the DASK mode)."""
    from pytensor.compile.mode import Mode, get_mode

    if isinstance(mode, Mode):
        return mode
    if isinstance(mode, str) and mode.upper() != "DASK":
        try:
            get_mode(mode)
        except ValueError:
            pass
        else:
            return mode
    raise ValueError(
        f"mode= expected a PyTensor mode that compiles the block where it runs: one of "
        f"{', '.join(_known_modes())}, or a pytensor.compile.mode.Mode; got {mode!r}"
    )


@dataclass(frozen=True, repr=False)
class Placement:
    """Where and how a task runs: Dask's placement options plus the compiling mode.

    Parameters
    ----------
    resources : dict, optional
        Worker resources one run needs, e.g. ``{"GPU": 1}``: only workers offering them run
        the task.
    retries : int, optional
        How many times the task is run again after an exception.
    priority : int, optional
        Scheduling priority (higher runs first).
    workers : str or sequence of str, optional
        Addresses (or names) of the workers allowed to run the task.
    allow_other_workers : bool
        With ``workers``: other workers may run the task when those are busy or gone.
    mode : str or pytensor.compile.mode.Mode, optional
        PyTensor mode that compiles the task's subgraph where it runs (``"JAX"``...);
        ``None`` compiles with the line's own backend.

    Examples
    --------
    >>> from dasktensor._placement import Placement
    >>> p = Placement(resources={"GPU": 1}, retries=2)
    >>> p
    Placement(resources={'GPU': 1}, retries=2)
    >>> p.submit_kwargs()["resources"], p.submit_kwargs()["priority"]
    ({'GPU': 1}, 0)
    >>> p.annotations()
    {'resources': {'GPU': 1}, 'retries': 2}
    >>> Placement(retries=-1)
    Traceback (most recent call last):
    ...
    TypeError: retries= expected an integer >= 0, got -1
    """

    resources: Mapping[str, float] | None = None
    retries: int | None = None
    priority: int | None = None
    workers: tuple[str, ...] | None = None
    allow_other_workers: bool = False
    mode: Any = None

    def __post_init__(self):
        set_ = object.__setattr__
        if self.resources is not None:
            r = self.resources
            if not isinstance(r, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Real) and v > 0 for k, v in r.items()
            ):
                raise TypeError(
                    "resources= expected a dict of resource names to positive amounts, "
                    f"such as {{'GPU': 1}}, got {r!r}"
                )
            set_(self, "resources", dict(sorted(r.items())) or None)
        if self.retries is not None:
            if not isinstance(self.retries, Integral) or self.retries < 0:
                raise TypeError(f"retries= expected an integer >= 0, got {self.retries!r}")
            set_(self, "retries", int(self.retries))
        if self.priority is not None:
            if not isinstance(self.priority, Integral):
                raise TypeError(f"priority= expected an integer, got {self.priority!r}")
            set_(self, "priority", int(self.priority))
        if self.workers is not None:
            w = [self.workers] if isinstance(self.workers, str) else self.workers
            if not all(isinstance(a, str) for a in w) or not w:
                raise TypeError(
                    "workers= expected a worker address or a list of them, such as "
                    f"'tcp://10.0.0.5:40000', got {self.workers!r}"
                )
            set_(self, "workers", tuple(w))
        if not isinstance(self.allow_other_workers, bool):
            raise TypeError(
                f"allow_other_workers= expected True or False, got {self.allow_other_workers!r}"
            )
        if self.allow_other_workers and self.workers is None:
            raise ValueError(
                "allow_other_workers= expected workers= too (the workers to prefer), got "
                "allow_other_workers=True alone"
            )
        if self.mode is not None:
            set_(self, "mode", _check_mode(self.mode))

    @classmethod
    def of(cls, owner: str, **options) -> Placement:
        """``Placement(**options)``, its errors naming ``owner`` (``"annotate"``...).

        Examples
        --------
        >>> Placement.of("annotate", priority="high")
        Traceback (most recent call last):
        ...
        TypeError: annotate(priority=...) expected an integer, got 'high'
        >>> Placement.of("annotate", resource={"GPU": 1})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: annotate() got an unexpected keyword argument 'resource'; the placement...
        """
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {unknown[0]!r}; the placement "
                f"options are {', '.join(f.name for f in fields(cls))}"
            )
        try:
            return cls(**options)
        except (TypeError, ValueError) as e:
            message = re.sub(r"^(\w+)=", rf"{owner}(\1=...)", str(e))
            raise type(e)(message) from None

    # -- in Dask's vocabulary ------------------------------------------------------------

    def submit_kwargs(self) -> dict:
        """Keyword arguments of ``client.submit`` for one run."""
        return {
            "resources": self.resources,
            "retries": self.retries,
            "priority": self.priority or 0,
            "workers": list(self.workers) if self.workers is not None else None,
            "allow_other_workers": self.allow_other_workers,
        }

    def annotations(self) -> dict:
        """The Dask annotations of a task's layer (only the options that are set)."""
        out = {}
        for name in ("resources", "retries", "priority", "workers"):
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if name == "workers" else value
        if self.allow_other_workers:
            out["allow_other_workers"] = True
        return out

    # -- value semantics ------------------------------------------------------------------

    def _items(self) -> tuple:
        return tuple((f.name, repr(getattr(self, f.name))) for f in fields(self))

    def __eq__(self, other) -> bool:
        return type(other) is Placement and self._items() == other._items()

    def __hash__(self) -> int:
        return hash(self._items())

    def __bool__(self) -> bool:
        return self != _NOWHERE

    def __repr__(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"Placement({', '.join(shown)})"


_NOWHERE = Placement()
