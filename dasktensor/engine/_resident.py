"""Resident stages: a function's cluster tasks kept compiled on the workers, called directly.

On a distributed client, submitting a task and gathering its result costs ~13 ms of Dask
round trip here (``benchmarks/channel_latency.py``), whatever the task does; a sampler
calls a log-density 10^5-10^6 times.  With ``dasktensor.execute.path: channel`` each
cluster task of a compiled DASK-mode function is instead a *resident stage*: a remote
model (``dasktensor.remote``) whose factory is the task's runner, so that

* **Dask places it**: the stage's replicas are built by ordinary tasks carrying the task's
  resources (``build-<task name>`` on the dashboard), on every worker offering them;
* **each worker compiles it once**: runners travel as a token and a payload and a worker
  keeps one compiled runner per token, shared by every replica and every caller process;
* **calls skip the scheduler**: one request and one reply through the remote-call
  channel (a fraction of a millisecond), spread over the replicas by the channel's
  policy, and a lost worker's stage is rebuilt elsewhere and the call retried (the
  channel's failover; the task's ``retries`` re-run calls that raised);
* **large values stay on the workers**: inputs of 256 KiB or more (data in shared
  variables, large constants, large arguments) are sent with a token; a replica keeps
  the last value it got for each input, and a later call sends only the token while the
  caller's value is the same object (``set_value`` puts a new object there, which is sent
  again).  A replica that lacks a token answers ``need`` and the call is made again with
  every value (once per replica and new value).

A task's ``workers=`` are the workers its stage is built on (first, with
``allow_other_workers=True``; alone otherwise), its ``retries`` re-run a call that raised.
The stages of one function live as long as its compiled function: they are released from
the workers when it is garbage-collected.
"""

from __future__ import annotations

import functools
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from dask.base import tokenize

from dasktensor._runtime import ProcessState, runtime
from dasktensor_worker.batching import batched

_LARGE = 1 << 18


class StageServer:
    """On a worker: one task's runner and the large input values it keeps between calls.

    Large values are kept by ``(position, token)``, a few per position (callers in other
    processes send the same value under tokens of their own), the oldest dropped first.

    Examples
    --------
    >>> server = StageServer(lambda a, b: (a + b,))
    >>> server.run(2, [[1, "t1"]], [[0, 1.0]])  # input 1 comes by token: not held yet
    ['need', [1]]
    >>> server.run(2, [[1, "t1"]], [[0, 1.0], [1, 2.0]])
    ['ok', [3.0]]
    >>> server.run(2, [[1, "t1"]], [[0, 5.0]])  # held now
    ['ok', [7.0]]
    """

    #: large values kept per input position (one per caller process that sends it)
    KEEP = 8

    def __init__(self, runner):
        self.runner = runner
        self.held: OrderedDict[tuple[int, str], Any] = OrderedDict()
        self.lock = runtime.lock()
        #: bytes of large values received so far (they are kept, not sent per call)
        self.received = 0

    def run(self, n_inputs: int, tokens: Sequence, given: Sequence) -> list:
        """``["ok", outputs]``, or ``["need", positions]`` for tokens this replica lacks.

        ``tokens`` are ``(position, token)`` pairs of the large inputs, ``given`` the
        ``(position, value)`` pairs sent with this call.
        """
        return self.run_together([n_inputs], [tokens], [given])[0]

    @batched(stack=False, wait=0)  # (the work per call is the same batched: no waiting)
    def run_together(self, n_inputs: list, tokens: list, given: list) -> list:
        """:meth:`run` for several calls that waited for this stage (see
        ``dasktensor_worker.batching``): one reply per call, each what it gets alone."""
        return [self._run_one(*call) for call in zip(n_inputs, tokens, given, strict=True)]

    def _run_one(self, n_inputs: int, tokens: Sequence, given: Sequence) -> list:
        values = dict(given)
        with self.lock:
            missing = [p for p, token in tokens if p not in values and (p, token) not in self.held]
            if missing:
                return ["need", missing]
            for p, token in tokens:
                if p in values:
                    self._keep(p, token, values[p])
                else:
                    values[p] = self.held[(p, token)]
                    self.held.move_to_end((p, token))
        return ["ok", list(self.runner(*(values[p] for p in range(n_inputs))))]

    def _keep(self, position: int, token: str, value) -> None:
        if (position, token) not in self.held:
            self.received += getattr(value, "nbytes", 0)
        self.held[(position, token)] = value
        self.held.move_to_end((position, token))
        mine = [k for k in self.held if k[0] == position]
        for old in mine[: max(0, len(mine) - self.KEEP)]:
            del self.held[old]


class ResidentStages:
    """The caller's side: one remote model per cluster task, and the tokens it sent.

    Parameters
    ----------
    tasks : sequence of Task
        The plan's cluster tasks that run as resident stages.
    runners : sequence of TaskRunner
        Every task's runner, by task index.
    client : distributed.Client
        The cluster.
    """

    def __init__(self, tasks, runners, client):
        from dasktensor.remote import RemoteModel

        self.models = {
            t.index: RemoteModel(
                functools.partial(StageServer, runners[t.index]),
                name=t.name,
                resources=t.placement.resources,
                # a compiled function lives as long as a notebook: its stages holding a
                # GPU all along would keep every other task asking for it waiting
                hold_resources=False,
                retries=t.placement.retries or 0,
                workers=t.placement.workers,
                allow_other_workers=t.placement.allow_other_workers,
                scheduler=client,
                # what the stage computes and where: copies of the function, in this
                # process or another, share its replicas (and its batches)
                key=tokenize(runners[t.index].identity, t.placement, client.scheduler.address),
            )
            for t in tasks
        }
        # (task index, input position) -> (the value last sent, its token)
        self._tokens: dict[tuple[int, int], tuple[Any, str]] = {}
        self._lock = runtime.lock()  # the stages outlive a fork (a sampler child's)
        weakref.finalize(self, release_in_background, list(self.models.values()))

    def call(self, index: int, inputs: Sequence) -> tuple:
        """Run task ``index`` on a replica with these input values; its outputs."""
        model = self.models[index]
        tokens, given = [], []
        for p, value in enumerate(inputs):
            if getattr(value, "nbytes", 0) < _LARGE:
                given.append((p, value))
                continue
            with self._lock:
                sent = self._tokens.get((index, p))
                if sent is None or sent[0] is not value:
                    sent = self._tokens[(index, p)] = (value, uuid.uuid4().hex)
                    given.append((p, value))  # a new value: it goes with this call
            tokens.append((p, sent[1]))
        status, payload = model.call("run_together", len(inputs), tokens, given)
        if status == "need":  # a replica that has not seen these values: send them all
            every = list(enumerate(inputs))
            status, payload = model.call("run_together", len(inputs), tokens, every)
        return tuple(payload)

    def holders(self) -> dict[int, list[str]]:
        """Per task index, the addresses of the workers holding its stage now (asks the
        cluster: for ``f.plan``, never on a call)."""
        return {index: model.workers() for index, model in self.models.items()}

    def close(self) -> None:
        """Release the stages from the workers."""
        release_in_background(list(self.models.values()))


class _SharedResident(ProcessState):
    """This process's resident stages by cluster and what they compute: copies of a
    function (thread copies, ``f.copy()``) share one set."""

    def __init__(self):
        self.stages: weakref.WeakValueDictionary[tuple, ResidentStages] = (
            weakref.WeakValueDictionary()
        )
        self.lock = threading.Lock()


def resident_stages(tasks, runners, client) -> ResidentStages:
    """The resident stages of ``tasks`` on ``client``: this process's, if a copy of the
    function made them already, else new ones."""
    key = (
        client.scheduler.address,
        tuple((runners[t.index].identity, t.placement) for t in tasks),
    )
    state = runtime.state(_SharedResident)
    with state.lock:
        found = state.stages.get(key)
        if found is None:
            found = state.stages[key] = ResidentStages(tasks, runners, client)
        return found


def release_in_background(models) -> None:
    """Drop the stages' replicas, in a thread of its own: a finalizer runs wherever the
    garbage collector does, possibly on Dask's event-loop thread, where a blocking client
    call (``client.run``) would wait for that very loop for ever.  At interpreter exit no
    thread can start (nor would a client call finish): the replicas stay on the workers
    until they are released or the workers restart."""
    try:
        thread = threading.Thread(target=_close, args=(models,), name="dasktensor-release")
        thread.daemon = True
        thread.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        pass


def _close(models) -> None:
    for model in models:
        try:
            model.close()
        except Exception:  # the cluster is gone already: nothing left to release
            pass
