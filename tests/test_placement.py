"""dt.annotate: marks survive rewrites and reach the plan; bad arguments are refused."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import dasktensor as dt


def heavy_tasks(f):
    return [(t.name, t.placement.annotations()) for t in f.plan.tasks if t.kind == "heavy"]


def test_annotations_survive_rewrites_and_reach_the_plan():
    x = pt.vector("x")
    with dt.annotate(resources={"GPU": 1}, retries=2, priority=5, name="surrogate"):
        y = pt.exp(x) * 2 + pt.log1p(pt.exp(x))  # rewritten (softplus, fusion) inside
    f = dt.function([x], (y + 1).sum(), scheduler="sync")
    assert heavy_tasks(f) == [
        ("surrogate", {"resources": {"GPU": 1}, "retries": 2, "priority": 5})
    ]
    xv = np.linspace(-1, 1, 5)
    np.testing.assert_allclose(f(xv), pytensor.function([x], (y + 1).sum())(xv))


def test_gradients_of_a_placed_subgraph_are_placed_too():
    x = pt.matrix("x")
    with dt.annotate(resources={"GPU": 1}, name="surrogate"):
        y = pt.tanh(x @ x.T)
    g = pytensor.grad(y.sum(), x)
    f = dt.function([x], g, scheduler="sync")
    assert ("surrogate-grad", {"resources": {"GPU": 1}}) in heavy_tasks(f)
    xv = np.random.default_rng(0).normal(size=(3, 3))
    np.testing.assert_allclose(f(xv), pytensor.function([x], g)(xv))


def test_decorator_form_and_default_name():
    @dt.annotate(retries=3)
    def block(v):
        return pt.exp(v).sum()

    x = pt.vector("x")
    f = dt.function([x], block(x) + block(2 * x), scheduler="sync")
    names = heavy_tasks(f)
    assert len(names) == 2 and all(a == {"retries": 3} for _, a in names)
    assert all(n.startswith("annotated-") for n, _ in names)
    np.testing.assert_allclose(f(np.ones(2)), 2 * np.e + 2 * np.e**2)


def test_nested_blocks_give_nested_placement():
    x = pt.vector("x")
    with dt.annotate(retries=1, name="outer"):
        with dt.annotate(resources={"GPU": 1}, name="inner"):
            a = pt.exp(x)
        b = a * 3
    f = dt.function([x], b.sum(), scheduler="sync")
    assert heavy_tasks(f) == [("outer", {"retries": 1})]
    np.testing.assert_allclose(f(np.zeros(2)), 6.0)


def test_differently_annotated_copies_are_not_merged():
    x = pt.vector("x")
    with dt.annotate(resources={"GPU": 1}, name="a"):
        a = pt.exp(x)
    with dt.annotate(retries=1, name="a"):
        b = pt.exp(x)
    f = dt.function([x], [a, b], scheduler="sync")  # MergeOptimizer must keep both
    assert sorted(heavy_tasks(f), key=str) == sorted(
        [("a", {"resources": {"GPU": 1}}), ("a", {"retries": 1})], key=str
    )


def test_a_block_that_raises_leaves_the_graph_alone():
    x = pt.vector("x")
    with pytest.raises(RuntimeError, match="boom"), dt.annotate(name="broken"):
        y = pt.exp(x)
        raise RuntimeError("boom")
    f = dt.function([x], y.sum(), scheduler="sync")
    assert f.plan.single_stage


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resources": {"GPU": -1}}, "positive amounts"),
        ({"resources": ["GPU"]}, "dict of resource names"),
        ({"retries": -1}, "integer >= 0"),
        ({"retries": 1.5}, "integer >= 0"),
        ({"priority": "high"}, "expected an integer"),
    ],
)
def test_bad_annotations_are_refused_with_the_expected_form(kwargs, message):
    with pytest.raises(TypeError, match=message):
        dt.annotate(**kwargs)


def test_names_must_be_key_friendly():
    with pytest.raises(ValueError, match="letters and dashes"):
        dt.annotate(name="gpu_0")


# ----------------------------------------------------------------------------- Placement


def test_placement_converts_to_submit_keywords_and_layer_annotations():
    p = dt.Placement(
        resources={"GPU": 1}, retries=2, priority=5, workers="tcp://a:1", allow_other_workers=True
    )
    assert p.submit_kwargs() == {
        "resources": {"GPU": 1},
        "retries": 2,
        "priority": 5,
        "workers": ["tcp://a:1"],
        "allow_other_workers": True,
    }
    assert p.annotations() == {
        "resources": {"GPU": 1},
        "retries": 2,
        "priority": 5,
        "workers": ["tcp://a:1"],
        "allow_other_workers": True,
    }
    # nothing set: Dask's defaults, and no annotations at all
    empty = dt.Placement()
    assert empty.submit_kwargs() == {
        "resources": None,
        "retries": None,
        "priority": 0,
        "workers": None,
        "allow_other_workers": False,
    }
    assert empty.annotations() == {} and not empty
    # the compiling mode is not a Dask annotation
    assert dt.Placement(mode="JAX").annotations() == {}
    assert dt.Placement(mode="JAX")


def test_placements_are_values():
    a = dt.Placement(resources={"GPU": 1, "MEM": 2}, workers=["w1", "w2"])
    b = dt.Placement(resources={"MEM": 2, "GPU": 1}, workers=("w1", "w2"))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != dt.Placement(resources={"GPU": 1})
    assert repr(dt.Placement(retries=1, mode="JAX")) == "Placement(retries=1, mode='JAX')"
    with pytest.raises(AttributeError):
        a.retries = 3  # frozen


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"resources": {"GPU": 0}}, TypeError, r"X\(resources=\.\.\.\) expected a dict"),
        ({"retries": True + 0.5}, TypeError, r"X\(retries=\.\.\.\) expected an integer >= 0"),
        ({"priority": 1.0}, TypeError, r"X\(priority=\.\.\.\) expected an integer, got 1.0"),
        ({"workers": [1, 2]}, TypeError, r"X\(workers=\.\.\.\) expected a worker address"),
        ({"workers": []}, TypeError, r"X\(workers=\.\.\.\) expected a worker address"),
        ({"allow_other_workers": 1}, TypeError, r"expected True or False, got 1"),
        ({"allow_other_workers": True}, ValueError, r"expected workers= too"),
        ({"mode": "FAST"}, ValueError, r"X\(mode=\.\.\.\) expected a PyTensor mode.*'FAST'"),
    ],
)
def test_placement_errors_name_the_owner_the_option_and_what_was_given(kwargs, error, message):
    with pytest.raises(error, match=message):
        dt.Placement.of("X", **kwargs)


def test_annotate_passes_every_placement_option_to_the_task():
    x = pt.vector("x")
    with dt.annotate(
        workers=["tcp://127.0.0.1:1"], allow_other_workers=True, priority=2, name="pinned"
    ):
        y = pt.exp(x)
    f = dt.function([x], y.sum(), scheduler="sync")
    (task,) = [t for t in f.plan.tasks if t.kind == "heavy"]
    assert task.placement == dt.Placement(
        workers=("tcp://127.0.0.1:1",), allow_other_workers=True, priority=2
    )
    np.testing.assert_allclose(f(np.zeros(3)), 3.0)
