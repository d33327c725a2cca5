"""The remote-call channel: this process's connections to the workers' call servers.

Dask places the replicas and says where each worker's call server listens (``client.run``
of ``dasktensor_worker.tasks.endpoint``); the calls go through this module, not through
Dask (see :mod:`dasktensor_worker.wire` for the messages and the worker's side):

* **The calling thread does the I/O.**  A call takes an idle connection to the worker (or
  opens one: TCP, no Nagle delay; connect timeout ``dasktensor.remote.connect-timeout``),
  writes its request and reads the reply on that socket, in the thread that called: no
  event loop, no thread hand-off.  So it works from any thread, inside a running event
  loop (which it does not use) and after ``asyncio.run()``.
* **One connection per call in flight.**  Connections are pooled per worker endpoint
  ``(host, port, tls)``; a call in flight owns its connection, so calls from several
  threads, or several calls sent at once by one thread (:meth:`Channel.send` for each,
  then :meth:`Connection.reply` for each), run at once on their workers.
* **TLS.**  A worker listening with TLS is reached with the client's
  ``Security.get_connection_args("client")`` context (the cluster's CA and the client's
  certificate, as Dask's own TLS comms); without credentials the call is refused with
  :class:`WireRefused`, as is a failed handshake.
* **Fork.**  A forked child (``pm.sample(cores=2)`` on Linux) starts with no
  connections: the channel is per-process state (:mod:`dasktensor._runtime`), and the
  child keeps the parent's channel object alive without touching it, since its sockets
  belong to the parent.

Which worker a call goes to, and what a reply means, is decided by the callers of this
module (``dasktensor.remote._replicas``, ``dasktensor.remote._calls``).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable

from dasktensor import _config
from dasktensor._runtime import ProcessState, runtime
from dasktensor_worker import wire


class WireRefused(ConnectionError):
    """A worker's call server cannot be reached securely (TLS without credentials, or a
    failed handshake): not a lost worker, so not retried elsewhere."""


class Connection:
    """One socket to a worker's call server; ``slot``: the one thread of this process
    that may busy-poll for its reply at a time (see :class:`wire.BusyPoll`)."""

    def __init__(
        self,
        address: str,
        endpoint: tuple,
        context,
        timeout: float | None = None,
        slot: threading.Lock | None = None,
    ):
        host, port, tls = endpoint
        self.address, self.endpoint = address, endpoint
        if timeout is None:
            timeout = _config.seconds("remote.connect-timeout")
        sock = socket.create_connection((host, port), timeout=timeout)
        wire.nodelay(sock)
        if tls:
            try:
                sock = context.wrap_socket(sock)
            except (ssl.SSLError, ssl.CertificateError) as e:
                sock.close()
                raise WireRefused(
                    f"the TLS handshake with the call server of worker {address} failed "
                    f"({type(e).__name__}: {e}); expected the cluster's credentials "
                    "(the client's distributed.Security)"
                ) from e
        sock.settimeout(None)
        self.sock = sock
        self.timeout: float | None = None  # the socket's (set only when it changes)
        self.reader = sock.makefile("rb")
        self.waiter = wire.BusyPoll(sock, _config.seconds("remote.busy-poll"), slot)

    def send(self, frames: list) -> None:
        """Write one message, as :func:`wire.dumps` gives it."""
        wire.send_frames(self.sock, frames)

    def reply(self, timeout: float | None = None):
        """The reply to the request sent; ``TimeoutError`` after ``timeout`` seconds."""
        if timeout is not None and not self.waiter.wait(timeout):
            raise TimeoutError(f"no reply within {timeout:g} s")
        if timeout != self.timeout:
            self.sock.settimeout(timeout)
            self.timeout = timeout
        return wire.recv(self.reader)

    def readable(self, timeout: float) -> bool:
        """Whether the reply starts arriving within ``timeout`` seconds (nothing is read:
        requests and replies alternate, so no byte of the reply is buffered yet); the
        thread busy-polls first (:class:`wire.BusyPoll`)."""
        return self.waiter.wait(timeout)

    def close(self) -> None:
        try:
            self.reader.close()
            self.sock.close()
        except OSError:  # pragma: no cover - already broken
            pass


class Channel(ProcessState):
    """This process's idle connections, by worker and endpoint, and TLS contexts by cluster.

    Idle connections are kept by worker address *and* endpoint: a call server that
    closed leaves its port free, and another worker's (or a restarted one's) may bind it;
    a connection made for one worker is never handed to another at the same endpoint."""

    def __init__(self):
        self.idle: dict[tuple, list[Connection]] = {}  # (address, endpoint) -> connections
        self.contexts: dict = {}
        self.lock = threading.Lock()
        #: the one thread at a time that busy-polls for a reply (wire.BusyPoll)
        self.poll_slot = threading.Lock()

    def send(
        self, address: str, endpoint: tuple, security, message, timeout: float | None = None
    ) -> Connection:
        """Write ``message`` to the worker at ``address``; the connection to read the reply
        from (give it back with :meth:`give_back`, or close it).  ``timeout`` bounds the
        connecting (default ``dasktensor.remote.connect-timeout``).  A message that does
        not pickle raises what pickling raised, before any connection is taken."""
        frames = wire.dumps(message)
        with self.lock:
            idle = self.idle.get((address, endpoint))
            conn = idle.pop() if idle else None
        if conn is not None:
            try:
                conn.send(frames)
                return conn
            except OSError:  # the worker closed it (restarted, or gone): try a fresh one
                conn.close()
        context = self._context(endpoint, address, security)
        conn = Connection(address, endpoint, context, timeout, self.poll_slot)
        try:
            conn.send(frames)
        except BaseException:
            conn.close()
            raise
        return conn

    def probe(self, address: str, endpoint: tuple, security, timeout: float) -> bool:
        """Whether the call server at ``endpoint`` answers within ``timeout`` seconds.

        The probe is a request for no model, which a live server answers at once with
        ``("missing", None)`` from its connection's thread, whatever its models are
        doing; a silent network or a frozen process lets it time out.  A refused or
        reset connection is an answer too: the host is there, its call server is not
        (removed, or its worker restarting), which the call's own outcome will tell."""
        try:
            conn = self.send(address, endpoint, security, (None, None, ()), timeout)
        except (ConnectionRefusedError, ConnectionResetError, WireRefused):
            return True
        except OSError:  # timed out connecting, or no route: silent
            return False
        try:
            if conn.readable(timeout):
                answered = conn.reply(timeout)[0] == "missing"
                if answered:
                    self.give_back(conn)
                    return True
        except (ConnectionResetError, EOFError):  # closed as the probe arrived: there
            conn.close()
            return True
        except OSError:
            pass
        conn.close()
        return False

    def give_back(self, conn: Connection) -> None:
        """Keep a connection whose reply was read, for the next call."""
        with self.lock:
            self.idle.setdefault((conn.address, conn.endpoint), []).append(conn)

    def forget(self, address: str) -> None:
        """Close the idle connections to a worker that failed."""
        with self.lock:
            gone = [key for key in self.idle if key[0] == address]
            closing = [c for key in gone for c in self.idle.pop(key)]
        for conn in closing:
            conn.close()

    def _context(self, endpoint: tuple, address: str, security):
        if not endpoint[2]:
            return None
        key = security_key(security)
        with self.lock:
            context = self.contexts.get(key)
            if context is None and key is not None:
                args = security.get_connection_args("client")
                context = self.contexts[key] = args.get("ssl_context")
        if context is None:
            raise WireRefused(
                f"the worker {address} serves calls over TLS only; expected a client with "
                "the cluster's TLS credentials (distributed.Security with a CA and a "
                f"client certificate), got {security!r}"
            )
        return context


def drain(conn: Connection, then: Callable[[], None]) -> None:
    """Read (and drop) the reply of a call that timed out, in a thread; then ``then()``.

    The call goes on on the worker: its worker counts as busy until the reply comes."""

    def wait():
        try:
            # a file object that timed out refuses to read again; nothing of the reply had
            # arrived (it would not have timed out), so a new one starts at its first byte
            conn.reader = conn.sock.makefile("rb")
            conn.reply(None)
        except Exception:
            pass
        finally:
            conn.close()
            then()

    threading.Thread(target=wait, name="dasktensor-drain", daemon=True).start()


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


def get_channel() -> Channel:
    """This process's channel (created on first use; a forked child gets its own)."""
    return runtime.state(Channel)
