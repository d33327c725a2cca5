"""The call protocol: one request, one reply, and what the caller does with each outcome.

A call picks a replica (``ReplicaSet.pick``), writes one request to its worker's call
server through the channel and reads the reply, in the calling thread:

* ``("OK", result)``: the result.
* ``("error", message)``: the model raised.  ``retries`` re-runs the call; then the
  exception is raised here with its own type and the remote traceback.
* ``("missing", None)``: the worker no longer holds the model (it was released).
  The replica is dropped and the call runs again on another one.
* The connection failed (the worker died, was replaced, or its ``ModelHost`` was
  removed): the replica is dropped and the call runs again on another one; when none is
  left, replicas are built again where Dask has workers.  More than
  ``dasktensor.remote.allowed-failures`` such failures in one call raise
  ``RemoteModelError``.  A worker that cannot be reached securely (TLS) is an error at
  once (``RemoteModelError``), not a lost worker.
* No reply yet after ``dasktensor.remote.probe-after`` (0.5 s), and the worker's call
  server does not answer a probe (a request for no model, answered at once by a live
  server whatever its models do) within ``dasktensor.remote.probe-timeout`` (1 s): a
  silent network or a frozen process.  The worker is a *suspect* (no call goes there
  until it answers a probe again) and the call is a lost worker's, as above.  Probes
  repeat every ``probe-after`` while the call waits: a slow model is not a silent one.
  Calls shorter than ``probe-after`` cost nothing more.
* No reply, and the scheduler removed the worker (it stopped answering its heartbeats;
  asked every ``refresh-interval`` of waiting): a lost worker, as above.
* No reply within the model's ``timeout``: ``TimeoutError`` (after ``retries``).  The
  call goes on on the worker (it cannot be stopped) and its worker counts as busy until
  the reply comes (read and dropped in a thread).

:func:`call_many` sends several calls at once from one thread (what ``ParallelCallsOp``
and the data shards do with the calls of one evaluation): every request is written
first, on a connection of its own, then the replies are read; no thread per call.
"""

from __future__ import annotations

import functools
import pickle
import threading
import time
from collections import deque
from collections.abc import Sequence

from dasktensor import _config
from dasktensor._runtime import ProcessState, runtime
from dasktensor.remote._channel import WireRefused, drain, get_channel
from dasktensor.remote._replicas import done, replica_set
from dasktensor.remote._spec import ModelSpec, RemoteModelError
from dasktensor_worker.wire import MANY

# what a failed connection raises: the worker is gone, replaced or unreachable
_LOST = (OSError, EOFError)


def call(
    spec: ModelSpec,
    method: str | None,
    args: tuple,
    retries_left: int | None = None,
    affinity: tuple | None = None,
):
    """Run ``model.<method>(*args)`` on a replica of ``spec``; its result.

    ``retries_left`` defaults to the model's ``retries``.  ``affinity``: ``("solves",
    key)`` remembers which replica answered for ``key`` (a digest of the inputs of a
    forward call that has a vjp), ``("reuses", key)`` goes to that replica if it is still
    there (the vjp's call at the same inputs, which may reuse the forward solution).
    """
    if retries_left is None:
        if affinity is None and spec.timeout is None:
            combiner = runtime.state(_Combiners).get((spec.key, method))
            if combiner is not None:  # a batched method: threads' calls go in one message
                return combiner.call(spec, method, args)
        retries_left = spec.retries
    replicas = replica_set(spec)
    lost = 0
    while True:
        address = replicas.pick(_preferred(replicas, affinity))
        try:
            reply = _round_trip(replicas, address, spec, (spec.key, method, args))
        except TimeoutError:
            if retries_left:
                retries_left -= 1
                continue
            raise TimeoutError(
                f"{spec!r}: {method or 'call'} did not return within {spec.timeout:g} s "
                f"on {address}"
            ) from None
        status = reply[0] if isinstance(reply, tuple) else None
        if status == "OK":
            _remember(replicas, affinity, address)
            if len(reply) > 2 and spec.timeout is None:  # ("OK", result, "batched")
                runtime.state(_Combiners).learn(spec.key, method)
            return reply[1]
        if status == "missing":  # the worker lost the replica (it was released)
            replicas.drop(address)
            continue
        if status is None:  # the connection failed: the worker is lost to us
            lost += 1
            replicas.drop(address)
            _check_lost(spec, method, address, lost, reply, replicas)
            continue
        if retries_left:
            retries_left -= 1
            continue
        _raise_remote(reply[1])


def _preferred(replicas, affinity: tuple | None) -> str | None:
    if affinity is None or affinity[0] != "reuses":
        return None
    return replicas.solved_at(affinity[1])


def _remember(replicas, affinity: tuple | None, address: str) -> None:
    if affinity is not None and affinity[0] == "solves":
        replicas.solved(affinity[1], address)


def _round_trip(replicas, address: str, spec: ModelSpec, request: tuple):
    """One request and its reply (or the exception of a failed connection); ``done`` is
    called for ``address`` when the call has ended on the worker."""
    channel = get_channel()
    try:
        conn = _send(channel, replicas, address, spec, request)
    except _LOST as e:
        done(address)
        return e
    except BaseException:  # nothing was sent: the worker must not stay counted as busy
        done(address)
        raise
    try:
        reply = _reply(conn, replicas, address, spec.timeout)
    except TimeoutError:  # the call goes on on the worker; its reply will be dropped
        drain(conn, functools.partial(done, address))
        raise
    except _LOST as e:
        conn.close()
        done(address)
        return e
    except BaseException:  # interrupted (Ctrl-C): the connection is not reused
        conn.close()
        done(address)
        raise
    channel.give_back(conn)
    done(address)
    return reply


def _reply(conn, replicas, address: str, timeout: float | None):
    """The reply on ``conn``.  Without a ``timeout``, every ``probe-after`` of waiting the
    worker's call server is probed, and every ``refresh-interval`` the scheduler is asked
    whether the worker is still there: a worker that does not answer, or that the
    scheduler removed, loses the call to another replica (see the module docstring)."""
    if timeout is not None:
        return conn.reply(timeout)
    every, patience = replicas.probe_after, replicas.probe_timeout
    asked = time.monotonic()
    while not conn.readable(every):
        if not replicas.answers(address, patience):
            raise ConnectionError(
                f"worker {address} did not answer a probe within {patience:g} s while it "
                "ran the call (a silent network, or a frozen process); the call runs "
                "again on another replica"
            )
        if time.monotonic() - asked > (replicas.interval or 1.0):
            asked = time.monotonic()
            if not replicas.alive(address):
                raise ConnectionError(
                    f"the scheduler removed worker {address} while it ran the call (it "
                    "stopped answering); the call runs again on another replica"
                )
    return conn.reply(None)


def _send(channel, replicas, address: str, spec: ModelSpec, request: tuple):
    try:
        return channel.send(address, replicas.endpoint(address), replicas.security, request)
    except WireRefused as e:
        raise RemoteModelError(f"{spec!r}: {e}") from e
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # raised by pickling
        method, args = request[1], request[2]
        if len(request) == 4:  # the calls of several threads: name the first one's
            args = args[0]
        given = ", ".join(type(a).__name__ for a in args)
        raise TypeError(
            f"{spec!r}: {method or 'call'} expected arguments that pickle (they travel to "
            f"a worker), got ({given}): {type(e).__name__}: {e}"
        ) from e


def call_many(calls: Sequence[tuple]) -> list:
    """Make several calls ``[(spec, method, args), ...]`` at once; their results, in order.

    A call may carry a fourth item, its ``affinity`` (see :func:`call`).

    Every request is written before any reply is read, and this thread waits once per
    reply.  A call that fails to reach its model, or raised with retries left, runs again
    on its own through :func:`call`; the first error left is raised once all calls are
    done.  Calls of models with a ``timeout`` belong in :func:`call`
    (``RemoteMethod.batchable``).
    """
    channel = get_channel()
    sent: list = []
    try:
        for spec, method, args, *rest in calls:
            affinity = rest[0] if rest else None
            replicas = replica_set(spec)
            address = replicas.pick(_preferred(replicas, affinity))
            try:
                conn = _send(channel, replicas, address, spec, (spec.key, method, args))
            except _LOST as e:
                conn = e
            except BaseException:
                done(address)
                raise
            sent.append((spec, replicas, method, args, address, conn, affinity))
    except BaseException:  # a call could not be sent: let the others end on their own
        for *_, address, conn, _ in sent:
            if isinstance(conn, BaseException):
                done(address)
            else:
                drain(conn, functools.partial(done, address))
        raise
    replies = []
    try:
        for _, replicas, _, _, address, conn, _ in sent:
            reply = conn
            if not isinstance(conn, BaseException):
                try:
                    reply = _reply(conn, replicas, address, None)
                    channel.give_back(conn)
                except _LOST as e:
                    conn.close()
                    reply = e
            done(address)
            replies.append(reply)
    except BaseException:  # interrupted (Ctrl-C): the calls not read end on their own
        for i, (*_, address, conn, _) in enumerate(sent[len(replies) :]):
            if isinstance(conn, BaseException):
                done(address)
            elif i == 0:  # the one being read: its connection is not reused
                conn.close()
                done(address)
            else:
                drain(conn, functools.partial(done, address))
        raise
    results, error = [], None
    for (spec, replicas, method, args, address, _, affinity), reply in zip(
        sent, replies, strict=True
    ):
        status = reply[0] if isinstance(reply, tuple) else None
        try:
            if status == "OK":
                _remember(replicas, affinity, address)
                results.append(reply[1])
            elif status == "error" and not spec.retries:
                _raise_remote(reply[1])
            elif status == "error":
                results.append(call(spec, method, args, spec.retries - 1, affinity))
            else:  # the connection failed, or the replica is gone: as call() does
                replicas.drop(address)
                results.append(call(spec, method, args, affinity=affinity))
        except Exception as e:
            results.append(None)
            error = error or e
    if error is not None:
        raise error
    return results


def _check_lost(spec: ModelSpec, method, address: str, lost: int, reason, replicas=None) -> None:
    if lost > _config.get("remote.allowed-failures"):
        what = f"{type(reason).__name__}: {reason}"
        why = _memory_restart(spec, address, replicas)
        raise RemoteModelError(
            f"{spec!r}: {lost} workers failed while calling {method!r}; the last was "
            f"{address} ({what}). Expected at most dasktensor.remote.allowed-failures="
            f"{_config.get('remote.allowed-failures')}; "
            + (f"{why}" if why else "check the workers' logs")
        ) from (reason if isinstance(reason, BaseException) else None)


def _memory_restart(spec: ModelSpec, address: str, replicas) -> str | None:
    """Why the worker at ``address`` left, when its nanny restarted it for memory (a
    sentence, see ``cluster.memory_restart``); None otherwise, or when the scheduler
    cannot say.  A worker's address is its process's own, so any such event about it is
    about this loss."""
    from dasktensor.cluster import memory_restart

    try:
        client = spec.client()
    except Exception:  # noqa: BLE001 - no scheduler to ask: the usual message
        return None
    info = getattr(replicas, "worker_info", {}).get(address) or {}
    return memory_restart(client, {address: info}, 0.0)


def _raise_remote(message: dict):
    """Raise the model's exception carried by an error reply, with its remote traceback."""
    from distributed.core import clean_exception

    _, exc, tb = clean_exception(**message)
    raise exc.with_traceback(tb)


# -- many threads, one batched method: their calls in one message ---------------------

#: the most calls of one process in one message
MAX_COMBINED = 256


class _Pending:
    """One thread's call of a batched method, waiting to be sent or for its reply.

    ``wake`` is a lock taken at once and released to wake the thread, once for the lead
    and once for the outcome: the cheapest way to wake one thread in CPython."""

    __slots__ = ("args", "lead", "state", "value", "wake")

    def __init__(self, args: tuple):
        self.args = args
        self.lead = False
        #: None until done; then "OK" (value: the result), "error" (value: the remote
        #: error message), "raise" (value: an exception) or "alone" (run it again alone)
        self.state: str | None = None
        self.value = None
        self.wake = threading.Lock()
        self.wake.acquire()


class _Leaders:
    """Calls of this process's threads queued together, sent by whichever of them leads:
    a thread that calls while fewer than ``limit`` lead sends every call waiting (``send``,
    up to :data:`MAX_COMBINED`), wakes each thread with its outcome, and hands the lead to
    the oldest call that arrived meanwhile.  What :class:`_Combiner` and
    :class:`Combined` share; they say what a round sends, and how long it waits."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queue: deque[_Pending] = deque()
        self.leaders = 0

    def _join(self, mine: _Pending, limit: int, send) -> None:
        """Queue ``mine`` and return once its outcome is set (``state``)."""
        with self.lock:
            self.queue.append(mine)
            self._arrived()
            if self.leaders < limit:
                self.leaders += 1
                mine.lead = True
        try:
            if not mine.lead:
                mine.wake.acquire()  # the lead, or the outcome
            if mine.lead:
                self._lead(mine, send)
            if mine.state is None:  # taken by another leader after it was handed the lead
                mine.wake.acquire()
        except BaseException:  # interrupted while waiting (Ctrl-C): leave, lead handed on
            with self.lock:
                if mine in self.queue:
                    self.queue.remove(mine)
                if mine.lead:
                    self._hand_on(mine)
            raise

    def _arrived(self) -> None:
        """A call was queued (the lock held)."""

    def _more(self, n: int) -> list[_Pending]:
        """Calls to add to a round of ``n`` before it is sent (none)."""
        return []

    def _lead(self, mine: _Pending, send) -> None:
        while True:
            with self.lock:
                if mine.state is not None or not self.queue:
                    self._hand_on(mine)
                    return  # done, or sent by another leader: its outcome comes
                taken = [self.queue.popleft() for _ in range(min(len(self.queue), MAX_COMBINED))]
            try:
                taken += self._more(len(taken))
                send(taken)
            except BaseException:  # interrupted: the others run their calls alone
                for p in taken:
                    if p.state is None:
                        p.state = "alone"
                    if p is not mine:
                        _wake(p)
                with self.lock:
                    self._hand_on(mine)
                raise
            for p in taken:
                if p is not mine:
                    _wake(p)

    def _hand_on(self, mine: _Pending) -> None:
        """Give up the lead (with the lock held): to the oldest call waiting to be sent,
        or to nobody."""
        mine.lead = False
        for waiting in self.queue:
            if not waiting.lead:  # (one handed the lead already may not be awake yet)
                waiting.lead = True
                _wake(waiting)
                return
        self.leaders -= 1


class _Combiner(_Leaders):
    """The calls of one batched method of one model, from this process's threads.

    A thread that calls while no message of the method is out (or fewer than its
    replicas) *leads*: it sends every call waiting in one message (``(key, method,
    [args, ...], MANY)``), reads the one reply (probing a silent worker as any call
    does), hands each thread its outcome, and hands the lead to the oldest call that
    arrived meanwhile.  The worker feeds the calls to the method's batches at once, so
    64 threads make batches of tens of rows where, a connection each, they queued on
    the GIL of both processes (measured: batches of 1.0 row).  A lone thread sends one
    call per message, as before.  Anything but a reply (a lost worker, a released
    replica, an error with ``retries`` left) sends each call again alone, through
    :func:`call`, with the usual failover."""

    def call(self, spec: ModelSpec, method, args: tuple):
        mine = _Pending(args)
        replicas = replica_set(spec)
        self._join(
            mine,
            max(1, len(replicas.addresses)),
            lambda taken: _send_together(spec, method, taken, replicas),
        )
        return _outcome(mine, spec, method)


def _wake(p: _Pending) -> None:
    """Wake ``p``'s thread.  A call handed the lead may be taken by another leader, and
    done, before its thread woke: its two wake-ups then make one, which is enough (a
    woken thread reads ``state`` before it waits again, and it is set before the wake)."""
    try:
        p.wake.release()
    except RuntimeError:  # released already, not yet taken: the thread is on its way
        pass


def _send_together(spec: ModelSpec, method, taken: list[_Pending], replicas) -> None:
    """One message with the calls ``taken``; each one's ``state`` and ``value`` set."""
    address = replicas.pick()
    try:
        reply = _round_trip(
            replicas, address, spec, (spec.key, method, [p.args for p in taken], MANY)
        )
    except Exception as e:  # nothing was sent (arguments that do not pickle, TLS refused)
        for p in taken:
            p.state, p.value = "raise", e
        return
    status = reply[0] if isinstance(reply, tuple) else None
    if status == "many" and len(reply[1]) == len(taken):
        for p, (outcome, value, *_) in zip(taken, reply[1], strict=True):
            if outcome == "OK":
                p.state, p.value = "OK", value
            else:
                p.state, p.value = ("alone" if spec.retries else "error"), value
        return
    if status == "error" and not spec.retries:  # the message failed on the worker
        for p in taken:
            p.state, p.value = "error", reply[1]
        return
    if status != "error":  # released, or the connection failed: lost to us
        replicas.drop(address)
    for p in taken:
        p.state = "alone"


def _outcome(p: _Pending, spec: ModelSpec, method):
    if p.state == "OK":
        return p.value
    if p.state == "error":
        _raise_remote(p.value)
    if p.state == "raise":
        raise p.value
    # "alone": a lost worker or a released replica (failover as for any call), or an
    # error with retries left (one of them was this message)
    retries = spec.retries - 1 if p.value is not None and spec.retries else spec.retries
    return call(spec, method, p.args, retries_left=retries)


class Combined(_Leaders):
    """The same call of several targets -- one method of each of K models, as the data
    shards of a likelihood are -- from several threads of this process, each thread with
    its own arguments (the chains of a sampler, each with its parameter vector).

    A thread that calls while no round is out *leads*: it sends one message per target
    holding every waiting thread's arguments (``(key, method, [args, ...], MANY)``), reads
    the K replies, hands each thread its K results and the lead to the oldest thread that
    arrived meanwhile.  Every target then sees the threads' calls together, at the same
    time, where a message per thread and target let each model's batches form apart:
    four chains on two shards met in batches of 1.4 calls, the shards working on
    different chains.  A round smaller than the threads present at once during the last
    one (sent or waiting) waits for the others, at most a quarter of the last round's
    time: threads that call back to back come back one after another from a round, and
    the first one back would otherwise go alone and the others behind it, for ever.  A
    lone thread never waits.

    A call whose batch raised on a target gets that error, with its type and the remote
    traceback, as a call alone would (the other threads of the round, in batches that did
    not raise, get their results).  Anything else but K results for a thread (a lost
    worker, a released replica, an error with ``retries`` left) makes that thread's call
    again on its own (:func:`call_many`), with the usual failover and retries.
    """

    def __init__(self, targets: Sequence[tuple[ModelSpec, str | None]]):
        self.targets = list(targets)
        # (a sharded function outlives a fork, a sampler's child: the child starts afresh)
        self.forked = runtime.lock()
        self._start()

    def _start(self) -> None:
        super().__init__()
        self.arrived = threading.Condition(self.lock)
        #: threads in the round out now; the most present at once (sent or waiting)
        #: since the last round was sent; the last round's threads and seconds
        self.sending = 0
        self.present = 0
        self.last = (1, 0.0)
        self.generation = runtime.generation  # (last: the state above is ready)

    def __call__(self, args: tuple) -> list:
        """The K targets' results for ``args``, in the targets' order."""
        if self.generation != runtime.generation:
            with self.forked:
                if self.generation != runtime.generation:
                    self._start()
        mine = _Pending(args)
        self._join(mine, 1, self._send)
        if mine.state == "OK":
            return mine.value
        if mine.state == "error":
            _raise_remote(mine.value)
        if mine.state == "raise":
            raise mine.value
        return call_many([(spec, method, args) for spec, method in self.targets])

    def _arrived(self) -> None:
        self.present = max(self.present, self.sending + len(self.queue))
        self.arrived.notify()

    def _more(self, n: int) -> list[_Pending]:
        """Calls arriving for a round of ``n``, while it is smaller than the threads
        present during the last round (at most a quarter of that round's time)."""
        more: list[_Pending] = []
        with self.lock:
            expected = min(max(self.last[0], self.present), MAX_COMBINED)
            deadline = time.monotonic() + self.last[1] / 4
            while n + len(more) < expected and (left := deadline - time.monotonic()) > 0:
                self.arrived.wait(left)
                room = MAX_COMBINED - n - len(more)
                more += [self.queue.popleft() for _ in range(min(len(self.queue), room))]
            self.sending = n + len(more)
            self.present = self.sending + len(self.queue)
        return more

    def _send(self, taken: list[_Pending]) -> None:
        began = time.monotonic()
        try:
            if len(taken) == 1:  # alone: the plain calls, as with no other thread
                p = taken[0]
                try:
                    p.state, p.value = "OK", call_many([(s, m, p.args) for s, m in self.targets])
                except Exception as e:  # (raised in its own thread, traceback and all)
                    p.state, p.value = "raise", e
            else:
                _send_rounds(self.targets, taken)
        finally:
            with self.lock:
                self.sending, self.last = 0, (len(taken), time.monotonic() - began)


def _send_rounds(targets: Sequence[tuple], taken: list[_Pending]) -> None:
    """One message per target with the calls ``taken`` (all written, then the replies
    read); each one's ``state`` and ``value`` (its K results) set."""
    channel = get_channel()
    calls = [p.args for p in taken]
    sent: list = []
    for spec, method in targets:
        replicas = replica_set(spec)
        address = replicas.pick()
        try:
            conn = _send(channel, replicas, address, spec, (spec.key, method, calls, MANY))
        except _LOST as e:
            conn = e
        except BaseException as e:  # nothing sent to this one; the others end on their own
            done(address)
            _abandon(sent)
            if not isinstance(e, Exception):
                raise
            for p in taken:  # (arguments that do not pickle: each call alone finds whose)
                p.state, p.value = "alone", None
            return
        sent.append((replicas, address, conn))
    values: list[list] = [[] for _ in taken]
    lost: set[int] = set()
    errors: dict[int, dict] = {}  # the first remote error of each call
    for i, ((spec, _), (replicas, address, conn)) in enumerate(zip(targets, sent, strict=True)):
        reply = conn
        if not isinstance(conn, BaseException):
            try:
                reply = _reply(conn, replicas, address, None)
                channel.give_back(conn)
            except _LOST as e:
                conn.close()
                reply = e
            except BaseException:  # interrupted: the replies not read end on their own
                conn.close()
                done(address)
                _abandon(sent[i + 1 :])
                raise
        done(address)
        status = reply[0] if isinstance(reply, tuple) else None
        if status == "many" and len(reply[1]) == len(taken):
            for j, (outcome, value, *_) in enumerate(reply[1]):
                if outcome == "OK":
                    values[j].append(value)
                elif spec.retries:
                    lost.add(j)
                else:  # the call's batch raised: its error (as for a call alone)
                    errors.setdefault(j, value)
            continue
        if status == "error" and not spec.retries:  # the message failed on the worker
            for j in range(len(taken)):
                errors.setdefault(j, reply[1])
            continue
        if status != "error":  # released, or the connection failed: lost to us
            replicas.drop(address)
        lost.update(range(len(taken)))
    for j, p in enumerate(taken):
        if j in errors:
            p.state, p.value = "error", errors[j]
        elif j in lost:
            p.state, p.value = "alone", None
        else:
            p.state, p.value = "OK", values[j]


def _abandon(sent: list) -> None:
    """Calls sent whose replies will not be read here: each ends on its own."""
    for _, address, conn in sent:
        if isinstance(conn, BaseException):
            done(address)
        else:
            drain(conn, functools.partial(done, address))


class _Combiners(ProcessState):
    """The combiners of this process, by ``(model key, method)``: made once a reply
    says the method is batched."""

    def __init__(self):
        self.by_method: dict[tuple, _Combiner] = {}
        self.get = self.by_method.get

    def learn(self, key: str, method) -> None:
        if (key, method) not in self.by_method:
            self.by_method.setdefault((key, method), _Combiner())
