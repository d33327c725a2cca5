"""Ops wrapping Python callables: model calls that the planner runs as tasks of their own.

``ArraysToArraysOp`` (arrays in, arrays out; a gradient through a ``vjp`` when given),
``LogpOp`` (arrays in, a scalar log-density out, no gradient) and ``LogpGradOp`` (a
function returning the log-density and its gradients).  ``LogpGradOp`` outputs
``[logp, *grads]`` and its gradient reuses the node's own outputs, so one evaluation of logp
and dlogp is ONE call of the function (a two-Op design makes two).

Each Op is heavy (a task of its own, named ``name`` on the dashboard) and carries Dask
annotations (``resources``, ``retries``, ``priority``) and an optional ``timeout``.
Inputs pass through ``pt.as_tensor_variable`` (``op(2)`` works) and are checked against
``itypes`` when the graph is built; results are checked against the declared outputs when
the function runs.

**The protocol with the modules above this one.**  This module imports neither
``dasktensor.ops._parallel_calls`` nor ``dasktensor.remote``; both build on two names here:

* :meth:`_CallableOp.store_result` ``(node, raw, inputs, output_storage)``: turns what the
  function returned into the node's outputs (converted, checked, stored).  Whoever makes
  the call itself (``ParallelCallsOp``, for calls it sends together) hands the raw result
  to it.
* :class:`RemoteCallTarget`: the base class of a *function* that reaches its model
  elsewhere (a ``RemoteModel`` method).  A callable Op with such a function has
  ``dasktensor_remote = True`` (the planner gives it the role ``remote``: made from the
  caller, not as a cluster task), and :attr:`_CallableOp.batch_target` offers the target
  to ``ParallelCallsOp``, which makes the calls of one kind of target at once with
  :meth:`RemoteCallTarget.call_together`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, grad_not_implemented
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor.type import TensorType

from dasktensor import _compat
from dasktensor._placement import Placement, check_name


def _as_types(types, what: str) -> tuple[TensorType, ...]:
    types = tuple(types)
    for t in types:
        if not isinstance(t, TensorType):
            raise TypeError(
                f"{what} expected PyTensor tensor types such as pt.dvector or "
                f"pt.TensorType('float64', shape=(3,)), got {t!r}"
            )
    return types


class RemoteCallTarget:
    """Base class of call targets that reach a model elsewhere (not in this process).

    A callable Op whose function is a ``RemoteCallTarget`` is *remote*: its calls are made
    from the caller (they wait on the network, not on a core), and independent ones may be
    sent together.  Subclasses implement ``__call__(*args)`` (one call, the model's raw
    result) and :meth:`call_together`; ``dasktensor.remote.RemoteMethod`` is one.

    Examples
    --------
    >>> class Echo(RemoteCallTarget):
    ...     def __call__(self, *args):
    ...         return args
    >>> Echo.call_together([(Echo(), (1,)), (Echo(), (2, 3))])
    [(1,), (2, 3)]
    """

    #: read by the planner (``dasktensor.engine._plan``) through the Op
    dasktensor_remote = True

    @property
    def batchable(self) -> bool:
        """Whether this target's calls may go in one :meth:`call_together` (True here)."""
        return True

    @classmethod
    def call_together(cls, calls: Sequence[tuple[RemoteCallTarget, tuple]]) -> list:
        """Make the calls ``[(target, args), ...]`` at once; their raw results, in order.

        The default makes them one after another; subclasses send them together.  An
        error is raised once every call is done.
        """
        return [target(*args) for target, args in calls]

    def __call__(self, *args):  # pragma: no cover - an abstract method
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")


class _CallableOp(Op):
    """Common machinery: input checks, annotations, output checks."""

    dasktensor_heavy = True
    __props__: tuple[str, ...] = (
        "fn", "itypes", "otypes", "dasktensor_name", "dasktensor_placement", "timeout",
    )  # fmt: skip
    # always given (Op declares them optional): tensor types, checked by _as_types
    itypes: tuple[TensorType, ...]
    otypes: tuple[TensorType, ...]

    def __init__(
        self,
        fn: Callable,
        itypes: Sequence[TensorType],
        otypes: Sequence[TensorType],
        *,
        name: str,
        resources=None,
        retries=None,
        priority=None,
        timeout=None,
    ):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__} expected a callable, got {fn!r}")
        _compat.register_python_ops_with_numba(_CallableOp)
        owner = type(self).__name__
        check_name(name, f"{owner}(name=...)")
        self.fn = fn
        #: the function reaches its model itself (a RemoteModel method): run on the caller
        self.dasktensor_remote = isinstance(fn, RemoteCallTarget)
        self.itypes = _as_types(itypes, f"{type(self).__name__}(itypes=...)")
        self.otypes = _as_types(otypes, f"{type(self).__name__}(otypes=...)")
        self.dasktensor_name = name
        self.dasktensor_placement = Placement.of(
            owner, resources=resources, retries=retries, priority=priority
        )
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise TypeError(
                f"{type(self).__name__}(timeout=...) expected a number of seconds > 0, "
                f"got {timeout!r}"
            )
        self.timeout = timeout

    def __setstate__(self, state):  # unpickled (a sampler's or a worker's copy): no __init__
        _compat.register_python_ops_with_numba(_CallableOp)
        self.__dict__.update(state)

    def __str__(self) -> str:
        return f"{type(self).__name__}{{{getattr(self.fn, '__name__', self.fn)}}}"

    def make_node(self, *inputs) -> Apply:
        if len(inputs) != len(self.itypes):
            raise TypeError(f"{self} expected {len(self.itypes)} inputs, got {len(inputs)}")
        checked = [self._check_input(i, x) for i, x in enumerate(inputs)]
        return Apply(self, checked, [t() for t in self.otypes])

    def _check_input(self, i: int, x):
        want = self.itypes[i]
        x = pt.as_tensor_variable(x)
        if x.ndim != want.ndim:
            raise TypeError(
                f"{self} input {i} expected {want} ({want.ndim} dimensions), got {x.type} "
                f"({x.ndim} dimensions)"
            )
        if x.dtype != want.dtype:
            if not np.can_cast(x.dtype, want.dtype, casting="same_kind"):
                raise TypeError(
                    f"{self} input {i} expected dtype {want.dtype}, got {x.dtype}; "
                    f"cast it explicitly (pt.cast(x, {want.dtype!r}))"
                )
            x = pt.cast(x, want.dtype)
        for axis, (have, need) in enumerate(zip(x.type.shape, want.shape, strict=True)):
            if have is not None and need is not None and have != need:
                raise TypeError(
                    f"{self} input {i} expected shape {want.shape}, got {x.type.shape} "
                    f"(axis {axis})"
                )
        if x.type.shape != want.shape and any(s is not None for s in want.shape):
            x = pt.specify_shape(x, want.shape)  # the declared static shape, checked at run
        return x

    def _check_outputs(self, results, node, inputs) -> list[np.ndarray]:
        outs = []
        for j, (value, var) in enumerate(zip(results, node.outputs, strict=True)):
            arr = np.asarray(value, dtype=var.dtype)
            if not arr.flags.writeable or any(np.may_share_memory(arr, x) for x in inputs):
                # PyTensor owns a node's outputs and may overwrite them in place later
                arr = arr.copy()
            want = var.type
            if arr.ndim != want.ndim or any(
                need is not None and have != need
                for have, need in zip(arr.shape, want.shape, strict=True)
            ):
                raise ValueError(
                    f"{self} output {j}: {getattr(self.fn, '__name__', 'fn')} returned an "
                    f"array of shape {arr.shape}, expected {want} with shape {want.shape}"
                    + _wrapped_hint(value, want)
                )
            outs.append(arr)
        return outs

    def _convert(self, out) -> tuple:
        """The tuple of outputs from what ``fn`` returned."""
        return (out,)

    @property
    def batch_target(self) -> RemoteCallTarget | None:
        """The function, if its calls may be sent together with others (see
        :class:`RemoteCallTarget`); None for local functions and for Ops with a timeout."""
        fn = self.fn
        if isinstance(fn, RemoteCallTarget) and fn.batchable and self.timeout is None:
            return fn
        return None

    def _call(self, inputs):
        """``fn(*inputs)``, within ``timeout``: the raw result."""
        if self.timeout is None:
            return self.fn(*inputs)
        box: dict = {}

        def target():
            try:
                box["value"] = self.fn(*inputs)
            except BaseException as e:  # handed to the caller below
                box["error"] = e

        thread = threading.Thread(target=target, daemon=True, name=f"{self.dasktensor_name}")
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise TimeoutError(
                f"{self}: {getattr(self.fn, '__name__', 'fn')} did not return within "
                f"{self.timeout:g} s (it goes on in a background thread; its result will be "
                "dropped)"
            )
        if "error" in box:
            raise box["error"]
        return box["value"]

    def perform(self, node, inputs, output_storage):
        self.store_result(node, self._call(inputs), inputs, output_storage)

    def store_result(self, node, raw, inputs, output_storage) -> None:
        """Put what ``fn(*inputs)`` returned (``raw``) in the node's output storage.

        Converts ``raw`` to the Op's outputs (``(logp, *grads)`` for a ``LogpGradOp``...),
        checks their number, dtypes and shapes against ``node.outputs``, and copies an
        array that is read-only or shares memory with an input.  ``node`` needs only
        ``inputs`` and ``outputs`` (a member's view of a merged node will do).
        """
        results = self._convert(raw)
        if len(results) != len(node.outputs):
            raise ValueError(
                f"{self}: {getattr(self.fn, '__name__', 'fn')} returned {len(results)} "
                f"value(s), expected {len(node.outputs)}"
            )
        for storage, value in zip(
            output_storage, self._check_outputs(results, node, inputs), strict=True
        ):
            storage[0] = value

    def _no_gradient(self, inputs, outputs, cotangents):
        return [grad_not_implemented(self, i, x) for i, x in enumerate(inputs)]

    if _compat.PYTENSOR_3:
        pullback = _no_gradient
    else:
        L_op = _no_gradient


def _wrapped_hint(value, want) -> str:
    """What to return instead, when a function returned its one output in a list or
    tuple (``[out]``, as pytensor-federated's functions do) and ``out`` would fit."""
    if not isinstance(value, list | tuple) or len(value) != 1:
        return ""
    inner = np.shape(value[0])
    if len(inner) != want.ndim or any(
        need is not None and have != need for have, need in zip(inner, want.shape, strict=True)
    ):
        return ""
    kind = type(value).__name__
    return (
        f"; it looks like the output wrapped in a {kind} of one: return the array itself "
        f"(`return out`, not `return [out]`)"
    )


class ArraysToArraysOp(_CallableOp):
    """Arrays in, arrays out, through a Python function; differentiable given a ``vjp``.

    Parameters
    ----------
    fn : callable
        ``fn(*arrays) -> array or tuple of arrays``, one per ``otypes``.
    itypes, otypes : sequence of TensorType
        Types of the inputs and outputs, e.g. ``[pt.dvector]``.
    name : str
        Prefix of the task keys on the dashboard (letters and dashes).
    vjp : callable, optional
        The vector-Jacobian product: ``vjp(*arrays, *cotangents) -> gradients``, the
        Op's inputs followed by one cotangent per output (shaped like it; zeros for an
        output the cost does not depend on), returning one gradient per input (shaped
        like it; the array itself for one input).  With it, ``pytensor.grad`` works
        through the Op (NUTS, ``pm.sample``): the vjp is an Op of its own (named
        ``name + "-vjp"``, a call of its own, placed as the forward one).
    jvp : callable, optional
        The Jacobian-vector product, for ``pytensor.gradient.Rop``: ``jvp(*arrays,
        *tangents) -> output tangents``, one tangent per input, one result per output.
    resources, retries, priority
        Dask annotations of the call's task (``resources={"GPU": 1}``...); ``retries``
        re-runs a call that raised (a timeout included).
    timeout : float, optional
        Seconds after which a call fails with ``TimeoutError``.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> simulate = dt.ArraysToArraysOp(np.cumsum, [pt.dvector], [pt.dvector])
    >>> f = dt.function([x := pt.dvector("x")], simulate(x) * 2)
    >>> f([1.0, 2.0, 3.0]).tolist()
    [2.0, 6.0, 12.0]

    With its vjp (the cotangent summed from the back: the transpose of ``cumsum``'s
    Jacobian), the Op has a gradient:

    >>> def cumsum_vjp(x, g):
    ...     return np.cumsum(g[::-1])[::-1]
    >>> simulate = dt.ArraysToArraysOp(np.cumsum, [pt.dvector], [pt.dvector], vjp=cumsum_vjp)
    >>> cost = (simulate(x) ** 2).sum()
    >>> g = dt.function([x], pytensor.grad(cost, x))
    >>> g([1.0, 2.0, 3.0]).tolist()
    [20.0, 18.0, 12.0]
    """

    __props__ = (*_CallableOp.__props__, "vjp", "jvp")
    __str__ = _CallableOp.__str__  # (PyTensor 2 makes one from __props__ otherwise)

    def __init__(
        self, fn, itypes, otypes, *, name="arrays-remote", vjp=None, jvp=None, **annotations
    ):
        super().__init__(fn, itypes, otypes, name=name, **annotations)
        for what, given in (("vjp", vjp), ("jvp", jvp)):
            if given is not None and not callable(given):
                raise TypeError(
                    f"{type(self).__name__}({what}=...) expected a callable, got {given!r}"
                )
        if vjp is not None or jvp is not None:
            for i, t in enumerate((*self.itypes, *self.otypes)):
                if not t.dtype.startswith("float"):
                    side = "input" if i < len(self.itypes) else "output"
                    raise TypeError(
                        f"{type(self).__name__} with a vjp or jvp: every input and output "
                        f"must be floating point to have a derivative, got {side} {t}"
                    )
        self.vjp = vjp
        self.jvp = jvp
        self._annotations = annotations

    def _convert(self, out) -> tuple:
        if len(self.otypes) == 1:
            return (out,)
        return tuple(out)

    def _derivative_op(self, fn, suffix: str, extra, otypes) -> ArraysToArraysOp:
        """The Op calling ``fn`` (the vjp or jvp) on the inputs and ``extra`` arrays."""
        return ArraysToArraysOp(
            fn, (*self.itypes, *extra), otypes, name=f"{self.dasktensor_name}-{suffix}",
            **self._annotations,
        )  # fmt: skip

    def _pullback(self, inputs, outputs, cotangents):
        if self.vjp is None:
            return self._no_gradient(inputs, outputs, cotangents)
        cotangents = [
            pt.zeros_like(out) if isinstance(g.type, DisconnectedType) else g
            for out, g in zip(outputs, cotangents, strict=True)
        ]
        op = _VjpOp(
            self.vjp, (*self.itypes, *self.otypes), self.itypes,
            name=f"{self.dasktensor_name}-vjp", transpose=self.jvp, **self._annotations,
        )  # fmt: skip
        grads = op(*inputs, *cotangents)
        return list(grads) if isinstance(grads, list | tuple) else [grads]

    def _pushforward(self, inputs, tangents):
        if self.jvp is None:
            raise NotImplementedError(
                f"{self} has no jvp: give jvp=... (the Jacobian-vector product) for "
                "pytensor.gradient.Rop"
            )
        tangents = [
            pt.zeros_like(x) if t is None or isinstance(t.type, DisconnectedType) else t
            for x, t in zip(inputs, tangents, strict=True)
        ]
        op = self._derivative_op(self.jvp, "jvp", self.itypes, self.otypes)
        out = op(*inputs, *tangents)
        return list(out) if isinstance(out, list | tuple) else [out]

    if _compat.PYTENSOR_3:
        pullback = _pullback

        def pushforward(self, inputs, outputs, tangents):
            return self._pushforward(inputs, tangents)

    else:
        L_op = _pullback

        def R_op(self, inputs, eval_points):
            return self._pushforward(inputs, eval_points)


class _VjpOp(ArraysToArraysOp):
    """The vjp of an :class:`ArraysToArraysOp`: ``(x, g) -> J(x)^T g``.

    Linear in the cotangents ``g``, so its own vjp with respect to them is ``J(x) c``:
    the forward Op's jvp (``transpose``), when it has one.  PyTensor's ``Rop`` (and
    ``pushforward``) takes that road by default (two pullbacks, the second through
    this Op); second derivatives with respect to ``x`` are not offered.
    """

    __props__ = (*ArraysToArraysOp.__props__, "transpose")

    def __str__(self) -> str:  # named as its task: <forward name>-vjp
        return f"{self.dasktensor_name}{{{getattr(self.fn, '__name__', self.fn)}}}"

    def __init__(self, fn, itypes, otypes, *, name, transpose=None, **annotations):
        super().__init__(fn, itypes, otypes, name=name, **annotations)
        self.transpose = transpose

    def _check_outputs(self, results, node, inputs) -> list[np.ndarray]:
        outs = super()._check_outputs(results, node, inputs)
        # one gradient per forward input (the cotangents follow them in inputs)
        for i, (grad, x) in enumerate(zip(outs, inputs[: len(outs)], strict=True)):
            if grad.shape != np.shape(x):
                raise ValueError(
                    f"{self}: the vjp {getattr(self.fn, '__name__', 'fn')} returned a "
                    f"gradient of shape {grad.shape} for input {i}, expected the input's "
                    f"shape {np.shape(x)}"
                )
        return outs

    def _pullback(self, inputs, outputs, cotangents):
        n = len(self.otypes)  # the forward Op's inputs, first
        if self.transpose is None:
            return self._no_gradient(inputs, outputs, cotangents)
        cotangents = [
            pt.zeros_like(out) if isinstance(c.type, DisconnectedType) else c
            for out, c in zip(outputs, cotangents, strict=True)
        ]
        xs = inputs[:n]
        jvp = ArraysToArraysOp(
            self.transpose, (*self.otypes, *self.otypes), self.itypes[n:],
            name=self.dasktensor_name.removesuffix("-vjp") + "-jvp", **self._annotations,
        )  # fmt: skip
        out = jvp(*xs, *cotangents)
        tangents = list(out) if isinstance(out, list | tuple) else [out]
        missing = [grad_not_implemented(self, i, x) for i, x in enumerate(xs)]
        return missing + tangents

    if _compat.PYTENSOR_3:
        pullback = _pullback
    else:
        L_op = _pullback


class LogpOp(_CallableOp):
    """A scalar log-density through a Python function; no gradient.

    Parameters
    ----------
    fn : callable
        ``fn(*arrays) -> float``.
    itypes : sequence of TensorType
        Types of the inputs.
    name, resources, retries, priority, timeout
        As for :class:`ArraysToArraysOp`.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> logp = dt.LogpOp(lambda x: -0.5 * float(x @ x), [pt.dvector])
    >>> float(dt.function([x := pt.dvector("x")], logp(x))([1.0, 2.0]))
    -2.5
    """

    def __init__(self, fn, itypes, *, name="logp-remote", **annotations):
        super().__init__(fn, itypes, [pt.dscalar], name=name, **annotations)


class LogpGradOp(_CallableOp):
    """A log-density and its gradient from one Python function; differentiable.

    The Op outputs ``[logp, *grads]``; ``pytensor.grad`` of ``logp`` reuses the node's
    gradient outputs, so logp and dlogp together cost one call of ``fn``.

    Parameters
    ----------
    fn : callable
        ``fn(*arrays) -> (logp, *grads)``, one gradient per input, shaped like it.
    itypes : sequence of TensorType
        Types of the inputs (floating point).
    name, resources, retries, priority, timeout
        As for :class:`ArraysToArraysOp`.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> def normal(x):
    ...     return -0.5 * float(x @ x), -x
    >>> op = dt.LogpGradOp(normal, [pt.dvector])
    >>> x = pt.dvector("x")
    >>> logp = op(x)[0]
    >>> f = dt.function([x], [logp, pytensor.grad(logp, x)])
    >>> [np.asarray(v).tolist() for v in f([1.0, 2.0])]
    [-2.5, [-1.0, -2.0]]
    """

    def __init__(self, fn, itypes, *, name="logp-grad-remote", **annotations):
        itypes = _as_types(itypes, "LogpGradOp(itypes=...)")
        for i, t in enumerate(itypes):
            if not t.dtype.startswith("float"):
                raise TypeError(
                    f"LogpGradOp input {i} must be floating point to have a gradient, got {t}"
                )
        super().__init__(fn, itypes, [pt.dscalar, *itypes], name=name, **annotations)

    def _convert(self, out) -> tuple:
        if not isinstance(out, tuple | list):
            raise ValueError(
                f"{self}: {getattr(self.fn, '__name__', 'fn')} must return (logp, *grads), "
                f"got {type(out).__name__}"
            )
        return tuple(out)

    def _vjp(self, inputs, outputs, cotangents):
        for j, g in enumerate(cotangents[1:], start=1):
            if not isinstance(g.type, DisconnectedType):
                raise NotImplementedError(
                    f"{self} provides first derivatives only; output {j} (a gradient) was "
                    "differentiated again"
                )
        g_logp = cotangents[0]
        return [g_logp * grad for grad in outputs[1:]]

    if _compat.PYTENSOR_3:
        pullback = _vjp
    else:
        L_op = _vjp


def logp_grad_op(fn=None, /, *, itypes, name="logp-grad-remote", **annotations):
    """Decorator form of :class:`LogpGradOp`.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> @dt.logp_grad_op(itypes=[pt.dvector], retries=2)
    ... def normal(x):
    ...     return -0.5 * float(x @ x), -x
    >>> normal.dasktensor_placement
    Placement(retries=2)
    """

    def wrap(f):
        return LogpGradOp(f, itypes, name=name, **annotations)

    return wrap if fn is None else wrap(fn)


def logp_op(fn=None, /, *, itypes, name="logp-remote", **annotations):
    """Decorator form of :class:`LogpOp` (see :func:`logp_grad_op`)."""

    def wrap(f):
        return LogpOp(f, itypes, name=name, **annotations)

    return wrap if fn is None else wrap(fn)


def arrays_to_arrays_op(
    fn=None, /, *, itypes, otypes, name="arrays-remote", vjp=None, jvp=None, **annotations
):
    """Decorator form of :class:`ArraysToArraysOp` (see :func:`logp_grad_op`); ``vjp=``
    and ``jvp=`` give it derivatives.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> def scale_vjp(x, g):
    ...     return 3.0 * g
    >>> @dt.arrays_to_arrays_op(itypes=[pt.dvector], otypes=[pt.dvector], vjp=scale_vjp)
    ... def scale(x):
    ...     return 3.0 * x
    >>> scale.vjp is scale_vjp
    True
    """

    def wrap(f):
        return ArraysToArraysOp(f, itypes, otypes, name=name, vjp=vjp, jvp=jvp, **annotations)

    return wrap if fn is None else wrap(fn)
