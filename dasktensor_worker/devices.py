"""The GPUs a process can use, found without a hard dependency, and the short label of a
worker's device that the calls page and a function's plan show.

* :func:`find_devices`: the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (what CUDA
  would show this process), else the lines of ``nvidia-smi -L``; names and memory come
  from ``nvidia-smi --query-gpu`` when it answers.  Device ids are nvidia-smi's indices
  (PCI bus order: GPU workers get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA counts the
  same way) or UUIDs.  ``dasktensor.cluster`` (``dt.connect(gpus=...)``, ``dasktensor
  worker --gpus``, ``dt.info()``) uses it; it lives here, on the worker side, so that a
  worker can name its device without importing dasktensor (and PyTensor).
* :func:`device_label`: ``"GPU 0 (NVIDIA H200)"``, or ``"cpu"`` for a process that sees
  no device; :func:`this_device` is this process's, found once (``nvidia-smi`` takes tens
  of milliseconds) and kept: a worker's devices do not change while it runs.  A GPU
  worker of ``dt.connect(gpus=...)`` sees its one device; a worker started without
  ``CUDA_VISIBLE_DEVICES`` on a GPU host sees them all, and says so.

Only the standard library is imported here (``dask.utils`` when a device is described).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

_SMI_TIMEOUT_S = 15
_LIST_LINE = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]+)\))?\s*$")


@dataclass(frozen=True)
class Device:
    """One GPU as this machine lists it.

    ``id`` is what ``CUDA_VISIBLE_DEVICES`` names it by (an index such as ``"0"``, or a
    UUID); ``memory_total`` and ``memory_used`` are bytes, None when nvidia-smi did not
    say.
    """

    id: str
    name: str = ""
    index: int | None = None
    uuid: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None

    def matches(self, wanted: str) -> bool:
        """Whether ``wanted`` (an index or a UUID, or a UUID's prefix) names this device."""
        wanted = str(wanted).strip()
        if wanted == self.id or (self.index is not None and wanted == str(self.index)):
            return True
        return bool(self.uuid and len(wanted) > 4 and self.uuid.startswith(wanted))

    def describe(self) -> str:
        """``"0: NVIDIA H200, 1.2 GiB of 140 GiB used"``: what ``dasktensor info`` shows."""
        from dask.utils import format_bytes

        text = f"{self.id}: {self.name or 'GPU'}"
        if self.memory_total is not None:
            used = format_bytes(self.memory_used) if self.memory_used is not None else "?"
            text += f", {used} of {format_bytes(self.memory_total)} used"
        return text


def _nvidia_smi(*args: str) -> str | None:
    """The output of ``nvidia-smi ARGS``, or None when it is not on PATH or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _listed() -> list[Device]:
    """The devices of ``nvidia-smi -L`` (``GPU 0: NAME (UUID: GPU-...)`` lines; MIG
    instances, indented below their GPU, are not listed as devices of their own)."""
    out = _nvidia_smi("-L")
    devices = []
    for line in (out or "").splitlines():
        m = _LIST_LINE.match(line.strip()) if not line.startswith((" ", "\t")) else None
        if m:
            index, name, uuid = m.groups()
            devices.append(Device(id=index, name=name, index=int(index), uuid=uuid))
    return devices


def _queried() -> list[Device]:
    """The devices of ``nvidia-smi --query-gpu`` with their memory (MiB there)."""
    out = _nvidia_smi(
        "--query-gpu=index,uuid,name,memory.total,memory.used",
        "--format=csv,noheader,nounits",
    )
    devices = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5 or not parts[0].isdigit():
            continue
        index, uuid, name, total, used = parts
        mib = [int(float(v)) * 2**20 if _number(v) else None for v in (total, used)]
        devices.append(
            Device(
                id=index,
                name=name,
                index=int(index),
                uuid=uuid or None,
                memory_total=mib[0],
                memory_used=mib[1],
            )
        )
    return devices


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _visible_entries(value: str) -> list[str]:
    return [e.strip() for e in value.split(",") if e.strip()]


def find_devices(environ=None) -> tuple[list[Device], str]:
    """The GPUs this machine offers this process, and how they were found.

    Parameters
    ----------
    environ : mapping, optional
        The environment to read ``CUDA_VISIBLE_DEVICES`` from (``os.environ``).

    Returns
    -------
    devices : list of Device
        In the order CUDA_VISIBLE_DEVICES or nvidia-smi lists them; empty when none.
    how : str
        Where they came from, or why none was found (for error messages).

    Examples
    --------
    >>> from dasktensor_worker.devices import find_devices
    >>> devices, how = find_devices({"CUDA_VISIBLE_DEVICES": ""})
    >>> devices, how
    ([], 'CUDA_VISIBLE_DEVICES is set and empty')
    """
    environ = os.environ if environ is None else environ
    detailed = _queried()
    listed = detailed or _listed()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = _visible_entries(visible)
        if not entries:
            return [], "CUDA_VISIBLE_DEVICES is set and empty"
        devices = []
        for entry in entries:
            known = next((d for d in listed if d.matches(entry)), None)
            devices.append(Device(**{**asdict(known), "id": entry}) if known else Device(id=entry))
        return devices, f"CUDA_VISIBLE_DEVICES={visible}"
    if listed:
        return listed, "nvidia-smi"
    if shutil.which("nvidia-smi") is None:
        return [], "no nvidia-smi on PATH and CUDA_VISIBLE_DEVICES not set"
    return [], "nvidia-smi -L listed no GPU"


#: what a process that sees no GPU runs on
CPU = "cpu"


def device_label(devices: list[Device]) -> str:
    """A short label of what a process runs on: ``"GPU 0 (NVIDIA H200)"``, several such
    joined with ``", "``, or ``"cpu"`` when it sees no device.

    Examples
    --------
    >>> device_label([Device("1", "NVIDIA H200", index=1)])
    'GPU 1 (NVIDIA H200)'
    >>> device_label([Device("GPU-5d1f-aa")]), device_label([])
    ('GPU GPU-5d1f-aa', 'cpu')
    """
    if not devices:
        return CPU
    labels = []
    for d in devices:
        number = d.index if d.index is not None else d.id
        labels.append(f"GPU {number} ({d.name})" if d.name else f"GPU {number}")
    return ", ".join(labels)


_found: list[str] = []  # this process's label, once found (two threads finding it at
# once both run nvidia-smi and find the same: no lock)


def this_device() -> str:
    """This process's :func:`device_label`, found on the first call and kept.

    A process with ``CUDA_VISIBLE_DEVICES`` set and empty (a CPU worker beside GPU
    workers) is ``"cpu"`` without asking ``nvidia-smi``.  The first call may take tens of
    milliseconds (``nvidia-smi``); later ones read the kept label.
    """
    if not _found:
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
            _found.append(CPU)
        else:
            _found.append(device_label(find_devices()[0]))
    return _found[0]


def worker_device(dask_worker=None) -> str:
    """``client.run``: the device label of this worker (:func:`this_device`)."""
    return this_device()
