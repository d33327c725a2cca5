"""``RemoteMethod``: a remote model's method as the function of a callable Op.

``model.logp_grad_op("logp_grad", itypes)`` makes a ``LogpGradOp`` whose function is
``RemoteMethod(spec, "logp_grad")``.  Being a ``RemoteCallTarget`` (the protocol of
``dasktensor.ops._callable``) makes the Op *remote*: the planner gives it the role
``remote`` (made from the caller), and ``ParallelCallsOp`` sends independent calls
together through :meth:`RemoteMethod.call_together`.

A ``RemoteMethod`` compares and hashes by model key and method, so that Ops of the same
method merge and compare equal, also across pickling; it pickles as the model's spec and
the method name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from dasktensor.ops import RemoteCallTarget
from dasktensor.remote._calls import Combined, call, call_many
from dasktensor.remote._spec import ModelSpec


class RemoteMethod(RemoteCallTarget):
    """``model.<method>`` of a remote model, called on one of its replicas.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> op = dt.RemoteModel(dict, name="table").arrays_to_arrays_op(
    ...     "lookup", [pt.dvector], [pt.dvector]
    ... )
    >>> op.fn, op.fn.batchable, op.dasktensor_remote
    (table.lookup, True, True)
    """

    def __init__(self, spec: ModelSpec, method: str, *, solves: int = 0, reuses: int = 0):
        self.spec = spec
        self.method = method
        self.__name__ = method
        #: the first ``solves`` arguments key a forward solution its vjp may reuse (the
        #: replica that answered is remembered); the vjp's target ``reuses`` them (its
        #: call goes to that replica while it is there)
        self.solves = solves
        self.reuses = reuses

    def affinity(self, args: tuple) -> tuple | None:
        """What this call's replica is chosen by, besides load (see
        ``dasktensor.remote._calls.call``): None, or ``("solves" | "reuses", digest of
        the leading arguments)``."""
        n, role = (self.solves, "solves") if self.solves else (self.reuses, "reuses")
        if not n:
            return None
        digest = hashlib.blake2b(digest_size=16)
        for arg in args[:n]:
            a = np.ascontiguousarray(arg)
            digest.update(f"{a.dtype.str}{a.shape}".encode())
            digest.update(a.tobytes())
        return (role, digest.digest())

    def __call__(self, *args):
        return call(self.spec, self.method, args, affinity=self.affinity(args))

    @property
    def batchable(self) -> bool:
        """Calls of models with a ``timeout`` are made one by one (each is waited for
        with its own timeout)."""
        return self.spec.timeout is None

    @classmethod
    def call_together(cls, calls: Sequence[tuple[RemoteMethod, tuple]]) -> list:
        """All calls at once through the channel (see ``dasktensor.remote._calls``)."""
        return call_many([(t.spec, t.method, args, t.affinity(args)) for t, args in calls])

    @classmethod
    def combined(cls, targets: Sequence[RemoteMethod]) -> Combined:
        """A function ``f(args) -> [result of each target]``: the same call of every
        target, the calls of this process's threads made together, one message per
        target (see ``dasktensor.remote._calls.Combined``).  For targets without
        ``timeout`` or affinity (``batchable``, ``solves``/``reuses`` unset), as the data
        shards of a likelihood are.

        Examples
        --------
        >>> import dasktensor as dt
        >>> halves = [dt.RemoteModel(dict, name=f"half-{h}").method("get") for h in "ab"]
        >>> both = RemoteMethod.combined(halves)  # both((key,)) -> [one's, other's]
        >>> slow = dt.RemoteModel(dict, name="slow", timeout=5).method("get")
        >>> RemoteMethod.combined([slow])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: RemoteMethod.combined expected targets without timeout or affinity, ...
        """
        for t in targets:
            if not t.batchable or t.solves or t.reuses:
                raise ValueError(
                    "RemoteMethod.combined expected targets without timeout or affinity, "
                    f"got {t!r} (timeout={t.spec.timeout}, solves={t.solves}, "
                    f"reuses={t.reuses})"
                )
        return Combined([(t.spec, t.method) for t in targets])

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, RemoteMethod)
            and other.spec == self.spec
            and other.method == self.method
            and (other.solves, other.reuses) == (self.solves, self.reuses)
        )

    def __hash__(self) -> int:
        return hash((self.spec.key, self.method, self.solves, self.reuses))

    def __repr__(self) -> str:
        return f"{self.spec.name}.{self.method}"
