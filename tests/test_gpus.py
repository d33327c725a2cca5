"""GPU workers out of the box, on machines without a GPU.

The only thing faked is ``nvidia-smi`` (``tests/_fake_gpus.py``, first on ``PATH``): it
lists two devices.  Everything else is real: ``dt.connect(gpus=[0, 1])`` starts a
``LocalCluster`` of worker processes, two CPU workers and one per device; what each
worker sees is read in that worker's process; placed blocks and remote models run where
Dask puts them; ``dasktensor worker`` runs as a command; a nanny restarts a worker that
passes its memory limit.  ``tests/gpu/`` runs the same checks with real devices.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from _clusters import eventually, local_cluster
from _fake_gpus import environ, install

import dasktensor as dt
from dasktensor.cli import main
from dasktensor.cluster import (
    Device,
    NoGPUError,
    choose_devices,
    find_devices,
    gpu_worker_options,
    parse_gpus,
)

FAKE = ["Fake A100 80GB", "Fake A100 80GB"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fake_smi(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("fake-nvidia-smi")).parent


@pytest.fixture
def two_gpus(fake_smi, monkeypatch):
    """This process sees two devices through the fake ``nvidia-smi``."""
    for k, v in environ(fake_smi, FAKE).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for v in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(v, raising=False)


@pytest.fixture
def no_gpu(tmp_path, monkeypatch):
    """This process finds no device: no nvidia-smi on PATH, no CUDA_VISIBLE_DEVICES."""
    monkeypatch.setenv("PATH", str(tmp_path))  # holds no nvidia-smi
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# --------------------------------------------------------------------- finding devices


def test_devices_are_found_with_nvidia_smi_with_their_name_and_memory(two_gpus):
    devices, how = find_devices()
    assert [d.id for d in devices] == ["0", "1"]
    assert [d.name for d in devices] == FAKE
    assert devices[0].memory_total == 81559 * 2**20 and devices[1].memory_used == 101 * 2**20
    assert devices[1].uuid == "GPU-00000001-fake-0001"
    assert how == "nvidia-smi"


def test_cuda_visible_devices_restricts_what_is_found(two_gpus):
    devices, how = find_devices({"CUDA_VISIBLE_DEVICES": "1"})
    assert [(d.id, d.name) for d in devices] == [("1", FAKE[1])]
    assert how == "CUDA_VISIBLE_DEVICES=1"
    by_uuid, _ = find_devices({"CUDA_VISIBLE_DEVICES": "GPU-00000000-fake-0000"})
    assert [(d.id, d.index) for d in by_uuid] == [("GPU-00000000-fake-0000", 0)]
    assert find_devices({"CUDA_VISIBLE_DEVICES": ""}) == (
        [],
        "CUDA_VISIBLE_DEVICES is set and empty",
    )


def test_without_nvidia_smi_cuda_visible_devices_alone_names_the_devices(no_gpu):
    assert find_devices({}) == ([], "no nvidia-smi on PATH and CUDA_VISIBLE_DEVICES not set")
    devices, _ = find_devices({"CUDA_VISIBLE_DEVICES": "0,2"})
    assert [d.id for d in devices] == ["0", "2"] and devices[0].name == ""


def test_mig_lines_of_nvidia_smi_are_not_devices_of_their_own(fake_smi, monkeypatch):
    from dasktensor_worker.devices import _listed

    for k, v in environ(fake_smi, ["Fake MIG-capable"]).items():
        monkeypatch.setenv(k, v)
    assert [d.id for d in _listed()] == ["0"]


# ----------------------------------------------------------------- choosing, bad input

FOUND = [Device("0", "A", index=0, uuid="GPU-aaaa-1111"), Device("1", "B", index=1)]


@pytest.mark.parametrize(
    ("gpus", "ids"),
    [("all", ["0", "1"]), ("ALL", ["0", "1"]), (1, ["0"]), ([1, 0], ["1", "0"]),
     (["1"], ["1"]), (["GPU-aaaa"], ["0"]), ((0,), ["0"])],
)  # fmt: skip
def test_gpus_chooses_all_a_count_or_ids(gpus, ids):
    assert [d.id for d in choose_devices(gpus, FOUND, "test")] == ids


def test_gpus_all_with_no_device_found_says_so_and_how_it_looked():
    expected = (
        r"gpus='all'\) expected GPUs on this machine, found "
        r"none \(no nvidia-smi on PATH.*gpus=None starts CPU workers only"
    )
    with pytest.raises(NoGPUError, match=expected):
        choose_devices("all", [], "no nvidia-smi on PATH and CUDA_VISIBLE_DEVICES not set")


@pytest.mark.parametrize(
    ("gpus", "error", "message"),
    [
        ([3], ValueError, (r"gpus=\[3\]\) expected ids of the devices found \(test\): 0: A; "
                           r"1: B; there is no device '3'")),
        (3, ValueError, r"gpus=3\) expected at most 2 GPU\(s\)"),
        ([0, 0], ValueError, r"each once .* got \[0, 0\]: 0 more than once"),
        ([], ValueError, r"got an empty list"),
        (0, ValueError, r"a number of GPUs >= 1.* got 0"),
        ("al", TypeError, (r"expected gpus= 'all', a number of GPUs >= 1, or a list of "
                           r"device ids such as \[0, 1\], got 'al'")),
        (True, TypeError, r"got True"),
        ([0.5], TypeError, r"got \[0.5\]"),
    ],
)  # fmt: skip
def test_bad_gpus_name_what_was_expected_and_given(gpus, error, message):
    with pytest.raises(error, match=message):
        choose_devices(gpus, FOUND, "test")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("all", "all"), (" All ", "all"), ("2", 2), ("0,1", ["0", "1"]), ("1,", ["1"]),
     ("GPU-ab12-cd,3", ["GPU-ab12-cd", "3"])],
)  # fmt: skip
def test_the_gpus_argument_takes_all_a_count_or_ids(text, parsed):
    assert parse_gpus(text) == parsed


@pytest.mark.parametrize("text", ["", "0", "-1", "one", "0;1", "0,,1", "1.5", "all,0"])
def test_a_malformed_gpus_argument_is_refused_naming_the_forms(text):
    with pytest.raises(ValueError, match=rf"expected 'all', a number of GPUs such as 2, or "
                       rf"comma-separated device ids such as 0,1 .*got {text!r}"):  # fmt: skip
        parse_gpus(text)


def test_a_malformed_gpus_on_the_command_line_exits_2_naming_the_forms(capsys):
    with pytest.raises(SystemExit) as info:
        main(["worker", "tcp://127.0.0.1:9", "--gpus", "first"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --gpus: expected 'all', a number of GPUs such as 2" in err
    assert "got 'first'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--nthreads", "0"], "expected a number of threads >= 1, got '0'"),
     (["--resources", "GPU=2"], "expected resources without GPU"),
     (["--resources", "MEM"], "expected NAME=AMOUNT pairs")],
)  # fmt: skip
def test_other_bad_worker_arguments_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["worker", "tcp://127.0.0.1:9", "--gpus", "all", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_worker_command_without_a_gpu_exits_2_and_starts_nothing(no_gpu, capsys):
    assert main(["worker", "tcp://127.0.0.1:9", "--gpus", "all"]) == 2
    err = capsys.readouterr().err
    assert "dasktensor worker --gpus(gpus='all') expected GPUs on this machine, found none" in err


def test_the_worker_command_refuses_a_device_that_is_not_there(two_gpus, capsys):
    assert main(["worker", "tcp://127.0.0.1:9", "--gpus", "0,7"]) == 2
    assert "there is no device '7'" in capsys.readouterr().err


def test_connect_gpus_all_without_a_device_fails_before_starting_anything(no_gpu):
    with pytest.raises(NoGPUError, match=r"dt.connect\(gpus='all'\) expected GPUs"):
        dt.connect(n_workers=1, gpus="all", dashboard_address=False, set_as_default=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": [0, 5]}, r"there is no device '5'"),
        ({"gpus": 1, "resources": {"GPU": 1}}, (r"got gpus=1 and resources=\{'GPU': 1\}.*"
                                                r"expected resources without 'GPU' beside gpus=")),
        ({"gpus": "all", "processes": False}, r"expected processes=True"),
        ({"gpus": [0], "env": {"CUDA_VISIBLE_DEVICES": "1"}}, r"expected one of the two"),
    ],
)  # fmt: skip
def test_connect_refuses_gpus_that_contradict_the_machine_or_other_options(
    two_gpus, kwargs, message
):
    with pytest.raises(ValueError, match=message):
        dt.connect(n_workers=1, dashboard_address=False, set_as_default=False, **kwargs)


def test_connect_to_an_address_with_gpus_points_at_the_worker_command():
    with pytest.raises(TypeError, match=r"\(gpus\).*dasktensor worker ADDRESS --gpus all"):
        dt.connect("tcp://127.0.0.1:9", gpus="all")


# ----------------------------------------------------------------- a GPU worker's options


def test_a_gpu_worker_sees_its_device_alone_offers_gpu_1_and_has_no_memory_limit(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    options = gpu_worker_options(Device("1", "B", index=1), {"MEM": 2})
    assert options["resources"] == {"MEM": 2, "GPU": 1}
    assert options["nthreads"] == 1 and options["memory_limit"] == 0
    assert options["env"] == {
        "CUDA_VISIBLE_DEVICES": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }


def test_the_memory_settings_become_variables_and_the_environment_wins(monkeypatch):
    for v in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
              "PYTORCH_CUDA_ALLOC_CONF"):  # fmt: skip
        monkeypatch.delenv(v, raising=False)
    settings = {
        "dasktensor.gpu.jax-preallocate": True,
        "dasktensor.gpu.jax-memory-fraction": 0.4,
        "dasktensor.gpu.pytorch-alloc-conf": "expandable_segments:True",
        "dasktensor.gpu.memory-limit": "32GiB",
        "dasktensor.gpu.threads-per-worker": 2,
    }
    with dask.config.set(settings):
        options = gpu_worker_options(Device("0"))
        assert options["memory_limit"] == "32GiB" and options["nthreads"] == 2
        assert options["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
        assert options["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4"
        assert options["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")  # the user's own
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in gpu_worker_options(Device("0"))["env"]
    with dask.config.set({"dasktensor.gpu.jax-preallocate": None}):
        assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in gpu_worker_options(Device("0"))["env"]


# --------------------------------------------------- an embedded cluster with GPU workers


def _environment(
    names=("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "XLA_PYTHON_CLIENT_PREALLOCATE"),
):
    return {n: os.environ.get(n) for n in names}


def _runners_here() -> list[str]:
    from dasktensor.engine._runners import restored

    return sorted({r.name for r in restored() if r.compiled_functions})


def _where():
    """This process's id and the devices it sees."""
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")


class DeviceModel:
    """A model that says which worker and device it was built on."""

    def __init__(self):
        self.built_on = _where()

    def where(self):
        return self.built_on, _where()


@pytest.fixture(scope="module")
def gpu_client(fake_smi):
    """``dt.connect(n_workers=2, gpus=[0, 1])`` with the fake nvidia-smi on PATH, a
    resource and a variable for every worker."""
    saved = dict(os.environ)
    os.environ.update(environ(fake_smi, FAKE))
    for v in ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        os.environ.pop(v, None)
    try:
        client = dt.connect(
            n_workers=2,
            gpus=[0, 1],
            resources={"MEM": 1},  # every worker's
            env={"DASKTENSOR_TEST_MARK": "every worker"},
            dashboard_address=False,
            set_as_default=False,
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield client
    client.shutdown()
    client.close()


def test_connect_gpus_starts_cpu_workers_without_devices_and_a_worker_per_device(gpu_client):
    seen = {str(w.name): w for w in dt.info(gpu_client).workers}
    assert sorted(seen) == ["0", "1", "gpu-0", "gpu-1"]
    for cpu in ("0", "1"):
        w = seen[cpu]
        assert w.devices == () and w.resources == {"MEM": 1}
        assert w.env["CUDA_VISIBLE_DEVICES"] == "" and w.memory_limit  # Dask's limit
    for device in ("0", "1"):
        w = seen[f"gpu-{device}"]
        assert [(d.id, d.name) for d in w.devices] == [(device, FAKE[int(device)])]
        assert w.resources == {"MEM": 1, "GPU": 1} and w.nthreads == 1
        assert w.memory_limit is None  # the nanny never restarts it for host memory
        assert w.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    # what the worker processes really have, read there
    env = gpu_client.run(_environment)
    by_name = {str(w.name): env[w.address] for w in seen.values()}
    assert by_name["0"]["CUDA_VISIBLE_DEVICES"] == "" == by_name["1"]["CUDA_VISIBLE_DEVICES"]
    assert by_name["gpu-1"] == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # fmt: skip
    assert by_name["0"]["XLA_PYTHON_CLIENT_PREALLOCATE"] is None
    # the caller's env= reaches every worker, GPU workers included
    marks = gpu_client.run(_environment, ("DASKTENSOR_TEST_MARK",))
    marks = {a: env["DASKTENSOR_TEST_MARK"] for a, env in marks.items()}
    assert set(marks.values()) == {"every worker"} and len(marks) == 4


def test_info_is_a_table_of_the_workers_and_their_devices(gpu_client):
    text = str(dt.info(gpu_client))
    lines = text.splitlines()
    assert lines[0].startswith(f"Scheduler {gpu_client.scheduler.address}: 4 worker(s)")
    assert lines[1].split()[:8] == [
        "name",
        "address",
        "threads",
        "memory",
        "limit",
        "resources",
        "holds",
        "(calls)",
    ]
    row = next(line for line in lines if line.startswith("gpu-1 "))
    assert "no limit" in row and "GPU=1" in row
    assert "1: Fake A100 80GB, 101.00 MiB of 79.65 GiB used" in row
    assert "(XLA_PYTHON_CLIENT_PREALLOCATE=false)" in row
    cpu = next(line for line in lines if line.startswith("0 "))
    assert 'none visible (CUDA_VISIBLE_DEVICES="")' in cpu
    assert "<table>" in dt.info(gpu_client)._repr_html_()


def test_a_placed_block_runs_on_the_gpu_workers_only(gpu_client):
    x = pt.dvector("x")
    with dt.annotate(resources={"GPU": 1}, name="on-gpu"):
        y = pt.tanh(pt.outer(x, x)).sum(axis=0)
    out = (y**2).sum() + x.sum()
    f = dt.function([x], out, scheduler=gpu_client)
    xv = np.linspace(-1, 1, 7)
    assert f(xv) == pytest.approx(pytensor.function([x], out)(xv), rel=1e-12)
    compiled = gpu_client.run(_runners_here)
    names = {str(w.name): compiled[w.address] for w in dt.info(gpu_client).workers}
    holders = sorted(n for n, runners in names.items() if "on-gpu" in runners)
    assert holders and set(holders) <= {"gpu-0", "gpu-1"}, names
    # dt.info() says which workers hold the block, and their devices
    seen = dt.info(gpu_client).workers
    holding = {str(w.name): w for w in seen if "on-gpu" in w.holds}
    assert holding and set(holding) <= {"gpu-0", "gpu-1"}
    assert all(w.devices for w in holding.values())
    called = {n for n, w in holding.items() if w.calls.get("on-gpu", 0) >= 1}
    assert called == set(holders)  # the calls went where the block was compiled
    row = next(line for line in str(dt.info(gpu_client)).splitlines() if "on-gpu (" in line)
    assert "Fake A100 80GB" in row


def test_a_remote_model_asking_for_a_gpu_is_built_and_called_on_gpu_workers(gpu_client):
    model = dt.RemoteModel(DeviceModel, name="device-model", resources={"GPU": 1},
                           scheduler=gpu_client)  # fmt: skip
    try:
        built_on, called_on = model.call("where")
        assert built_on == called_on
        names = {w.address: str(w.name) for w in dt.info(gpu_client).workers}
        by_pid = {pid: names[a] for a, pid in gpu_client.run(os.getpid).items()}
        pid, device = built_on
        assert (by_pid[pid], device) in {("gpu-0", "0"), ("gpu-1", "1")}
        assert {names[a] for a in model.workers()} == {"gpu-0", "gpu-1"}
    finally:
        model.close()


def _calls_page(dask_scheduler):
    """What the dashboard's calls page shows now (its Bokeh view, made on the scheduler
    from the channel monitor, as the page makes it): the table's rows and the calls
    plotted, by column."""
    from dasktensor_worker.dashboard import CallsView
    from dasktensor_worker.monitor import monitor_of

    view = CallsView(monitor_of(dask_scheduler))
    view.update()  # (and the monitor fetches the calls themselves from now on)
    return {"table": dict(view.models.data), "calls": dict(view.calls.data)}


def test_the_calls_page_shows_each_replicas_device_beside_its_worker(gpu_client):
    seen = {str(w.name): w.address for w in dt.info(gpu_client).workers}
    on_gpu = dt.RemoteModel(DeviceModel, name="page-gpu", resources={"GPU": 1},
                            scheduler=gpu_client)  # fmt: skip
    on_cpu = dt.RemoteModel(DeviceModel, name="page-cpu", workers=["0"], replicas=1,
                            allow_other_workers=False, scheduler=gpu_client)  # fmt: skip
    try:
        gpu_client.run_on_scheduler(_calls_page)  # the page is open: calls are fetched
        for _ in range(4):
            on_gpu.call("where")
            on_cpu.call("where")
        expected = {
            "page-gpu": "; ".join(
                f"{seen[f'gpu-{d}']}: GPU {d} (Fake A100 80GB)"
                for d in sorted(("0", "1"), key=lambda d: seen[f"gpu-{d}"])
            ),
            "page-cpu": f"{seen['0']}: cpu",
        }

        def shown():
            page = gpu_client.run_on_scheduler(_calls_page)
            where = dict(zip(page["table"]["model"], page["table"]["where"], strict=True))
            plotted = {m for m in page["calls"]["model"] if m.startswith("page-")}
            done = all(where.get(m) == w for m, w in expected.items())
            return page if done and plotted == set(expected) else None

        page = eventually(shown, 20)
        table = gpu_client.run_on_scheduler(_calls_page)["table"]
        assert page, (expected, dict(zip(table["model"], table["where"], strict=True)))
        # each call plotted says its worker's device (on hover)
        calls = page["calls"]
        by_model: dict[str, set] = {}
        for model, worker, device in zip(calls["model"], calls["worker"], calls["device"],
                                         strict=True):  # fmt: skip
            by_model.setdefault(model, set()).add((worker, device))
        gpus = {(seen[f"gpu-{d}"], f"GPU {d} (Fake A100 80GB)") for d in ("0", "1")}
        assert by_model["page-gpu"] and by_model["page-gpu"] <= gpus
        assert by_model["page-cpu"] == {(seen["0"], "cpu")}
    finally:
        on_gpu.close()
        on_cpu.close()


def test_the_plan_says_which_worker_and_device_each_placed_block_ran_on(gpu_client):
    x = pt.dvector("x")
    with dt.annotate(resources={"GPU": 1}, name="plan-gpu"):
        y = pt.tanh(pt.outer(x, x)).sum(axis=0)
    with dt.annotate(resources={"MEM": 1}, workers=["0"], allow_other_workers=False,
                     name="plan-cpu"):  # fmt: skip
        z = pt.exp(pt.outer(x, x)).sum(axis=1)
    out = (y**2).sum() + z.sum()
    f = dt.function([x], out, scheduler=gpu_client)
    assert "ran on" not in str(f.plan)  # not called yet
    xv = np.linspace(-1, 1, 5)
    assert f(xv) == pytest.approx(pytensor.function([x], out)(xv), rel=1e-12)
    seen = {str(w.name): w.address for w in dt.info(gpu_client).workers}
    lines = str(f.plan).splitlines()

    def ran(block: str) -> str:
        at = next(i for i, line in enumerate(lines) if f"] {block} " in line)
        assert lines[at + 1].startswith("        ran on: "), lines
        return lines[at + 1].removeprefix("        ran on: ")

    gpu = ran("plan-gpu").split("; ")
    assert gpu and set(gpu) <= {
        f"gpu-{d} ({seen[f'gpu-{d}']}): GPU {d} (Fake A100 80GB)" for d in ("0", "1")
    }, gpu
    assert ran("plan-cpu") == f"0 ({seen['0']}): cpu"
    # the same in Jupyter's table, and on the boxes' tooltips
    page = f.plan._repr_html_()
    assert "ran on (worker: device)" in page and "GPU" in page
    assert f"ran on: {gpu[0]}" in f.plan._repr_svg_()


def test_dasktensor_info_shows_the_gpus_each_worker_sees(gpu_client, capsys):
    assert main(["info", "--scheduler", gpu_client.scheduler.address]) == 0
    out = capsys.readouterr().out
    assert "GPUs:       2 device(s), seen by 2 worker(s)\n" in out
    section = out.split("GPUs:", 1)[1].splitlines()[1:]
    rows = {line.split()[0]: line for line in section if line.startswith("  ")}
    assert "0: Fake A100 80GB" in rows["gpu-0"] and "1: Fake A100 80GB" in rows["gpu-1"]
    assert 'none visible (CUDA_VISIBLE_DEVICES="")' in rows["0"]


# ------------------------------------------------------- GPU workers for a running cluster


def test_the_worker_command_starts_a_worker_per_gpu_and_stops_them_on_sigterm(fake_smi, tmp_path):
    from distributed import Client

    env = {**os.environ, **environ(fake_smi, FAKE), "PYTHONPATH": str(ROOT)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    with local_cluster(n_workers=0) as cluster, Client(cluster, set_as_default=False) as client:
        log = open(tmp_path / "worker.log", "w")  # noqa: SIM115
        command = [sys.executable, "-m", "dasktensor", "worker", cluster.scheduler_address,
                   "--gpus", "all", "--name-prefix", "host", "--host", "127.0.0.1"]  # fmt: skip
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            client.wait_for_workers(2, timeout=120)
            seen = {str(w.name): w for w in dt.info(client).workers}
            assert sorted(seen) == ["host-gpu-0", "host-gpu-1"]
            for device in ("0", "1"):
                w = seen[f"host-gpu-{device}"]
                assert [d.id for d in w.devices] == [device]
                assert w.resources == {"GPU": 1} and w.memory_limit is None
                assert w.env["CUDA_VISIBLE_DEVICES"] == device
                assert w.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
            assert eventually(lambda: not client.scheduler_info(n_workers=-1)["workers"], 30)
        finally:
            if process.poll() is None:
                process.kill()
            log.close()
        out = (tmp_path / "worker.log").read_text()
        assert "Starting 2 GPU worker(s)" in out and "GPU workers stopped." in out, out


def test_the_worker_command_joins_a_tls_cluster_with_certificate_files(fake_smi, tmp_path):
    from distributed import Client
    from distributed.security import Security

    security = Security.temporary()
    files = []
    for option, pem in [
        ("--tls-ca-file", security.tls_ca_file),  # Security.temporary() holds PEM text
        ("--tls-cert", security.tls_worker_cert),
        ("--tls-key", security.tls_worker_key),
    ]:
        path = tmp_path / (option.strip("-") + ".pem")
        path.write_text(pem)
        files += [option, str(path)]
    env = {**os.environ, **environ(fake_smi, FAKE), "PYTHONPATH": str(ROOT)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with (
        local_cluster(n_workers=0, protocol="tls://", security=security) as cluster,
        Client(cluster, security=security, set_as_default=False) as client,
    ):
        address = cluster.scheduler_address
        command = [sys.executable, "-m", "dasktensor", "worker", address, "--gpus", "1",
                   "--host", "127.0.0.1", *files]  # fmt: skip
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            client.wait_for_workers(1, timeout=120)
            (worker,) = dt.info(client).workers
            assert worker.address.startswith("tls://127.0.0.1:")
            assert [d.id for d in worker.devices] == ["0"] and worker.resources == {"GPU": 1}
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0


def test_the_worker_command_wants_the_three_tls_files_together(capsys):
    assert main(["worker", "tls://127.0.0.1:9", "--gpus", "all", "--tls-ca-file", "ca.pem"]) == 2
    assert "--tls-ca-file, --tls-cert and --tls-key go together" in capsys.readouterr().err


# ------------------------------------------------------------ a nanny's memory restart


class Hungry:
    """A model whose build takes more host memory than its worker may use."""

    def __init__(self, nbytes: int):
        self.block = np.ones(nbytes // 8)  # touched: resident
        time.sleep(30)  # the nanny looks every 100 ms

    def f(self):
        return 0.0


def test_a_build_lost_to_the_nannys_memory_restart_is_named_as_such():
    from distributed import Client

    with (
        local_cluster(n_workers=1, memory_limit="600MiB") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        factory = functools.partial(Hungry, 700 * 2**20)
        model = dt.RemoteModel(factory, name="hungry", scheduler=client)
        with pytest.raises(dt.RemoteModelError) as info:
            model.call("f")
    message = str(info.value)
    assert "restarted it for memory" in message, message
    assert "of its 600.00 MiB memory limit" in message
    assert "--memory-limit" in message and "dasktensor.gpu.memory-limit" in message
    assert "left while building" not in message


class Greedy:
    """A model whose call takes more host memory than its worker may use."""

    def f(self, nbytes):
        block = np.ones(nbytes // 8)  # touched: resident
        if nbytes > 2**20:  # held while the nanny looks (every 100 ms) and restarts it
            time.sleep(30)
        return float(block[0])


def test_a_call_lost_to_the_nannys_memory_restart_is_named_as_such():
    from distributed import Client

    with (
        dask.config.set({"dasktensor.remote.allowed-failures": 0}),
        local_cluster(n_workers=1, memory_limit="600MiB") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        model = dt.RemoteModel(Greedy, name="greedy", scheduler=client)
        assert model.call("f", 8) == 1.0  # built and serving
        with pytest.raises(dt.RemoteModelError) as info:
            model.call("f", 700 * 2**20)
    message = str(info.value)
    assert "1 workers failed while calling 'f'" in message, message
    assert "restarted it for memory" in message, message
    assert "of its 600.00 MiB memory limit" in message
    assert "--memory-limit" in message and "check the workers' logs" not in message


def test_the_worker_command_describes_itself(capsys):
    with pytest.raises(SystemExit) as info:
        main(["worker", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("--gpus", "--memory-limit", "--nthreads", "CUDA_VISIBLE_DEVICES", "GPU=1",
                  "nvidia-smi", "dask cuda worker", "no host memory limit"):  # fmt: skip
        assert words in out, words
