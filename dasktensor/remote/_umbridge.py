"""UM-Bridge models as PyTensor Ops: ``dt.umbridge_op``.

UM-Bridge (https://um-bridge-benchmarks.readthedocs.io) serves a model over HTTP/JSON:
``/Evaluate`` maps a list of input vectors to a list of output vectors, ``/Gradient`` is
the vector-Jacobian product of one output with respect to one input (``sens`` the
cotangent), ``/ApplyJacobian`` the Jacobian-vector product, and ``/Info``,
``/ModelInfo``, ``/InputSizes``, ``/OutputSizes`` describe the model.

:func:`umbridge_op` makes an :class:`~dasktensor.ArraysToArraysOp` of such a model: one
vector input per UM-Bridge input and one vector output per output, their sizes read from
the server.  Its function is a :class:`~dasktensor.ops.RemoteCallTarget`, so the
independent calls of one evaluation are made at once (the parallel-calls rewrite; tasks
made from the caller in the DASK mode).  Its vjp sums ``/Gradient`` over the outputs
(one request per input and output whose cotangent is not zero, made at once), its jvp
``/ApplyJacobian`` over the inputs, where the model supports them.

The HTTP connections are kept alive, one per server and thread at a time, in this
process's runtime (a forked child opens its own); several ``urls`` of the same model are
balanced by calls in flight, and a server that refuses or drops a connection loses the
call to another.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dasktensor._runtime import ProcessState, runtime
from dasktensor.ops import ArraysToArraysOp, RemoteCallTarget


class UMBridgeError(RuntimeError):
    """An error a UM-Bridge server answered with (``InvalidInput``,
    ``UnsupportedFeature``, ``ModelNotFound``, ``InvalidOutput``...), or a reply that is
    not UM-Bridge's.

    Attributes
    ----------
    kind : str
        The error's type as the server named it.
    """

    def __init__(self, kind: str, message: str, url: str, model: str | None):
        self.kind = kind
        where = f"UM-Bridge model {model!r} at {url}" if model else f"UM-Bridge server {url}"
        super().__init__(f"{where}: {kind}: {message}")


_LOST = (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine, OSError)


class _Connections(ProcessState):
    """Idle keep-alive connections, by (host, port), and the calls in flight by url."""

    def __init__(self):
        self.idle: dict[tuple[str, int], list] = {}
        self.inflight: dict[str, int] = {}
        self.lock = threading.Lock()


def _split(url: str) -> tuple[str, int, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"expected a UM-Bridge server's url such as 'http://host:4242', got {url!r}"
        )
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), parts.scheme


def post(url: str, route: str, body: dict | None, timeout: float | None, model=None) -> dict:
    """One request to a UM-Bridge server (GET without a body); the reply's JSON.

    An error the server answered with raises :class:`UMBridgeError`; a connection that
    fails raises ``ConnectionError`` (the server is gone), a reply that does not come in
    ``timeout`` seconds ``TimeoutError``."""
    host, port, scheme = _split(url)
    state = runtime.state(_Connections)
    with state.lock:
        idle = state.idle.get((host, port), [])
        conn = idle.pop() if idle else None
    fresh = conn is None
    for attempt in range(2):  # a kept-alive connection the server closed: once more, anew
        if conn is None:
            kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = kind(host, port, timeout=timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        try:
            if body is None:
                conn.request("GET", route)
            else:
                payload = json.dumps(body).encode()
                conn.request("POST", route, payload, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
            break
        except TimeoutError:  # (socket.timeout is TimeoutError)
            conn.close()
            raise TimeoutError(
                f"UM-Bridge {'model ' + repr(model) if model else 'server'} at {url}: no reply "
                f"to {route} within {timeout:g} s"
            ) from None
        except _LOST as e:
            conn.close()
            conn = None
            if fresh or attempt:
                raise ConnectionError(f"UM-Bridge server {url} did not answer {route}: {e}") from e
            fresh = True
    assert conn is not None  # (the loop ends with a reply, or raises)
    if reply.getheader("Connection", "").lower() == "close":
        conn.close()
    else:
        with state.lock:
            state.idle.setdefault((host, port), []).append(conn)
    try:
        answer = json.loads(data)
    except ValueError:
        text = data[:300].decode(errors="replace").strip()
        raise UMBridgeError(
            f"HTTP {reply.status}", f"not a UM-Bridge reply to {route}: {text!r}", url, model
        ) from None
    if isinstance(answer, dict) and "error" in answer:
        error = answer["error"]
        raise UMBridgeError(str(error.get("type")), str(error.get("message")), url, model)
    return answer


class _Servers:
    """Several servers of one model: each call goes to the one with the fewest calls in
    flight from this process; one that fails to answer loses the call to the next."""

    def __init__(self, urls: Sequence[str], name: str, timeout: float | None):
        self.urls = list(urls)
        self.name = name
        self.timeout = timeout

    def post(self, route: str, body: dict):
        state = runtime.state(_Connections)
        with state.lock:
            order = sorted(self.urls, key=lambda u: state.inflight.get(u, 0))
            state.inflight[order[0]] = state.inflight.get(order[0], 0) + 1
        failures = []
        for i, url in enumerate(order):
            if i:
                with state.lock:
                    state.inflight[url] = state.inflight.get(url, 0) + 1
            try:
                return post(url, route, body, self.timeout, self.name)
            except ConnectionError as e:
                failures.append(str(e))
            finally:
                with state.lock:
                    state.inflight[url] -= 1
        raise ConnectionError(
            f"UM-Bridge model {self.name!r}: no server answered {route} ({'; '.join(failures)})"
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, _Servers) and (self.urls, self.name) == (other.urls, other.name)

    def __hash__(self) -> int:
        return hash((tuple(self.urls), self.name))


def _vectors(arrays) -> list[list[float]]:
    return [np.asarray(a, dtype=float).ravel().tolist() for a in arrays]


class _Target(RemoteCallTarget):
    """One kind of UM-Bridge request of one model, as the function of a callable Op."""

    kind = ""

    def __init__(self, servers: _Servers, config: dict, n_inputs: int, n_outputs: int):
        self.servers = servers
        self.config = config
        self.n_inputs = n_inputs
        self.n_outputs = n_outputs
        self.__name__ = f"{servers.name}.{self.kind}"

    @classmethod
    def call_together(cls, calls):
        """The calls at once, a thread each (HTTP has no way to send several on one
        connection before reading a reply)."""
        if len(calls) < 2:
            return [target(*args) for target, args in calls]
        with ThreadPoolExecutor(len(calls), thread_name_prefix="dasktensor-umbridge") as pool:
            futures = [pool.submit(target, *args) for target, args in calls]
            return [f.result() for f in futures]

    def _body(self, inputs, **extra) -> dict:
        return {"name": self.servers.name, "input": _vectors(inputs), "config": self.config,
                **extra}  # fmt: skip

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and (other.servers, other.config_key) == (
            self.servers,
            self.config_key,
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.servers, self.config_key))

    @property
    def config_key(self) -> str:
        return json.dumps(self.config, sort_keys=True)

    def __repr__(self) -> str:
        return self.__name__


class Evaluate(_Target):
    """``/Evaluate``: the outputs at the inputs."""

    kind = "Evaluate"

    def __call__(self, *inputs):
        out = self.servers.post("/Evaluate", self._body(inputs))["output"]
        arrays = tuple(np.asarray(o, dtype=float) for o in out)
        return arrays[0] if self.n_outputs == 1 else arrays


class Gradient(_Target):
    """The vjp through ``/Gradient``: ``(*inputs, *cotangents) -> one gradient per input``,
    summed over the outputs (a zero cotangent needs no request)."""

    kind = "Gradient"

    def __call__(self, *args):
        inputs, cotangents = args[: self.n_inputs], args[self.n_inputs :]
        sums = _summed(
            self, "/Gradient", "sens", inputs, cotangents, [np.size(x) for x in inputs],
            by_input=False,
        )  # fmt: skip
        return sums[0] if self.n_inputs == 1 else tuple(sums)


class ApplyJacobian(_Target):
    """The jvp through ``/ApplyJacobian``: ``(*inputs, *tangents) -> one tangent per
    output``, summed over the inputs (a zero tangent needs no request)."""

    kind = "ApplyJacobian"

    def __init__(self, servers, config, n_inputs, n_outputs, output_sizes):
        super().__init__(servers, config, n_inputs, n_outputs)
        self.output_sizes = list(output_sizes)

    def __call__(self, *args):
        inputs, tangents = args[: self.n_inputs], args[self.n_inputs :]
        sums = _summed(
            self, "/ApplyJacobian", "vec", inputs, tangents, self.output_sizes, by_input=True
        )
        return sums[0] if self.n_outputs == 1 else tuple(sums)


def _summed(target, route, field, inputs, vectors, sizes, by_input: bool) -> list:
    """The requests of ``route`` for every (input ``i``, output ``j``) pair whose vector
    (``vectors[i]`` if ``by_input``, else ``vectors[j]``) is not zero, made at once, with
    that vector as ``field``; their results summed into arrays of ``sizes``, indexed by
    output (``by_input``: a jvp) or by input (a vjp)."""
    out = [np.zeros(n) for n in sizes]
    pairs = [
        (i, j) for i in range(target.n_inputs) for j in range(target.n_outputs)
        if np.any(np.asarray(vectors[i if by_input else j]))
    ]  # fmt: skip

    def one(pair):
        i, j = pair
        vec = _vectors([vectors[i if by_input else j]])[0]
        body = target._body(inputs, outWrt=j, inWrt=i, **{field: vec})
        return (j if by_input else i), np.asarray(target.servers.post(route, body)["output"])

    for k, value in _at_once(one, pairs):
        out[k] += value
    return out


def _at_once(fn, items: list) -> list:
    if len(items) < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(min(len(items), 16), thread_name_prefix="dasktensor-umbridge") as pool:
        return list(pool.map(fn, items))


def umbridge_op(
    url: str | None = None,
    name: str = "forward",
    config: dict | None = None,
    *,
    urls: Sequence[str] | None = None,
    timeout: float | None = None,
    op_name: str | None = None,
) -> ArraysToArraysOp:
    """An Op of a UM-Bridge model: one vector input per model input, one vector output
    per model output, differentiable where the model offers ``Gradient``.

    Parameters
    ----------
    url : str
        The server, e.g. ``"http://localhost:4242"``.
    name : str
        The model's name on the server (UM-Bridge's default is ``"forward"``).
    config : dict, optional
        The model's configuration, sent with every request (and asked for its sizes).
    urls : sequence of str, optional
        Several servers of the same model instead of ``url``: each call goes to the one
        with the fewest calls in flight, and one that fails loses the call to another.
    timeout : float, optional
        Seconds a request may wait for its reply (``TimeoutError`` after).
    op_name : str, optional
        The Op's name on the dashboard (``umbridge-<name>`` by default).

    Returns
    -------
    ArraysToArraysOp
        Its inputs and outputs are float64 vectors of the sizes the server gave.  Its
        gradient is the model's ``/Gradient`` (one request per input and output with a
        non-zero cotangent, made at once), its ``Rop``/``pushforward`` the model's
        ``/ApplyJacobian``; a model without them has no gradient, and the error says so.

    Raises
    ------
    UMBridgeError
        The server does not serve ``name`` (the error lists what it serves), or speaks
        another protocol version.
    ConnectionError
        No server answered.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> op = dt.umbridge_op("http://localhost:4242", "forward")  # doctest: +SKIP
    >>> theta = pt.dvector("theta")
    >>> trajectory = op(theta)  # doctest: +SKIP
    """
    if (url is None) == (urls is None):
        raise TypeError("umbridge_op expected a url or urls=[...] (one of them), got "
                        f"url={url!r}, urls={urls!r}")  # fmt: skip
    urls = [url] if url is not None else list(urls or ())  # (one of the two is None)
    if not urls or not all(isinstance(u, str) for u in urls):
        raise TypeError(f"umbridge_op(urls=...) expected a list of urls, got {urls!r}")
    for u in urls:
        _split(u)
    if not isinstance(name, str):
        raise TypeError(f"umbridge_op expected the model's name as a str, got {name!r}")
    config = dict(config or {})
    info = None
    failures = []
    for u in urls:  # the first that answers describes the model
        try:
            info = post(u, "/Info", None, timeout or 10.0)
            break
        except ConnectionError as e:
            failures.append(str(e))
    if info is None:
        raise ConnectionError(f"no UM-Bridge server answered /Info: {'; '.join(failures)}")
    if float(info.get("protocolVersion", 0)) != 1.0:
        raise UMBridgeError("UnsupportedProtocol", f"protocol version "
                            f"{info.get('protocolVersion')!r}, expected 1.0", u, None)  # fmt: skip
    if name not in info.get("models", []):
        raise UMBridgeError("ModelNotFound", f"the server serves {info.get('models')}, "
                            f"not {name!r}", u, None)  # fmt: skip
    support = post(u, "/ModelInfo", {"name": name}, timeout or 10.0, name)["support"]
    sized = {"name": name, "config": config}
    n_in = post(u, "/InputSizes", sized, timeout or 10.0, name)["inputSizes"]
    n_out = post(u, "/OutputSizes", sized, timeout or 10.0, name)["outputSizes"]
    if not support.get("Evaluate", False):
        raise UMBridgeError("UnsupportedFeature", "the model does not support Evaluate",
                            u, name)  # fmt: skip
    import pytensor.tensor as pt

    servers = _Servers(urls, name, timeout)
    itypes = [pt.TensorType("float64", shape=(int(n),)) for n in n_in]
    otypes = [pt.TensorType("float64", shape=(int(n),)) for n in n_out]
    args = (servers, config, len(n_in), len(n_out))
    label = "".join(c if c.isalnum() else "-" for c in name).strip("-").lower() or "model"
    return ArraysToArraysOp(
        Evaluate(*args),
        itypes,
        otypes,
        name=op_name or f"umbridge-{label}",
        vjp=Gradient(*args) if support.get("Gradient", False) else None,
        jvp=ApplyJacobian(*args, n_out) if support.get("ApplyJacobian", False) else None,
    )
