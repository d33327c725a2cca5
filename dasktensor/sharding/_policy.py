"""Whether a function is sharded, into how many shards, and what ``print(f.plan)`` says.

The pure decisions of sharded execution (:mod:`dasktensor.sharding._executor`), apart
from running it: the ``shards=`` option, the settings ``dasktensor.shard.min-rows`` (data
worth looking at) and ``dasktensor.shard.min-work`` (work worth a shard), and the cost
rule.  :func:`~dasktensor.sharding._analysis.find_shards` proves that a graph's outputs
are exact sums over data rows; :func:`worth_it` and :func:`n_shards` decide from its
estimate of the work (``ShardPlan.work``, element operations of an evaluation over all
rows) whether that pays: every shard should compute for longer than the call reaching it
takes (~1 ms), so a function with work for fewer than two shards of ``min-work`` is not
sharded, and one with more gets one shard per worker up to ``work / min-work`` shards.
The rule is static -- the graph, the data's size and the number of workers decide, never
a timing -- so the same function on the same cluster always splits the same way (and
sums in the same order).
"""

from __future__ import annotations

import numpy as np

from dasktensor import _config
from dasktensor.sharding._analysis import NotSharded, ShardPlan, find_shards


def check_shards(shards, owner: str = "shards="):
    """``None`` (one shard per worker), ``0`` (off) or a number of shards ``K >= 1``.

    Examples
    --------
    >>> [check_shards(v) for v in (None, True, False, 0, 4)]
    [None, None, 0, 0, 4]
    """
    if shards is None or shards is True:
        return None
    if shards is False:
        return 0
    if isinstance(shards, int | np.integer) and shards >= 0:
        return int(shards)
    raise ValueError(
        f"{owner} expected None (one shard per worker), an int K >= 1 (K shards) or "
        f"False/0 (no sharding), got {shards!r}"
    )


def analyse(fgraph, shards) -> ShardPlan | NotSharded:
    """``find_shards`` (``dasktensor.sharding._analysis``) as the linker runs it, or why not.

    Examples
    --------
    >>> analyse(None, 0)
    NotSharded(reason='turned off (shards=False)')
    """
    if shards == 0:
        return NotSharded("turned off (shards=False)")
    if getattr(fgraph, "update_mapping", None):
        return NotSharded("the function updates shared variables")
    rows, work = min_rows(), min_work()
    try:
        return worth_it(find_shards(fgraph, min_rows=rows), shards, work)
    except Exception as e:  # an analysis error must not break compiling the function
        return NotSharded(f"the analysis failed ({type(e).__name__}: {e})")


def worth_it(plan: ShardPlan | NotSharded, shards, work: float) -> ShardPlan | NotSharded:
    """``plan``, unless the cost estimate leaves fewer than two shards of ``work``
    element operations each (``shards=K`` overrides the estimate)."""
    if not plan or shards or plan.work >= 2 * work:
        return plan
    return NotSharded(
        f"the estimated work of an evaluation, ~{plan.work:.1e} element operations over "
        f"{plan.n_rows} rows, makes fewer than 2 shards of dasktensor.shard.min-work "
        f"({work:.1e}): a call to a shard would cost more than it saves"
    )


def n_shards(plan: ShardPlan, shards, n_workers: int, work: float) -> int:
    """K: ``shards`` if given, else one per worker but at most ``plan.work / work``.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(work=5e7, n_rows=10**6)
    >>> n_shards(plan, None, 8, 1e7), n_shards(plan, None, 2, 1e7), n_shards(plan, 3, 8, 1e7)
    (5, 2, 3)
    """
    k = shards or min(n_workers, int(plan.work // work) if work > 0 else n_workers)
    return max(1, min(k, plan.n_rows))


def min_rows() -> int:
    """``dasktensor.shard.min-rows``, checked."""
    value = _config.get("shard.min-rows")
    if not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"dasktensor.shard.min-rows expected an int >= 1, got {value!r}")
    return int(value)


def block_rows() -> int:
    """``dasktensor.shard.block-rows``, checked (0: a shard runs all its rows at once)."""
    value = _config.get("shard.block-rows")
    if not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"dasktensor.shard.block-rows expected an int >= 0, got {value!r}")
    return int(value)


def min_work() -> float:
    """``dasktensor.shard.min-work``, checked."""
    value = _config.get("shard.min-work")
    if isinstance(value, str):  # YAML reads 1e7 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if not isinstance(value, int | float | np.number) or not value >= 0:
        raise ValueError(
            f"dasktensor.shard.min-work expected a number of element operations >= 0, "
            f"got {value!r}"
        )
    return float(value)


def describe(plan: ShardPlan | NotSharded, shards, now: str | None = None) -> str:
    """What ``print(f.plan)`` says of sharding: over which data, how many shards and why.

    Examples
    --------
    >>> print(describe(NotSharded("no data input with >= 100000 rows"), None))
    not sharded: no data input with >= 100000 rows
    """
    if not plan:
        return f"not sharded: {plan.reason}"
    work = min_work()
    if shards:
        how = f"{shards} shards (shards={shards})"
    elif work > 0:
        how = (
            f"one shard per worker, at most {plan.work // work:.0f} by the estimated work "
            f"(~{plan.work:.1e} element operations, dasktensor.shard.min-work each)"
        )
    else:
        how = "one shard per worker"
    data = ", ".join(f"{d.name} (axis {d.axis})" for d in plan.data)
    params = ", ".join(str(v) for v in plan.param_inputs) or "none"
    kinds = ", ".join(f"{p.kind}{p.variable.type.shape}" for p in plan.partials)
    lines = [
        f"sharded: into {how}, over the {plan.n_rows} rows of {data}",
        (
            "  why: every output is an exact sum over these rows, and they are at least "
            "dasktensor.shard.min-rows"
        ),
        (
            f"  each shard: a resident stage on its own worker holding its rows "
            f"({len(plan.shard_nodes)} nodes); a call sends the parameters ({params}) and "
            f"sums the partial values ({kinds}) here, where the rest runs"
        ),
        "  without a distributed client, or with one worker: unsharded, as planned below",
    ]
    if plan.assumptions:
        lines.append(
            f"  assumed true: {len(plan.assumptions)} check(s) over all rows "
            "(a false one costs a second round)"
        )
    if now:
        lines.append(f"  now: {now}")
    return "\n".join(lines)
