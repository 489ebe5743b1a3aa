"""torchfeed.cluster.SlurmPool on a real Slurm cluster: workers as job-array tasks.

The cluster (tests/slurm_cluster.py: munged, slurmctld, slurmd g1 in partition gpu and
c1, c2 in partition cpu, 8 CPUs each) runs on this machine; the tests skip without the
Slurm or munge programs (`apt-get install slurm-wlm munge`) or without root.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import Any

import pytest
import torch

import torchfeed
from helpers import SleepDataset
from pool_conformance import check_retired, check_secret_off_the_workers, grow_and_wait, kill_and_check
from slurm_cluster import started_for_tests
from torchfeed.cluster import SlurmPool, pool_script
from torchfeed.scaling.pool import WorkerPool as Pool

pytestmark = pytest.mark.slurm

SAMPLES, BATCH = 160, 4


@pytest.fixture(scope="module")
def slurm():
    with started_for_tests() as cluster:
        yield cluster


def _pool(tmp_path, **kw) -> SlurmPool:
    kw.setdefault("partition", "cpu")
    kw.setdefault("pending_warning", 2.0)
    kw.setdefault("poll_interval", 0.2)
    return SlurmPool(tmp_path / "pool", time="10", **kw)


def _states(slurm, pool: SlurmPool, job_ids) -> dict:
    return {j: slurm.job(j).get("JobState") for j in job_ids}


def _wait_until(what: str, check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.2)


def _jobs_by_address(pool: SlurmPool) -> dict[str, str]:
    """Each announced address and its task's id (the name of its address file)."""
    files = pool.directory / "workers"
    return {(files / task).read_text().strip(): task for task in os.listdir(files)}


def _ds(pool: SlurmPool, addresses):
    session = torchfeed.Session(secret=pool.secret)
    return torchfeed.RemoteDataset(addresses, SleepDataset, SAMPLES, 0.03, session=session)


def test_env_cannot_carry_the_secret():
    with pytest.raises(ValueError, match="secret_file="):
        pool_script("/p", "/p/secret", env={"TORCHFEED_SECRET": "x" * 64})
    with pytest.raises(ValueError, match="not a variable"):
        pool_script("/p", "/p/secret", env={"A B": "1"})


@pytest.mark.timeout(240)
def test_scale_up_retire_mid_epoch_and_close(slurm, tmp_path):
    """Three workers as array tasks train an epoch exactly once (as torch's DataLoader gives
    it) while one is drained and retired in the middle; close cancels the rest."""
    pool = _pool(tmp_path, parallel=2)
    assert isinstance(pool, Pool)
    addresses = grow_and_wait(pool, 3)  # tests/pool_conformance.py: what every pool does
    job_of = _jobs_by_address(pool)
    jobs = sorted(job_of.values())
    assert len(jobs) == 3 and sorted(job_of) == sorted(addresses)
    for path in (
        pool.directory,
        pool.directory / "workers",
        pool.secret_file,
        pool.directory / "workers" / jobs[0],
    ):
        assert stat.S_IMODE(path.stat().st_mode) in (0o600, 0o700), path
    script = pool.script_path.read_text()
    assert pool.secret.value.decode() not in script and "TORCHFEED_SECRET_FILE=" in script
    check_secret_off_the_workers(addresses, pool.secret.value, torchfeed.Session(secret=pool.secret))

    ds = _ds(pool, addresses)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=BATCH)
    gone = addresses[0]
    retired = threading.Event()
    retired_at: list[int] = []

    def drain_then_retire():  # what the autoscale controller does: drain, then retire
        _wait_until("the removed worker to drain", lambda: gone not in loader.stats().workers)
        pool.retire([gone])
        retired.set()

    batches = []
    for i, batch in enumerate(loader):
        batches.append(batch)
        if i == 3:
            ds.remove_workers([gone])
            threading.Thread(target=drain_then_retire, daemon=True).start()
        if retired.is_set() and not retired_at:
            retired_at.append(i)
    expected = list(torch.utils.data.DataLoader(SleepDataset(SAMPLES, 0.0), batch_size=BATCH))
    assert len(batches) == len(expected)
    for got, want in zip(batches, expected):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert retired_at and retired_at[0] < len(expected) - 1, "retired after the epoch, not during it"

    check_retired(pool, [gone], 2, addresses[1:])  # again, or never ours: nothing happens
    _wait_until(
        "the retired job to be cancelled", lambda: slurm.job(job_of[gone]).get("JobState") == "CANCELLED"
    )
    assert not (pool.directory / "workers" / job_of[gone]).exists()
    ds.close()

    pool.close()
    _wait_until(
        "close to cancel every job", lambda: set(_states(slurm, pool, jobs).values()) == {"CANCELLED"}
    )
    assert pool.requested() == 0 and pool.addresses() == [] and not pool.secret_file.exists()
    pool.close()  # again: nothing


@pytest.mark.timeout(240)
def test_queued_jobs_are_said_once_and_training_goes_on(slurm, tmp_path, caplog):
    """Two 8-CPU workers fill the cpu partition: a third job queues (one log line), training
    runs on the two; when one is retired, the queued one starts and joins."""
    caplog.set_level(logging.INFO, logger="torchfeed.cluster")
    pool = _pool(tmp_path, cpus_per_worker=8)
    try:
        pool.scale(3)
        addresses = pool.wait(2, timeout=120)
        # polled, as the autoscale controller does
        _wait_until(
            "the queued job to be reported", lambda: pool.addresses() and "still queued" in caplog.text
        )
        for _ in range(5):
            assert len(pool.addresses()) == 2 and pool.requested() == 3
        queued = [r.getMessage() for r in caplog.records if "still queued" in r.getMessage()]
        assert len(queued) == 1 and "1 worker job(s)" in queued[0] and "Resources" in queued[0], queued
        assert "training goes on with the 2 running" in queued[0]

        ds = _ds(pool, addresses)
        seen = torch.cat([b[1] for b in torchfeed.RemoteDataLoader(ds, batch_size=BATCH, shuffle=True)])
        assert sorted(seen.tolist()) == list(range(SAMPLES))
        ds.close()

        pool.retire(addresses[:1])
        later = pool.wait(2, timeout=120)
        assert addresses[1] in later and addresses[0] not in later
        assert any("started after" in r.getMessage() for r in caplog.records)

        pool.scale(3)  # queues again; a smaller request cancels the queued job, never a worker
        pool.scale(2)
        assert pool.requested() == 2 and sorted(pool.addresses()) == sorted(later)

        # a worker job ends on its own (its node fails, a user cancels it): reported, not counted
        jobs = _jobs_by_address(pool)
        left = kill_and_check(
            pool,
            lambda address: slurm.cancel(jobs[address]),
            replaced=False,
            caplog=caplog,
            said="ended before it was retired",
        )
        assert len(left) == 1 and set(left) < set(later) and pool.requested() == 1
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_refused_submission_is_logged_not_raised(slurm, tmp_path, caplog):
    pool = _pool(tmp_path, partition="nosuch")
    try:
        pool.scale(2)
        assert pool.requested() == 0 and pool.addresses() == []
        refused = [r for r in caplog.records if "sbatch refused 2 more worker job(s)" in r.getMessage()]
        assert len(refused) == 1 and "nosuch" in refused[0].getMessage()
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_autoscale_grows_and_drains_a_slurm_pool_and_every_epoch_is_exact(slurm, tmp_path, caplog):
    """The autoscale scenario on Slurm: a fast trainer grows the pool (array tasks), a slow one
    drains it back (scancel after the drain), and every epoch sees each sample exactly once."""
    caplog.set_level(logging.INFO, logger="torchfeed.autoscale")
    n = 60
    with _pool(tmp_path, cpus_per_worker=1) as pool:
        pool.scale(1)
        session = torchfeed.Session(secret=pool.secret)
        ds = torchfeed.RemoteDataset(pool.wait(1, 60), SleepDataset, n, 0.02, session=session)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True)
        most = [1]

        def epoch(per_sample: float) -> list[int]:
            seen: list[int] = []
            for _x, y in loader:
                seen += y.tolist()
                time.sleep(per_sample * len(y))
                most[0] = max(most[0], len(ds.workers), pool.requested())
            return seen

        fast: dict[str, Any] = dict(
            target_wait=0.2, interval=0.25, window=1.5, up_cooldown=1.5, down_after=2.0
        )
        with torchfeed.autoscale(
            loader, pool, max_workers=3, down_cooldown=1.0, drain_timeout=30, **fast
        ) as scaler:
            deadline = time.monotonic() + 150
            while len(ds.workers) < 3 and time.monotonic() < deadline:  # 5 ms a sample: needs 5
                assert sorted(epoch(0.005)) == list(range(n))
            assert len(ds.workers) == 3, scaler.stats()
            while len(ds.workers) > 1 and time.monotonic() < deadline:  # 30 ms a sample: 1 is plenty
                assert sorted(epoch(0.03)) == list(range(n))
            assert len(ds.workers) == 1, scaler.stats()
            _wait_until(
                "the drained tasks ended", lambda: pool.requested() == 1 and len(pool.addresses()) == 1, 30
            )
            assert sorted(epoch(0.0)) == list(range(n))  # the one left serves on
        assert most[0] <= 3  # never above max_workers
        lines = [r.getMessage() for r in caplog.records if r.name == "torchfeed.autoscale"]
        assert any(line.startswith("scaling up from 1 to ") for line in lines), lines
        assert any(line.startswith("scaling down from ") for line in lines), lines
        ds.close()
