"""The call protocol: one request, one reply, and what the caller does with each outcome.

A call packs its arguments (``dasktensor_worker.codec``), picks a replica
(``ReplicaSet.pick``), sends one request through the channel and waits for the reply:

* ``{"status": "OK", "result": ...}``: the result, unpacked.
* ``{"status": "error", ...}``: the model raised.  ``retries`` re-runs the call; then the
  exception is raised here with its own type and the remote traceback.
* ``{"status": "missing"}``: the worker no longer holds the model (it was released).
  The replica is dropped and the call runs again on another one.
* The request itself failed (the connection broke: the worker died or was replaced), or
  the reply is not an answer of the call handler (the worker's ``ModelHost`` was
  removed): the replica is dropped and the call runs again on another one; when none is
  left, replicas are built again where Dask has workers.  More than
  ``dasktensor.remote.allowed-failures`` such failures in one call raise
  ``RemoteModelError``.
* No reply within the model's ``timeout``: ``TimeoutError`` (after ``retries``).  The
  call goes on on the worker (its thread cannot be stopped) and its worker counts as
  busy until it really ends.

:func:`call_many` sends several calls at once from one thread (what ``ParallelCallsOp``
does with the calls it merged): one ``asyncio.gather`` on the channel's loop and one wait,
no thread per call (each would cost a hand-off, ~0.3 ms with 4 calls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Sequence

from dasktensor import _config
from dasktensor.remote._channel import get_channel
from dasktensor.remote._replicas import done, replica_set
from dasktensor.remote._spec import ModelSpec, RemoteModelError
from dasktensor_worker.codec import pack, unpack


def call(spec: ModelSpec, method: str | None, args: tuple, retries_left: int | None = None):
    """Run ``model.<method>(*args)`` on a replica of ``spec``; its result.

    ``retries_left`` defaults to the model's ``retries``.
    """
    if retries_left is None:
        retries_left = spec.retries
    channel = get_channel()
    replicas = replica_set(spec)
    lost = 0
    while True:
        address = replicas.pick()
        future = channel.run(channel.call(replicas.pool, address, spec.key, method, pack(args)))
        # the worker counts as busy until the call really ends, also after a timeout
        future.add_done_callback(functools.partial(_done, address))
        try:
            reply = future.result(spec.timeout)
        except concurrent.futures.TimeoutError:
            # the call goes on on the worker; its result will be dropped
            if retries_left:
                retries_left -= 1
                continue
            raise TimeoutError(
                f"{spec!r}: {method or 'call'} did not return within {spec.timeout:g} s "
                f"on {address}"
            ) from None
        except Exception as e:  # the connection failed: the worker is gone or replaced
            reply = e
        status = reply.get("status") if isinstance(reply, dict) else None
        if status == "OK":
            return unpack(reply["result"])
        if status == "missing":  # the worker lost the replica (it was released)
            replicas.drop(address)
            continue
        if status is None:  # no answer of the call handler: the worker is lost to us
            lost += 1
            replicas.drop(address)
            _check_lost(spec, method, address, lost, reply)
            continue
        if retries_left:
            retries_left -= 1
            continue
        _raise_remote(reply)


def call_many(calls: Sequence[tuple[ModelSpec, str | None, tuple]]) -> list:
    """Make several calls ``[(spec, method, args), ...]`` at once; their results, in order.

    All requests leave together through the channel, and this thread waits once.  A call
    that fails to reach its model, or raised with retries left, runs again on its own
    through :func:`call`; the first error left is raised once all calls are done.  Calls
    of models with a ``timeout`` belong in :func:`call` (``RemoteMethod.batchable``).
    """
    channel = get_channel()
    picked = []
    for spec, method, args in calls:
        replicas = replica_set(spec)
        picked.append((spec, replicas, replicas.pick(), method, args))

    async def all_at_once():
        return await asyncio.gather(
            *(
                channel.call(replicas.pool, address, spec.key, method, pack(args))
                for spec, replicas, address, method, args in picked
            ),
            return_exceptions=True,
        )

    future = channel.run(all_at_once())
    future.add_done_callback(lambda _: [done(p[2]) for p in picked])
    replies = future.result()
    results, error = [], None
    for (spec, replicas, address, method, args), reply in zip(picked, replies):
        status = reply.get("status") if isinstance(reply, dict) else None
        try:
            if status == "OK":
                results.append(unpack(reply["result"]))
            elif status == "error" and not spec.retries:
                _raise_remote(reply)
            elif status == "error":
                results.append(call(spec, method, args, spec.retries - 1))
            else:  # the connection failed, or the replica is gone: as call() does
                replicas.drop(address)
                results.append(call(spec, method, args))
        except Exception as e:
            results.append(None)
            error = error or e
    if error is not None:
        raise error
    return results


def _done(address: str, _future=None) -> None:
    done(address)


def _check_lost(spec: ModelSpec, method, address: str, lost: int, reason) -> None:
    if lost > _config.get("remote.allowed-failures"):
        what = f"{type(reason).__name__}: {reason}"
        raise RemoteModelError(
            f"{spec!r}: {lost} workers failed while calling {method!r}; the last was "
            f"{address} ({what}). Expected at most dasktensor.remote.allowed-failures="
            f"{_config.get('remote.allowed-failures')}; check the workers' logs"
        ) from (reason if isinstance(reason, BaseException) else None)


def _raise_remote(reply: dict):
    """Raise the model's exception carried by an error reply, with its remote traceback."""
    from distributed.core import clean_exception

    _, exc, tb = clean_exception(**reply)
    raise exc.with_traceback(tb)
