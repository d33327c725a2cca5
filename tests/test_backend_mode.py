"""Blocks compiled by the backend their worker needs: ``dt.annotate(mode="JAX")``.

JAX runs on the CPU here; the same placement with ``resources={"GPU": 1}`` puts the block
on a GPU worker, compiled there for its device.  JAX runs in worker processes only: a
process that ran JAX warns when it forks (``pm.sample(cores=2)`` does, in other tests).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _clusters import gpu_worker_address
from distributed import Client

import dasktensor as dt

if importlib.util.find_spec("jax") is None:
    pytest.skip("the JAX backend needs jax (in the test extra)", allow_module_level=True)

RNG = np.random.default_rng(3)
W = RNG.normal(size=(4, 3))


def surrogate_model(mode="JAX", **placement):
    """A loss whose middle block (a small network) is compiled by ``mode``, and its grad."""
    x = pt.dmatrix("x")
    h = pt.exp(x) * 0.5  # a cheap stage before the block
    with dt.annotate(mode=mode, name="surrogate", **placement):
        y = pt.tanh(h @ W)
    loss = (y**2).sum() + pt.sin(x).sum()
    return x, [loss, pytensor.grad(loss, x)]


def _linkers_here() -> dict[str, list[str]]:
    """On a worker: the linker classes of the runners it restored, by task name."""
    from dasktensor.engine._runners import restored

    return {
        r.name: sorted({type(fn.maker.linker).__name__ for fn in r.compiled_functions})
        for r in restored()
        if r.compiled_functions
    }


def linkers_on(client) -> dict[str, list[str]]:
    """The linker classes each task was compiled with, over all workers."""
    found: dict[str, set] = {}
    for per_worker in client.run(_linkers_here).values():
        for name, linkers in per_worker.items():
            found.setdefault(name, set()).update(linkers)
    return {name: sorted(linkers) for name, linkers in found.items()}


def test_a_jax_block_and_its_gradient_equal_the_default_mode_and_really_use_jax(client):
    x, outs = surrogate_model()
    f = dt.function([x], outs, scheduler=client)
    placed = {t.name: t.placement.mode for t in f.plan.tasks if t.kind == "heavy"}
    assert placed == {"surrogate": "JAX", "surrogate-grad": "JAX"}
    xv = RNG.normal(size=(5, 4))
    ref = pytensor.function([x], outs)
    for got, want in zip(f(xv), ref(xv)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    linkers = linkers_on(client)
    assert linkers["surrogate"] == ["JAXLinker"]
    assert linkers["surrogate-grad"] == ["JAXLinker"]
    # stages outside the block keep the line's own backend (here: run on the caller)
    executor = f.maker.linker.executor
    for task in f.plan.tasks:
        if task.kind == "stage":
            for compiled in executor.graph.runners[task.index].compiled_functions:
                assert type(compiled.maker.linker).__name__ != "JAXLinker", task.name


def test_a_mode_object_works_as_a_name_does(client):
    from pytensor.compile.mode import get_mode

    x, outs = surrogate_model(mode=get_mode("JAX"))
    f = dt.function([x], outs[0], scheduler=client)
    xv = RNG.normal(size=(2, 4))
    np.testing.assert_allclose(f(xv), pytensor.function([x], outs[0])(xv), rtol=1e-12)
    assert linkers_on(client)["surrogate"] == ["JAXLinker"]


@pytest.mark.parametrize("mode", ["JAXX", "DASK", 3])
def test_a_mode_pytensor_does_not_know_fails_at_annotate_listing_the_known_ones(mode):
    with pytest.raises(ValueError, match=r"annotate\(mode=\.\.\.\).*JAX.*NUMBA") as info:
        dt.annotate(mode=mode)
    assert repr(mode) in str(info.value)


def test_the_gpu_stage_compiles_with_jax_on_the_gpu_worker_only(mixed_cluster):
    x, outs = surrogate_model(resources={"GPU": 1})
    with Client(mixed_cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        f = dt.function([x], outs, scheduler=client)
        xv = RNG.normal(size=(5, 4))
        ref = pytensor.function([x], outs)
        for _ in range(2):
            for got, want in zip(f(xv), ref(xv)):
                np.testing.assert_allclose(got, want, rtol=1e-12)
        gpu = gpu_worker_address(client)
        compiled = client.run(_linkers_here)
    with_jax = {name for name, linkers in compiled.pop(gpu).items() if "JAXLinker" in linkers}
    assert with_jax == {"surrogate", "surrogate-grad"}
    (on_cpu,) = compiled.values()  # the other worker compiled nothing with JAX
    assert all("JAXLinker" not in linkers for linkers in on_cpu.values())
