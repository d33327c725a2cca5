"""A Dask cluster as a UM-Bridge server: ``dt.serve_umbridge``.

A UM-Bridge model (a subclass of ``umbridge.Model``: ``__call__``, ``gradient``,
``apply_jacobian``, ``apply_hessian``, ``get_input_sizes``, ``get_output_sizes`` and the
``supports_*`` flags) is served by ``umbridge.serve_models`` from one process, one request
at a time.  Here the factory of a :class:`~dasktensor.RemoteModel` builds that same model
on the workers, and each HTTP request becomes one call on a replica through the channel:
the replicas share the load, a replica lost with its worker is rebuilt and its call
moves, ``resources`` place the replicas (GPU workers), methods marked ``@dt.batched``
serve concurrent requests in batches, and the calls show on the dashboard's calls page.
The model's code does not change.

* **The protocol** (UM-Bridge 1.0): ``GET /Info``; ``POST /ModelInfo``, ``/InputSizes``,
  ``/OutputSizes``, ``/Evaluate``, ``/Gradient``, ``/ApplyJacobian``, ``/ApplyHessian``.
  Errors are ``{"error": {"type", "message"}}``: ``ModelNotFound``, ``UnsupportedFeature``
  and ``InvalidInput`` with status 400, ``InvalidOutput`` with 500, checked here as
  ``umbridge.serve_models`` checks them (sizes, indices, the lengths of ``sens`` and
  ``vec``, the output's).  An exception the model raised is a 500 ``ModelError`` naming
  its type and message (``serve_models`` answers a bare "500 Internal Server Error"),
  and no replica to run the call a 503 ``Unavailable``.  A request without ``name``
  addresses the first model (protocol 0.9 named none).  The shared-memory routes of the
  Python server (``/EvaluateShMem``...) are not served: a client asking for them falls
  back to HTTP, as with any server on another host.
* **Where the work is.**  What a request needs besides the call -- the model's flags,
  its sizes for a ``config`` -- is asked of a replica once and kept, so a request costs
  one round trip to a worker.
* **Threads.**  The HTTP server (the standard library's, HTTP/1.1 with keep-alive) gives
  each client connection a thread, which makes the channel call itself: concurrent
  requests are concurrent calls, spread over the replicas.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from dasktensor.cluster import SchedulerLostError
from dasktensor.remote._model import RemoteModel
from dasktensor.remote._spec import RemoteModelError

_log = logging.getLogger("dasktensor.umbridge")

PROTOCOL_VERSION = 1.0

#: the model's method run by each request, and the flag saying whether it supports it
_FEATURES = {
    "Evaluate": ("__call__", "supports_evaluate"),
    "Gradient": ("gradient", "supports_gradient"),
    "ApplyJacobian": ("apply_jacobian", "supports_apply_jacobian"),
    "ApplyHessian": ("apply_hessian", "supports_apply_hessian"),
}


class _Reply(Exception):
    """An answer other than the result: a protocol error, with its HTTP status."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def _invalid(message: str) -> _Reply:
    return _Reply(400, "InvalidInput", message)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _vector(value, what: str, size: int | None = None) -> list:
    if not isinstance(value, list) or not all(_is_number(x) for x in value):
        raise _invalid(f"{what} must be an array of numbers, got {_short(value)}")
    if size is not None and len(value) != size:
        raise _invalid(f"{what} has invalid length! Expected {size} but got {len(value)}.")
    return value


def _index(body: dict, key: str, count: int, what: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
        raise _invalid(
            f"Invalid {key} index! Expected an integer between 0 and the number of {what} "
            f"minus one ({count - 1}), but got {_short(value)}"
        )
    return value


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _native(value):
    """The model's output as JSON's numbers (NumPy arrays and scalars, tuples)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_native(v) for v in value]
    return value


class _Served:
    """One model as the server sees it: its replicas, flags and sizes by ``config``."""

    def __init__(self, model: RemoteModel):
        self.model = model
        self.name = model.name
        self.support: dict[str, bool] = {}
        self.sizes: dict[str, tuple[list[int], list[int]]] = {}
        self.lock = threading.Lock()

    def start(self) -> None:
        self.model.start()
        for feature, (_, flag) in _FEATURES.items():
            self.support[feature] = bool(self._ask(flag))
        self.sizes_for({})

    def _ask(self, method: str, *args):
        try:
            return self.model.call(method, *args)
        except AttributeError as e:
            raise TypeError(
                f"{self.model!r}: expected its factory to build an umbridge.Model (with "
                f"get_input_sizes, get_output_sizes, supports_evaluate...), its replica has "
                f"no {method!r} ({e})"
            ) from e

    def sizes_for(self, config) -> tuple[list[int], list[int]]:
        key = json.dumps(config, sort_keys=True)
        with self.lock:
            found = self.sizes.get(key)
        if found is None:
            found = ([int(n) for n in self._ask("get_input_sizes", config)],
                     [int(n) for n in self._ask("get_output_sizes", config)])  # fmt: skip
            with self.lock:
                self.sizes[key] = found
        return found


class UMBridgeServer:
    """A running UM-Bridge server whose models are :class:`~dasktensor.RemoteModel` s.

    Made by :func:`serve_umbridge`; ``close()`` (or leaving a ``with`` block) stops it.
    The models and their replicas stay: they are the caller's.

    Attributes
    ----------
    url : str
        Where clients reach it, e.g. ``http://127.0.0.1:4242``.
    models : list of str
        The names it serves.
    """

    def __init__(self, served: Sequence[_Served], host: str, port: int):
        self._served = {s.name: s for s in served}
        self.models = list(self._served)
        try:
            self._http = _HTTPServer((host, port), _Handler)
        except OSError as e:
            raise OSError(
                e.errno, f"serve_umbridge: cannot listen on {host}:{port} ({e.strerror}); "
                "pass another port (port=0: one the system chooses)"
            ) from e  # fmt: skip
        self._http.owner = self
        self.port = self._http.server_address[1]
        shown = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self.url = (
            f"http://[{shown}]:{self.port}" if ":" in shown else f"http://{shown}:{self.port}"
        )
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"dasktensor-umbridge-{self.port}", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "serving"
        return f"<UMBridgeServer {self.url} {state} {self.models}>"

    @property
    def closed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server is closed (from another thread, or Ctrl-C in this one:
        then it closes); True if it is."""
        try:
            self._thread.join(timeout)
        except KeyboardInterrupt:
            self.close()
        return self.closed

    def close(self) -> None:
        """Stop listening and answering (requests being answered finish)."""
        if self._thread.is_alive():
            self._http.shutdown()
        self._http.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the protocol -----------------------------------------------------------------------

    def info(self) -> dict:
        return {"protocolVersion": PROTOCOL_VERSION, "models": self.models}

    def answer(self, route: str, body: dict) -> dict:
        """The reply to a POST of ``body`` to ``route``, or a :class:`_Reply` raised."""
        served = self._model(body)
        if route == "ModelInfo":
            return {"support": dict(served.support)}
        config = body.get("config", {})
        if config is None:
            config = {}
        if route in ("InputSizes", "OutputSizes"):
            inputs, outputs = self._sizes(served, config)
            return {"inputSizes": inputs} if route == "InputSizes" else {"outputSizes": outputs}
        if route not in _FEATURES:
            raise _Reply(404, "NotFound", f"no route /{route}; UM-Bridge 1.0 has /Info, "
                         "/ModelInfo, /InputSizes, /OutputSizes, " + ", ".join(
                             f"/{f}" for f in _FEATURES))  # fmt: skip
        if not served.support[route]:
            raise _Reply(
                400, "UnsupportedFeature", f"{route} not supported by model {served.name!r}!"
            )
        inputs, outputs = self._sizes(served, config)
        parameters = body.get("input")
        if not isinstance(parameters, list) or len(parameters) != len(inputs):
            raise _invalid(
                f"Number of input parameters does not match model number of model inputs! "
                f"Expected {len(inputs)} arrays of numbers, got {_short(parameters)}"
            )
        for i, (p, n) in enumerate(zip(parameters, inputs, strict=True)):
            _vector(p, f"Input parameter {i}", n)
        method = _FEATURES[route][0]
        if route == "Evaluate":
            output = self._call(served, method, parameters, config)
            return {"output": self._outputs(served, output, outputs)}
        out_wrt = _index(body, "outWrt", len(outputs), "outputs")
        args: tuple  # the model method's arguments
        if route == "Gradient":
            in_wrt = _index(body, "inWrt", len(inputs), "inputs")
            sens = _vector(body.get("sens"), "Sensitivity vector sens", outputs[out_wrt])
            args = (out_wrt, in_wrt, parameters, sens, config)
            size = inputs[in_wrt]
        elif route == "ApplyJacobian":
            in_wrt = _index(body, "inWrt", len(inputs), "inputs")
            vec = _vector(body.get("vec"), "Vector vec", inputs[in_wrt])
            args = (out_wrt, in_wrt, parameters, vec, config)
            size = outputs[out_wrt]
        else:
            in_wrt1 = _index(body, "inWrt1", len(inputs), "inputs")
            in_wrt2 = _index(body, "inWrt2", len(inputs), "inputs")
            sens = _vector(body.get("sens"), "Sensitivity vector sens", outputs[out_wrt])
            vec = _vector(body.get("vec"), "Vector vec", inputs[in_wrt2])
            args = (out_wrt, in_wrt1, in_wrt2, parameters, sens, vec, config)
            size = inputs[in_wrt1]
        output = self._call(served, method, *args)
        return {"output": self._output(served, route, output, size)}

    def _model(self, body: dict) -> _Served:
        name = body.get("name", self.models[0])  # protocol 0.9: no name
        served = self._served.get(name) if isinstance(name, str) else None
        if served is None:
            raise _Reply(400, "ModelNotFound", f"Model {_short(name)} not found! The following "
                         f"are available: {self.models}.")  # fmt: skip
        return served

    def _sizes(self, served: _Served, config) -> tuple[list[int], list[int]]:
        try:
            return served.sizes_for(config)
        except Exception as e:  # the model's own error
            raise self._failed(served, "get_input_sizes / get_output_sizes", e) from e

    def _call(self, served: _Served, method: str, *args):
        try:
            return served.model.call(method, *args)
        except Exception as e:
            raise self._failed(served, method, e) from e

    @staticmethod
    def _failed(served: _Served, method: str, error: Exception) -> _Reply:
        if isinstance(error, RemoteModelError | SchedulerLostError):
            return _Reply(503, "Unavailable", f"model {served.name!r}: {error}")
        _log.warning("model %r: %s raised", served.name, method, exc_info=error)
        return _Reply(500, "ModelError", f"model {served.name!r}: {method} raised "
                      f"{type(error).__name__}: {error}")  # fmt: skip

    @staticmethod
    def _outputs(served: _Served, output, sizes: list[int]) -> list:
        output = _native(output)
        if not isinstance(output, list) or not all(isinstance(v, list) for v in output):
            raise _Reply(500, "InvalidOutput", f"model {served.name!r}: Model output is not a "
                         f"list of lists! Got {_short(output)}")  # fmt: skip
        if len(output) != len(sizes):
            raise _Reply(
                500,
                "InvalidOutput",
                f"model {served.name!r}: Number of output vectors returned by model does not "
                "match number of model outputs declared by model! "
                f"Declared {len(sizes)}, returned {len(output)}.",
            )
        for i, (v, n) in enumerate(zip(output, sizes, strict=True)):
            UMBridgeServer._check(served, v, n, f"Output vector {i}")
        return output

    @staticmethod
    def _output(served: _Served, route: str, output, size: int) -> list:
        output = _native(output)
        if not isinstance(output, list):
            raise _Reply(500, "InvalidOutput", f"model {served.name!r}: {route}: Model output "
                         f"is not a list! Got {_short(output)}")  # fmt: skip
        return UMBridgeServer._check(served, output, size, f"{route}: Output vector")

    @staticmethod
    def _check(served: _Served, vector: list, size: int, what: str) -> list:
        if len(vector) != size:
            raise _Reply(500, "InvalidOutput", f"model {served.name!r}: {what} has invalid "
                         f"length! Model declared {size} but returned {len(vector)}.")  # fmt: skip
        if not all(_is_number(x) for x in vector):
            raise _Reply(500, "InvalidOutput", f"model {served.name!r}: {what} holds "
                         f"something other than numbers: {_short(vector)}")  # fmt: skip
        return vector


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a client's idle keep-alive connection does not hold close()
    block_on_close = False
    request_queue_size = 128
    owner: UMBridgeServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client's requests share its connection
    # the headers and the body go out as two writes: with Nagle's algorithm the body
    # waits for the client's delayed ACK of the headers (40 ms a request, measured)
    disable_nagle_algorithm = True
    server: _HTTPServer

    def log_message(self, format, *args):
        _log.debug("%s - " + format, self.address_string(), *args)

    def _send(self, status: int, answer: dict | str) -> None:
        if isinstance(answer, dict):
            data, kind = json.dumps(answer, allow_nan=True).encode(), "application/json"
        else:
            data, kind = answer.encode(), "text/plain; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, reply: _Reply) -> None:
        self._send(reply.status, {"error": {"type": reply.kind, "message": reply.message}})

    def do_GET(self):
        owner = self.server.owner
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/Info":
            self._send(200, owner.info())
        elif path == "":
            self._send(200, f"UM-Bridge server (protocol {PROTOCOL_VERSION}) on a Dask cluster, "
                       f"served by dasktensor.\nModels: {', '.join(owner.models)}\n"
                       "GET /Info; POST /ModelInfo, /InputSizes, /OutputSizes, /Evaluate, "
                       "/Gradient, /ApplyJacobian, /ApplyHessian with a JSON body.\n")  # fmt: skip
        else:
            self._error(_Reply(404, "NotFound", f"no GET route {path}: GET /Info, POST the rest"))

    do_HEAD = do_GET

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        route = self.path.split("?", 1)[0].strip("/")
        try:
            try:
                body = json.loads(raw) if raw.strip() else {}
            except ValueError as e:
                raise _invalid(f"the request's body is not JSON ({e})") from None
            if not isinstance(body, dict):
                raise _invalid(f"expected a JSON object as the request's body, got {_short(body)}")
            if route == "Info":
                answer = self.server.owner.info()
            else:
                answer = self.server.owner.answer(route, body)
        except _Reply as reply:
            self._error(reply)
            return
        self._send(200, answer)


def serve_umbridge(
    models: RemoteModel | Sequence[RemoteModel], port: int = 4242, host: str = "127.0.0.1"
) -> UMBridgeServer:
    """Serve remote models over UM-Bridge: each request runs on a replica on the cluster.

    The factory of each :class:`~dasktensor.RemoteModel` builds an ``umbridge.Model``
    (the model code a UM-Bridge server already runs) on the workers; UM-Bridge clients
    (``umbridge.HTTPModel``, the C++, R, Julia and MATLAB clients, UQ tools built on them)
    then reach it at ``url`` under the ``RemoteModel``'s name.  The replicas share the
    requests, a lost worker's requests move to another replica, and the calls show on
    the dashboard's calls page.

    Parameters
    ----------
    models : RemoteModel or sequence of RemoteModel
        The models, each served under its ``name`` (names must differ).  Their replicas
        are built now, and each is asked for its flags (``supports_evaluate``...) and its
        sizes for ``config={}``.
    port : int
        The port to listen on (4242, UM-Bridge's usual one; 0: one the system chooses).
    host : str
        The address to listen on: ``"127.0.0.1"`` (this machine only) by default;
        ``"0.0.0.0"`` for every interface.

    Returns
    -------
    UMBridgeServer
        The running server (a thread of this process): ``.url``, ``.models``,
        ``.close()``, ``.wait()``; a context manager.

    Examples
    --------
    >>> import umbridge
    >>> import dasktensor as dt
    >>> class Double(umbridge.Model):
    ...     def __init__(self):
    ...         super().__init__("double")
    ...     def get_input_sizes(self, config):
    ...         return [2]
    ...     def get_output_sizes(self, config):
    ...         return [2]
    ...     def __call__(self, parameters, config):
    ...         return [[2 * x for x in parameters[0]]]
    ...     def supports_evaluate(self):
    ...         return True
    >>> client = dt.connect(n_workers=2, processes=False, dashboard_address=False)
    >>> model = dt.RemoteModel(Double, name="double")
    >>> server = dt.serve_umbridge(model, port=0)
    >>> umbridge.HTTPModel(server.url, "double")([[1.0, 2.5]])
    [[2.0, 5.0]]
    >>> server.close(); model.close(); client.shutdown()
    """
    if isinstance(models, RemoteModel):
        models = [models]
    if isinstance(models, str | bytes) or not isinstance(models, Sequence) or not models:
        raise TypeError(
            "serve_umbridge expected a dt.RemoteModel whose factory builds an umbridge.Model, "
            f"or a list of them, got {models!r}"
        )
    wrong = [m for m in models if not isinstance(m, RemoteModel)]
    if wrong:
        raise TypeError(
            f"serve_umbridge expected dt.RemoteModel objects (dt.RemoteModel(factory, "
            f"name=...)), got {wrong[0]!r}"
        )
    names = [m.name for m in models]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"serve_umbridge serves each model under its name; expected different names, "
            f"got {twice} more than once (dt.RemoteModel(factory, name=...))"
        )
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise ValueError(f"serve_umbridge expected a port in 0..65535, got {port!r}")
    served = [_Served(m) for m in models]
    for s in served:
        s.start()
    return UMBridgeServer(served, host, port)


__all__ = ["UMBridgeServer", "serve_umbridge"]
