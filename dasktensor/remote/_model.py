"""``RemoteModel``, the public front: options checked once, Ops made, calls delegated.

The work is done elsewhere in this package (see its docstring); this class validates the
options into a :class:`~dasktensor.remote._spec.ModelSpec`, makes the callable Ops whose
function is a :class:`~dasktensor.remote._target.RemoteMethod`, and hands calls and
replica management to ``_calls`` and ``_replicas``.  It pickles as its spec (factory,
options, key, scheduler address), so its Ops can go into ``pm.sample(cores=2)`` (fork or
spawn) and reach the same replicas from there.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from dasktensor._placement import Placement, check_name
from dasktensor.cluster import SchedulerRef
from dasktensor.ops import ArraysToArraysOp, LogpGradOp, LogpOp
from dasktensor.remote._calls import call
from dasktensor.remote._leases import let_go
from dasktensor.remote._replicas import build_counts, holders, owned, release, replica_set
from dasktensor.remote._spec import ModelSpec
from dasktensor.remote._summary import cluster_summary, model_html
from dasktensor.remote._target import RemoteMethod


def _label(text: str) -> str:
    """Letters and dashes only (see ``dasktensor.engine._plan.op_label``)."""
    label = re.sub(r"[^a-z]+", "-", text.lower()).strip("-")
    return label or "model"


def _option(field: str, doc: str) -> property:
    """A read-only attribute of ``RemoteModel``, read from its spec."""
    return property(lambda self: getattr(self._spec, field), doc=doc)


class RemoteModel:
    """A model built once per worker by ``factory()``, whose methods become Ops.

    The factory runs on the workers, once per worker that serves the model: load data,
    weights or a GPU context there.  Calls go straight to a worker holding a replica
    (a fraction of a millisecond on a local network), spread over the replicas; Dask chooses
    the workers (honouring ``resources``) and shows each build as a ``build-<name>``
    task; a replica lost with its worker is rebuilt where Dask has workers.  The workers
    need not import dasktensor (nor PyTensor) for it: only ``dasktensor_worker``.

    Parameters
    ----------
    factory : callable
        ``factory() -> model``, run on a worker.  It travels there with cloudpickle.
    name : str
        Shown on the dashboard (``build-<name>``) and in error messages.
    resources : dict, optional
        Worker resources a replica needs, e.g. ``{"GPU": 1}``; only workers offering
        them build one.  Two models sharing one GPU ask for a part each: ``{"GPU": 0.5}``.
    replicas : int, optional
        How many workers hold the model.  By default every worker offering
        ``resources`` does, including workers that join later.
    concurrency : int
        Calls one replica runs at once (on the threads of its worker's call server);
        1 by default, so the model needs not be thread-safe.
    retries : int
        Times a call that raised is run again before its error reaches the caller.
    timeout : float, optional
        Seconds after which a call fails with ``TimeoutError``.
    scheduler : str or distributed.Client, optional
        The cluster.  By default the process's default Dask client
        (``dt.connect()`` makes one); a forked or unpickled copy reconnects by address.
    workers : str or sequence of str, optional
        Workers (addresses or names) to build the replicas on first, in this order, among
        those offering ``resources``; other workers build them when these are gone (a
        lost replica is rebuilt on the next worker of the list that is alive, else
        anywhere).  ``replicas=1, workers=[a]`` prefers worker ``a``.
    allow_other_workers : bool
        With ``False``, only the workers named in ``workers`` build replicas (Dask's
        meaning of the word): a call with none of them alive fails with
        ``RemoteModelError`` instead of moving elsewhere.  ``True`` by default.
    hold_resources : bool
        Each replica holds ``resources`` while it lives (a ``hold-<name>`` task: no other
        task asking for them runs beside it); ``False``: only while it is built.
    key : str, optional
        The model's identity on its cluster, as hex digits (``dask.base.tokenize`` of
        what defines it).  Models made with the same ``name`` and ``key`` -- in this
        process, in sampler processes, on the workers running ``dt.sample`` -- share one
        set of replicas, and their concurrent calls of a ``@dt.batched`` method run in
        the same batches.  Each such object holds the replicas while it lives: ``close()``
        lets go of its hold only, and the workers drop a replica when no holder is left.
        By default every ``RemoteModel`` is a model of its own (copies made by pickling
        share it).

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> class Normal:
    ...     def __init__(self):
    ...         self.mu = np.zeros(3)  # data, weights... loaded once per worker
    ...     def logp_grad(self, x):
    ...         return -0.5 * float((x - self.mu) @ (x - self.mu)), self.mu - x
    >>> client = dt.connect(n_workers=2, processes=False, dashboard_address=False)
    >>> model = dt.RemoteModel(Normal, name="normal")
    >>> model.call("logp_grad", np.ones(3))
    (-1.5, array([-1., -1., -1.]))
    >>> len(model.start())  # a replica on each worker
    2
    >>> op = model.logp_grad_op("logp_grad", [pt.dvector])
    >>> x = pt.dvector("x")
    >>> f = pytensor.function([x], pytensor.grad(op(x)[0], x))
    >>> f(np.full(3, 2.0))
    array([-2., -2., -2.])
    >>> model.close()
    >>> client.shutdown()
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        name: str = "model",
        resources: dict | None = None,
        replicas: int | None = None,
        concurrency: int = 1,
        retries: int = 0,
        timeout: float | None = None,
        scheduler=None,
        workers=None,
        allow_other_workers: bool = True,
        hold_resources: bool = True,
        key: str | None = None,
    ):
        self._spec = _checked_spec(
            factory,
            name=name,
            resources=resources,
            replicas=replicas,
            concurrency=concurrency,
            retries=retries,
            timeout=timeout,
            scheduler=scheduler,
            workers=workers,
            allow_other_workers=allow_other_workers,
            hold_resources=hold_resources,
            key=key,
        )
        self._hold = owned(self, self._spec)  # made here: its replicas live while it does

    # -- options (read-only: they are the model's identity on the cluster) -----------------

    key = _option("key", "Identity of the model on the cluster; copies made by pickling share it.")
    name = _option("name", "Shown on the dashboard (``build-<name>``) and in error messages.")
    factory = _option("factory", "``factory() -> model``, run on the workers.")
    resources = _option("resources", "Worker resources a replica needs (``{}``: none).")
    replicas = _option("replicas", "How many workers hold the model (None: every eligible one).")
    concurrency = _option("concurrency", "Calls one replica runs at once.")
    retries = _option("retries", "Times a call that raised is run again.")
    timeout = _option("timeout", "Seconds after which a call fails (None: no limit).")
    preferred_workers = _option("workers", "Workers the replicas are built on first (in order).")
    only_workers = _option("only_workers", "Whether replicas live on ``workers`` alone.")
    hold_resources = _option("hold_resources", "Whether replicas hold ``resources`` while alive.")

    def __repr__(self) -> str:
        return repr(self._spec)

    def __getstate__(self):  # a copy made by pickling holds nothing: its creator does
        return {"_spec": self._spec, "_hold": None}

    def _repr_html_(self) -> str:  # Jupyter: options, workers holding replicas, calls so far
        return model_html(self, lambda: cluster_summary(self._spec.client()))

    def __eq__(self, other) -> bool:
        return isinstance(other, RemoteModel) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    # -- Ops --------------------------------------------------------------------------------

    def logp_grad_op(self, method: str, itypes: Sequence, *, name: str | None = None):
        """A :class:`~dasktensor.LogpGradOp` calling ``model.<method>(*arrays) -> (logp, *grads)``.

        Examples
        --------
        >>> import pytensor.tensor as pt
        >>> import dasktensor as dt
        >>> model = dt.RemoteModel(dict, name="normal")
        >>> op = model.logp_grad_op("logp_grad", [pt.dvector])
        >>> op.dasktensor_remote, op.dasktensor_name
        (True, 'normal-logp-grad')
        """
        return LogpGradOp(self.method(method), itypes, name=self._op_name(method, name))

    def logp_op(self, method: str, itypes: Sequence, *, name: str | None = None):
        """A :class:`~dasktensor.LogpOp` calling ``model.<method>(*arrays) -> float``."""
        return LogpOp(self.method(method), itypes, name=self._op_name(method, name))

    def arrays_to_arrays_op(
        self,
        method: str,
        itypes: Sequence,
        otypes: Sequence,
        *,
        name: str | None = None,
        vjp: str | None = None,
        jvp: str | None = None,
    ):
        """An :class:`~dasktensor.ArraysToArraysOp` calling ``model.<method>(*arrays)``.

        ``vjp="method_vjp"`` names the model's vector-Jacobian product,
        ``model.method_vjp(*arrays, *cotangents) -> gradients`` (one cotangent per
        output, one gradient per input), which makes the Op differentiable
        (``pytensor.grad``, NUTS); ``jvp=`` likewise names its Jacobian-vector product,
        for ``pytensor.gradient.Rop``.  Each is a call of its own on a replica: a model
        whose vjp reuses the forward solution keeps it keyed by its inputs: the vjp's
        call goes to the replica that answered the forward call at the same inputs
        while it holds a replica, but that replica may have been lost meanwhile (see
        the user guide's remote-models page).

        Examples
        --------
        >>> import pytensor.tensor as pt
        >>> import dasktensor as dt
        >>> model = dt.RemoteModel(dict, name="ode")
        >>> op = model.arrays_to_arrays_op(
        ...     "solve", [pt.dvector], [pt.dmatrix], vjp="solve_vjp"
        ... )
        >>> op.fn, op.vjp, op.dasktensor_name
        (ode.solve, ode.solve_vjp, 'ode-solve')
        """
        n = len(itypes)
        derived = vjp is not None or jvp is not None
        return ArraysToArraysOp(
            RemoteMethod(self._spec, self._checked(method), solves=n if derived else 0),
            itypes,
            otypes,
            name=self._op_name(method, name),
            vjp=None if vjp is None else RemoteMethod(self._spec, self._checked(vjp), reuses=n),
            jvp=None if jvp is None else RemoteMethod(self._spec, self._checked(jvp), reuses=n),
        )

    def method(self, method: str) -> RemoteMethod:
        """``model.<method>`` as a call target (``RemoteMethod.call_together`` sends several).

        >>> import dasktensor as dt
        >>> dt.RemoteModel(dict, name="table").method("get")
        table.get
        """
        return RemoteMethod(self._spec, self._checked(method))

    def _checked(self, method: str) -> str:
        if not isinstance(method, str) or not method.isidentifier():
            raise TypeError(f"{self!r}: expected a method name, got {method!r}")
        return method

    def _op_name(self, method: str, name: str | None) -> str:
        return _label(name) if name is not None else f"{self.name}-{_label(method)}"

    # -- calls ------------------------------------------------------------------------------

    def call(self, method: str | None, *args):
        """Run ``model.<method>(*args)`` on a replica and return its result.

        ``method=None`` calls the model object itself.  Works from any thread, also while
        an event loop runs in this one (its loop is not used).
        """
        if method is not None and not (isinstance(method, str) and method.isidentifier()):
            raise TypeError(f"{self!r}: expected a method name or None, got {method!r}")
        return call(self._spec, method, args)

    async def acall(self, method: str | None, *args):
        """``await`` form of :meth:`call`, for code running in an event loop."""
        return await asyncio.to_thread(self.call, method, *args)

    # -- replicas ---------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Build the replicas now (else the first call does); returns their workers."""
        return replica_set(self._spec).start()

    def close(self) -> None:
        """Drop the model's replicas from the workers (and this process's connections);
        a model made with ``key=`` lets go of its hold only (see there)."""
        if not self._spec.shared:
            release(self._spec)
        elif self._hold is not None and self._hold.detach() is not None and let_go(self.key):
            release(self._spec)

    def workers(self) -> list[str]:
        """Addresses of the workers that hold a replica now (asks the cluster)."""
        return holders(self._spec)

    def build_counts(self) -> dict[str, int]:
        """How many times ``factory()`` ran on each worker that ever built the model."""
        return build_counts(self._spec)


def _checked_spec(
    factory,
    *,
    name,
    resources,
    replicas,
    concurrency,
    retries,
    timeout,
    scheduler,
    workers,
    allow_other_workers,
    hold_resources,
    key,
) -> ModelSpec:
    """``RemoteModel``'s options, checked, as a :class:`ModelSpec` (a fresh key unless
    ``key`` is given)."""
    if not callable(factory):
        raise TypeError(f"RemoteModel expected a callable factory, got {factory!r}")
    check_name(name, "RemoteModel(name=...)", "it prefixes Dask keys and names the model's Ops")
    placement = Placement.of(
        "RemoteModel",
        resources=resources,
        workers=workers,
        # Placement's rule: allow_other_workers=True needs workers= to prefer
        allow_other_workers=allow_other_workers and workers is not None,
    )
    for option, value, low in (("replicas", replicas, 1), ("concurrency", concurrency, 1)):
        if value is not None and not (isinstance(value, int) and value >= low):
            raise ValueError(f"RemoteModel({option}=...) expected an int >= {low}, got {value!r}")
    if not isinstance(hold_resources, bool):
        raise TypeError(
            f"RemoteModel(hold_resources=...) expected True or False, got {hold_resources!r}"
        )
    if not (isinstance(retries, int) and retries >= 0):
        raise ValueError(f"RemoteModel(retries=...) expected an int >= 0, got {retries!r}")
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(
            f"RemoteModel(timeout=...) expected a number of seconds > 0, got {timeout!r}"
        )
    if key is not None and not (
        isinstance(key, str) and len(key) >= 8 and re.fullmatch(r"[0-9a-f]+", key)
    ):
        raise ValueError(
            "RemoteModel(key=...) expected at least 8 lowercase hex digits (e.g. "
            f"dask.base.tokenize(...) of what defines the model), got {key!r}"
        )
    spec = ModelSpec(
        # identity of the model on the cluster; copies made by pickling share it
        key=f"{name}-{(key or uuid.uuid4().hex)[:16]}",
        name=name,
        factory=factory,
        resources=dict(resources or {}),
        replicas=replicas,
        concurrency=concurrency,
        retries=retries,
        timeout=timeout,
        scheduler=SchedulerRef(scheduler),
        workers=placement.workers,
        only_workers=placement.workers is not None and not placement.allow_other_workers,
        hold_resources=hold_resources,
        shared=key is not None,
    )
    return spec
