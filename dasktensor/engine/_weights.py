"""Node weights: what the planner keeps alone, what is worth parallel work, what is cheap.

Every node of a graph gets a :class:`Weight`, which :mod:`dasktensor.engine._plan` partitions by:

* **heavy** -- the Op says so (``op.dasktensor_heavy`` is true) or its type was registered
  with :func:`mark_heavy`: the node is always a task of its own;
* **costly** -- the cost rule (:func:`estimated_flops`) reaches the ``heavy_flops``
  threshold: the node is worth running in parallel, but may be fused with neighbours;
* **cheap** -- everything else.

:func:`op_label` turns an Op into the dashboard-friendly prefix of its task keys, and
:func:`is_remote` tells the calls that the caller makes itself (remote model calls).
:func:`work_of` is the other cost rule, the one sharding uses (element operations over
data rows, see :mod:`dasktensor.sharding._policy`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pytensor.graph.basic import Apply

_HEAVY_TYPES: dict[type, str | None] = {}


@dataclass(frozen=True)
class Weight:
    """The weight of one node, and the reason as :meth:`~dasktensor.Plan.describe` shows it.

    Examples
    --------
    >>> w = Weight("costly", "~1.0e+08 flops >= heavy-flops")
    >>> w.kind, w.anchor
    ('costly', True)
    """

    kind: Literal["heavy", "costly", "cheap"]
    reason: str

    @property
    def anchor(self) -> bool:
        """Heavy or costly: the node anchors a task of its own before any fusion."""
        return self.kind != "cheap"


def mark_heavy(op_type: type, name: str | None = None) -> type:
    """Plan every node of an Op type as a task of its own.

    Use it for Ops you do not own (a third-party solver Op, say).  Ops you write can
    instead set the class attribute ``dasktensor_heavy = True`` (and optionally
    ``dasktensor_name`` and ``dasktensor_placement``, a :class:`~dasktensor.Placement`).

    Parameters
    ----------
    op_type : type
        A subclass of ``pytensor.graph.op.Op``.
    name : str, optional
        Prefix of the task keys on the dashboard; letters and dashes, such as
        ``"ode-solve"``.  Defaults to the Op's class name.

    Returns
    -------
    type
        ``op_type``, so that ``mark_heavy`` also works as a class decorator.

    Examples
    --------
    >>> import dasktensor as dt
    >>> from pytensor.graph.op import Op
    >>> @dt.mark_heavy
    ... class Simulate(Op):
    ...     def make_node(self, x): ...
    ...     def perform(self, node, inputs, outputs): ...
    >>> dt.is_heavy(Simulate())
    True
    """
    from pytensor.graph.op import Op

    if not (isinstance(op_type, type) and issubclass(op_type, Op)):
        raise TypeError(f"mark_heavy expected a subclass of pytensor Op, got {op_type!r}")
    _HEAVY_TYPES[op_type] = name
    return op_type


def is_heavy(op) -> bool:
    """Whether the planner gives every node of ``op`` a task of its own.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> import dasktensor as dt
    >>> dt.is_heavy(pt.exp(pt.vector()).owner.op)
    False
    """
    return bool(getattr(op, "dasktensor_heavy", False)) or isinstance(op, tuple(_HEAVY_TYPES))


def op_label(op) -> str:
    """A short dashboard-friendly name: lowercase letters and dashes only.

    ``dask.utils.key_split`` keeps the leading words of a key that are pure letters, so a
    key ``f"{op_label(op)}-3-{token}"`` shows on the dashboard as ``op_label(op)``.
    """
    name = getattr(op, "dasktensor_name", None)
    if name is None:
        for typ, registered in _HEAVY_TYPES.items():
            if isinstance(op, typ) and registered:
                name = registered
                break
    if name is None:
        core_op = getattr(op, "core_op", None)  # Blockwise: name it after what it maps
        name = type(core_op if core_op is not None else op).__name__
    name = _READABLE.get(str(name), str(name))
    words = re.findall(r"[a-z]+", re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name).lower())
    # key_split stops at an 8-letter word that starts with a-f (it takes it for a hex
    # token) and drops the rest of the key: such a word is spelled out, or made longer
    words = [_WORDS.get(w) or (w + "op" if len(w) == 8 and w[0] in "abcdef" else w) for w in words]
    return "-".join(words) or "op"


_READABLE = {"Elemwise": "elementwise", "CAReduce": "reduce", "DimShuffle": "dimshuffle"}
_WORDS = {"elemwise": "elementwise", "careduce": "reduce"}


def dominant_label(nodes: Sequence[Apply]) -> str:
    """The most common :func:`op_label` among ``nodes`` (``"identity"`` if there is none)."""
    if not nodes:
        return "identity"
    return Counter(op_label(n.op) for n in nodes).most_common(1)[0][0]


def is_remote(node: Apply) -> bool:
    """A call that reaches its model itself (``RemoteModel`` Ops): made from the caller."""
    return bool(getattr(node.op, "dasktensor_remote", False))


# ----------------------------------------------------------------------------- cost rule

_PRODUCT_OPS = re.compile(r"Dot|Gemm|Gemv|Ger|MatMul|Matmul|BatchedDot|Dot22", re.ASCII)


def is_product(op) -> bool:
    """Whether ``op`` is a matrix product (``Dot``, BLAS ``Gemv``/``Gemm``, ``MatMul``...),
    or a ``Blockwise`` of one.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> is_product((pt.matrix() @ pt.matrix()).owner.op), is_product(pt.exp(pt.vector()).owner.op)
    (True, False)
    """
    core = getattr(op, "core_op", op)
    return bool(_PRODUCT_OPS.search(type(core).__name__) or _PRODUCT_OPS.search(type(op).__name__))


def estimated_flops(node: Apply) -> float:
    """Floating-point work of ``node`` estimated from static shapes (``nan`` if unknown).

    Matrix products count ``2 * prod(output shape) * k`` with ``k`` the contracted length;
    every other node counts one operation per output element and input.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> a, b = pt.matrix(shape=(10, 20)), pt.matrix(shape=(20, 30))
    >>> estimated_flops((a @ b).owner)
    12000.0
    >>> estimated_flops(pt.exp(pt.vector()).owner)
    nan
    """

    def size(var) -> float:
        shape = getattr(var.type, "shape", None)
        if shape is None or any(s is None for s in shape):
            return math.nan
        return float(math.prod(shape))

    if is_product(node.op):
        out = max((size(o) for o in node.outputs), default=math.nan)
        k = math.nan
        for inp in node.inputs:
            shape = getattr(inp.type, "shape", None)
            if shape and len(shape) >= 2 and shape[-1] is not None:
                k = float(shape[-1])
                break
        return 2.0 * out * k
    out = sum(size(o) for o in node.outputs)
    return out * max(1, len(node.inputs))


def node_weight(node: Apply, heavy_flops: float) -> Weight:
    """The weight of one node under the cost rule's threshold ``heavy_flops``.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> a = pt.matrix(shape=(100, 100))
    >>> node_weight((a @ a).owner, heavy_flops=1e6)
    Weight(kind='costly', reason='~2.0e+06 flops >= heavy-flops')
    >>> node_weight((a @ a).owner, heavy_flops=1e7).kind
    'cheap'
    """
    if is_heavy(node.op):
        return Weight("heavy", "marked heavy")
    flops = estimated_flops(node)
    if flops >= heavy_flops:  # nan compares False
        return Weight("costly", f"~{flops:.1e} flops >= heavy-flops")
    return Weight("cheap", "cheap")


def work_of(node: Apply, elements) -> float:
    """Element operations of one row-aligned node over all rows: the largest row-aligned
    value it reads or makes (``elements(var)``), times 2 for a matrix product (a multiply
    and an add per element of the operand holding the rows), times the scalar operations
    of a fused elementwise node.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> x = pt.matrix("x", shape=(None, 3))
    >>> product = (x @ pt.matrix("b", shape=(3, 1))).owner
    >>> work_of(product, lambda v: 1000.0 * 3 if v is x else 0.0)
    6000.0
    >>> work_of(pt.exp(x).owner, lambda v: 1000.0 * 3)
    3000.0
    """
    largest = max((elements(v) for v in (*node.inputs, *node.outputs)), default=0.0)
    if is_product(node.op):
        return 2.0 * largest
    inner = getattr(getattr(node.op, "scalar_op", None), "fgraph", None)  # a fused Composite
    return largest * (len(inner.apply_nodes) if inner is not None else 1)
