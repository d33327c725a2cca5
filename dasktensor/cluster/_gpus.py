"""GPU workers: finding the devices, choosing them, and what a GPU worker is started with.

The convention is dask-cuda's: **one worker process per device**, started with that device
alone visible (``CUDA_VISIBLE_DEVICES``), offering the resource ``GPU=1``, one thread, and
memory settings made for a GPU stack.  ``dt.connect(gpus=...)`` starts such workers beside
CPU workers that see no device (``CUDA_VISIBLE_DEVICES=""``); ``dasktensor worker ADDRESS
--gpus all`` starts them on a GPU host of a running cluster.

* **Finding devices** (:func:`find_devices`, from :mod:`dasktensor_worker.devices`, where
  a worker finds its own without importing dasktensor), without a hard dependency: the
  entries of ``CUDA_VISIBLE_DEVICES`` when it is set (what CUDA would show this process),
  else the lines of ``nvidia-smi -L``; names and memory come from ``nvidia-smi
  --query-gpu`` when it answers.  Device ids are nvidia-smi's indices (PCI bus order: GPU
  workers get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA counts the same way) or UUIDs.
* **Choosing** (:func:`choose_devices`): ``"all"``, a count, or a list of ids, checked
  against what was found, with errors naming what was expected and what was given.
* **Starting** (:func:`gpu_worker_options`, :func:`cpu_worker_env`): a GPU worker's
  Nanny options.  Its host memory is not limited by default
  (``dasktensor.gpu.memory-limit: 0``): the CUDA and XLA libraries alone hold several GiB
  of host memory, which Dask's default limit (the machine's memory shared between the
  workers) took for a leak and restarted the worker for.  JAX is told not to preallocate
  75 % of the device (``dasktensor.gpu.jax-preallocate``), so that the caller, a second
  model or a second worker can share it; ``dasktensor.gpu.jax-memory-fraction`` and
  ``dasktensor.gpu.pytorch-alloc-conf`` set the other knobs.  A variable already set in
  the environment of the process starting the workers is left as it is.
* **What a worker sees** (:func:`worker_view`, run on each worker by ``dt.info()``): its
  ``CUDA_VISIBLE_DEVICES``, the devices it can use (name, memory total and used) and the
  memory variables it was started with; :func:`worker_devices`: the short label of each
  worker's device (``"GPU 0 (NVIDIA H200)"``, ``"cpu"``), what a function's plan says of
  where its blocks ran.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict

from dasktensor import _config
from dasktensor.cluster._workers import run_on_workers
from dasktensor_worker.devices import Device as Device
from dasktensor_worker.devices import find_devices as find_devices

#: the variables a GPU worker's memory settings become, by setting
MEMORY_VARIABLES = {
    "gpu.jax-preallocate": "XLA_PYTHON_CLIENT_PREALLOCATE",
    "gpu.jax-memory-fraction": "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "gpu.pytorch-alloc-conf": "PYTORCH_CUDA_ALLOC_CONF",
}
#: what ``dt.info()`` reports of each worker's environment
SHOWN_VARIABLES = ("CUDA_VISIBLE_DEVICES", *MEMORY_VARIABLES.values())


class NoGPUError(ValueError):
    """GPU workers were asked for and no such device was found on this machine."""


def choose_devices(
    gpus, devices: list[Device], how: str, *, owner: str = "dt.connect"
) -> list[Device]:
    """The devices that ``gpus`` asks for, among ``devices`` (found as ``how`` says).

    Parameters
    ----------
    gpus : None, "all", int or sequence of int or str
        None: no GPU worker. ``"all"``: every device found. A count: the first that many.
        A list: those device ids (indices or UUIDs).
    devices : list of Device
        What :func:`find_devices` found.
    how : str
        How they were found, for the errors.
    owner : str
        The function or command named in errors.

    Returns
    -------
    list of Device
        One GPU worker each, in the order asked.

    Raises
    ------
    NoGPUError
        ``gpus`` asks for devices and none was found.
    ValueError
        A count above the devices found, an id that is not among them, an id twice, or an
        empty list.
    TypeError
        ``gpus`` is none of the forms above.

    Examples
    --------
    >>> from dasktensor.cluster import Device, choose_devices
    >>> found = [Device("0", "A"), Device("1", "B")]
    >>> [d.id for d in choose_devices([1], found, "nvidia-smi -L")]
    ['1']
    """
    if gpus is None:
        return []
    expected = (
        f"{owner} expected gpus= 'all', a number of GPUs >= 1, or a list of device ids "
        "such as [0, 1]"
    )
    wanted: int | list[str] | None  # a count, device ids, or every device
    if isinstance(gpus, str) and gpus.strip().lower() == "all":
        wanted = None
    elif isinstance(gpus, int) and not isinstance(gpus, bool):
        if gpus < 1:
            raise ValueError(f"{expected}, got {gpus!r}")
        wanted = gpus
    elif isinstance(gpus, list | tuple) and all(
        isinstance(g, int | str) and not isinstance(g, bool) for g in gpus
    ):
        if not gpus:
            raise ValueError(f"{expected}, got an empty list (None starts no GPU worker)")
        wanted = [str(g).strip() for g in gpus]
        twice = sorted({g for g in wanted if wanted.count(g) > 1})
        if twice:
            raise ValueError(
                f"{expected}, each once (one worker per device), got {list(gpus)!r}: "
                f"{', '.join(twice)} more than once"
            )
    else:
        raise TypeError(f"{expected}, got {gpus!r}")
    if not devices:
        raise NoGPUError(
            f"{owner}(gpus={gpus!r}) expected GPUs on this machine, found none ({how}). "
            "Check that nvidia-smi works here, or name the devices in CUDA_VISIBLE_DEVICES; "
            "gpus=None starts CPU workers only."
        )
    listing = "; ".join(d.describe() for d in devices)
    if wanted is None:
        return list(devices)
    if isinstance(wanted, int):
        if wanted > len(devices):
            raise ValueError(
                f"{owner}(gpus={wanted}) expected at most {len(devices)} GPU(s), the "
                f"devices found ({how}): {listing}"
            )
        return list(devices[:wanted])
    chosen = []
    for g in wanted:
        device = next((d for d in devices if d.matches(g)), None)
        if device is None:
            raise ValueError(
                f"{owner}(gpus={list(gpus)!r}) expected ids of the devices found ({how}): "
                f"{listing}; there is no device {g!r}"
            )
        chosen.append(device)
    return chosen


def parse_gpus(text: str):
    """A ``--gpus`` argument as :func:`choose_devices` takes it: ``"all"``, a count
    (``"2"``), or device ids (``"0,1"``, UUIDs).

    Raises
    ------
    ValueError
        Anything else, naming what was expected.

    Examples
    --------
    >>> from dasktensor.cluster import parse_gpus
    >>> parse_gpus("all"), parse_gpus("2"), parse_gpus("0,1")
    ('all', 2, ['0', '1'])
    """
    value = text.strip()
    expected = (
        "expected 'all', a number of GPUs such as 2, or comma-separated device ids such "
        f"as 0,1 (indices or UUIDs), got {text!r}"
    )
    if value.lower() == "all":
        return "all"
    if value.isdigit() and "," not in value:
        if int(value) < 1:
            raise ValueError(expected)
        return int(value)
    if value.endswith(",") and value[:-1].strip().isdigit():
        return [value[:-1].strip()]  # "0,": the device 0
    entries = [e.strip() for e in value.split(",")]
    if not entries or not all(re.fullmatch(r"\d+|(GPU|MIG)-[0-9A-Za-z-]+", e) for e in entries):
        raise ValueError(expected)
    return entries


def cpu_worker_env() -> dict[str, str]:
    """The environment of a CPU worker beside GPU workers: no device visible, so that a
    library it imports (JAX, PyTorch) takes no GPU memory."""
    return {"CUDA_VISIBLE_DEVICES": ""}


def memory_env(environ=None) -> dict[str, str]:
    """The memory variables of a GPU worker from ``dasktensor.gpu.*``: a setting that is
    null, or a variable already set in ``environ`` (``os.environ``), adds nothing."""
    environ = os.environ if environ is None else environ
    settings = {
        "gpu.jax-preallocate": _config.get("gpu.jax-preallocate"),
        "gpu.jax-memory-fraction": _config.get("gpu.jax-memory-fraction"),
        "gpu.pytorch-alloc-conf": _config.get("gpu.pytorch-alloc-conf"),
    }
    env = {}
    for key, variable in MEMORY_VARIABLES.items():
        value = settings[key]
        if value is None or variable in environ:
            continue
        env[variable] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return env


def memory_limit():
    """A GPU worker's host memory limit for its nanny (``dasktensor.gpu.memory-limit``):
    0 (none) by default."""
    limit = _config.get("gpu.memory-limit")
    return 0 if limit in (None, "none", "None") else limit


def gpu_worker_options(device: Device, resources: dict | None = None) -> dict:
    """A GPU worker's Nanny options: the device alone visible (in nvidia-smi's order),
    ``GPU=1`` beside ``resources``, the threads and memory policy of ``dasktensor.gpu.*``.

    Examples
    --------
    >>> from dasktensor.cluster import Device, gpu_worker_options
    >>> options = gpu_worker_options(Device("1", "A"))
    >>> options["env"]["CUDA_VISIBLE_DEVICES"], options["resources"]
    ('1', {'GPU': 1})
    """
    return {
        "nthreads": _config.get("gpu.threads-per-worker"),
        "resources": {**(resources or {}), "GPU": 1},
        "memory_limit": memory_limit(),
        "env": {
            **memory_env(),
            "CUDA_VISIBLE_DEVICES": device.id,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        },
    }


def worker_view(dask_worker=None) -> dict:
    """What this worker sees of the GPUs, and what runs on it (``client.run`` by
    ``dt.info()``): its ``CUDA_VISIBLE_DEVICES`` and memory variables; the devices it can
    use, with their memory total and used (nvidia-smi lists every device of the machine;
    those outside ``CUDA_VISIBLE_DEVICES`` are left out); the remote models and resident
    stages (placed blocks) it holds, by name, and the calls it answered by name."""
    from dasktensor_worker import tasks

    devices, how = find_devices()
    held = tasks.summary(dask_worker)
    return {
        "env": {v: os.environ.get(v) for v in SHOWN_VARIABLES},
        "devices": [asdict(d) for d in devices],
        "how": how,
        "holds": sorted(set(held["models"].values())),
        "calls": {name: int(c[0]) for name, c in held["calls"].items()},
    }


def worker_devices(client, addresses) -> dict[str, str]:
    """The device label of each worker of ``addresses``: ``"GPU 0 (NVIDIA H200)"``, or
    ``"cpu"`` for a worker that sees no device (see
    :func:`dasktensor_worker.devices.device_label`).

    Each worker finds its label once (``nvidia-smi``) and keeps it; a worker that is gone
    or does not answer is left out.

    Parameters
    ----------
    client : distributed.Client
        The cluster's client.
    addresses : iterable of str
        Worker addresses.

    Returns
    -------
    dict
        ``{address: label}``.
    """
    from dasktensor_worker.devices import worker_device

    found = run_on_workers(client, worker_device, workers=list(addresses))
    return {a: label for a, label in found.items() if isinstance(label, str)}
