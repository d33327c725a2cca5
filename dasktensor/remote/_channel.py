"""The remote-call channel: this process's route to the workers that hold models.

``client.submit(f, x).result()`` costs about 13 ms on loopback (the client batches its
messages every few ms), against 1.1-1.5 ms for one request to a handler in
``worker.handlers`` over a pooled connection (``benchmarks/channel_latency.py``).  A
sampler makes 10^5-10^6 calls, so remote calls take the second way:

* **One channel per process**, created on first use: an event loop in a daemon thread
  and a ``distributed.core.ConnectionPool`` per set of client credentials (plain TCP
  clusters share one; a TLS cluster's pool carries its client's ``Security`` connection
  arguments; connect timeout ``dasktensor.remote.connect-timeout``).
* **Any thread may call.**  A call is ``run_coroutine_threadsafe`` onto the channel's
  loop and one request/reply on a pooled connection; it works from any thread, inside a
  running event loop (its loop is not used) and after ``asyncio.run()``.
* **Fork.**  A forked child (``pm.sample(cores=2)`` on Linux) starts without a channel.
  It keeps the parent's channel object alive without touching it: its connections belong
  to the parent, and closing them here would warn or, worse, talk on the parent's
  sockets.

Which worker a call goes to, and what a reply means, is decided by the callers of this
module (``dasktensor.remote._replicas``, ``dasktensor.remote._calls``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Sequence

from dasktensor import _config
from dasktensor_worker.codec import CALL_HANDLER


class Channel:
    """An event loop in a thread of its own, with connection pools to the workers."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="dasktensor-channel", daemon=True
        )
        self.thread.start()
        self.pools: dict = {}
        self.lock = threading.Lock()

    def pool(self, security) -> object:
        """The pool for a cluster with this ``distributed.Security`` (None: plain TCP)."""
        key = security_key(security)
        with self.lock:
            pool = self.pools.get(key)
            if pool is None:
                args = security.get_connection_args("client") if security is not None else {}
                pool = self.pools[key] = self.run(self._make_pool(args)).result()
            return pool

    @staticmethod
    async def _make_pool(connection_args: dict):
        from distributed.core import ConnectionPool

        return await ConnectionPool(
            limit=512,
            timeout=_config.seconds("remote.connect-timeout"),
            connection_args=connection_args,
        )

    def run(self, coro) -> concurrent.futures.Future:
        """Run a coroutine on the channel's loop; its future, to wait on in this thread."""
        if threading.current_thread() is self.thread:  # pragma: no cover - a misuse guard
            raise RuntimeError(
                "a remote model was called from dasktensor's own channel thread; expected "
                "a call from any other thread (a model must not call remote models itself "
                "from inside a channel callback)"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @staticmethod
    async def call(pool, address: str, key: str, method: str | None, args: Sequence):
        """One request to the call handler of the worker at ``address``; its reply."""
        return await getattr(pool(address), CALL_HANDLER)(key=key, method=method, args=args)

    def forget(self, address: str) -> None:
        """Drop pooled connections to a worker that failed."""
        for pool in list(self.pools.values()):
            self.loop.call_soon_threadsafe(pool.remove, address)


def security_key(security):
    """What identifies a cluster's client credentials (None for plain TCP)."""
    if (
        security is None
        or not getattr(security, "require_encryption", False)
        and not any(getattr(security, f, None) for f in ("tls_ca_file", "tls_client_cert"))
    ):
        return None
    names = getattr(type(security), "__slots__", None) or vars(security)
    fields = ((k, getattr(security, k, None)) for k in names)
    return tuple(sorted((k, v) for k, v in fields if isinstance(v, str | bool)))


_channel: Channel | None = None
_channel_lock = threading.Lock()
# a parent's channel, kept from the garbage collector in a forked child (see above)
_inherited: list[Channel] = []


def get_channel() -> Channel:
    """This process's channel (created on first use)."""
    global _channel
    with _channel_lock:
        if _channel is None:
            _channel = Channel()
        return _channel


def _reset_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _channel, _channel_lock
    if _channel is not None:
        _inherited.append(_channel)
    _channel, _channel_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
