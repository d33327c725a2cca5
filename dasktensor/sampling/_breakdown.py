"""Where a ``dt.sample`` call's wall time went: printed at its end with a progress bar.

The phases follow one run on the caller's clock, one after another (their sum is the
call's wall time); what the workers did meanwhile (compiling the step method, sampling)
and what the caller did between segments (fetching results, recording draws) overlap
them and are shown beside, with how busy the workers were.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

#: the caller's phases, in the order a run goes through them
PHASES = (
    ("connect", "connect (the client)"),
    ("prepare", "PyMC's setup in the caller (step method compiled, initial points)"),
    ("pickle", "step method pickled"),
    ("send", "step method sent to the workers"),
    ("first", "until the first segment's draws (workers compiling, first segment)"),
    ("tuning", "tuning (until every chain is tuned)"),
    ("draws", "draws (until the last segment)"),
    ("release", "run released on the workers"),
    ("conversion", "conversion to PyMC's result, convergence checks"),
)


@dataclass
class Breakdown:
    """The wall time of one ``dt.sample`` call, by phase (seconds), and what ran beside.

    Attributes
    ----------
    phases : dict
        Phase name (see ``PHASES``) -> seconds on the caller's clock; they add up to
        ``total``.
    compile : dict
        Worker address -> seconds it spent unpickling the run's step method (compiling
        its functions, or reading them from the compile caches), waits for the compile
        lock included.
    busy : float
        Seconds the workers spent in segments (sampling and compiling), all together.
    gathering : float
        Seconds the caller spent fetching segments' results and recording their draws
        (overlapping the sampling phases).
    segments, workers : int
        Segments run, and workers that ran them.

    Examples
    --------
    >>> b = Breakdown()
    >>> b.phases.update(prepare=1.0, tuning=2.0, draws=1.0)
    >>> b.total
    4.0
    >>> print(b.table().splitlines()[0])
    dt.sample: 4.00 s
    """

    phases: dict = field(default_factory=dict)
    compile: dict = field(default_factory=dict)
    busy: float = 0.0
    gathering: float = 0.0
    segments: int = 0
    workers: int = 0
    sampling_wall: float = 0.0
    slots: int = 0
    _mark: float | None = None

    @property
    def total(self) -> float:
        """The call's wall time: the sum of its phases."""
        return sum(self.phases.values())

    def start(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """End ``phase`` now (it began at the previous lap, or at start)."""
        now = time.perf_counter()
        if self._mark is not None:
            self.phases[phase] = self.phases.get(phase, 0.0) + now - self._mark
        self._mark = now

    @property
    def utilisation(self) -> float | None:
        """Share of the worker threads' time spent in segments while chains ran."""
        capacity = self.sampling_wall * max(self.slots, 1)
        return self.busy / capacity if capacity > 0 else None

    def table(self) -> str:
        """The breakdown as lines of text."""
        lines = [f"dt.sample: {self.total:.2f} s"]
        for name, label in PHASES:
            if name in self.phases:
                lines.append(f"  {label:<68} {self.phases[name]:7.2f} s")
        if self.compile:
            slowest = max(self.compile.values())
            lines.append(
                f"  beside: step method unpickled (compiled) on {len(self.compile)} "
                f"worker(s), {slowest:.2f} s at most"
            )
        use = self.utilisation
        busy = f", workers busy {use:.0%} of the sampling time" if use is not None else ""
        lines.append(
            f"  beside: {self.segments} segments on {self.workers} worker(s){busy}; the "
            f"caller fetched and recorded them in {self.gathering:.2f} s"
        )
        return "\n".join(lines)


_last = threading.local()


def last_breakdown() -> Breakdown | None:
    """The wall-time breakdown of the last ``dt.sample`` call of this thread (None before
    any).

    Returns
    -------
    Breakdown or None
        Phases on the caller's clock (``phases``, adding up to ``total``), the seconds
        each worker spent making the step method usable (``compile``), the segments and
        how busy the workers were; ``table()`` gives it as text (what ``dt.sample``
        prints at its end with ``progressbar=True``).

    Examples
    --------
    >>> import dasktensor.sampling as ds
    >>> b = ds.last_breakdown()  # after a dt.sample call in this thread
    >>> b is None or b.total > 0
    True
    """
    return getattr(_last, "value", None)


def _set_last(breakdown: Breakdown) -> None:
    _last.value = breakdown
