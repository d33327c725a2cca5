"""Concurrent model calls outside the DASK mode.

``pm.sample`` compiles its functions with PyTensor's default mode, which evaluates nodes one
after another: independent model calls would wait for each other.  The rewrite here, in
PyTensor's default rewrite database under the tag ``dasktensor_parallel_calls``, merges
independent calls of dasktensor's callable Ops into one :class:`ParallelCallsOp` node,
which runs them concurrently on one thread pool.  It touches dasktensor's own Ops only.
The DASK mode leaves it out, there every call is a Dask task of its own; except for calls
of remote models, which are made from the caller anyway: a second rewrite (tag
``dasktensor_remote_calls``), which the DASK mode keeps, merges those, so that one task
makes them all at once through the remote-call channel.

Calls are grouped by *level*: a call's level is one more than the highest level among the
calls it depends on.  Calls of one level never depend on each other, so merging them cannot
create a cycle.

``ParallelCallsOp`` knows the callable Ops through their protocol only (named in
``dasktensor.ops._callable``): a member whose ``batch_target`` is set is sent together
with the other members of that target's class, from the calling thread, by the class's
``RemoteCallTarget.call_together`` (for remote models: every request written to the
remote-call channel, then every reply read, no thread per call), and its raw result goes to the
member's ``store_result``; every other member runs its own ``perform`` on the thread pool.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from pytensor.compile.mode import optdb
from pytensor.graph.basic import Apply
from pytensor.graph.features import ReplaceValidate
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import GraphRewriter

from dasktensor import _compat
from dasktensor._runtime import ProcessState, runtime
from dasktensor.ops._callable import RemoteCallTarget, _CallableOp


class _CallPool(ProcessState):
    """The threads that run local calls concurrently (made on first use)."""

    def __init__(self):
        self.pool: ThreadPoolExecutor | None = None
        self.lock = threading.Lock()


def _get_pool() -> ThreadPoolExecutor:
    state = runtime.state(_CallPool)
    with state.lock:
        if state.pool is None:
            state.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="dasktensor-call")
        return state.pool


class ParallelCallsOp(Op):
    """Independent calls of callable Ops, run concurrently as one node.

    Inputs are the calls' inputs one after another, outputs their outputs.  An exception in
    any call is raised with its own type once the others have finished.
    """

    __props__ = ("ops",)
    # in the DASK mode (remote calls only): one task of its own, made from the caller
    dasktensor_heavy = True
    dasktensor_name = "remote-calls"

    def __init__(self, ops):
        _compat.register_python_ops_with_numba(ParallelCallsOp)
        self.ops = tuple(ops)
        self.dasktensor_remote = all(op.dasktensor_remote for op in self.ops)

    def __setstate__(self, state):  # unpickled (a sampler's or a worker's copy): no __init__
        _compat.register_python_ops_with_numba(ParallelCallsOp)
        self.__dict__.update(state)

    def make_node(self, *inputs):
        raise NotImplementedError("ParallelCallsOp nodes are built by the rewrite only")

    def perform(self, node, inputs, output_storage):
        pool = _get_pool()
        jobs, i, o = [], 0, 0
        batches: dict[type[RemoteCallTarget], list] = {}  # by the batch target's class
        for op in self.ops:
            n_in, n_out = len(op.itypes), len(op.otypes)
            # the member's view of the node: its own inputs and outputs
            sub = SimpleNamespace(
                inputs=node.inputs[i : i + n_in], outputs=node.outputs[o : o + n_out]
            )
            member = (op, sub, inputs[i : i + n_in], output_storage[o : o + n_out])
            target = op.batch_target
            if target is not None:  # sent together below, from this thread
                batches.setdefault(type(target), []).append((target, member))
            else:
                jobs.append(pool.submit(op.perform, *member[1:]))
            i, o = i + n_in, o + n_out
        errors: list[BaseException | None] = []
        for kind, members in batches.items():
            try:
                raw = kind.call_together([(target, m[2]) for target, m in members])
                for (_, (op, sub, args, storage)), out in zip(members, raw, strict=True):
                    op.store_result(sub, out, args, storage)
            except Exception as e:  # raised once the other calls are done too
                errors.append(e)
        errors = [job.exception() for job in jobs] + errors
        for error in errors:
            if error is not None:
                raise error

    def __str__(self) -> str:
        return f"ParallelCalls{{{', '.join(str(op) for op in self.ops)}}}"


class MergeIndependentCalls(GraphRewriter):
    """Replace independent callable-Op nodes of one level by one ParallelCallsOp node.

    With ``remote_only``, only calls of remote models are merged.
    """

    def __init__(self, remote_only: bool = False):
        super().__init__()
        self.remote_only = remote_only

    def add_requirements(self, fgraph):
        fgraph.attach_feature(ReplaceValidate())

    def apply(self, fgraph):
        level: dict = {}
        by_level: dict[int, list[Apply]] = {}
        for node in fgraph.toposort():
            above = max((level[i.owner] for i in node.inputs if i.owner in level), default=-1)
            if isinstance(node.op, _CallableOp) and (
                node.op.dasktensor_remote or not self.remote_only
            ):
                level[node] = above + 1
                by_level.setdefault(above + 1, []).append(node)
            elif above >= 0:
                level[node] = above  # passes the level of the calls above it on
        for nodes in by_level.values():
            if len(nodes) < 2:
                continue
            op = ParallelCallsOp([n.op for n in nodes])
            inputs = [i for n in nodes for i in n.inputs]
            outputs = [o.type() for n in nodes for o in n.outputs]
            Apply(op, inputs, outputs)
            old = [o for n in nodes for o in n.outputs]
            fgraph.replace_all_validate(
                list(zip(old, outputs, strict=True)), reason="dasktensor_parallel_calls"
            )


optdb.register(
    "merge_independent_calls",
    MergeIndependentCalls(),
    "fast_run",
    "dasktensor_parallel_calls",
    position=48.5,
)
optdb.register(
    "merge_independent_remote_calls",
    MergeIndependentCalls(remote_only=True),
    "fast_run",
    "dasktensor_remote_calls",
    position=48.6,
)
