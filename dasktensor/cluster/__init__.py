"""Cluster plumbing: which Client a call uses, what the workers offer, one submit path.

Everything in dasktensor that talks to a distributed cluster goes through here: the engine
(cluster tasks), remote models (replica builds), ``dt.sample`` (segments) and ``pmap``
(finding the client).

* **Which scheduler** (``_client.py``).  :class:`SchedulerRef` keeps a function's choice
  (a Client, an address, a local scheduler, or Dask's own resolution at call time) in a
  form that pickles: a Client pickles as its address and each process reconnects lazily
  (:func:`client_for_address`, one Client per process and address).
* **Resources, and asking the workers** (``_workers.py``).  A task asking for
  resources that no worker offers would wait forever; :func:`check_resources` waits up to
  ``dasktensor.placement.resource-timeout`` for such a worker and raises
  :class:`NoWorkerWithResourcesError` naming what the workers offer.
  :func:`run_on_workers` runs a function on the workers of a list that the scheduler
  still lists (Dask would retry a dead one's address for its connect timeout).
* **Submitting** (``_submit.py``).  :func:`submit` is the one place a task goes to the
  cluster, with its :class:`~dasktensor.Placement` turned into ``client.submit``
  keywords.
* **Connecting** (``_connect.py``).  ``dt.connect``: a Client of a running cluster or of
  an embedded ``LocalCluster`` on 127.0.0.1.
* **GPU workers** (``_gpus.py``, ``_info.py``).  Finding a machine's GPUs without a
  hard dependency (``CUDA_VISIBLE_DEVICES``, ``nvidia-smi``), choosing them
  (``dt.connect(gpus=...)``, ``dasktensor worker --gpus``), a GPU worker's options (its
  device alone visible, ``GPU=1``, memory settings for a GPU stack), and ``dt.info()``:
  the workers and the devices each one sees; :func:`worker_devices`: the short label of
  each worker's device, which a function's plan shows for the blocks that ran there.
* **Worker processes** (``_nanny.py``).  :class:`Nanny`: Dask's nanny, its worker
  spawned without Dask's ``MALLOC_TRIM_THRESHOLD_`` (``dasktensor.cluster.
  malloc-trim-threshold``), so that a model's NumPy temporaries reuse freed memory; the
  embedded cluster and ``dasktensor worker`` start their workers with it.
* **Errors** (``_errors.py``).  :class:`SchedulerLostError`, and how a lost scheduler is
  recognised.
* **The channel on Dask's tools** (``_dashboard.py``, ``_adaptive.py``).
  :func:`show_calls_page` starts the scheduler's channel monitor: the dashboard page
  ``/individual-dasktensor-calls``, the ``dasktensor_*`` metrics on ``/metrics``;
  :class:`Adaptive` (``dt.Adaptive``) scales on the channel's demand as well as Dask's.

A forked child forgets the Clients of its parent and Dask's thread pools
(:mod:`dasktensor._runtime`), and reconnects to the same scheduler on first use.
"""

from dasktensor.cluster._adaptive import Adaptive as Adaptive
from dasktensor.cluster._client import SchedulerRef as SchedulerRef
from dasktensor.cluster._client import client_for_address as client_for_address
from dasktensor.cluster._client import default_client as default_client
from dasktensor.cluster._client import is_client as is_client
from dasktensor.cluster._connect import configured_address as configured_address
from dasktensor.cluster._connect import connect as connect
from dasktensor.cluster._dashboard import calls_link as calls_link
from dasktensor.cluster._dashboard import show_calls_page as show_calls_page
from dasktensor.cluster._errors import NoWorkerWithResourcesError as NoWorkerWithResourcesError
from dasktensor.cluster._errors import SchedulerLostError as SchedulerLostError
from dasktensor.cluster._errors import lost_scheduler as lost_scheduler
from dasktensor.cluster._errors import memory_restart as memory_restart
from dasktensor.cluster._gpus import Device as Device
from dasktensor.cluster._gpus import NoGPUError as NoGPUError
from dasktensor.cluster._gpus import choose_devices as choose_devices
from dasktensor.cluster._gpus import cpu_worker_env as cpu_worker_env
from dasktensor.cluster._gpus import find_devices as find_devices
from dasktensor.cluster._gpus import gpu_worker_options as gpu_worker_options
from dasktensor.cluster._gpus import parse_gpus as parse_gpus
from dasktensor.cluster._gpus import worker_devices as worker_devices
from dasktensor.cluster._info import ClusterInfo as ClusterInfo
from dasktensor.cluster._info import WorkerInfo as WorkerInfo
from dasktensor.cluster._info import info as info
from dasktensor.cluster._nanny import Nanny as Nanny
from dasktensor.cluster._submit import carrying as carrying
from dasktensor.cluster._submit import holding as holding
from dasktensor.cluster._submit import submit as submit
from dasktensor.cluster._submit import task_slot_released as task_slot_released
from dasktensor.cluster._workers import check_resources as check_resources
from dasktensor.cluster._workers import offers as offers
from dasktensor.cluster._workers import run_on_workers as run_on_workers
from dasktensor.cluster._workers import scheduler_workers as scheduler_workers

__all__ = [
    "Adaptive",
    "ClusterInfo",
    "Device",
    "Nanny",
    "NoGPUError",
    "NoWorkerWithResourcesError",
    "SchedulerLostError",
    "SchedulerRef",
    "WorkerInfo",
    "calls_link",
    "carrying",
    "check_resources",
    "choose_devices",
    "client_for_address",
    "configured_address",
    "connect",
    "cpu_worker_env",
    "default_client",
    "find_devices",
    "gpu_worker_options",
    "holding",
    "info",
    "is_client",
    "lost_scheduler",
    "memory_restart",
    "offers",
    "parse_gpus",
    "run_on_workers",
    "scheduler_workers",
    "show_calls_page",
    "submit",
    "task_slot_released",
    "worker_devices",
]
