"""The loader's thread rules (no user code and no blocking send on reader threads) and the
next pass's prefetch (zero-gap epochs: identical results with and without it)."""

from __future__ import annotations

import threading

import pytest
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

import torchfeed
from helpers import RandomAugmentDataset, RangeDataset, SleepDataset, deep_equal, indices

N = 41


@pytest.fixture(scope="module")
def rds(workers2):
    return torchfeed.RemoteDataset(workers2, RandomAugmentDataset, N)


class RecordingSampler(Sampler):
    """Yields 0..n-1 and records the thread of every step of its iteration."""

    def __init__(self, n: int):
        self.n = n
        self.threads: set = set()

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            self.threads.add(threading.current_thread().name)
            yield i


def test_sampler_never_runs_on_reader_threads(rds):
    sampler = RecordingSampler(N)
    loader = torchfeed.RemoteDataLoader(rds, batch_size=2, sampler=sampler, prefetch_factor=1)
    assert len(list(loader)) == (N + 1) // 2
    assert sampler.threads
    assert not [t for t in sampler.threads if t.startswith("torchfeed-rx")], sampler.threads
    allowed = {threading.current_thread().name}
    assert all(t in allowed or t.startswith("torchfeed-dispatch") for t in sampler.threads), sampler.threads


class _BlockingFetcher:
    """A worker's fetcher that records the keys it was asked for in ``sent``; once ``sent`` is
    armed, the first send (to whichever worker) blocks while ``gate`` is closed (a full socket
    buffer)."""

    def __init__(self, ref, sent: _Sent, gate: threading.Event):
        self.ref, self.sent, self.gate = ref, sent, gate

    @property
    def closed(self):
        return self.ref.closed

    def request(self, args, **kwargs):
        if self.sent.blocks_this_send():
            self.gate.wait(30)
        request_id = self.ref.request(args, **kwargs)
        self.sent.add(args[0])
        return request_id

    def cancel(self, request_ids):
        self.ref.cancel(request_ids)


class _Sent:
    """The sampler keys requested so far, and the events of the blocked send."""

    def __init__(self):
        self.keys: list = []
        self.changed = threading.Condition()
        self.armed, self.entered = threading.Event(), threading.Event()

    def blocks_this_send(self) -> bool:
        """True for the first send once armed (it marks ``entered``)."""
        with self.changed:
            if not self.armed.is_set() or self.entered.is_set():
                return False
            self.entered.set()
            self.changed.notify_all()
            return True

    def add(self, keys):
        with self.changed:
            self.keys.append(list(keys))
            self.changed.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` requests were sent, or the blocked send began."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.keys) >= count or self.entered.is_set(), timeout)


def test_blocked_send_to_one_worker_does_not_delay_the_others(workers2):
    rds = torchfeed.RemoteDataset(workers2, RangeDataset, N)
    loader = torchfeed.RemoteDataLoader(rds, batch_size=1, prefetch_factor=2, timeout=20)
    sent, gate = _Sent(), threading.Event()
    fetchers = loader._fetchers.for_pass(loader.collate_fn, loader.worker_init_fn)
    original = fetchers.get

    def get(address):
        ref = original(address)
        return _BlockingFetcher(ref, sent, gate) if ref is not None else ref

    fetchers.get = get  # type: ignore[method-assign]  # one worker's fetcher blocks, on purpose
    window = 2 * 2  # prefetch_factor batches per worker
    try:
        it = iter(loader)
        got = [next(it)]  # the pass starts
        assert sent.wait_for(1 + window, 20), f"the first window was never requested (sent: {sent.keys})"
        sent.armed.set()
        got.append(next(it))  # its replacement is the send that blocks
        assert sent.entered.wait(20), "no request replaced the batch taken"
        with sent.changed:  # a hedged batch is sent twice: count batches, not requests
            in_flight = len({tuple(keys) for keys in sent.keys}) - len(got)
        assert in_flight >= window - 1, (in_flight, sent.keys)
        # every batch sent before the stuck send arrives while it is stuck (were next() to wait
        # for that send, it would hang: only the finally below opens the gate)
        got += [next(it) for _ in range(in_flight)]
        assert not gate.is_set()
    finally:
        gate.set()
    got += list(it)
    assert deep_equal(got, list(torch_loader(N)))


def torch_loader(n):
    from torch.utils.data import DataLoader

    return DataLoader(RangeDataset(n), batch_size=1)


def _epochs(loader, epochs, set_epoch=None):
    out, prefetched = [], []
    for e in range(epochs):
        if set_epoch is not None:
            set_epoch(e)
        it = iter(loader)
        out.append(list(it))
        prefetched.append(it.prefetched)
    return out, prefetched


@pytest.mark.parametrize("kw", [dict(shuffle=True), dict(shuffle=False), dict(shuffle=True, drop_last=True)])
def test_prefetch_gives_identical_batches(rds, kw):
    on = torchfeed.RemoteDataLoader(rds, batch_size=3, seed=7, **kw)
    off = torchfeed.RemoteDataLoader(rds, batch_size=3, seed=7, **kw)
    off._prefetch = False
    with_prefetch, counts = _epochs(on, 3)
    without, none = _epochs(off, 3)
    assert deep_equal(with_prefetch, without)
    assert sum(none) == 0
    assert sum(counts[1:]) > 0  # the later passes did use batches loaded ahead


def test_prefetch_with_distributed_sampler_set_epoch(rds):
    def make(prefetch):
        sampler: DistributedSampler[int] = DistributedSampler(
            indices(N), num_replicas=1, rank=0, shuffle=True, seed=3
        )
        loader = torchfeed.RemoteDataLoader(rds, batch_size=4, sampler=sampler, seed=1)
        loader._prefetch = prefetch
        return loader, sampler

    (on, s_on), (off, s_off) = make(True), make(False)
    with_prefetch, counts = _epochs(on, 3, s_on.set_epoch)
    without, _ = _epochs(off, 3, s_off.set_epoch)
    assert deep_equal(with_prefetch, without)
    assert sum(counts[1:]) > 0


def test_prefetch_discarded_when_the_next_pass_differs(rds):
    on = torchfeed.RemoteDataLoader(rds, batch_size=3, seed=7, shuffle=True)
    off = torchfeed.RemoteDataLoader(rds, batch_size=3, seed=7, shuffle=True)
    off._prefetch = False
    results = {}
    for name, loader in (("on", on), ("off", off)):
        first = list(loader)
        loader.set_epoch(5)  # not the epoch predicted
        it = iter(loader)
        second = list(it)
        results[name] = (first, second, it.prefetched)
    assert deep_equal(results["on"][:2], results["off"][:2])
    assert results["on"][2] == 0


def test_prefetch_and_resume(rds):
    loader = torchfeed.RemoteDataLoader(rds, batch_size=3, seed=11, shuffle=True)
    reference = torchfeed.RemoteDataLoader(rds, batch_size=3, seed=11, shuffle=True)
    reference._prefetch = False
    expected = [list(reference) for _ in range(2)]
    assert deep_equal(list(loader), expected[0])  # ends with the next pass prefetched
    it = iter(loader)
    part = [next(it) for _ in range(4)]
    state = loader.state_dict()
    assert state["batches"] == 4 and state["epoch"] == 1
    resumed = torchfeed.RemoteDataLoader(rds, batch_size=3, seed=11, shuffle=True)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert deep_equal(part + rest, expected[1])
    assert deep_equal(part + list(it), expected[1])


# -- where the next pass's first batches go ----------------------------------------------------
FAST3_SLOW = {"f1": 1.0, "f2": 1.0, "f3": 1.0, "slow": 4.0}  # seconds per batch: 3.25 batches/s in all


def test_prefetch_places_the_slow_workers_batches_by_when_they_are_needed():
    from torchfeed.loader.prefetch import place

    unsent = list(range(32))
    free = dict.fromkeys(FAST3_SLOW, 2)
    picks = place(unsent, FAST3_SLOW, free, dict.fromkeys(FAST3_SLOW, 0), 0, {})
    got: dict[str, list[int]] = {}
    for address, seq in picks:
        got.setdefault(address, []).append(seq)
    assert sorted(got["f1"] + got["f2"] + got["f3"]) == [0, 1, 2, 3, 4, 5]  # the fast ones: the lowest
    # the slow one finishes its first in 4 s and its second in 8 s, while all deliver 3.25
    # batches/s: 13 and 26 batches, plus a 15% margin
    assert got["slow"] == [14, 29]
    assert 14 not in unsent and 29 not in unsent and 6 in unsent


def test_prefetch_counts_the_ending_passs_batches_and_queue():
    from torchfeed.loader.prefetch import place

    free, busy = {"slow": 1}, {"slow": 1}  # one request of the ending pass still ahead of it
    assert place(list(range(32)), FAST3_SLOW, free, busy, 10, {}) == [("slow", 19)]  # 29 - 10 still loading
    assert place(list(range(32)), FAST3_SLOW, {"slow": 2}, {"slow": 0}, 40, {}) == [("slow", 0), ("slow", 1)]
    # a batch it could not finish in time is not given at all
    assert place(list(range(8)), FAST3_SLOW, {"slow": 2}, {"slow": 0}, 0, {}) == []


class FailingSampler(Sampler):
    """Raises after ``good`` indices (beyond the first window: on the dispatch thread)."""

    def __init__(self, good: int):
        self.good = good

    def __len__(self):
        return self.good + 1

    def __iter__(self):
        yield from range(self.good)
        raise ValueError("sampler broke")


def test_sampler_error_reaches_the_consumer(rds):
    loader = torchfeed.RemoteDataLoader(rds, batch_size=1, sampler=FailingSampler(30), prefetch_factor=1)
    with pytest.raises(ValueError, match="sampler broke"):
        for _ in loader:
            pass


# -- pipeline depth: small fast batches get more requests in flight ---------------------------


def test_pipeline_depth_rule():
    from torchfeed.loader.plan import FAST_BATCH_SECONDS, SMALL_BATCH_BYTES, pipeline_depth

    fast, slow = {"a": FAST_BATCH_SECONDS / 10, "b": 1.0}, {"a": 1.0}
    assert pipeline_depth(2, None, None) == 2  # first pass: nothing measured yet
    assert pipeline_depth(2, fast, None) == 2
    assert pipeline_depth(2, fast, 100.0) == 4  # small and fast: deeper
    assert pipeline_depth(3, fast, SMALL_BATCH_BYTES) == 6
    assert pipeline_depth(2, fast, SMALL_BATCH_BYTES + 1) == 2  # large batches keep torch's depth
    assert pipeline_depth(2, slow, 100.0) == 2  # slow batches: the worker, not the round trip, bounds


def test_deeper_pipeline_keeps_every_batch_in_order(workers2, monkeypatch):
    """From the second pass on, tiny fast batches run with twice the depth: torch's batches still.

    Whether a batch counts as fast depends on the machine's load (test_pipeline_depth_rule
    tests the rule): here every batch does. The samples are slow, so requests queue at the
    workers up to the depth: the passes after the first hold more than one request per
    worker, and still deliver torch's batches in torch's order."""
    from torch.utils.data import DataLoader

    from torchfeed.loader import plan

    monkeypatch.setattr(plan, "FAST_BATCH_SECONDS", 3600.0)
    depths = []
    scheduler = plan.scheduler

    def recorded(*args, **kwargs):
        sched = scheduler(*args, **kwargs)
        depths.append(sched.credits)
        return sched

    monkeypatch.setattr(plan, "scheduler", recorded)
    n = 60
    rds = torchfeed.RemoteDataset(workers2, SleepDataset, n, 0.02)  # the worker bounds, not the round trip
    loader = torchfeed.RemoteDataLoader(rds, batch_size=1, prefetch_factor=1, seed=5)
    expected = list(DataLoader(RangeDataset(n), batch_size=1))
    assert deep_equal(list(loader), expected)  # the first pass measures
    for _ in range(2):
        got, inflight = [], []
        for batch in loader:
            got.append(batch)
            inflight.append(sum(w.inflight for w in loader.stats().workers.values()))
        assert deep_equal(got, expected)
        assert max(inflight) > len(workers2), inflight  # more than one request per worker at a time
    assert depths[0] == 1 and depths[1:] and all(d == 2 for d in depths[1:]), depths
