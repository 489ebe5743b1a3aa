"""torchfeed.ray.Pool on a real Ray cluster on this machine (tests/raycluster.py), and a Ray
Train run fed by it.

The cluster (session-scoped, tests/conftest.py; the docs' Ray blocks use it too) is a head node and a second node offering the workers' resource,
as a CPU node of a mixed cluster would; see tests/raycluster.py.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path

import pytest

from helpers import RangeDataset, SleepDataset, wait_for
from pool_conformance import (
    check_killed,
    check_secret_off_the_workers,
    close_and_check,
    grow_and_wait,
    retire_and_check,
)
from raycluster import LABELS, NODE_IP
from raycluster import RESOURCE as RESOURCE_NAME
from torchfeed import DistributedSampler, RemoteDataLoader, RemoteDataset, autoscale

ray = pytest.importorskip("ray", reason="the Ray tests need ray: pip install 'torchfeed[ray]'")
psutil = pytest.importorskip("psutil")
from torchfeed.ray import Pool  # noqa: E402
from torchfeed.ray.nodes import clear_reason  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(300)]

RESOURCE: dict[str, float] = {RESOURCE_NAME: 1}
N = 160


@pytest.fixture(scope="module")
def ray_cluster(ray_cluster_shared):  # tests/conftest.py: shared with the docs' Ray blocks
    cluster = ray_cluster_shared
    try:
        ray.init(
            address=cluster.address,
            _node_ip_address=NODE_IP,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        cluster.wait_for_resource(ray, 3)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()


def _placed_on_the_cpu_node(pool: Pool) -> bool:
    """Every actor runs on the node offering the workers' resource (not on the head)."""
    offering = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("torchfeed_worker")}
    placed = set(ray.get([h.node_id.remote() for h in pool.actors().values()], timeout=30))
    return bool(placed) and placed <= offering


def test_the_secret_stays_off_clear_networks(monkeypatch):
    assert clear_reason("127.0.0.1", "127.0.0.1") is None
    reason = clear_reason("127.0.0.1", "192.0.2.7")
    assert reason is not None and "not encrypted" in reason
    assert clear_reason("192.0.2.1", "127.0.0.1")
    assert clear_reason("127.0.0.1", "127.0.0.1") is None
    monkeypatch.setenv("RAY_USE_TLS", "1")
    assert clear_reason("192.0.2.1", "192.0.2.7") is None


def test_scale_up_kill_mid_epoch_and_drain(ray_cluster):
    """What every pool does (tests/pool_conformance.py), with the loss and the retirement mid-epoch."""
    with Pool(resources=RESOURCE, start_timeout=60) as pool:
        first = grow_and_wait(pool, 2)
        assert all(a.startswith(NODE_IP + ":") for a in first)
        check_secret_off_the_workers(first, pool.secret.value)  # sent by the actor's call, to stdin
        assert _placed_on_the_cpu_node(pool)
        ds = RemoteDataset(first, SleepDataset, N, 0.005)
        loader = RemoteDataLoader(ds, batch_size=8, shuffle=True)
        # an actor killed mid-epoch: its batches are requeued, every index exactly once
        seen = []
        for i, (_, idx) in enumerate(loader):
            seen += idx.tolist()
            if i == 3:
                ray.kill(pool.actors()[first[0]])
        assert sorted(seen) == list(range(N))
        # the pool replaces it (its target holds): a new worker joins the dataset
        fresh = [a for a in check_killed(pool, first[0], 2, replaced=True) if a not in ds.workers]
        ds.remove_workers([first[0]])
        ds.add_workers(fresh)
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(N))
        # grow to 3, then drain one and retire it
        pool.scale(3)
        three = pool.wait(3, timeout=120)
        ds.add_workers([a for a in three if a not in ds.workers])
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(N))
        going = three[0]
        ds.remove_workers([going])
        retire_and_check(pool, [going])
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(N))
        close_and_check(pool)
        # a fourth would need a fourth torchfeed_worker: Ray has 3, and the pool says so once
    assert wait_for(lambda: ray.available_resources().get("torchfeed_worker", 0) == 3, timeout=90), (
        "the actors' resources freed"
    )


def test_actors_placed_by_node_labels(ray_cluster):
    with Pool(1, label_selector=LABELS) as pool:  # no resource asked: the head has CPUs too
        pool.wait(1, timeout=120)
        assert _placed_on_the_cpu_node(pool)


def test_autoscale_grows_a_ray_pool(ray_cluster):
    with Pool(1, resources=RESOURCE) as pool:
        ds = RemoteDataset(pool.wait(1, timeout=120), SleepDataset, N, 0.01)
        loader = RemoteDataLoader(ds, batch_size=4)
        with autoscale(loader, pool, max_workers=3, interval=0.5, window=2.0, up_cooldown=1.0) as scaler:
            for _ in range(8):  # input-bound: the controller asks the pool for more
                assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(N))
                if len(ds.workers) == 3:
                    break
            assert pool.requested() == 3, scaler.stats()
            assert wait_for(lambda: len(ds.workers) == 3, timeout=90), "three workers in the dataset"
            assert sorted(ds.workers) == pool.addresses()
            assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(N))


def test_actors_ray_cannot_place_are_reported_once_per_request(ray_cluster, caplog):
    def reports() -> list[str]:
        return [r.getMessage() for r in caplog.records if "are not running" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="torchfeed.ray"):
        with Pool(4, resources=RESOURCE, place_timeout=2) as pool:  # the cluster offers 3
            assert len(pool.wait(3, timeout=120)) == 3
            assert wait_for(lambda: len(reports()) == 1, timeout=90), "the report"
            time.sleep(3.0)
            assert len(reports()) == 1, "said once"
            said = reports()[0]
            assert "'torchfeed_worker': 0.0" in said and "'torchfeed_worker': 3.0" in said, said
            pool.scale(5)  # a new request that cannot be met either: said again, once
            assert wait_for(lambda: len(reports()) == 2, timeout=90), "the second report"
            time.sleep(3.0)
            assert len(reports()) == 2
            assert len(pool.addresses()) == 3 and pool.requested() == 5


def _rank_loader(config, seed: int, batch_size: int) -> tuple[int, int, DistributedSampler, RemoteDataLoader]:
    """In a Ray Train worker: its rank, the world's size, and its loader of ``config``'s workers
    (a RangeDataset of ``config["n"]`` samples, a shuffling DistributedSampler seeded ``seed``)."""
    import ray.train

    os.environ["TORCHFEED_SECRET_FILE"] = config["secret_file"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    ds = RemoteDataset(config["addresses"], RangeDataset, config["n"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return rank, world, sampler, RemoteDataLoader(ds, batch_size=batch_size, sampler=sampler)


def _private_secret_file(tmp_path: Path) -> Path:
    """A new secret in a file only its owner can read, in a folder only its owner can enter."""
    private = tmp_path / "secret"
    private.mkdir(mode=0o700)
    secret_file = private / "secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    return secret_file


def _fit(tmp_path: Path, loop, n: int, **run) -> Path:
    """Run ``loop`` as a Ray Train job of two ranks fed by a pool of two workers (with a private
    secret file), over ``n`` samples; ``run`` adds to its RunConfig. Returns the folder the
    ranks write to (``config["out"]``)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    secret_file = _private_secret_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with Pool(2, resources=RESOURCE, secret_file=secret_file) as pool:
        config = {"addresses": pool.wait(2, 120), "secret_file": str(secret_file), "n": n, "out": str(out)}
        TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(storage_path=str(tmp_path / "runs"), **run),
        ).fit()
    return out


def _train_loop(config):
    import ray.train

    rank, world, sampler, loader = _rank_loader(config, seed=7, batch_size=8)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = [i for _, idx in loader for i in idx.tolist()]
        Path(config["out"], f"epoch{epoch}-rank{rank}.json").write_text(json.dumps(seen))
    ray.train.report({"rank": rank, "world": world})


def test_ray_train_ranks_fed_from_the_pool(ray_cluster, tmp_path):
    out = _fit(tmp_path, _train_loop, N, name="torchfeed")
    for epoch in range(2):
        shards = [json.loads((out / f"epoch{epoch}-rank{r}.json").read_text()) for r in range(2)]
        assert not set(shards[0]) & set(shards[1]), "the ranks' shards are disjoint"
        assert sorted(shards[0] + shards[1]) == list(range(N)), f"epoch {epoch}: every index exactly once"


def _resume_loop(config):
    import tempfile

    import ray.train
    import torch
    from ray.train import Checkpoint

    rank, _, _, loader = _rank_loader(config, seed=11, batch_size=4)
    seen: list[int] = []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # the second attempt: exactly where the checkpoint was taken
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d, f"rank{rank}.pt"))
        loader.load_state_dict(state["loader"])
        seen = state["seen"]
    for step, (_, idx) in enumerate(loader):
        seen += idx.tolist()
        if checkpoint is None and step == 2:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"loader": loader.state_dict(), "seen": seen}, Path(d, f"rank{rank}.pt"))
                ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
            seen += [-1]  # consumed after the checkpoint: must not survive the restart
            raise RuntimeError("a simulated failure after the checkpoint")
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(seen))
    ray.train.report({"done": 1})


def test_ray_train_resumes_exactly_from_its_checkpoint(ray_cluster, tmp_path):
    from ray.train import FailureConfig

    out = _fit(tmp_path, _resume_loop, 64, name="resume", failure_config=FailureConfig(max_failures=1))
    shards = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(64)), "every index exactly once across the restart"
