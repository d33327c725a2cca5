"""The planner is pure: these tests build graphs and inspect plans, without Dask."""

from __future__ import annotations

import pytensor.tensor as pt
import pytest
from _ops import Scale
from dask.utils import key_split
from pytensor.graph.fg import FunctionGraph

import dasktensor as dt
from dasktensor.engine._plan import (
    anchors_around,
    colour,
    fuse_caller_stages,
    fuse_chains,
    make_plan,
    op_label,
)
from dasktensor.engine._weights import Weight, node_weight


def plan_of(inputs, outputs, **kwargs):
    return dt.plan_graph(FunctionGraph(inputs, outputs, clone=True), **kwargs)


def test_graph_without_heavy_nodes_is_one_stage():
    x = pt.vector("x")
    y = x
    for i in range(200):
        y = pt.exp(y) * 0.5 + i
    plan = plan_of([x], [y.sum()])
    assert plan.single_stage
    assert plan.tasks[0].where == "caller"
    assert len(plan.tasks[0].nodes) == len(plan.fgraph.apply_nodes)
    assert "nothing to run in parallel" in str(plan)


def test_thousand_cheap_nodes_and_four_heavy_ones_make_a_handful_of_tasks():
    x = pt.vector("x")
    h = x
    for i in range(500):
        h = pt.tanh(h) + i
    branches = []
    for k in range(4):
        b = Scale(k + 1.0)(h + k)
        for i in range(120):
            b = b * 1.001 + i
        branches.append(b.sum())
    plan = plan_of([x], [sum(branches)])
    assert len(plan.fgraph.apply_nodes) > 1000
    kinds = [t.kind for t in plan.tasks]
    assert kinds.count("heavy") == 4
    assert len(plan.tasks) <= 10
    # every heavy node is alone in its task, and the cheap work runs on the caller
    for t in plan.tasks:
        if t.kind == "heavy":
            assert len(t.nodes) == 1 and t.where == "cluster"
        else:
            assert t.where == "caller"


def test_tasks_form_an_acyclic_graph_covering_every_node_once():
    x = pt.vector("x")
    a = Scale(2.0)(x)
    b = Scale(3.0)(pt.exp(x) + a)  # depends on a: a chain through cheap nodes
    c = Scale(4.0)(pt.sin(x))
    out = (a + b).sum() + c.sum() + pt.exp(a).sum()
    plan = plan_of([x], [out])
    seen = [n for t in plan.tasks for n in t.nodes]
    assert sorted(map(id, seen)) == sorted(map(id, plan.fgraph.apply_nodes))
    for t in plan.tasks:
        assert all(d < t.index for d in t.deps)  # tasks are listed in topological order


def test_cheap_stage_between_two_heavy_calls_runs_on_the_cluster():
    x = pt.vector("x")
    a = Scale(2.0)(x)
    b = Scale(3.0)(pt.exp(a) + 1)
    plan = plan_of([x], [b.sum()])
    between = [
        t for t in plan.tasks if t.kind == "stage" and t.reason.startswith("cheap nodes between")
    ]
    assert len(between) == 1 and between[0].where == "cluster"


def test_costly_matmul_branches_become_one_task_each():
    x = pt.matrix("x", shape=(300, 300))
    ws = [[pt.matrix(f"w{b}{i}", shape=(300, 300)) for i in range(3)] for b in range(4)]
    outs = []
    for chain in ws:
        h = x
        for w in chain:
            h = pt.tanh(h @ w)
        outs.append(h.sum())
    inputs = [x, *[w for chain in ws for w in chain]]
    plan = plan_of(inputs, [sum(outs)], heavy_flops=1e7)
    work = [t for t in plan.tasks if t.where == "cluster"]
    assert len(work) == 4, plan
    assert all(t.name.startswith("work-") for t in work)
    # the same graph with small matrices has nothing worth parallelising
    assert plan_of(inputs, [sum(outs)], heavy_flops=1e12).single_stage


def test_a_single_costly_chain_stays_in_process():
    x = pt.matrix("x", shape=(300, 300))
    w = pt.matrix("w", shape=(300, 300))
    plan = plan_of([x, w], [pt.tanh(pt.tanh(x @ w) @ w).sum()], heavy_flops=1e7)
    assert plan.single_stage
    assert "one chain" in plan.tasks[0].reason


def test_keys_split_into_readable_prefixes():
    x = pt.vector("x")
    plan = plan_of([x], [Scale()(pt.exp(x)).sum()])
    names = {t.name for t in plan.tasks}
    assert "scale-heavy" in names and "stage-elementwise" in names
    for t in plan.tasks:
        key = f"{t.name}-{t.index}-0123456789abcdef0123456789abcdef"
        assert key_split(key) == t.name


def test_op_label_uses_letters_only():
    x = pt.matrix("x")
    assert op_label((x @ x).owner.op) in {"dot", "matmul", "blockwise"}
    assert op_label(Scale()) == "scale-heavy"


@pytest.mark.parametrize(
    "name, label",
    [
        ("FusedElemwise", "fused-elementwise"),  # PyTensor 3's stage names
        ("ScalarCAReduce", "scalar-reduce"),
        ("ScalarizedElemwise", "scalarized-elementwise"),
        ("deadbeef model", "deadbeefop-model"),
        ("abcdefghi", "abcdefghi"),  # 9 letters: not taken for a token
    ],
)
def test_op_label_survives_key_split(name, label):
    op = type("Named", (), {"dasktensor_name": name})()
    assert op_label(op) == label
    assert key_split(f"stage-{label}-3-0123456789abcdef0123456789abcdef") == f"stage-{label}"


def test_mark_heavy_registers_third_party_ops():
    from pytensor.tensor.math import Argmax

    x = pt.matrix("x")
    out = pt.argmax(x, axis=0)
    assert plan_of([x], [out]).single_stage
    dt.mark_heavy(Argmax, name="argmax-heavy")
    try:
        plan = plan_of([x], [out + 1])
        assert [t.name for t in plan.tasks if t.kind == "heavy"] == ["argmax-heavy"]
    finally:
        from dasktensor.engine._plan import _HEAVY_TYPES

        del _HEAVY_TYPES[Argmax]


def test_mark_heavy_rejects_non_ops():
    with pytest.raises(TypeError, match="expected a subclass of pytensor Op"):
        dt.mark_heavy(int)


def test_destroyed_inputs_are_reported_for_copying():
    import pytensor

    x = pt.vector("x")
    a = Scale()(x)
    y = pt.inc_subtensor(a[:2], 1.0)  # inc_subtensor becomes in place after rewriting
    f = dt.function([x], [y, a * 2], scheduler="sync")
    stage_inputs = [
        (t, [t.inputs[i] for i in t.destroyed_inputs]) for t in f.plan.tasks if t.destroyed_inputs
    ]
    assert stage_inputs, f.plan
    import numpy as np

    got = f(np.arange(3.0))
    want = pytensor.function([x], [y, a * 2])(np.arange(3.0))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w)


def test_describe_lists_every_node_of_every_task():
    x = pt.vector("x")
    plan = plan_of([x], [(Scale()(pt.exp(x)) + 1).sum()])
    text = plan.describe(nodes=True)
    for node in plan.fgraph.apply_nodes:
        assert str(node) in text


def test_caller_work_independent_of_the_cluster_gets_its_own_stage():
    x = pt.vector("x")
    side = x
    for i in range(20):
        side = pt.cos(side) + i
    plan = plan_of([x], [Scale()(pt.exp(x)).sum() + side.sum()])
    reasons = [t.reason for t in plan.tasks if t.where == "caller"]
    assert any(r.startswith("cheap nodes beside") for r in reasons), plan
    assert any(r.startswith("cheap nodes before") for r in reasons), plan
    (heavy,) = [t for t in plan.tasks if t.kind == "heavy"]
    (beside,) = [t for t in plan.tasks if t.reason.startswith("cheap nodes beside")]
    assert beside.index not in heavy.deps


# ----------------------------------------------------------------------------- the steps


def graph_nodes(inputs, outputs):
    """A graph of the given variables themselves (not clones) and its nodes in order."""
    fgraph = FunctionGraph(inputs, outputs, clone=False)
    return fgraph, fgraph.toposort()


def as_sets(blocks):
    return {frozenset(block) for block in blocks}


def in_node_order(blocks, nodes):
    position = {n: i for i, n in enumerate(nodes)}
    firsts = [position[block[0]] for block in blocks]
    return firsts == sorted(firsts) and all(
        [position[n] for n in block] == sorted(position[n] for n in block) for block in blocks
    )


def test_anchor_pass_on_a_tiny_dag():
    # 0 -> 1 -> 3 -> 5 and 0 -> 2 -> 3; 4 stands apart; the anchors are 1, 2 and 5
    preds = [(), (0,), (0,), (1, 2), (), (3,)]
    above, below = anchors_around(range(6), preds, {1, 2, 5}.__contains__)
    assert [set(above[i]) for i in range(6)] == [set(), set(), set(), {1, 2}, set(), {1, 2}]
    assert [set(below[i]) for i in range(6)] == [{1, 2, 5}, {5}, {5}, {5}, set(), set()]
    # the same DAG given as a mapping, in another topological order
    order = [4, 0, 2, 1, 3, 5]
    above2, below2 = anchors_around(order, dict(enumerate(preds)), {1, 2, 5}.__contains__)
    assert above2 == above and below2 == below


def test_colour_groups_cheap_nodes_by_their_anchors_above_and_below():
    x = pt.vector("x")
    a, b = pt.exp(x), pt.sin(x)  # no anchor above, the heavy node below: one colour
    s = a + b
    h = Scale()(s)
    c, d = pt.cos(h), pt.sqr(h)  # the heavy node above, none below: another colour
    t = pt.tanh(x)  # no anchor at all
    _, nodes = graph_nodes([x], [c, d, t])
    weights = {n: node_weight(n, float("inf")) for n in nodes}
    groups = colour(weights)
    assert as_sets(groups) == {
        frozenset({a.owner, b.owner, s.owner}),
        frozenset({h.owner}),
        frozenset({c.owner, d.owner}),
        frozenset({t.owner}),
    }
    assert in_node_order(groups, nodes)


def test_colour_keeps_every_anchor_alone():
    x = pt.vector("x")
    a = pt.exp(x)
    b = pt.sin(a)  # two costly nodes in a row: each is a group of its own
    _, nodes = graph_nodes([x], [b])
    weights = {n: Weight("costly", "test") for n in nodes}
    assert as_sets(colour(weights)) == {frozenset({a.owner}), frozenset({b.owner})}


def test_fuse_chains_merges_a_linear_chain_but_never_across_a_heavy_node():
    x = pt.vector("x")
    n1 = pt.exp(x)
    n2 = pt.sin(n1)
    h = Scale()(n2)
    n4 = pt.cos(h)
    n5 = pt.tanh(n4)
    n6, n7 = pt.sqr(n5), pt.abs(n5)  # n5 has two consumers: the chain ends there
    _, nodes = graph_nodes([x], [n6, n7])
    weights = {n: Weight("costly", "test") for n in nodes}
    weights[h.owner] = Weight("heavy", "test")
    fused = fuse_chains([[n] for n in nodes], weights)
    assert as_sets(fused) == {
        frozenset({n1.owner, n2.owner}),
        frozenset({h.owner}),
        frozenset({n4.owner, n5.owner}),
        frozenset({n6.owner}),
        frozenset({n7.owner}),
    }
    assert in_node_order(fused, nodes)


def caller_stage_graph():
    """Each node its own block around two heavy calls: stages of every role."""
    x, y = pt.vector("x"), pt.vector("y")
    a, b = pt.exp(x), pt.sin(y)  # two independent stages feeding the cluster
    s = a + b
    h = Scale()(s)
    e = pt.exp(h)  # between the two heavy calls
    h2 = Scale(3.0)(e)
    c, d = pt.cos(h), pt.sqr(h)  # after
    t, u = pt.tanh(x), pt.tanh(y)  # beside
    fgraph, nodes = graph_nodes([x, y], [h2, c, d, t, u])
    weights = {n: node_weight(n, float("inf")) for n in nodes}
    blocks = fuse_caller_stages([[n] for n in nodes], weights)
    return fgraph, nodes, weights, blocks, locals()


def test_fuse_caller_stages_merges_the_stages_of_each_role_into_one():
    _, nodes, _, blocks, v = caller_stage_graph()
    assert as_sets(blocks) == {
        frozenset({v["a"].owner, v["b"].owner, v["s"].owner}),
        frozenset({v["h"].owner}),
        frozenset({v["e"].owner}),
        frozenset({v["h2"].owner}),
        frozenset({v["c"].owner, v["d"].owner}),
        frozenset({v["t"].owner, v["u"].owner}),
    }
    assert in_node_order(blocks, nodes)


def test_make_plan_orders_and_places_the_blocks():
    fgraph, _, weights, blocks, v = caller_stage_graph()
    plan = make_plan(fgraph, blocks, weights)
    role = {n: t.role for t in plan.tasks for n in t.nodes}
    assert [role[v[k].owner] for k in ("a", "h", "e", "h2", "c", "t")] == [
        "before",
        "cluster",
        "cluster",
        "cluster",
        "after",
        "beside",
    ]
    task = {n: t.index for t in plan.tasks for n in t.nodes}
    assert plan.tasks[task[v["h2"].owner]].deps == (task[v["e"].owner],)
    for t in plan.tasks:
        assert all(d < t.index for d in t.deps)
