"""Which replica a call goes to: a pure function of what this process knows.

Callers do not coordinate: many threads and processes (the chains of
``pm.sample(cores=4)``) call the same models at once, and asking a coordinator would cost
a round trip per call.  The choice therefore depends on three things only:

* **the home replica.**  Every call has one, ``(model number + process number) mod
  replicas`` (:func:`home_replica`), both numbers handed out by the scheduler (see
  ``dasktensor_worker.tasks.next_number``).  Within a process different models get
  different homes; across processes one model gets different homes, so concurrent calls
  spread over the replicas and never queue at one while another is idle.
* **the calls this process has in flight**, per worker and over all models.
* **the order of the replicas**, sorted by address: the same in every process.

:func:`choose_replica` takes the replica with the fewest calls in flight from this
process, the home first, then its neighbours in order.  When nothing is in flight, that is
the home itself.

Both functions are pure (no state, no side effects): ``tests/test_replica_policy.py``
checks them with tables of cases.  The bookkeeping around them (counting calls in flight,
finding the replicas) lives in ``dasktensor.remote._replicas``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def home_replica(model_number: int, process_number: int, n_replicas: int) -> int:
    """Index of a model's home replica for this process, among ``n_replicas``.

    Examples
    --------
    >>> [home_replica(model, process, 4) for model, process in [(0, 0), (1, 0), (1, 1)]]
    [0, 1, 2]
    >>> home_replica(3, 2, 4)
    1
    """
    if n_replicas < 1:
        raise ValueError(f"home_replica expected n_replicas >= 1, got {n_replicas!r}")
    return (model_number + process_number) % n_replicas


def choose_replica(addresses: Sequence[str], home: int, inflight: Mapping[str, int]) -> int:
    """Index of the replica a call goes to.

    Parameters
    ----------
    addresses : sequence of str
        The model's replicas (their workers' addresses), sorted.
    home : int
        Index of the home replica (:func:`home_replica`).
    inflight : mapping of str to int
        Calls this process has in flight per worker address (missing: none).

    Returns
    -------
    int
        The replica with the fewest calls in flight, ties going to the home replica,
        then to the replicas after it (wrapping around).

    Examples
    --------
    >>> workers = ["tcp://a:1", "tcp://b:1", "tcp://c:1"]
    >>> choose_replica(workers, 1, {})  # nothing in flight: the home replica
    1
    >>> choose_replica(workers, 1, {"tcp://b:1": 1})  # busy at home: the next one
    2
    >>> choose_replica(workers, 1, {"tcp://b:1": 1, "tcp://c:1": 1})
    0
    """
    n = len(addresses)
    if n == 0:
        raise ValueError("choose_replica expected at least one replica address, got none")
    if not 0 <= home < n:
        raise ValueError(f"choose_replica expected a home index in [0, {n}), got {home!r}")
    return min(range(n), key=lambda i: (inflight.get(addresses[i], 0), (i - home) % n))
