"""GPU workers on real devices: ``dt.connect(n_workers=1, gpus="all")``.

JAX sees ``cuda`` on each GPU worker and no GPU on the CPU worker; a placed JAX block's
output comes from a GPU worker and equals the default mode's; a remote model asking for
``{"GPU": 1}`` runs JAX on a GPU; GPU memory is held by the GPU workers only.
Skipped where no GPU is visible (``conftest.py``); ``tests/test_gpus.py`` runs the same
checks on CPU machines with a fake ``nvidia-smi``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import dasktensor as dt
from dasktensor.cluster import find_devices


def _jax_here() -> dict:
    """On a worker: JAX's platforms, and the bytes it holds on its first GPU (0 if none)."""
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    in_use = (gpus[0].memory_stats() or {}).get("bytes_in_use", 0) if gpus else 0
    return {"platforms": sorted({d.platform for d in jax.devices()}), "in_use": in_use,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip


def _runners_here() -> list[str]:
    from dasktensor.engine._runners import restored

    return sorted({r.name for r in restored() if r.compiled_functions})


class JaxDevice:
    """A remote model that runs a JAX product on its default device."""

    def __init__(self):
        import jax.numpy as jnp

        self.w = jnp.ones((256, 256))

    def platform(self, x):
        y = self.w @ np.asarray(x, dtype=np.float32)
        return str(y.devices().pop().platform), np.asarray(y)


@pytest.fixture(scope="module")
def client():
    c = dt.connect(n_workers=1, gpus="all", dashboard_address=False, set_as_default=False)
    yield c
    c.shutdown()
    c.close()


def by_role(client):
    seen = dt.info(client).workers
    gpus = [w for w in seen if w.resources.get("GPU")]
    cpus = [w for w in seen if not w.resources.get("GPU")]
    return gpus, cpus


def test_each_gpu_worker_sees_its_device_and_jax_sees_cuda_there_only(client):
    gpus, cpus = by_role(client)
    found, _ = find_devices()
    assert len(gpus) == len(found) and len(cpus) == 1
    for w in gpus:
        assert len(w.devices) == 1 and w.devices[0].memory_total > 0, w
    jax = client.run(_jax_here)
    for w in gpus:
        assert jax[w.address]["platforms"] == ["gpu"], jax[w.address]
    for w in cpus:
        assert "gpu" not in jax[w.address]["platforms"] and jax[w.address]["visible"] == ""


def test_a_placed_jax_block_runs_on_a_gpu_worker_and_equals_the_default_mode(client):
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=(512, 512)) / 512**0.5 for _ in range(3)]
    x = pt.dmatrix("x")
    with dt.annotate(resources={"GPU": 1}, mode="JAX", name="net"):
        h = x
        for w in weights:
            h = pt.tanh(h @ w)
    out = (h**2).sum()
    f = dt.function([x], out, scheduler=client)
    xv = rng.normal(size=(64, 512))
    assert f(xv) == pytest.approx(pytensor.function([x], out)(xv), rel=1e-9)
    gpus, cpus = by_role(client)
    compiled = client.run(_runners_here)
    assert any("net" in compiled[w.address] for w in gpus)
    assert not any("net" in compiled[w.address] for w in cpus)
    held = client.run(_jax_here, workers=[w.address for w in gpus])
    assert max(v["in_use"] for v in held.values()) > 0  # the block's arrays were on a GPU


def test_a_remote_model_asking_for_a_gpu_runs_jax_on_a_gpu(client):
    model = dt.RemoteModel(JaxDevice, name="jax-device", resources={"GPU": 1}, scheduler=client)
    try:
        platform, y = model.call("platform", np.ones(256))
        assert platform == "gpu"
        np.testing.assert_allclose(y, 256.0)
        gpus, _ = by_role(client)
        assert set(model.workers()) <= {w.address for w in gpus}
    finally:
        model.close()


def test_gpu_memory_is_held_by_gpu_workers_only(client):
    test_a_placed_jax_block_runs_on_a_gpu_worker_and_equals_the_default_mode(client)
    smi = shutil.which("nvidia-smi")
    done = subprocess.run([smi, "--query-compute-apps=pid,used_memory",
                           "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pids = {int(line.split(",")[0]) for line in done.stdout.splitlines() if line.strip()}
    if not pids:
        pytest.skip("nvidia-smi lists no process on the GPUs (a container's own pids)")
    gpus, cpus = by_role(client)
    worker_pids = client.run(os.getpid)
    gpu_pids = {worker_pids[w.address] for w in gpus}
    assert pids & gpu_pids, (pids, gpu_pids)
    assert os.getpid() not in pids
    assert not pids & {worker_pids[w.address] for w in cpus}
