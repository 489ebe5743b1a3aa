"""torchfeed.dask on a real distributed.LocalCluster with worker processes (and a real S3 server)."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import secrets
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import Client, LocalCluster, wait
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import torchfeed
import torchfeed.dask as tfd
from helpers import RangeDataset, dask_cluster, print_lots, secret_seen_by_worker_code, wait_for
from pool_conformance import check_pool
from s3server import S3Server
from test_datasets import make_tree, to_tensor
from torchfeed.dask.comms import in_clear
from torchfeed.dask.pool import POOL_PLUGIN
from torchfeed.dask.ranks import _order_workers
from torchfeed.datasets import ImageFolder
from torchfeed.util import free_port, pid_alive

pytestmark = pytest.mark.dask

# conftest's secret; not imported from conftest, whose import (in Dask workers unpickling this
# module's functions) would set TORCHFEED_SECRET there again
SECRET = os.environ.get("TORCHFEED_SECRET")
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def client():
    with (
        dask_cluster(2) as cluster,
        Client(cluster) as c,
    ):
        c.wait_for_workers(2, timeout=60)
        yield c


# ---------------------------------------------------------------- functions run as ranks


def allreduce(scale):
    import distributed

    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return {
        "sum": t.item(),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {k: os.environ[k] for k in RANK_ENV},
        "worker": distributed.get_worker().address,
    }


def train_step(x, y, lr):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    loss = torch.nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world])
    opt.zero_grad()
    loss.backward()  # DDP averages the gradients of the ranks
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fail_in_rank_1(handler=None):
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    if handler is not None:
        handler.submit_result("ok.txt", "rank 0 was fine")
    return "ok"


def report(handler, big):
    rank = dist.get_rank()
    handler.submit_result(f"rank{rank}/hello.txt", f"hello from {rank}")
    handler.submit_result(f"rank{rank}/raw.bin", bytes([rank]) * 3)
    handler.submit_metrics({"loss": torch.tensor(0.5 + rank)}, step=1)
    if rank == 0:
        handler.submit_result("checkpoint-2026-01-01T00:00:00.pt", {"w": torch.arange(4.0)})
        handler.submit_result("big.bin", big)  # above inline_limit: fetched from the rank's worker
    return rank


def stream_metrics(handler, n):
    for step in range(n):
        handler.submit_metrics(step=step, loss=1.0 / (step + 1))


def load_shard(addresses):
    """A DDP rank reading its DistributedSampler shard from Dask-hosted torchfeed workers."""
    ds = torchfeed.RemoteDataset(addresses, RangeDataset, 10)
    sampler: DistributedSampler[Any] = DistributedSampler(
        ds, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False
    )
    return [y for _, ys in torchfeed.RemoteDataLoader(ds, batch_size=2, sampler=sampler) for y in ys.tolist()]


def torchfeed_pids(dask_worker=None):
    plugin = dask_worker.plugins.get(tfd.workers.PLUGIN_NAME)
    return [p.pid for p in plugin.processes] if plugin is not None else []


def secret_here():
    """The secret this Dask worker process finds, and what its environment holds."""
    from torchfeed.protocol import auth

    return auth.load_secret().value.decode(), os.environ.get("TORCHFEED_SECRET")


# ---------------------------------------------------------------- DDP


def rank_env():
    return {k: os.environ.get(k) for k in RANK_ENV}


@pytest.mark.slow
def test_allreduce_across_two_ranks(client):
    before = client.run(rank_env)
    futures = tfd.run(
        client, allreduce, 2.0, backend="gloo", init_kwargs={"timeout": datetime.timedelta(seconds=60)}
    )
    results = client.gather(futures)
    assert [r["sum"] for r in results] == [6.0, 6.0]  # 2 * (1 + 2)
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert {r["backend"] for r in results} == {"gloo"}
    assert sorted(r["worker"] for r in results) == sorted(client.scheduler_info()["workers"])
    envs = [r["env"] for r in results]
    assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["MASTER_ADDR"] for e in envs} == {
        "127.0.0.1"
    }
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    # the rank's environment is undone afterwards, and the default backend here is gloo
    assert client.run(rank_env) == before
    assert [r["backend"] for r in client.gather(tfd.run(client, allreduce, 1.0))] == ["gloo", "gloo"]


@pytest.mark.slow
def test_training_step_matches_single_process(client):
    torch.manual_seed(1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    states = client.gather(tfd.run(client, train_step, x, y, 0.1))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    loss = (
        sum((torch.nn.functional.mse_loss(model(x[r::2]), y[r::2]) for r in range(2)), torch.tensor(0.0)) / 2
    )
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            p.sub_(0.1 * p.grad)
    for state in states:
        for k, v in model.state_dict().items():
            assert torch.allclose(state[k], v, atol=1e-6), k


def test_error_in_rank_1_is_reported_with_its_rank(client):
    futures = tfd.run(client, fail_in_rank_1)
    with pytest.raises(tfd.RankError) as info:
        client.gather(futures)
    err = info.value
    assert err.rank == 1 and err.world_size == 2 and err.remote_type == "ValueError"
    assert isinstance(err, torchfeed.RemoteError)
    assert "rank 1 of 2" in str(err) and "rank one is broken" in str(err) and "fail_in_rank_1" in str(err)
    assert futures[0].result() == "ok"
    # the process groups were destroyed: the workers can run DDP again
    assert [r["sum"] for r in client.gather(tfd.run(client, allreduce, 1.0))] == [3.0, 3.0]


def test_worker_order_groups_hosts():
    infos = {
        "tcp://10.0.0.2:1": {"host": "b", "pid": 1, "name": "0"},
        "tcp://10.0.0.1:2": {"host": "a", "pid": 2, "name": "w-10"},
        "tcp://10.0.0.1:3": {"host": "a", "pid": 3, "name": "w-9"},
    }
    assert _order_workers(infos) == ["tcp://10.0.0.1:3", "tcp://10.0.0.1:2", "tcp://10.0.0.2:1"]
    infos["tcp://10.0.0.1:3"]["pid"] = 2
    with pytest.raises(RuntimeError, match="same process"):
        _order_workers(infos)


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_run_needs_worker_processes():
    with LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, Client(cluster) as c:
        with pytest.raises(RuntimeError, match="one process per rank"):
            tfd.run(c, allreduce, 1.0)


# ---------------------------------------------------------------- results and metrics


def test_results_and_metrics_are_collected(client, tmp_path):
    handler = tfd.ResultsHandler(inline_limit=1024)
    big = os.urandom(4096)
    futures = tfd.run(client, report, handler, big)
    metrics: list = []
    written = handler.process_results(str(tmp_path / "out"), futures, on_metrics=metrics.append)
    out = tmp_path / "out"
    assert sorted(os.path.relpath(p, out) for p in written) == sorted(
        [
            "rank0/hello.txt",
            "rank1/hello.txt",
            "rank0/raw.bin",
            "rank1/raw.bin",
            "big.bin",
            "checkpoint-2026-01-01T00:00:00.pt",
        ]
    )
    assert (out / "rank1" / "hello.txt").read_text() == "hello from 1"
    assert (out / "rank1" / "raw.bin").read_bytes() == b"\x01\x01\x01"
    assert (out / "big.bin").read_bytes() == big
    state = torch.load(out / "checkpoint-2026-01-01T00:00:00.pt", weights_only=True)
    assert torch.equal(state["w"], torch.arange(4.0))
    assert sorted(metrics, key=lambda m: m["rank"]) == [
        {"loss": 0.5, "step": 1, "rank": 0},
        {"loss": 1.5, "step": 1, "rank": 1},
    ]
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]  # no temporary file left
    handler.close()


def test_metrics_stream(client):
    handler = tfd.ResultsHandler()
    futures = tfd.run(client, stream_metrics, handler, 5)
    seen = list(handler.metrics(futures))
    assert len(seen) == 10
    for rank in (0, 1):
        assert [m["step"] for m in seen if m["rank"] == rank] == [0, 1, 2, 3, 4]
    handler.close()


def test_results_with_a_failed_rank(client, tmp_path, caplog):
    handler = tfd.ResultsHandler()
    futures = tfd.run(client, fail_in_rank_1, handler)
    wait(futures)
    with pytest.raises(tfd.RankError, match="rank 1 of 2"):
        handler.process_results(str(tmp_path / "a"), futures)
    assert (tmp_path / "a" / "ok.txt").read_text() == "rank 0 was fine"  # written before raising

    futures = tfd.run(client, fail_in_rank_1, handler)
    with caplog.at_level(logging.ERROR, logger="torchfeed.dask"):
        written = handler.process_results(str(tmp_path / "b"), futures, raise_errors=False)
    assert written == [str(tmp_path / "b" / "ok.txt")]
    assert "rank 1 of 2" in caplog.text and "rank one is broken" in caplog.text
    with pytest.raises(ValueError, match="must be relative"):
        handler.submit_result("../escape.txt", "x")
    handler.close()


@pytest.mark.slow
def test_results_to_s3(client):
    s3 = S3Server.shared()
    prefix = f"s3://{s3.new_prefix()}/run1"
    handler = tfd.ResultsHandler(inline_limit=1024)
    futures = tfd.run(client, report, handler, b"x" * 2048)
    written = handler.process_results(prefix, futures, storage_options=s3.storage_options)
    assert len(written) == 6 and all(w.startswith("s3://") for w in written)
    fs = s3.filesystem()
    assert fs.cat(f"{prefix}/rank0/hello.txt") == b"hello from 0"
    assert fs.cat(f"{prefix}/big.bin") == b"x" * 2048
    handler.close()


# ---------------------------------------------------------------- Dask-hosted torchfeed workers


@pytest.mark.slow
def test_dask_hosted_workers_feed_remote_loaders(client, tmp_path):
    assert os.environ["TORCHFEED_SECRET"] == SECRET
    s3 = S3Server.shared()
    make_tree(str(tmp_path / "tree"))
    url = f"s3://{s3.new_prefix()}/images"
    s3.filesystem().put(str(tmp_path / "tree") + "/", url + "/", recursive=True)

    addresses = tfd.start_workers(client)
    try:
        assert len(addresses) == 2 and sorted(addresses.by_dask_worker) == sorted(
            client.scheduler_info()["workers"]
        )
        assert os.environ["TORCHFEED_SECRET"] == addresses.secret.value.decode() != SECRET  # a fresh secret
        # the Dask worker processes find it (for ranks), and keep it out of their environment
        assert set(client.run(secret_here).values()) == {(addresses.secret.value.decode(), SECRET)}
        for address in addresses:  # nor do the torchfeed workers have it in theirs
            seen = torchfeed.rpc_async(address, secret_seen_by_worker_code, timeout=60).wait()
            assert seen["os.environ"] is None and seen["subprocess"] == "", seen
            assert not seen["started with it"], seen
        assert type(pickle.loads(pickle.dumps(addresses))) is list  # the secret never travels with it

        ds = torchfeed.RemoteDataset(addresses, RangeDataset, 10)
        got = list(
            torchfeed.RemoteDataLoader(
                ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3)
            )
        )
        want = list(
            DataLoader(
                RangeDataset(10), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3)
            )
        )
        assert all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True)
        )

        images = torchfeed.RemoteDataset(
            addresses, ImageFolder, url, transform=to_tensor, storage_options=s3.storage_options
        )
        local = ImageFolder(url, transform=to_tensor, storage_options=s3.storage_options)
        for (x, y), (ex, ey) in zip(
            torchfeed.RemoteDataLoader(images, batch_size=4), DataLoader(local, batch_size=4), strict=True
        ):
            assert torch.equal(x, ex) and torch.equal(y, ey)

        shards = client.gather(tfd.run(client, load_shard, list(addresses)))  # ranks use them too
        assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
        pids = [p for ps in client.run(torchfeed_pids).values() for p in ps]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    finally:
        tfd.stop_workers(client)
    assert os.environ["TORCHFEED_SECRET"] == SECRET
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 20), "the torchfeed workers did not stop"
    assert set(client.run(secret_here).values()) == {(SECRET, SECRET)}


@pytest.mark.timeout(300)
def test_a_worker_that_prints_a_lot_does_not_block(client):
    """The Dask worker keeps reading its torchfeed workers' output after their address line."""
    addresses = tfd.start_workers(client, start_timeout=180)
    try:
        for address in addresses:
            assert torchfeed.rpc_async(address, print_lots, (256 * 1024,), timeout=60).wait() == 256 * 1024
    finally:
        tfd.stop_workers(client)


def test_start_workers_errors(client):
    with pytest.raises(ValueError, match="procs_per_worker"):
        tfd.start_workers(client, procs_per_worker=0)
    with pytest.raises(RuntimeError, match="(?s)could not start torchfeed workers on 2 of 2 .*in time"):
        tfd.start_workers(client, start_timeout=0.01)
    with pytest.raises(
        RuntimeError, match="(?s)exited with code 2 .*unrecognized arguments: --no-such-option"
    ):
        tfd.start_workers(client, worker_args=["--no-such-option"])
    assert [p for ps in client.run(torchfeed_pids).values() for p in ps] == []  # the late ones were stopped
    assert os.environ["TORCHFEED_SECRET"] == SECRET
    tfd.stop_workers(client)  # nothing running: no error


# ---------------------------------------------------------------- the secret's way through Dask


@pytest.mark.parametrize(
    "address, listen",
    [
        ("tcp://127.0.0.1:{port}", "127.0.0.1"),
        ("tcp://127.0.0.2:{port}", "127.0.0.2"),  # all of 127.0.0.0/8 is loopback
        ("tcp://127.255.1.3:{port}", "127.255.1.3"),
        ("tcp://localhost:{port}", "127.0.0.1"),
        ("tcp://[::1]:{port}", "::1"),
        ("tcp://[::ffff:127.0.0.1]:{port}", "127.0.0.1"),
        ("127.0.0.1:{port}", "127.0.0.1"),  # no scheme: tcp
    ],
)
def test_a_loopback_address_is_safe_while_this_user_listens_there(address, listen):
    """Loopback stays on this machine, and the kernel says the listening socket is ours: the
    secret may cross. With nothing of ours listening, another user could be: in clear."""
    import socket

    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    with socket.socket(family) as mine:
        mine.bind((listen, 0))
        mine.listen()
        port = mine.getsockname()[1]
        assert in_clear(address.format(port=port)) is False
    assert in_clear(address.format(port=port)) is True  # nobody listens there now


@pytest.mark.parametrize(
    "address, clear",
    [
        ("tls://10.0.0.5:8786", False),
        ("tls://scheduler.example.org:8786", False),
        ("wss://10.0.0.5:8786", False),
        ("tcp://10.0.0.5:8786", True),
        ("10.0.0.5:8786", True),
        ("tcp://192.0.2.2:8786", True),
        ("tcp://[fd00::2]:8786", True),
        ("tcp://0.0.0.0:8786", True),
        ("tcp://scheduler.example.org:8786", True),  # names are not resolved: a network
        ("tcp://localhost.example.org:8786", True),
        ("ws://10.0.0.5:8786", True),
        ("nosuchscheme://127.0.0.1:1", True),  # not provably safe
    ],
)
def test_which_dask_addresses_carry_a_secret_in_clear(address, clear):
    assert in_clear(address) is clear


@pytest.fixture(scope="module")
def advertised_cluster():
    """A Dask worker that advertises tcp://0.0.0.0 (not loopback to the check), listening on
    loopback: connections to 0.0.0.0 stay on this machine, so even without the check no
    byte leaves it."""
    port = free_port()
    with (
        dask_cluster(worker_port=port, contact_address=f"tcp://0.0.0.0:{port}") as cluster,
        Client(cluster) as c,
    ):
        c.wait_for_workers(1, timeout=60)
        assert list(c.scheduler_info(n_workers=-1)["workers"]) == [f"tcp://0.0.0.0:{port}"]
        yield c


def test_start_workers_refuses_to_send_the_secret_in_clear(advertised_cluster):
    c = advertised_cluster
    with pytest.raises(ValueError) as info:
        tfd.start_workers(c, host="127.0.0.1", start_timeout=30)
    message = str(info.value)
    assert "tcp://0.0.0.0:" in message and "not encrypted" in message
    for fix in ("Security(require_encryption=True", "secret_file=", "allow_insecure=True"):
        assert fix in message
    # nothing was sent: no torchfeed worker started, no secret adopted there, none exported here
    assert [p for ps in c.run(torchfeed_pids).values() for p in ps] == []
    assert set(c.run(secret_here).values()) == {(SECRET, SECRET)}
    assert os.environ["TORCHFEED_SECRET"] == SECRET


def test_start_workers_in_clear_when_allowed(advertised_cluster):
    c = advertised_cluster
    addresses = tfd.start_workers(c, host="127.0.0.1", allow_insecure=True, export_secret=False)
    try:
        assert torchfeed.rpc_async(addresses[0], os.getpid, secret=addresses.secret, timeout=30).wait() > 0
    finally:
        tfd.stop_workers(c)


def test_start_workers_with_a_shared_secret_file_sends_only_its_path(advertised_cluster, tmp_path):
    c = advertised_cluster
    value = secrets.token_hex(32)
    path = tmp_path / "secret"
    path.write_text(value + "\n")
    path.chmod(0o600)
    addresses = tfd.start_workers(c, host="127.0.0.1", secret_file=str(path), export_secret=False)
    try:
        assert addresses.secret.value == value.encode()
        assert torchfeed.rpc_async(addresses[0], os.getpid, secret=value, timeout=30).wait() > 0
        assert set(c.run(secret_here).values()) == {(value, SECRET)}  # read there, not sent
        seen = torchfeed.rpc_async(addresses[0], secret_seen_by_worker_code, secret=value, timeout=60).wait()
        assert seen["os.environ"] is None and not seen["started with it"], seen
    finally:
        tfd.stop_workers(c)
    with pytest.raises(ValueError, match="not both"):
        tfd.start_workers(c, secret=value, secret_file=str(path))


@pytest.mark.slow
def test_start_workers_sends_the_secret_only_to_the_workers_it_checked(client, monkeypatch):
    # a Dask worker that joins after the check is not sent the secret (it was not checked)
    first = sorted(client.scheduler_info()["workers"])[0]
    monkeypatch.setattr(tfd.workers, "refuse_clear_transport", lambda client, what: [first])
    addresses = tfd.start_workers(client, export_secret=False)
    try:
        assert list(addresses.by_dask_worker) == [first] and len(addresses) == 1
    finally:
        tfd.stop_workers(client)


def _pool_addresses(dask_worker=None) -> list[str]:
    plugin = dask_worker.plugins.get(POOL_PLUGIN)
    return plugin.report()["addresses"] if plugin is not None else []


@pytest.mark.slow
def test_the_dask_pool_passes_the_pool_conformance_checks(client):
    """torchfeed.dask.Pool does what every pool does (tests/pool_conformance.py) on this module's
    cluster: a Dask worker killed takes its torchfeed worker along, the nanny starts it again and
    the pool gives it a new one (the request holds); the secret goes to each checked Dask worker
    by call, never into an environment. The cluster is back at two Dask workers afterwards."""
    pool = tfd.Pool(client, secret=secrets.token_hex(32), export_secret=False, poll=0.25)
    session = torchfeed.Session(secret=pool.secret)

    def kill_its_dask_worker(address: str) -> None:
        (host,) = [w for w, own in client.run(_pool_addresses).items() if address in own]
        os.kill(client.run(os.getpid, workers=[host])[host], signal.SIGKILL)

    try:
        assert os.environ["TORCHFEED_SECRET"] == SECRET  # not exported
        check_pool(pool, kill_its_dask_worker, replaced=True, secret=pool.secret.value, session=session)
    finally:
        pool.close()
        session.close()
        assert client.cluster is not None
        client.cluster.scale(2)
        client.wait_for_workers(2, timeout=120)


def test_torchfeed_workers_end_with_their_dask_worker(client):
    """Last in this module: it kills one Dask worker and retires the other."""
    addresses = tfd.start_workers(client, secret=secrets.token_hex(32), export_secret=False)
    try:
        assert os.environ["TORCHFEED_SECRET"] == SECRET  # not exported
        assert torchfeed.rpc_async(addresses[1], os.getpid, secret=addresses.secret).wait() > 0
        pids = client.run(torchfeed_pids)
        retired, killed = sorted(pids)
        client.retire_workers([retired], close_workers=True)  # a clean close runs the plugin's teardown
        assert wait_for(lambda: not any(pid_alive(p) for p in pids[retired]), 20), (
            "a closed Dask worker's torchfeed workers did not stop"
        )
        assert all(pid_alive(p) for p in pids[killed])
        dask_pid = client.run(os.getpid, workers=[killed])[killed]
        os.kill(dask_pid, signal.SIGKILL)  # no teardown runs: its workers notice their parent is gone
        assert wait_for(lambda: not any(pid_alive(p) for p in pids[killed]), 20), (
            "orphaned torchfeed workers did not exit"
        )
    finally:
        tfd.stop_workers(client)
