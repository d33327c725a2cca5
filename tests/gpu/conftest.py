"""GPU tests: the checks of ``tests/test_gpus.py`` with real devices.

Skipped, every one, where this machine shows no GPU (``nvidia-smi`` lists none, or
``CUDA_VISIBLE_DEVICES`` hides them all) or JAX is not installed; a skipped GPU test
never stands in for the CPU test of the same feature, which runs everywhere.  Nothing
here imports JAX in the test process: a process that touches the GPU keeps memory on it.
"""

from __future__ import annotations

import importlib.util

import pytest

from dasktensor.cluster import find_devices

DEVICES, HOW = find_devices()


def pytest_collection_modifyitems(config, items):
    reason = None
    if not DEVICES:
        reason = f"no GPU visible here ({HOW})"
    elif importlib.util.find_spec("jax") is None:
        reason = "JAX is not installed (pip install -e '.[jax]' with a CUDA jaxlib)"
    if reason is None:
        return
    here = config.rootpath / "tests" / "gpu"
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.skip(reason=reason))
