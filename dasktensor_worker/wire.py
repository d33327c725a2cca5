"""The data plane of remote calls: framed messages on plain or TLS sockets.

Dask places and builds the replicas, reports lost workers and tells callers where a
worker's replicas listen (the control plane); the calls themselves do not go through
Dask.  Through a Dask comm, a call crossed four threads and event loops (the caller's
thread, the channel's loop, the worker's event loop, the replica's thread, and back):
about 1.2 ms against 0.06 ms for a raw socket's round trip on loopback.  Here a call is
written by the calling thread straight into a socket and read on the worker by the
thread that owns the connection, which runs the model itself and writes the reply:
no thread hop on either side.

* **Frames.**  A message is a pickle (protocol 5) whose large buffers (NumPy arrays of
  :data:`IN_BAND` bytes or more) travel out of band as raw frames: ``<u4 n>`` then ``n`` lengths
  ``<u8>``, then the frames, sent with one ``sendmsg`` (no copy of the arrays on the way
  out; more calls for over 1023 frames or 2 GiB) and received each into a ``bytearray``
  of its own (arrays come back writeable, without a copy).  Lengths are 64-bit: a frame
  over 2 or 4 GiB travels as any other; a message holds at most 65,535 large arrays.
  A caller and a worker trust each other as Dask's own comms do (Dask
  pickles too); on a TLS cluster both ends authenticate with the cluster's certificates.
* **Requests** are ``(key, method, args)``; **replies** ``("OK", result)``,
  ``("missing", None)`` (no such replica here) or ``("error", {...})`` with the model's
  exception and traceback pickled as ``distributed.core.error_message`` makes them (the
  caller raises it again with ``distributed.core.clean_exception``).  A call of a
  batched method is answered ``("OK", result, "batched")``: from then on the caller's
  threads send their concurrent calls of it together, ``(key, method, [args, ...],
  MANY)``, answered ``("many", [reply, ...])`` (one reply per call) or ``("missing",
  None)``; the worker feeds them to the method's batches at once.
* **Waiting** (:class:`BusyPoll`).  A thread that expects a message soon (a caller
  waiting for its reply, a call server after answering a back-to-back caller) polls its
  socket for up to ``dasktensor.remote.busy-poll`` (200 us) before it sleeps: waking a
  sleeping thread is most of a fast call's round trip on loopback and on virtual
  machines.  One thread per process polls at a time, and a poll that missed is not tried
  again for a while.
* **The server** (:class:`WireServer`, started by the worker's ``ModelHost``) listens on
  the worker's own host, on a port of the system's choosing; each connection gets a
  thread that answers its requests in order.  A caller opens one connection per call in
  flight, so calls of one evaluation run at once on their workers.
* **TLS.**  A worker whose address is ``tls://`` serves TLS only, with the context Dask
  gives the worker (``Security.get_listen_args("worker")``: the cluster's CA, the
  worker's certificate, client certificates required).

This module imports the standard library and NumPy; ``distributed`` is imported on use.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
from collections.abc import Callable
from time import perf_counter

import numpy as np

#: arrays (buffers) smaller than this many bytes travel inside the pickle
IN_BAND = 4096
#: the tag of a packed array (see :func:`dumps`)
ND = "__dasktensor_nd__"
#: the fourth item of a request of several calls, ``(key, method, [args, ...], MANY)``
MANY = "many"
#: a message's frame count, and each frame's length
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
#: at most this many frames in one message (a guard against reading garbage)
_MAX_FRAMES = 1 << 16
#: at most this many buffers in one ``sendmsg`` (the system's IOV_MAX; more: EMSGSIZE)
_IOV_MAX = 1024
#: the head of a message of one frame: its count (1) and its length
_ONE = struct.Struct("<IQ")
#: messages up to this size are joined into one buffer and sent with one ``send``
_JOIN = 65536
#: how long a waiting thread polls before it sleeps (``dasktensor.remote.busy-poll``)
BUSY_POLL = 200e-6


def dumps(obj) -> list:
    """``obj`` as frames: the pickle, then the raw buffers it refers to.

    Numeric arrays and NumPy scalars in ``obj``, or in the tuples and lists it holds, are
    swapped for ``(ND, dtype, shape, data, is_scalar)`` before pickling, ``data`` being
    the bytes, or for arrays of :data:`IN_BAND` bytes or more a ``pickle.PickleBuffer``
    that pickle sends out of band: a tuple of plain values pickles in about 0.5 us, where
    NumPy's own pickling of one small array takes 7-9 us (measured here).  Arrays deeper
    inside other objects go by NumPy's pickling, out of band as well.

    Examples
    --------
    >>> import numpy as np
    >>> frames = dumps(("k", None, (np.zeros(1000), 2.5)))
    >>> len(frames), frames[1].nbytes
    (2, 8000)
    >>> key, method, (x, s) = loads([bytearray(f) for f in frames])
    >>> x.shape, x.flags.writeable, s
    ((1000,), True, 2.5)
    """
    frames: list = [memoryview(b"")]

    def out_of_band(buffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < IN_BAND:
            return True  # in band
        frames.append(raw)
        return False

    packed = _pack(obj, {})  # (the dict keeps the arrays' ids valid meanwhile)
    frames[0] = pickle.dumps(packed, protocol=5, buffer_callback=out_of_band)
    if len(frames) > _MAX_FRAMES:  # the receiver would take it for garbage and hang up
        raise ValueError(
            f"a dasktensor message holds at most {_MAX_FRAMES - 1} arrays of {IN_BAND} "
            f"bytes or more, got {len(frames) - 1}: stack them into fewer, larger arrays"
        )
    return frames


def _pack(value, seen: dict):
    t = type(value)
    if t is tuple or t is list:
        return t([_pack(v, seen) for v in value])
    if t is np.ndarray or isinstance(value, np.generic):
        if value.dtype.kind not in "biufc":
            return value
        arr = value
        if t is not np.ndarray or not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(value)
        if arr.nbytes < IN_BAND:
            return (ND, arr.dtype.str, value.shape, arr.tobytes(), t is not np.ndarray)
        # one tuple per array: pickle memoizes it, so an array held twice travels once
        packed = seen.get(id(value))
        if packed is None:
            data = pickle.PickleBuffer(arr)
            packed = seen[id(value)] = (ND, arr.dtype.str, value.shape, data, False)
        return packed
    return value


def loads(frames: list):
    """The inverse of :func:`dumps` (``frames`` as received: writeable buffers)."""
    return _unpack(pickle.loads(frames[0], buffers=frames[1:]))


def _unpack(value):
    t = type(value)
    if t is tuple and len(value) == 5 and value[0] == ND:
        _, dtype, shape, data, scalar = value
        if type(data) is bytes:  # in band: a copy, writeable
            data = bytearray(data)
        arr = np.frombuffer(data, dtype=dtype).reshape(shape)  # out of band: the frame
        return arr[()] if scalar else arr
    if t is tuple or t is list:
        return t([_unpack(v) for v in value])
    return value


def send(sock, obj) -> None:
    """Write ``obj`` to ``sock`` as one message."""
    send_frames(sock, dumps(obj))


def send_frames(sock, frames: list) -> None:
    """Write the frames of one message (:func:`dumps`) to ``sock``."""
    if len(frames) == 1 and len(frames[0]) <= _JOIN:  # the usual small call: one write
        sock.sendall(_ONE.pack(1, len(frames[0])) + frames[0])
        return
    lengths = [len(frames[0]), *(f.nbytes for f in frames[1:])]
    prefix = _COUNT.pack(len(frames)) + b"".join(_LENGTH.pack(n) for n in lengths)
    parts = [prefix, *frames]
    total = len(prefix) + sum(lengths)
    if hasattr(sock, "sendmsg") and not hasattr(sock, "cipher"):  # plain socket: one call
        sent = sock.sendmsg(parts if len(parts) <= _IOV_MAX else parts[:_IOV_MAX])
        if sent == total:  # (the usual case: no list is made again)
            return
        parts = _unsent(parts, sent)
        while parts:  # (more when a message has over _IOV_MAX parts, or over 2 GiB)
            parts = _unsent(parts, sock.sendmsg(parts[:_IOV_MAX]))
        return
    for part in parts if total > 65536 else [b"".join(parts)]:
        sock.sendall(part)


def _unsent(parts: list, sent: int) -> list:
    """What is left of ``parts`` once ``sent`` bytes of them went: views, not copies.

    A ``sendmsg`` may send less than it was given: Linux sends at most 2 GiB - 4 KiB per
    call, and a socket with a timeout what fits in its buffer.

    >>> [bytes(p) for p in _unsent([b"abc", b"de", b"f"], 4)]
    [b'e', b'f']
    >>> _unsent([b"abc", b"de"], 5)
    []
    """
    for i, part in enumerate(parts):
        n = memoryview(part).nbytes
        if sent < n:
            return [memoryview(part).cast("B")[sent:], *parts[i + 1 :]]
        sent -= n
    return []


def recv(reader):
    """Read one message from ``reader`` (a socket's ``makefile("rb")``); EOFError when the
    other end closed the connection."""
    return loads(recv_frames(reader))


def recv_frames(reader) -> list:
    """Read the frames of one message (see :func:`recv`)."""
    head = _read(reader, _COUNT.size)
    (count,) = _COUNT.unpack(head)
    if not 0 < count <= _MAX_FRAMES:
        raise ConnectionError(f"not a dasktensor message: {count} frames announced")
    sizes = _read(reader, _LENGTH.size * count)
    frames = []
    for i in range(count):
        (n,) = _LENGTH.unpack_from(sizes, _LENGTH.size * i)
        frames.append(_read(reader, n))
    return frames


def _read(reader, n: int) -> bytearray:
    buffer = bytearray(n)
    got = reader.readinto(buffer) if n else 0
    if got != n:
        if got == 0:
            raise EOFError("the connection was closed")
        raise ConnectionError(f"the connection was closed after {got} of {n} bytes")
    return buffer


def error_reply(e: BaseException) -> tuple:
    """The reply carrying the model's exception ``e`` (raised in this thread)."""
    from distributed.core import error_message

    message = dict(error_message(e))
    for name in ("exception", "traceback"):  # Serialize wrappers -> their pickled bytes
        message[name] = getattr(message[name], "data", message[name])
    return ("error", message)


class BusyPoll:
    """Wait for a socket to become readable, polling it for a while before sleeping.

    On loopback and on virtual machines most of a fast call's round trip is waking the
    threads that sleep in ``recv`` (measured here: a raw echo 60 us sleeping, 23 us
    polling; a call 136 us with both ends sleeping, 36 us with both polling).  So a
    thread that expects a message soon (a caller waiting for a reply, a call server
    waiting for a back-to-back caller's next request) polls for up to ``seconds``
    first, and sleeps only after that.  At most one thread per ``slot`` polls at a
    time: many waiting threads must not take turns spinning on the GIL.

    Examples
    --------
    >>> import socket, threading
    >>> a, b = socket.socketpair()
    >>> waiter = BusyPoll(a, 100e-6, threading.Lock())
    >>> waiter.wait(0.01)
    False
    >>> _ = b.send(b"x")
    >>> waiter.wait(0.01)
    True
    >>> a.close(); b.close()
    """

    __slots__ = ("_backoff", "_pending", "_poll", "_skip", "seconds", "slot")

    def __init__(self, sock, seconds: float, slot: threading.Lock | None):
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        self._poll = poller.poll
        self._pending = getattr(sock, "pending", None)  # TLS: bytes decrypted already
        self.seconds = seconds
        self.slot = slot
        #: waits left without polling, and how many the next miss skips: a poll that
        #: missed (a slow model, an idle caller) is not tried again at once, so that
        #: polling never takes a loaded machine's CPU from the process that must answer
        self._skip = self._backoff = 0

    def wait(self, timeout: float | None) -> bool:
        """Whether the socket is readable (or closed) within ``timeout`` seconds (None:
        for ever); nothing is read."""
        if self._pending is not None and self._pending():
            return True
        poll = self._poll
        if poll(0):
            return True
        slot, start, skipped = self.slot, perf_counter(), self._skip
        if skipped:
            self._skip -= 1
        elif self.seconds > 0 and slot is not None and slot.acquire(blocking=False):
            try:
                deadline = start + (
                    self.seconds if timeout is None else min(self.seconds, timeout)
                )
                while perf_counter() < deadline:
                    if poll(0):
                        self._backoff = 0
                        return True
            finally:
                slot.release()
            self._skip = self._backoff = min(2 * self._backoff or 1, 64)
        if timeout is None:
            came = bool(poll(None))
        else:
            came = bool(poll(max(0.0, timeout - (perf_counter() - start)) * 1000))
        if skipped and came and perf_counter() - start < self.seconds:
            self._skip = self._backoff = 0  # it would have come while polling: poll again
        return came


def nodelay(sock) -> None:
    """Send small messages at once (no Nagle delay: a call is one small write)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class WireServer:
    """A listening socket on ``host`` and a thread per connection, answering requests with
    ``answer(key, method, args) -> reply``.

    Parameters
    ----------
    host : str
        The address to listen on (the worker's own host).
    answer : callable
        Runs one request; returns the reply (see the module docstring).
    ssl_context : ssl.SSLContext, optional
        Serve TLS only, with this (server side) context.
    name : str
        The prefix of its threads' names.
    busy_poll : float
        Seconds a connection's thread polls for the next request before it sleeps (one
        thread at a time; 0: never), see :class:`BusyPoll`.

    Examples
    --------
    >>> import socket
    >>> server = WireServer("127.0.0.1", lambda key, method, args: ("OK", sum(args)))
    >>> sock = socket.create_connection(server.address)
    >>> send(sock, ("key", None, (1, 2, 3)))
    >>> recv(sock.makefile("rb"))
    ('OK', 6)
    >>> sock.close(); server.close()
    """

    def __init__(
        self,
        host: str,
        answer: Callable,
        ssl_context=None,
        name: str = "dasktensor",
        busy_poll: float = BUSY_POLL,
        answer_many: Callable | None = None,
    ):
        self.answer = answer
        self.answer_many = answer_many or self._one_by_one
        self.ssl_context = ssl_context
        self.name = name
        #: how long a connection's thread polls for the next request before it sleeps,
        #: and the one slot for it (see :class:`BusyPoll`)
        self.busy_poll = busy_poll
        self.poll_slot = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, 0), family=family, backlog=128)
        self.address: tuple[str, int] = (host, self.listener.getsockname()[1])
        self.connections: set = set()
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(
                target=self._serve, args=(sock,), name=f"{self.name}-call", daemon=True
            ).start()

    def _serve(self, sock) -> None:
        try:
            nodelay(sock)
            if self.ssl_context is not None:
                sock.settimeout(10.0)  # a client that never completes its handshake
                sock = self.ssl_context.wrap_socket(sock, server_side=True)
                sock.settimeout(None)
            with self.lock:
                if self.closed:
                    return
                self.connections.add(sock)
            reader = sock.makefile("rb")
            waiter = BusyPoll(sock, self.busy_poll, self.poll_slot)
            while True:
                try:
                    waiter.wait(None)  # a back-to-back caller's next request comes soon
                    frames = recv_frames(reader)
                except (OSError, EOFError):
                    return  # the caller went away (or spoke something else)
                send_frames(sock, self._reply(frames))
        except OSError:  # a failed handshake, or the caller left before its reply
            return
        finally:
            with self.lock:
                self.connections.discard(sock)
            sock.close()

    def _reply(self, frames: list) -> list:
        """The reply's frames; arguments that do not unpickle, or a result that does not
        pickle, are the call's error (the connection stays usable)."""
        try:
            request = loads(frames)
            if len(request) == 4 and request[3] == MANY:
                return dumps(self.answer_many(*request[:3]))
            key, method, args = request
            return dumps(self.answer(key, method, args))
        except Exception as e:
            return dumps(error_reply(e))

    def _one_by_one(self, key, method, calls) -> tuple:
        return ("many", [self.answer(key, method, args) for args in calls])

    def close(self) -> None:
        """Stop listening and end the connections (a call running goes on to its end)."""
        with self.lock:
            self.closed = True
            connections, self.connections = self.connections, set()
        try:  # wakes the accept thread (closing alone leaves it blocked, still listening)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:  # pragma: no cover - not connected on some systems
            pass
        self.listener.close()
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
