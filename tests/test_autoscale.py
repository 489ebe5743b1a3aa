"""torchfeed.autoscale: the decisions (synthetic readings), then the controller on a real Dask cluster."""

from __future__ import annotations

import logging
import os
import time

import pytest
from distributed import Client
from torch.utils.data import Dataset

import torchfeed
import torchfeed.dask as tfd
from helpers import FAST_AUTOSCALE, dask_cluster, wait_for
from pool_conformance import check_pool, kill_the_process
from torchfeed.protocol import auth
from torchfeed.scaling import Decision, LocalPool, Policy, Reading
from torchfeed.util import free_port

# ---------------------------------------------------------------- the decisions, pure


def policy(**kw) -> Policy:
    base = dict(
        min_workers=1, max_workers=10, target_wait=0.1, up_cooldown=10, down_after=30, down_cooldown=20
    )
    return Policy(**{**base, **kw})


def decided(p: Policy, r: Reading) -> Decision:
    """What ``p`` decides on ``r``, where the test expects a decision."""
    d = p.decide(r)
    assert d is not None, r
    return d


def reading(t, workers, wait, *, requested=None, demand=200.0, per_worker=50.0, active=True) -> Reading:
    return Reading(
        time=t,
        workers=workers,
        requested=workers if requested is None else requested,
        wait=wait,
        demand=demand,
        per_worker=per_worker,
        active=active,
    )


def test_up_quickly_to_the_need_in_one_step():
    p = policy()
    d = p.decide(reading(0, 1, 0.75))  # 200 samples/s wanted, 50 per worker, 10% headroom: 5
    assert d is not None and (d.action, d.before, d.target) == ("up", 1, 5)
    assert "waits 75%" in d.line() and "about 5 would keep up" in d.line()
    assert d.line().startswith("scaling up from 1 to 5 workers")


def test_up_by_at_least_one_when_the_estimate_says_enough():
    p = policy()
    d = p.decide(reading(0, 5, 0.4))  # need 5, have 5, yet the trainer waits
    assert d is not None and d.target == 6
    d = p.decide(reading(0, 3, 0.4, demand=None, per_worker=None))  # nothing measured: one more
    assert d is None  # ... but not twice in the cool-down


def test_no_more_while_the_workers_asked_for_start_unless_the_need_grows():
    p = policy()
    assert decided(p, reading(0, 1, 0.8)).target == 5
    for t in range(1, 60):  # the 4 new ones take a minute to come: nothing more is asked
        assert p.decide(reading(t, 1, 0.8, requested=5)) is None
    d = p.decide(reading(61, 1, 0.8, requested=5, demand=400))  # twice the demand: need 9
    assert d is not None and d.target == 9


def test_up_cooldown_starts_when_the_workers_serve():
    p = policy(up_cooldown=10)
    assert decided(p, reading(0, 1, 0.8)).target == 5
    assert p.decide(reading(20, 1, 0.8, requested=5)) is None  # still starting
    assert p.decide(reading(21, 5, 0.5)) is None  # they serve since 21: their effect is not measured yet
    assert p.decide(reading(30, 5, 0.5)) is None
    d = p.decide(reading(31.5, 5, 0.5))
    assert d is not None and d.target == 6


def test_down_slowly_after_a_sustained_low_wait_by_at_most_half():
    p = policy(down_after=30, down_cooldown=20)
    assert p.decide(reading(0, 6, 0.0, demand=20)) is None  # need 1
    assert p.decide(reading(29, 6, 0.0, demand=20)) is None
    d = p.decide(reading(30, 6, 0.0, demand=20))
    assert d is not None and (d.action, d.before, d.target) == ("down", 6, 3)  # half at most
    assert p.decide(reading(45, 3, 0.0, demand=20)) is None  # cool-down
    d = p.decide(reading(50, 3, 0.0, demand=20))
    assert d is not None and d.target == 2
    assert decided(p, reading(70, 2, 0.0, demand=20)).target == 1
    assert p.decide(reading(200, 1, 0.0, demand=20)) is None  # min_workers


def test_down_only_to_the_need():
    p = policy(down_after=5, down_cooldown=0)
    assert p.decide(reading(0, 8, 0.0, demand=150)) is None
    d = decided(p, reading(5, 8, 0.0, demand=150))  # 150 * 1.1 / 50: 4
    assert d.target == 4
    assert p.decide(reading(100, 4, 0.0, demand=150)) is None


def test_hysteresis_a_wait_between_the_bands_changes_nothing_and_restarts_the_down_clock():
    p = policy(target_wait=0.1, down_after=30)  # low band: 5%
    assert p.decide(reading(0, 6, 0.02, demand=20)) is None
    assert p.decide(reading(25, 6, 0.08, demand=20)) is None  # between 5% and 10%: hold
    assert p.decide(reading(26, 6, 0.09, demand=20)) is None
    assert p.decide(reading(40, 6, 0.01, demand=20)) is None  # low again since 40
    assert p.decide(reading(69, 6, 0.01, demand=20)) is None
    assert decided(p, reading(70, 6, 0.01, demand=20)).action == "down"


def test_no_flapping_after_a_step_up():
    p = policy(up_cooldown=5, down_after=30, down_cooldown=20)
    assert decided(p, reading(0, 1, 0.8)).target == 5
    decisions = [p.decide(reading(t, 5, 0.0, demand=200)) for t in range(1, 200)]
    assert decisions == [None] * 199  # the need is 5: no step down however long


def test_down_cooldown_after_a_step_up():
    p = policy(down_after=0, down_cooldown=20)
    assert decided(p, reading(0, 1, 0.8, demand=100)).target == 3
    assert p.decide(reading(10, 3, 0.0, demand=20)) is None
    assert decided(p, reading(20, 3, 0.0, demand=20)).target == 2


def test_bounds():
    p = policy(min_workers=2, max_workers=4)
    assert decided(p, reading(0, 1, 0.0)).target == 2  # below the minimum: up at once
    assert p.decide(reading(1, 2, 0.9, demand=1000)) is None  # the new one serves only now: cool-down
    assert decided(p, reading(20, 2, 0.9, demand=1000)).target == 4  # need 22: capped
    assert p.decide(reading(100, 4, 0.9, demand=1000)) is None  # at the maximum
    d = p.decide(reading(101, 6, 0.0))  # more than allowed (started by hand): down at once
    assert d is not None and (d.action, d.target) == ("down", 4)
    q = policy(min_workers=2, down_after=0, down_cooldown=0)
    assert decided(q, reading(0, 3, 0.0, demand=1)).target == 2  # never below the minimum


def test_an_idle_trainer_shrinks_to_the_minimum_slowly():
    p = policy(min_workers=1, down_after=30, down_cooldown=20)
    assert p.decide(reading(0, 8, 0.0, demand=None, active=False)) is None
    d = decided(p, reading(30, 8, 0.0, demand=None, active=False))
    assert d.target == 4 and "took no batch for 30 s" in d.reason


def test_policy_arguments_are_checked():
    with pytest.raises(ValueError, match="max_workers"):
        Policy(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="target_wait"):
        Policy(target_wait=1.5)
    with pytest.raises(ValueError, match="low_wait"):
        Policy(target_wait=0.1, low_wait=0.2)
    with pytest.raises(ValueError, match="headroom"):
        Policy(headroom=0.5)


# ---------------------------------------------------------------- the controller on a real Dask cluster


class SleepDataset(Dataset):
    """Sample i is i, after ``seconds`` of sleep (as much I/O as a worker may overlap)."""

    def __init__(self, n: int, seconds: float):
        self.n, self.seconds = n, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return i


@pytest.fixture
def cluster():
    with dask_cluster() as c:
        yield c


def epoch(loader, per_sample: float, watch=None) -> list[int]:
    """One pass as a trainer that takes ``per_sample`` seconds a sample; the indices seen."""
    seen: list[int] = []
    for batch in loader:
        seen += batch.tolist()
        time.sleep(per_sample * len(batch))
        if watch is not None:
            watch()
    return seen


@pytest.mark.slow
@pytest.mark.dask
@pytest.mark.timeout(300)
def test_scales_up_then_drains_down_on_dask_and_every_epoch_sees_each_sample_once(cluster, caplog):
    caplog.set_level(logging.INFO, logger="torchfeed.autoscale")
    with tfd.Pool(cluster, poll=0.25) as pool:
        ds = torchfeed.RemoteDataset(pool.wait(1, 60), SleepDataset, 60, 0.02)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True)
        most = [1]

        def watch():
            most[0] = max(most[0], len(ds.workers), pool.requested())

        with torchfeed.autoscale(loader, pool, max_workers=3, **FAST_AUTOSCALE) as scaler:
            deadline = time.monotonic() + 200  # Dask workers start slowly on 2 busy cores
            while len(ds.workers) < 3 and time.monotonic() < deadline:  # 5 ms a sample: needs 5
                assert sorted(epoch(loader, 0.005, watch)) == list(range(60))
            assert len(ds.workers) == 3, scaler.stats()
            while len(ds.workers) > 1 and time.monotonic() < deadline:  # 30 ms a sample: 1 is plenty
                assert sorted(epoch(loader, 0.03, watch)) == list(range(60))
            assert len(ds.workers) == 1, scaler.stats()
            assert wait_for(lambda: len(cluster.scheduler_info["workers"]) == 1, 30)  # retired in Dask too
            assert wait_for(lambda: pool.requested() == 1 and len(pool.addresses()) == 1, 10)
            assert sorted(epoch(loader, 0.0)) == list(range(60))  # the one left serves on
            s = scaler.stats()
        assert most[0] == 3  # never above max_workers
        actions = [d.action for d in s.decisions]
        assert actions[0] == "up" and "down" in actions, s.decisions
        assert s.draining == [] and s.workers == ds.workers
        lines = [r.getMessage() for r in caplog.records if r.name == "torchfeed.autoscale"]
        assert any(line.startswith("scaling up from 1 to ") for line in lines), lines
        assert any(line.startswith("scaling down from ") for line in lines), lines


@pytest.mark.slow
@pytest.mark.dask
def test_a_worker_removed_mid_pass_finishes_its_batches_before_it_is_retired(cluster):
    # two workers, then max_workers=1: one goes while it holds batches of a running pass
    with tfd.Pool(cluster, 2, poll=0.25) as pool:
        addresses = pool.wait(2, 60)
        ds = torchfeed.RemoteDataset(addresses, SleepDataset, 40, 0.1)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=2, prefetch_factor=2)
        held: dict[str, int] = {}
        requeued = 0  # batches sent elsewhere because their worker went: none when it drains
        scaler = None
        seen: list[int] = []
        try:
            for i, batch in enumerate(loader):
                seen += batch.tolist()
                if i == 2:  # both workers hold batches now
                    scaler = torchfeed.autoscale(loader, pool, max_workers=1, interval=0.1, window=0.5)
                for a, w in loader.stats().workers.items():
                    requeued += w.requeued
                    if w.state == "draining":
                        held[a] = max(held.get(a, 0), w.inflight)
            assert scaler is not None
            assert wait_for(lambda: scaler.stats().draining == [] and len(pool.addresses()) == 1, 30)
            retired = set(addresses) - set(pool.addresses())
        finally:
            if scaler is not None:
                scaler.close()
    assert sorted(seen) == list(range(40))  # nothing lost, nothing twice
    assert requeued == 0  # delivered by the worker that went, not requeued
    assert len(retired) == 1 and held.get(retired.pop(), 0) > 0  # it did hold batches when removed
    assert scaler.stats().decisions[0].reason == "above max_workers=1"


@pytest.mark.slow
@pytest.mark.dask
def test_a_pool_that_cannot_grow_is_logged_and_training_goes_on(cluster, caplog):
    caplog.set_level(logging.INFO, logger="torchfeed")
    # a client connected by address has no cluster object: nothing can ask Dask for workers
    with (
        Client(cluster.scheduler_address, set_as_default=False) as client,
        tfd.Pool(client, poll=0.25) as pool,
    ):
        ds = torchfeed.RemoteDataset(pool.wait(1, 60), SleepDataset, 60, 0.02)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=4)
        with torchfeed.autoscale(loader, pool, max_workers=4, start_timeout=1.0, **FAST_AUTOSCALE) as scaler:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                "did not grow" in r.getMessage() for r in caplog.records
            ):
                assert sorted(epoch(loader, 0.0)) == list(range(60))
            assert sorted(epoch(loader, 0.0)) == list(range(60))  # and it goes on
            assert scaler.stats().decisions[0].action == "up"
        assert len(ds.workers) == 1 and len(pool.addresses()) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot grow" in m and "no cluster object to scale" in m for m in messages), messages
    assert any("the pool did not grow" in m and "training goes on with 1" in m for m in messages), messages


def test_autoscale_arguments_are_checked(workers2):
    ds = torchfeed.RemoteDataset(workers2, SleepDataset, 4, 0.0)
    loader = torchfeed.RemoteDataLoader(ds)
    with pytest.raises(TypeError, match="addresses"):
        torchfeed.autoscale(loader, object())  # type: ignore[arg-type]  # not a pool: refused
    with pytest.raises(ValueError, match="min_workers"):
        torchfeed.autoscale(loader, object(), min_workers=0)  # type: ignore[arg-type]  # refused first for min_workers


@pytest.mark.dask
def test_dask_pool_refuses_to_send_the_secret_in_clear():
    # a Dask worker advertised on 0.0.0.0 (listening on loopback): not provably local to the check
    port = free_port()
    with dask_cluster(worker_port=port, contact_address=f"tcp://0.0.0.0:{port}") as c:
        before = os.environ.get("TORCHFEED_SECRET")
        with pytest.raises(
            ValueError, match="(?s)torchfeed.dask.Pool would send .*not encrypted.*secret_file="
        ):
            tfd.Pool(c)
        assert os.environ.get("TORCHFEED_SECRET") == before  # nothing exported


@pytest.mark.slow
def test_a_local_pool_passes_the_pool_conformance_checks(caplog):
    """LocalPool (LocalWorkers on this machine) does what every pool does (tests/pool_conformance.py):
    a worker killed is logged and replaced, its request holding; the secret goes over stdin only."""
    with LocalPool(cpu_budget=3, poll=0.25) as pool:
        check_pool(
            pool,
            kill_the_process,
            replaced=True,
            secret=auth.load_secret().value,
            caplog=caplog,
            said="ended; starting another",
        )
