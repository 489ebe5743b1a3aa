"""RemoteDataLoader.stats(): is the trainer waiting for data? (issue 13), on real workers."""

from __future__ import annotations

import json
import logging
import statistics
import time

import pytest

import torchfeed
from helpers import RangeDataset, SleepDataset, wait_for

pytestmark = pytest.mark.timeout(60)


def test_input_bound_run_says_add_workers(workers2):
    ds = torchfeed.RemoteDataset(workers2, SleepDataset, 400, 0.004)  # ~16 ms per batch per worker
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4)
    for _ in loader:  # a fast consumer
        pass
    s = loader.stats()
    assert s.wait_fraction > 0.7, s
    assert s.advice.startswith("input-bound"), s.advice
    need = int(s.advice.split("about ")[1].split()[0])
    assert need > 2 and "(now 2)" in s.advice, s.advice
    assert s.batches == 100 and s.samples == 400
    assert s.bytes_received > 0
    assert set(s.workers) == set(workers2)
    assert sum(w.batches for w in s.workers.values()) >= 100
    json.dumps(s.to_dict())  # plain data for any logger


def test_compute_bound_run_is_not_input_bound(workers2):
    ds = torchfeed.RemoteDataset(workers2, RangeDataset, 240)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4)
    for _ in loader:
        time.sleep(0.02)  # the trainer computes
    s = loader.stats()
    assert s.wait_fraction < 0.2, s
    assert s.advice.startswith("not input-bound"), s.advice


def test_worker_rates_sum_to_the_loaders(workers2):
    ds = torchfeed.RemoteDataset(workers2, SleepDataset, 480, 0.001)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4)
    for _ in loader:
        time.sleep(0.004)
    s = loader.stats()
    total = sum(w.samples_per_s for w in s.workers.values())
    assert s.samples_per_s > 0 and abs(total - s.samples_per_s) <= 0.15 * s.samples_per_s, s
    assert all(w.samples_per_s > 0 and w.mean_batch_seconds for w in s.workers.values()), s


@pytest.mark.slow
def test_killed_worker_shows_lost_then_serving_after_restart(fresh_workers, caplog):
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, SleepDataset, 4000, 0.002)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, timeout=60)
    victim = w.addresses[0]
    seen = []
    with caplog.at_level(logging.INFO, logger="torchfeed"):
        for i, _ in enumerate(loader):
            if i == 5:
                w.kill(0)
            if i > 5 and not seen and loader.stats().workers[victim].state == "lost":
                seen.append("lost")
                w.restart(0)  # same port
            if seen and loader.stats().workers[victim].state == "serving":
                seen.append("serving")
                break
    assert seen == ["lost", "serving"], seen
    s = loader.stats()
    assert s.workers[victim].requeued >= 0 and s.workers[w.addresses[1]].state == "serving"
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("torchfeed")]
    assert any("lost worker " + victim in m for m in messages), messages
    assert any("is back" in m for m in messages), messages


def test_stats_call_is_cheap(workers2):
    """Called every step of a running pass, and between passes: the median is < 50 us."""
    ds = torchfeed.RemoteDataset(workers2, RangeDataset, 1600)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4)
    busy = []
    for _ in loader:
        t0 = time.perf_counter()
        loader.stats()
        busy.append(time.perf_counter() - t0)
        time.sleep(0.001)  # the trainer's step
    idle = []
    for _ in range(2000):
        t0 = time.perf_counter()
        loader.stats()
        idle.append(time.perf_counter() - t0)
    medians = statistics.median(busy), statistics.median(idle)
    assert max(medians) < 50e-6, [f"{m * 1e6:.1f} us" for m in medians]


def test_periodic_summary_and_iterable_stats(workers2, caplog):
    from stream_datasets import Counting

    ds = torchfeed.RemoteDataset(workers2, Counting, 40)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2)
    loader.log_stats(every=1e-6)
    with caplog.at_level(logging.INFO, logger="torchfeed.stats"):
        assert len(list(loader)) == 20
    assert any("samples/s" in r.getMessage() for r in caplog.records if r.name == "torchfeed.stats")
    s = loader.stats()
    assert s.batches == 20 and sum(w.batches for w in s.workers.values()) == 20, s
    assert wait_for(lambda: all(w.inflight == 0 for w in loader.stats().workers.values()))
