"""The scheduler alone, driven by a fake clock: no workers, no sleeps, no real time."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from torchfeed.loader.scheduler import Scheduler

FACTOR, MIN_SECONDS = 4.0, 0.05  # the loader's straggler defaults


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def make(workers, credits=2, window=100, batches=0, **kw):
    clock = kw.pop("clock", None) or FakeClock()
    s = Scheduler(workers, credits=credits, window=window, clock=clock, seed=kw.pop("seed", 0), **kw)
    for _ in range(batches):
        s.add_batch()
    return s, clock


def dispatch_all(s):
    """Every decision available now, as the loader's dispatch loop takes them."""
    out = []
    while (choice := s.next_dispatch()) is not None:
        out.append(choice)
    return out


def holding(s, address):
    return sorted(s.workers[address].in_flight)


# -- credits and least-loaded choice ------------------------------------------------
def test_credits_bound_the_requests_of_a_worker():
    s, clock = make(["a", "b"], credits=2, batches=10)
    got = dispatch_all(s)
    assert [seq for _, seq in got] == [0, 1, 2, 3]  # nothing measured: the lowest pending each time
    assert Counter(w for w, _ in got) == {"a": 2, "b": 2}
    assert s.next_dispatch() is None  # no credit left

    first_a = holding(s, "a")[0]
    clock.advance(1.0)
    assert s.completed("a", first_a) == (True, [])
    assert s.next_dispatch() == ("a", 4)  # the returned credit is used at once
    assert s.next_dispatch() is None


def test_no_measurements_spread_one_request_per_worker_first():
    s, _ = make(["a", "b", "c"], credits=3, batches=9)
    got = dispatch_all(s)
    first_round = {w for w, _ in got[:3]}
    assert first_round == {"a", "b", "c"}  # fewest in flight first
    assert Counter(w for w, _ in got) == {"a": 3, "b": 3, "c": 3}


def test_least_drain_time_first():
    s, _ = make(["fast", "slow"], credits=2, batches=10, estimates={"fast": 1.0, "slow": 3.0})
    got = dispatch_all(s)
    # drain times: fast 1, 2 (then full); slow 3, then 6: twice the soonest (fast: 3), so
    # its second batch is one needed in 6 s, at 1.33 batches/s
    assert got == [("fast", 0), ("fast", 1), ("slow", 2), ("slow", 8)]


def test_measured_rates_come_from_completions():
    s, clock = make(["a", "b"], credits=1, batches=4)
    dispatch_all(s)
    clock.advance(0.5)
    s.completed("a", holding(s, "a")[0])
    clock.advance(1.5)
    s.completed("b", holding(s, "b")[0])
    assert s.workers["a"].seconds_per_batch == pytest.approx(0.5)
    assert s.workers["b"].seconds_per_batch == pytest.approx(2.0)
    assert s.typical_batch_seconds() == pytest.approx(2.0)  # the median of the measured ones
    # a request queued behind another is timed from when the previous one finished
    s2, clock2 = make(["a"], credits=2, batches=2)
    dispatch_all(s2)
    clock2.advance(1.0)
    s2.completed("a", 0)
    clock2.advance(1.0)
    s2.completed("a", 1)
    assert s2.workers["a"].seconds_per_batch == pytest.approx(1.0)


def test_unmeasured_worker_counts_as_typical():
    s, _ = make(["a", "b", "new"], credits=1, batches=6, estimates={"a": 1.0, "b": 1.0})
    got = dispatch_all(s)
    assert sorted(w for w, _ in got) == ["a", "b", "new"]
    assert sorted(seq for _, seq in got) == [0, 1, 2]  # nobody looks slow: no look-ahead


def test_ties_are_broken_by_a_seeded_order():
    workers = [f"w{i}" for i in range(50)]

    def first_choices(seed):
        s, _ = make(workers, credits=1, batches=10, seed=seed)
        return [w for w, _ in dispatch_all(s)]

    assert first_choices(1) == first_choices(1)
    # trainers sharing the workers do not all start on the same ones
    assert set(first_choices(1)) != set(first_choices(2))


def test_clock_is_used_when_no_time_is_given():
    s, clock = make(["a"], credits=1, batches=1)
    clock.now = 7.0
    assert s.next_dispatch() == ("a", 0)
    assert s.workers["a"].in_flight == {0: 7.0}
    clock.now = 9.0
    s.completed("a", 0)
    assert s.workers["a"].seconds_per_batch == pytest.approx(2.0)
    # an explicit now wins over the clock
    s.add_batch()
    assert s.next_dispatch(now=20.0) == ("a", 1)
    assert s.workers["a"].in_flight == {1: 20.0}


# -- look-ahead ---------------------------------------------------------------------
FAST3_SLOW = {"f1": 1.0, "f2": 1.0, "f3": 1.0, "slow": 4.0}


def test_slow_worker_gets_a_batch_needed_later():
    s, _ = make(list(FAST3_SLOW), credits=1, batches=20, estimates=FAST3_SLOW)
    got = dict(dispatch_all(s))
    assert sorted(got[f] for f in ("f1", "f2", "f3")) == [0, 1, 2]
    # it finishes in 4 s; meanwhile the others deliver 3.25 batches/s * 4 s = 13
    assert got["slow"] == 13
    assert s._pending[:10] == list(range(3, 13))  # the skipped ones wait for the fast workers


def test_look_ahead_is_clamped_to_the_window():
    s, _ = make(list(FAST3_SLOW), credits=1, window=8, max_window=8, batches=8, estimates=FAST3_SLOW)
    got = dict(dispatch_all(s))
    assert got["slow"] == 7  # the highest batch inside the window


def test_slow_worker_waits_for_its_batch_to_be_pulled():
    # at the start of a pass only some batches are pulled: the slow worker must not take
    # the highest of them (needed long before it could finish it) but wait for batch 13
    s, _ = make(list(FAST3_SLOW), credits=1, batches=6, estimates=FAST3_SLOW)
    got = dict(dispatch_all(s))
    assert "slow" not in got and sorted(got.values()) == [0, 1, 2]
    while s.known < 14:
        s.add_batch()
    assert s.next_dispatch() == ("slow", 13)


def test_no_look_ahead_without_measurements():
    s, _ = make(list(FAST3_SLOW), credits=1, batches=20)
    assert sorted(seq for _, seq in dispatch_all(s)) == [0, 1, 2, 3]


# -- window ---------------------------------------------------------------------------
def test_window_is_sized_from_carried_estimates():
    s, _ = make(list(FAST3_SLOW), credits=2, window=4, max_window=16, estimates=FAST3_SLOW)
    # others deliver 3.25 batches/s while the slow one drains 2 credits * 4 s: 26 + 4 + 2
    assert s.window == 16  # clamped at max_window, before any result of this pass
    while s.wants_more():
        s.add_batch()
    assert s.known == 16
    dispatch_all(s)
    assert all(seq < 16 for w in s.workers.values() for seq in w.in_flight)


def test_window_widens_with_measured_rates():
    s, clock = make(list(FAST3_SLOW), credits=2, window=4, max_window=32)
    while s.wants_more():
        s.add_batch()
    assert s.known == 4
    dispatch_all(s)
    assert all(seq < 4 for w in s.workers.values() for seq in w.in_flight)
    seq = holding(s, "f1")[0]
    clock.advance(1.0)
    s.completed("f1", seq)
    # measured: 1 s per batch, the others count as typical (the median): 4 batches/s while
    # the slowest known drains its 2 credits: 8 + 4 workers + 2 credits
    assert s.window == 14
    while s.wants_more():
        s.add_batch()
    assert s.known == s.delivered + 14


def test_window_stays_without_measurements():
    s, _ = make(["a", "b"], credits=2, window=5)
    while s.wants_more():
        s.add_batch()
    dispatch_all(s)
    assert s.known == 5 and s.window == 5


# -- loss, requeue, poison blame ------------------------------------------------------------
def test_lost_worker_batches_return_first_and_the_oldest_is_blamed():
    s, clock = make(["a", "b"], credits=2, batches=8)
    s.next_dispatch()
    clock.advance(0.1)
    dispatch_all(s)
    a_batches = holding(s, "a")
    started = s.workers["a"].in_flight
    oldest = min(started, key=started.get)
    requeued, blamed = s.worker_lost("a")
    assert sorted(requeued) == a_batches
    assert blamed == oldest
    assert s.workers["a"].status == "lost" and s.alive_workers() == ["b"]
    assert s.worker_lost("a") == ([], None)  # once
    clock.advance(1.0)
    b_first = holding(s, "b")[0]
    s.completed("b", b_first)
    assert s.next_dispatch() == ("b", min(a_batches))  # requeued batches are the lowest pending


def test_a_batch_that_kills_every_worker_is_blamed_each_time():
    s, clock = make(["a", "b", "c"], credits=1, batches=1)
    for _ in range(3):
        worker, seq = s.next_dispatch()
        assert seq == 0
        clock.advance(0.5)
        assert s.worker_lost(worker) == ([0], 0)  # the pass counts it (loader/faults.py)
    assert s.next_dispatch() is None and s.serving_workers() == []


def test_connections_closed_on_purpose_blame_no_batch():
    s, clock = make(["a", "b", "c"], credits=1, batches=1)
    for _ in range(3):
        worker, seq = s.next_dispatch()
        clock.advance(0.5)
        assert s.worker_lost(worker, blame=False) == ([0], None)  # requeued, not blamed


def test_batch_held_by_a_duplicate_is_not_requeued():
    s, clock = make(["a", "b", "c"], credits=1, batches=3, estimates={"a": 1.0, "b": 1.0, "c": 1.0})
    got = dict(dispatch_all(s))
    slow_one = next(w for w, seq in got.items() if seq == 0)
    others = [w for w in got if w != slow_one]
    clock.advance(1.0)
    for w in others:
        s.completed(w, got[w])
    clock.advance(4.0)
    hedges = s.hedge(FACTOR, MIN_SECONDS)
    assert [seq for _, seq in hedges] == [0]
    requeued, blamed = s.worker_lost(slow_one)
    assert requeued == [] and blamed == 0  # still running on the hedge target
    assert s.holders(0) == [hedges[0][0]]


def test_rejoined_worker_starts_fresh():
    s, _ = make(["a", "b"], credits=1, batches=4, estimates={"a": 1.0, "b": 1.0})
    dispatch_all(s)
    s.worker_lost("a")
    s.add_worker("a")
    assert s.workers["a"].status == "alive" and s.workers["a"].in_flight == {}
    assert s.workers["a"].seconds_per_batch == 1.0  # the estimate given at the start still holds


# -- draining -------------------------------------------------------------------------------
def test_draining_worker_gets_nothing_new_and_finishes_its_batches():
    s, clock = make(["a", "b"], credits=2, batches=10)
    dispatch_all(s)
    a_batches = holding(s, "a")
    s.drain_worker("a")
    assert s.alive_workers() == ["b"] and sorted(s.serving_workers()) == ["a", "b"]
    clock.advance(1.0)
    for seq in a_batches:
        assert s.completed("a", seq) == (True, [])
    assert all(w == "b" for w, _ in dispatch_all(s))
    clock.advance(1.0)
    s.completed("b", holding(s, "b")[0])
    assert all(w == "b" for w, _ in dispatch_all(s))
    assert s.workers["a"].in_flight == {}
    s.add_worker("a")  # back in service
    assert {w for w, _ in dispatch_all(s)} == {"a"}


# -- hedging --------------------------------------------------------------------------------
def test_overdue_batch_needed_soon_is_duplicated_once():
    est = {"a": 1.0, "b": 1.0, "c": 1.0}
    s, clock = make(list(est), credits=1, batches=3, estimates=est)
    got = dict(dispatch_all(s))
    stuck = next(w for w, seq in got.items() if seq == 0)
    clock.advance(1.0)
    for w, seq in got.items():
        if w != stuck:
            s.completed(w, seq)
    clock.advance(2.9)  # 3.9 s: not yet 4 x the typical 1 s
    assert s.hedge(FACTOR, MIN_SECONDS) == []
    clock.advance(0.2)
    hedges = s.hedge(FACTOR, MIN_SECONDS)
    assert len(hedges) == 1 and hedges[0][1] == 0 and hedges[0][0] != stuck
    assert s.hedge(FACTOR, MIN_SECONDS) == []  # once per batch
    target = hedges[0][0]
    assert sorted(s.holders(0)) == sorted([stuck, target])
    clock.advance(1.0)
    assert s.completed(target, 0) == (True, [stuck])  # first result wins; cancel the other
    assert s.completed(stuck, 0) == (False, [])  # the late duplicate is dropped
    assert s.holders(0) == []


def test_hedge_needs_a_free_credit_and_a_measurement():
    s, clock = make(["a", "b"], credits=1, batches=2)
    dispatch_all(s)
    clock.advance(100.0)
    assert s.hedge(FACTOR, MIN_SECONDS) == []  # nothing measured: no typical time
    est = {"a": 1.0, "b": 1.0}
    s, clock = make(list(est), credits=1, batches=2, estimates=est)
    dispatch_all(s)
    clock.advance(100.0)
    assert s.hedge(FACTOR, MIN_SECONDS) == []  # both overdue, no free credit anywhere


def test_hedge_looks_only_at_batches_needed_soon():
    est = {f"w{i}": 1.0 for i in range(3)}
    s, clock = make(list(est), credits=1, batches=10, estimates=est)
    got = dict(dispatch_all(s))
    clock.advance(1.0)
    s.completed(next(w for w, q in got.items() if q == 0), 0)
    s.take_delivered()
    # batches 1 and 2 are stuck; 0 was delivered; horizon: delivered + 3 alive workers
    clock.advance(10.0)
    hedges = s.hedge(FACTOR, MIN_SECONDS)
    assert [seq for _, seq in hedges] == [1]  # one free credit: the earliest batch first


def test_failed_request_releases_every_holder():
    est = {"a": 1.0, "b": 1.0}
    s, clock = make(list(est), credits=1, batches=1, estimates=est)
    dispatch_all(s)
    holder = s.holders(0)[0]
    other = "b" if holder == "a" else "a"
    clock.advance(10.0)
    assert s.hedge(FACTOR, MIN_SECONDS) == [(other, 0)]
    assert s.failed(holder, 0) == [other]
    assert 0 in s.done and s.holders(0) == []


# -- end of the pass -------------------------------------------------------------------------
def test_end_of_pass_slow_worker_waits_instead_of_holding_up_the_tail():
    # 8 batches: the fast workers finish the 5 left after their first 3 in about 2.7 s;
    # the slow worker would need 4 s for one
    s, clock = make(list(FAST3_SLOW), credits=1, batches=8, estimates=FAST3_SLOW, pass_length=8)
    s.exhausted = True  # the sampler is done (the loader sets it)
    got = dispatch_all(s)
    assert {w for w, _ in got} == {"f1", "f2", "f3"}
    assert s.workers["slow"].in_flight == {}
    # the fast workers take every remaining batch as their credits come back
    delivered_by: Counter[str] = Counter()
    while not s.finished():
        clock.advance(1.0)
        for w in ("f1", "f2", "f3"):
            for seq in holding(s, w):
                s.completed(w, seq)
                delivered_by[w] += 1
        while s.delivered in s.done:
            s.take_delivered()
        got = dispatch_all(s)
        assert all(w != "slow" for w, _ in got)
    assert sum(delivered_by.values()) == 8 and clock.now == 103.0


def test_end_known_from_exhausted_without_pass_length():
    s, _ = make(list(FAST3_SLOW), credits=1, batches=8, estimates=FAST3_SLOW)
    s.exhausted = True
    assert s.pass_end() == 8
    assert "slow" not in {w for w, _ in dispatch_all(s)}


def test_without_a_known_end_the_slow_worker_looks_ahead_as_before():
    s, _ = make(list(FAST3_SLOW), credits=1, batches=20, estimates=FAST3_SLOW)
    assert s.pass_end() is None
    assert dict(dispatch_all(s))["slow"] == 13


def test_long_pass_slow_worker_still_helps():
    s, _ = make(list(FAST3_SLOW), credits=1, batches=40, estimates=FAST3_SLOW, pass_length=40)
    assert dict(dispatch_all(s))["slow"] == 13  # others need ~12 s for the rest: 4 s is fine


def test_pass_length_counts_batches_not_added_yet():
    # the window holds only 8 batches, but 40 are coming: the slow worker is useful
    s, _ = make(
        list(FAST3_SLOW), credits=1, window=8, max_window=8, batches=8, estimates=FAST3_SLOW, pass_length=40
    )
    assert "slow" in dict(dispatch_all(s))


def test_end_of_pass_slow_worker_is_served_when_the_others_stall():
    s, clock = make(list(FAST3_SLOW), credits=1, batches=8, estimates=FAST3_SLOW, pass_length=8)
    dispatch_all(s)
    assert s.workers["slow"].in_flight == {}
    clock.advance(1.5)  # the fast ones are late, not yet much
    assert s.next_dispatch() is None
    clock.advance(1.0)  # 2.5 s on a 1 s batch: they are now estimated at 2.5 s or more
    assert s.next_dispatch() == ("slow", 3)


def test_the_only_worker_is_never_held_back():
    s, _ = make(["slow"], credits=1, batches=2, estimates={"slow": 4.0}, pass_length=2)
    assert s.next_dispatch() == ("slow", 0)


# -- estimates ---------------------------------------------------------------------------------
def test_estimates_carry_to_the_next_pass():
    s, clock = make(list(FAST3_SLOW), credits=1, batches=4)
    got = dict(dispatch_all(s))
    clock.advance(1.0)
    for w in ("f1", "f2", "f3"):
        s.completed(w, got[w])
    clock.advance(3.0)
    s.completed("slow", got["slow"])
    carried = s.estimates()
    assert carried == pytest.approx(FAST3_SLOW)
    s2, _ = make(list(FAST3_SLOW), credits=1, batches=20, estimates=carried)
    assert dict(dispatch_all(s2))["slow"] == 13  # look-ahead from the first decision


def test_lost_workers_have_no_estimate():
    s, _ = make(list(FAST3_SLOW), credits=1, estimates=FAST3_SLOW)
    s.worker_lost("slow")
    assert "slow" not in s.estimates()


def test_a_request_far_past_its_estimate_raises_it():
    est = {"a": 1.0, "b": 1.0}
    s, clock = make(list(est), credits=2, batches=1, estimates=est)
    ((holder, _),) = dispatch_all(s)
    clock.advance(1.5)
    s.hedge(FACTOR, MIN_SECONDS)
    assert s.estimates()[holder] == 1.0  # late, but not twice the estimate
    clock.advance(1.5)
    s.hedge(FACTOR, MIN_SECONDS)
    assert s.estimates()[holder] == pytest.approx(3.0)
    assert s.workers[holder].seconds_per_batch == 1.0  # the measurement itself is kept
    assert s.typical_batch_seconds() == 1.0  # and so is the hedging limit
    # ... so the next batch goes to the other worker, although the holder has a credit
    s.add_batch()
    assert s.next_dispatch()[0] != holder


# -- bookkeeping against a brute-force recomputation -----------------------------------------
def _check_consistent(s: Scheduler) -> None:
    alive = [w for w in s.workers.values() if w.alive]
    measured = sorted(w.seconds_per_batch for w in alive if w.seconds_per_batch)
    assert s.index.times == measured
    effective = [w.effective_seconds for w in alive if w.effective_seconds]
    assert s.index.rate_sum == pytest.approx(math.fsum(1 / t for t in effective))
    assert s.index.alive == len(alive)
    assert s.index.unmeasured == len(alive) - len(effective)
    assert s.index.in_flight == sum(len(w.in_flight) for w in alive)
    holders: dict[int, list[str]] = {}
    for w in s.workers.values():
        assert len(w.in_flight) <= s.credits
        if w.status == "lost":
            assert not w.in_flight
        for seq in w.in_flight:
            holders.setdefault(seq, []).append(w.address)
    assert {q: sorted(h) for q, h in holders.items()} == {q: sorted(s.holders(q)) for q in s._holders}
    typical = s.typical_batch_seconds() or 1.0
    free = [w for w in alive if len(w.in_flight) < s.credits]
    best = s.index.best(s.index.free_measured, s.index.free_unmeasured)
    if not free:
        assert best is None
    else:
        expect = min(
            free, key=lambda w: ((len(w.in_flight) + 1) * (w.effective_seconds or typical), w.tie, w.order)
        )
        assert best is not None and best[1] is expect
    for seq in range(s.delivered, s.known):  # every batch is in exactly one place
        places = (seq in s._pending) + (seq in holders) + (seq in s.done)
        assert places == 1, seq


def test_incremental_state_matches_a_recomputation_under_random_events():
    rng = random.Random(12)
    clock = FakeClock(0.0)
    names = [f"w{i}" for i in range(12)]
    s = Scheduler(names[:8], credits=2, window=30, clock=clock, seed=3, pass_length=400)
    hedges = blamed = 0
    slowness = {w: rng.choice([0.5, 1.0, 1.0, 4.0, 100.0]) for w in names}  # 100: nearly stuck
    for _step in range(3000):
        clock.advance(rng.expovariate(8.0))
        r = rng.random()
        while s.wants_more() and s.known < 400:
            s.add_batch()
        if s.known >= 400:
            s.exhausted = True
        if r < 0.45:
            running = [(w.address, seq) for w in s.workers.values() for seq in w.in_flight]
            if running:
                ((address, seq),) = rng.choices(running, weights=[1 / slowness[a] for a, _ in running])
                if rng.random() < 0.97:
                    s.completed(address, seq)
                else:
                    s.failed(address, seq)
        elif r < 0.47:
            live = s.alive_workers()
            if len(live) > 2:
                blamed += s.worker_lost(rng.choice(live))[1] is not None
        elif r < 0.48:
            live = s.alive_workers()
            if len(live) > 2:
                s.drain_worker(rng.choice(live))
        elif r < 0.51:
            s.add_worker(rng.choice(names))
        elif r < 0.6:
            hedges += len(s.hedge(FACTOR, MIN_SECONDS))
        dispatch_all(s)
        while s.delivered in s.done:
            s.take_delivered()
        _check_consistent(s)
    assert s.delivered > 100 and hedges and blamed


def test_stale_heap_entries_are_dropped():
    est = {f"w{i}": 1.0 + i / 10 for i in range(20)}
    s, clock = make(list(est), credits=2, window=1000, estimates=est)
    for _ in range(5000):
        s.add_batch()
        ((address, seq),) = [s.next_dispatch()]
        clock.advance(0.01)
        s.completed(address, seq)
        s.take_delivered()
    for heap in (
        s.index.free_measured,
        s.index.all_measured,
        s.index.free_unmeasured,
        s.index.all_unmeasured,
        s.index.running,
        s.index.late,
    ):
        assert len(heap) <= 4 * len(s.workers) + 64 + 1
