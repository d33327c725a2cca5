"""Raw loopback echo servers in another process: the floor a remote call is measured against.

``python _echo.py`` listens on two loopback ports and prints them (``tcp zmq``):

* **tcp**: length-prefixed messages (``<u4 n`` then ``n`` bytes) on a plain TCP socket
  (no Nagle delay), each read into a NumPy array and written back: what any call needs
  at least (a write, the other process waking, a read, a write back, a read).
* **zmq**: the same bytes through a pyzmq ``REP`` socket (if pyzmq is installed), the
  messaging library a data plane could be built on.

:func:`echo_servers` starts it and gives clients for both.  ``python _echo.py --poll``
serves the tcp echo with both ends busy-polling before they sleep, 200 us at most
(:func:`polling_echo` starts it): waking a sleeping process is most of a loopback round
trip on a virtual machine, and dasktensor's channel polls as well
(``dasktensor.remote.busy-poll``), so this is its floor.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading

_LEN = struct.Struct("<I")


def _poll_for(sock, seconds: float = 200e-6):
    """A function that polls ``sock`` for up to ``seconds`` before the caller sleeps."""
    import select
    import time

    poller = select.poll()
    poller.register(sock, select.POLLIN)

    def wait() -> None:
        deadline = time.perf_counter() + seconds
        while not poller.poll(0) and time.perf_counter() < deadline:
            pass

    return wait


def _serve_tcp(listener, poll: bool = False) -> None:
    import numpy as np

    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        wait = _poll_for(sock) if poll else (lambda: None)
        while True:
            wait()
            head = reader.read(4)
            if len(head) < 4:
                break
            (n,) = _LEN.unpack(head)
            data = np.frombuffer(bytearray(reader.read(n)), dtype=np.uint8)
            sock.sendall(head + data.tobytes())


def _serve_zmq(sock) -> None:
    import numpy as np

    while True:
        data = np.frombuffer(sock.recv(copy=True), dtype=np.uint8)
        sock.send(data.tobytes())


def _main() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ports = [str(listener.getsockname()[1])]
    if "--poll" in sys.argv:
        print(ports[0], flush=True)
        _serve_tcp(listener, poll=True)
        return
    try:
        import zmq

        rep = zmq.Context().socket(zmq.REP)
        ports.append(str(rep.bind_to_random_port("tcp://127.0.0.1")))
        threading.Thread(target=_serve_zmq, args=(rep,), daemon=True).start()
    except ImportError:
        ports.append("-")
    print(" ".join(ports), flush=True)
    _serve_tcp(listener)


class TcpEcho:
    """A client of the tcp echo: ``echo(payload) -> payload``; ``poll``: busy-poll for
    the reply before sleeping."""

    def __init__(self, port: int, poll: bool = False):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")
        self.wait = _poll_for(self.sock) if poll else (lambda: None)

    def __call__(self, payload: bytes) -> bytes:
        self.sock.sendall(_LEN.pack(len(payload)) + payload)
        self.wait()
        (n,) = _LEN.unpack(self.reader.read(4))
        return self.reader.read(n)


class ZmqEcho:
    """A pyzmq ``REQ`` client of the zmq echo."""

    def __init__(self, port: int):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def __call__(self, payload: bytes) -> bytes:
        self.sock.send(payload)
        return self.sock.recv()


@contextlib.contextmanager
def echo_servers():
    """Start the echo process; yield ``(tcp_client, zmq_client or None)``; stop it."""
    proc = subprocess.Popen(
        [sys.executable, __file__], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        tcp, zmq_port = proc.stdout.readline().split()
        yield TcpEcho(int(tcp)), (None if zmq_port == "-" else ZmqEcho(int(zmq_port)))
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def polling_echo():
    """Start the tcp echo whose both ends busy-poll; yield its client; stop it."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--poll"], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        yield TcpEcho(int(proc.stdout.readline()), poll=True)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    _main()
