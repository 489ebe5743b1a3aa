"""torchfeed.cluster: launcher environments, ports, worker discovery, device groups, DDP."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from helpers import PROMPT
from torchfeed import LocalWorkers
from torchfeed.cluster import (
    Environment,
    device_group,
    discovery,
    environment,
    init_distributed,
    split_workers,
    workers,
)
from torchfeed.cluster import env as cenv
from torchfeed.errors import Timeout, TorchfeedError

TESTS = Path(__file__).resolve().parent
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHFEED_WORKERS",
    "TORCHFEED_ADDRESS_FILE",
    "TORCHFEED_NUM_WORKERS",
    "TORCHFEED_GPUS_PER_MODEL",
)


@pytest.fixture
def clean_env(monkeypatch):
    """os.environ without any launcher variable; whatever a test sets is removed afterwards."""
    for name in LAUNCH_VARS:  # registered with monkeypatch even when absent, so teardown removes them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")):
            monkeypatch.delenv(name)
    return monkeypatch


# -- environment() for each launcher ------------------------------------------------


def test_torchrun_variables():
    env = environment(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29511",
            "TORCHELASTIC_RUN_ID": "abc",
            "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "2",
        }
    )
    assert env == Environment(5, 1, 8, 4, 1, "node0", 29511, "torchrun", "abc")
    plain = environment({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (plain.source, plain.local_rank, plain.local_world_size, plain.node_rank) == ("env", 0, 1, 3)


# Variables as Slurm 22.05 sets them in the tasks of `srun --het-group=0` (2 tasks on g1)
# and of `srun --het-group=0,1` (tasks on g1, c1, c2) in a heterogeneous job.
HET_COMMON = {
    "SLURM_JOB_ID": "41",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "g1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "c[1-2]",
}


def test_slurm_het_group_step():
    env = environment(
        {
            **HET_COMMON,
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "0",
            "SLURM_STEP_ID": "1",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_NODELIST": "g1",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURMD_NODENAME": "g1",
            "SLURM_JOB_NODELIST": "g1",
        }
    )
    assert env == Environment(1, 1, 2, 2, 0, "g1", cenv.derive_port("41.1"), "slurm", "41")


def test_slurm_step_spanning_het_groups():
    env = environment(
        {
            **HET_COMMON,
            "SLURM_PROCID": "2",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "1",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_NODELIST": "c[1-2],g1",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2),2",
            "SLURMD_NODENAME": "c1",
        }
    )
    # rank 0 runs on group 0's first node, although the sorted node list starts with c1
    assert (env.rank, env.world_size, env.local_world_size, env.node_rank, env.master_addr) == (
        2,
        4,
        1,
        1,
        "g1",
    )


def test_slurm_multi_node_and_respected_variables():
    base = {
        "SLURM_JOB_ID": "77",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_STEP_NODELIST": "gpu[08-10]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURMD_NODENAME": "gpu10",
    }
    env = environment(base)
    assert (env.local_world_size, env.node_rank, env.master_addr) == (2, 2, "gpu08")
    assert environment({**base, "SLURM_STEP_RESV_PORTS": "12010-12013"}).master_port == 12010
    kept = environment({**base, "MASTER_ADDR": "head", "MASTER_PORT": "23456"})
    assert (kept.master_addr, kept.master_port) == ("head", 23456)


def test_batch_script_is_a_single_process():
    env = environment({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})  # no step variables
    assert (env.source, env.world_size, env.job_id, env.master_port) == (
        "single",
        1,
        "9",
        cenv.derive_port("9"),
    )
    assert environment({}) == Environment()


def test_mpi_launchers():
    ompi = environment(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "n0",
            "PMIX_NAMESPACE": "ns1",
        }
    )
    assert ompi == Environment(3, 1, 4, 2, 1, "n0", cenv.derive_port("ns1"), "openmpi", "ns1")
    one_node = environment(
        {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert one_node.master_addr == "127.0.0.1"
    mpich = environment(
        {
            "PMI_RANK": "2",
            "PMI_SIZE": "3",
            "MPI_LOCALRANKID": "0",
            "MPI_LOCALNRANKS": "1",
            "MASTER_ADDR": "a",
            "MASTER_PORT": "2000",
        }
    )
    assert mpich == Environment(2, 0, 3, 1, 2, "a", 2000, "mpich", None)
    pmi = environment({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "b", "MASTER_PORT": "2001"})
    assert (pmi.source, pmi.rank, pmi.world_size) == ("pmi", 1, 2)


def test_unknown_master_is_a_clear_error():
    multi_node = environment(
        {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert multi_node.master_addr is None
    with pytest.raises(TorchfeedError, match="set MASTER_ADDR"):
        init_distributed(env=multi_node)


def test_dask_worker(clean_env):
    addresses = ["tcp://10.0.0.2:4000", "tcp://10.0.0.1:5000", "tcp://10.0.0.1:4000"]
    me = types.SimpleNamespace(address="tcp://10.0.0.1:5000")
    info = {"address": "tcp://10.0.0.9:8786", "workers": {a: {} for a in addresses}}
    client = types.SimpleNamespace(scheduler_info=lambda n_workers=-1: info)
    fake = types.SimpleNamespace(get_worker=lambda: me, get_client=lambda: client)
    clean_env.setitem(sys.modules, "distributed", fake)
    env = environment()
    assert env == Environment(
        1, 1, 3, 2, 0, "10.0.0.1", cenv.derive_port("tcp://10.0.0.9:8786"), "dask", "tcp://10.0.0.9:8786"
    )

    def outside():
        raise ValueError("No worker found")

    clean_env.setitem(sys.modules, "distributed", types.SimpleNamespace(get_worker=outside))
    assert environment().source == "single"


@pytest.mark.dask
def test_dask_local_cluster(clean_env):
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=2, processes=False, threads_per_worker=1, dashboard_address=None
        ) as lc,
        distributed.Client(lc) as client,
    ):
        addresses = sorted(client.scheduler_info()["workers"])
        envs = [client.submit(environment, pure=False, workers=[a]).result(timeout=30) for a in addresses]
    assert [(e.source, e.rank, e.world_size) for e in envs] == [("dask", 0, 2), ("dask", 1, 2)]
    assert [(e.local_rank, e.local_world_size, e.node_rank) for e in envs] == [(0, 2, 0), (1, 2, 0)]
    assert len({(e.master_addr, e.master_port, e.job_id) for e in envs}) == 1


# -- ports ---------------------------------------------------------------------------


def test_derived_ports_are_stable_and_spread():
    assert cenv.derive_port("123") == cenv.derive_port("123")
    ports = {cenv.derive_port(str(job)) for job in range(1000, 1200)}
    assert len(ports) > 190 and all(cenv.PORT_MIN <= p < cenv.PORT_MIN + cenv.PORT_SPAN for p in ports)


def test_choose_port_checks_the_port_is_free():
    job = f"test-{secrets.token_hex(4)}"
    first, second = cenv.derive_port(job, 0), cenv.derive_port(job, 1)
    assert cenv.choose_port(job, environ={}) == first
    with socket.socket() as busy:
        busy.bind(("", first))
        busy.listen()
        assert cenv.choose_port(job, environ={}) == second
    assert cenv.choose_port(job, environ={"MASTER_PORT": "24680"}) == 24680
    free = cenv.choose_port(environ={})  # no job id: any free port
    assert cenv.port_is_free(free)


def test_port_helper_command(clean_env):
    job = f"cmd-{secrets.token_hex(4)}"
    env = dict(os.environ, SLURM_JOB_ID=job)
    out = subprocess.run(
        [sys.executable, "-m", "torchfeed.cluster", "port"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and int(out.stdout) in (cenv.derive_port(job, 0), cenv.derive_port(job, 1))


def test_export_keeps_existing_variables(clean_env):
    clean_env.setenv("MASTER_PORT", "1111")
    cenv._export(Environment(1, 0, 2, 2, 0, "h", 2222, "slurm", "1"))
    assert (
        os.environ["MASTER_PORT"] == "1111" and os.environ["RANK"] == "1" and os.environ["MASTER_ADDR"] == "h"
    )


# -- workers() -------------------------------------------------------------------------


def test_split_and_shared(clean_env):
    addrs = [f"w{i}:1" for i in range(5)]
    assert split_workers(addrs, 0, 2) == ["w0:1", "w2:1", "w4:1"]
    assert split_workers(addrs, 1, 2) == ["w1:1", "w3:1"]
    assert split_workers(addrs[:2], 2, 3) == ["w0:1"]  # fewer workers than ranks: share round-robin
    assert split_workers(addrs, 1, 2, shared=True) == addrs
    clean_env.setenv("TORCHFEED_WORKERS", "a:1 b:2,c:3 d:4")
    assert workers(rank=1, world_size=2) == ["b:2", "d:4"]
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    assert workers() == ["a:1", "c:3"] and workers(shared=True) == ["a:1", "b:2", "c:3", "d:4"]
    with pytest.raises(ValueError, match="outside"):
        split_workers(addrs, 2, 2)


def test_address_file_wait(clean_env, tmp_path):
    path = tmp_path / "workers"

    def register():
        for addr in ("h1:10", "h2:20", "h3:30"):
            time.sleep(0.2)
            with open(path, "a") as f:
                f.write(addr + "\n")

    t = threading.Thread(target=register)
    t.start()
    try:
        got = workers(address_file=str(path), expected=2, rank=0, world_size=1, timeout=10)
    finally:
        t.join()
    assert got == ["h1:10", "h2:20"]  # the first `expected`, the same on every rank
    clean_env.setenv("TORCHFEED_ADDRESS_FILE", str(path))
    clean_env.setenv("TORCHFEED_NUM_WORKERS", "3")
    assert workers(rank=1, world_size=2) == ["h2:20"]


def test_address_file_timeout_and_errors(clean_env, tmp_path):
    path = tmp_path / "workers"
    path.write_text("h1:10\n")
    t0 = time.monotonic()
    with pytest.raises(Timeout, match=r"only 1 of 2 workers registered in .*workers within 0.5 s"):
        workers(address_file=str(path), expected=2, rank=0, world_size=1, timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 0.5 + PROMPT
    with pytest.raises(TorchfeedError, match="stopped before registering"):
        discovery.wait_for_addresses(str(path), 2, timeout=30, alive=lambda: False)
    with pytest.raises(TorchfeedError, match="TORCHFEED_WORKERS"):
        workers(rank=0, world_size=1)


@pytest.mark.slow
def test_address_file_from_real_workers(clean_env, tmp_path):
    path = tmp_path / "workers"
    with LocalWorkers(2, extra_args=["--address-file", str(path)]) as w:
        got = workers(address_file=str(path), expected=2, shared=True, timeout=30)
        assert sorted(got) == sorted(w.addresses)
        out = subprocess.run(
            [sys.executable, "-m", "torchfeed.cluster", "wait-workers", str(path), "2", "--timeout", "10"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.split() == got


def test_wait_workers_command_fails_fast_when_the_workers_died(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    # its own timeout is far longer than subprocess.run's: only the dead pid can end it in time
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchfeed.cluster",
            "wait-workers",
            str(tmp_path / "none"),
            "2",
            "--timeout",
            "600",
            "--pid",
            str(dead.pid),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "stopped before registering: 0 of 2" in out.stderr


# -- device_group --------------------------------------------------------------------


def test_device_group_cpu(clean_env):
    assert device_group(2, local_rank=3) == [torch.device("cpu")] * 2
    clean_env.setenv("TORCHFEED_GPUS_PER_MODEL", "3")
    assert len(device_group()) == 3
    with pytest.raises(ValueError):
        device_group(0)


def test_device_group_gpu_indices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert device_group(2, local_rank=1) == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert device_group(4, local_rank=1) == [torch.device("cuda", i) for i in range(4, 8)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # each task sees only its own GPUs
    assert device_group(2, local_rank=3) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(TorchfeedError, match="at most 1 task"):
        device_group(2, local_rank=1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a machine with at least 2 GPUs")
def test_device_group_real_gpus():
    devices = device_group(2, local_rank=0)
    a = torch.ones(4, device=devices[0])
    assert torch.equal((a.to(devices[1]) * 2).cpu(), torch.full((4,), 2.0))


# -- torch.distributed ---------------------------------------------------------------------


def test_single_process_is_a_no_op(clean_env):
    import torch.distributed as dist

    env = init_distributed()
    assert env.world_size == 1 and not dist.is_initialized()


def test_busy_master_port_is_reported(clean_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = Environment(0, 0, 2, 2, 0, "127.0.0.1", port, "slurm", "1")
        with pytest.raises(TorchfeedError, match=f"127.0.0.1:{port} .*already in use.*MASTER_PORT"):
            init_distributed(env=env, timeout=5)


@pytest.mark.slow
def test_ddp_over_a_model_split_across_two_devices(clean_env, tmp_path):
    """Two srun-like ranks: init_distributed (derived port), DDP over a 2-device replica, agreed stop."""
    from cluster_ddp import SplitModel, batch

    job = f"ddp-{secrets.token_hex(4)}"
    base = dict(
        os.environ,
        SLURM_JOB_ID=job,
        SLURM_STEP_ID="0",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_NODEID="0",
        SLURM_STEP_NODELIST="localhost",
        SLURMD_NODENAME="localhost",
        SLURM_STEP_TASKS_PER_NODE="2",
        TORCHFEED_GPUS_PER_MODEL="2",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    if not cenv.port_is_free(cenv.derive_port(f"{job}.0")):
        pytest.skip("the derived port happens to be busy on this machine")
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "cluster_ddp.py"), str(tmp_path / f"r{r}.json")],
            env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2))
    assert (r0["source"], r0["world_size"], r1["rank"], r1["local_rank"]) == ("slurm", 2, 1, 1)
    assert r0["master_port"] == r1["master_port"] == cenv.derive_port(f"{job}.0")
    assert r0["devices"] == ["cpu", "cpu"] and r0["backend"] == "gloo"
    assert (r0["local_flag"], r1["local_flag"], r0["agreed"], r1["agreed"]) == (False, True, True, True)
    assert r0["params"] == r1["params"]
    # reference: one process, gradients averaged over both ranks' batches as DDP does
    torch.manual_seed(0)
    model = SplitModel([torch.device("cpu")] * 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        losses = [((model(x) - y) ** 2).mean() for x, y in (batch(r, step) for r in range(2))]
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    for got, want in zip(r0["params"], model.parameters()):
        assert torch.allclose(torch.tensor(got), want.detach().flatten(), atol=1e-6)
