"""torchfeed.autoscale: the decisions (synthetic readings), then the controller on a real Dask cluster."""

from __future__ import annotations

import logging
import time

import pytest

from torchfeed.scaling import Policy, Reading

# ---------------------------------------------------------------- the decisions, pure


def policy(**kw) -> Policy:
    base = dict(min_workers=1, max_workers=10, target_wait=0.1, up_cooldown=10, down_after=30, down_cooldown=20)
    return Policy(**{**base, **kw})


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
    assert p.decide(reading(0, 1, 0.8)).target == 5
    for t in range(1, 60):  # the 4 new ones take a minute to come: nothing more is asked
        assert p.decide(reading(t, 1, 0.8, requested=5)) is None
    d = p.decide(reading(61, 1, 0.8, requested=5, demand=400))  # twice the demand: need 9
    assert d is not None and d.target == 9


def test_up_cooldown_starts_when_the_workers_serve():
    p = policy(up_cooldown=10)
    assert p.decide(reading(0, 1, 0.8)).target == 5
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
    assert p.decide(reading(70, 2, 0.0, demand=20)).target == 1
    assert p.decide(reading(200, 1, 0.0, demand=20)) is None  # min_workers


def test_down_only_to_the_need():
    p = policy(down_after=5, down_cooldown=0)
    assert p.decide(reading(0, 8, 0.0, demand=150)) is None
    d = p.decide(reading(5, 8, 0.0, demand=150))  # 150 * 1.1 / 50: 4
    assert d.target == 4
    assert p.decide(reading(100, 4, 0.0, demand=150)) is None


def test_hysteresis_a_wait_between_the_bands_changes_nothing_and_restarts_the_down_clock():
    p = policy(target_wait=0.1, down_after=30)  # low band: 5%
    assert p.decide(reading(0, 6, 0.02, demand=20)) is None
    assert p.decide(reading(25, 6, 0.08, demand=20)) is None  # between 5% and 10%: hold
    assert p.decide(reading(26, 6, 0.09, demand=20)) is None
    assert p.decide(reading(40, 6, 0.01, demand=20)) is None  # low again since 40
    assert p.decide(reading(69, 6, 0.01, demand=20)) is None
    assert p.decide(reading(70, 6, 0.01, demand=20)).action == "down"


def test_no_flapping_after_a_step_up():
    p = policy(up_cooldown=5, down_after=30, down_cooldown=20)
    assert p.decide(reading(0, 1, 0.8)).target == 5
    decisions = [p.decide(reading(t, 5, 0.0, demand=200)) for t in range(1, 200)]
    assert decisions == [None] * 199  # the need is 5: no step down however long


def test_down_cooldown_after_a_step_up():
    p = policy(down_after=0, down_cooldown=20)
    assert p.decide(reading(0, 1, 0.8, demand=100)).target == 3
    assert p.decide(reading(10, 3, 0.0, demand=20)) is None
    assert p.decide(reading(20, 3, 0.0, demand=20)).target == 2


def test_bounds():
    p = policy(min_workers=2, max_workers=4)
    assert p.decide(reading(0, 1, 0.0)).target == 2  # below the minimum: up at once
    assert p.decide(reading(1, 2, 0.9, demand=1000)) is None  # the new one serves only now: cool-down
    assert p.decide(reading(20, 2, 0.9, demand=1000)).target == 4  # need 22: capped
    assert p.decide(reading(100, 4, 0.9, demand=1000)) is None  # at the maximum
    d = p.decide(reading(101, 6, 0.0))  # more than allowed (started by hand): down at once
    assert d is not None and (d.action, d.target) == ("down", 4)
    q = policy(min_workers=2, down_after=0, down_cooldown=0)
    assert q.decide(reading(0, 3, 0.0, demand=1)).target == 2  # never below the minimum


def test_an_idle_trainer_shrinks_to_the_minimum_slowly():
    p = policy(min_workers=1, down_after=30, down_cooldown=20)
    assert p.decide(reading(0, 8, 0.0, demand=None, active=False)) is None
    d = p.decide(reading(30, 8, 0.0, demand=None, active=False))
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


_ = (logging, time)
