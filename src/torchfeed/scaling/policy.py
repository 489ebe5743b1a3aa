"""When to grow or shrink a pool of workers: :class:`Policy`, pure decisions from readings.

No I/O, no threads and no clock of its own: :mod:`torchfeed.autoscale` measures a
:class:`Reading` every few seconds and asks :meth:`Policy.decide`; tests feed it
synthetic readings.

* **Need.** ``demand`` (samples/s the trainer would take if it never waited) times
  ``headroom``, divided by ``per_worker`` (samples/s one worker delivers at full speed),
  rounded up: how many workers would keep up.
* **Up quickly.** While the trainer waits more than ``target_wait`` of its time, the pool
  grows at once to the need (at least one more worker), unless workers asked for are
  still starting (then only a larger need asks for more) or the workers of the last step
  up have served for less than ``up_cooldown`` seconds (their effect is not measured yet).
* **Down slowly.** Only after the trainer waited less than ``low_wait`` (hysteresis: well
  below ``target_wait``) for ``down_after`` seconds in a row, at least ``down_cooldown``
  seconds after the last change (up or down), and with nothing starting; then to the
  need, but at most half the workers go in one step. A trainer that takes no batch at all (between
  passes, evaluation) counts as needing ``min_workers``.
* **Bounds.** Never below ``min_workers`` nor above ``max_workers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """What the controller measured over its last window."""

    time: float  # seconds, any monotonic origin
    workers: int  # serving workers (in the dataset, not draining)
    requested: int  # workers asked of the pool and not being retired: serving plus starting
    wait: float  # share of the window the trainer waited for data
    demand: float | None = None  # samples/s the trainer would take if it never waited
    per_worker: float | None = None  # samples/s one worker delivers at full speed
    active: bool = True  # the trainer took batches in the window


@dataclass(frozen=True)
class Decision:
    """One decision: ask for ``target`` workers in all (``action`` ``up`` or ``down``)."""

    time: float
    action: str  # "up" | "down"
    before: int  # workers asked for before (requested)
    target: int
    reason: str

    def line(self) -> str:
        verb = "scaling up" if self.action == "up" else "scaling down"
        return f"{verb} from {self.before} to {self.target} workers: {self.reason}"


class Policy:
    """Decides the pool's size from :class:`Reading` s (see the module docstring)."""

    def __init__(
        self,
        *,
        min_workers: int = 1,
        max_workers: int | None = None,
        target_wait: float = 0.1,
        low_wait: float | None = None,
        headroom: float = 1.1,
        up_cooldown: float = 10.0,
        down_after: float = 30.0,
        down_cooldown: float = 20.0,
    ):
        if min_workers < 0:
            raise ValueError(f"min_workers must be >= 0, got {min_workers}")
        if max_workers is not None and max_workers < max(min_workers, 1):
            raise ValueError(f"max_workers ({max_workers}) must be >= min_workers ({min_workers}) and >= 1")
        if not 0.0 < target_wait < 1.0:
            raise ValueError(f"target_wait is a share of the trainer's time, in (0, 1): got {target_wait}")
        low = target_wait / 2 if low_wait is None else low_wait
        if not 0.0 <= low < target_wait:
            raise ValueError(
                f"low_wait must be in [0, target_wait): got {low} with target_wait={target_wait}"
            )
        if headroom < 1.0:
            raise ValueError(f"headroom must be >= 1 (1.1 keeps 10% spare capacity), got {headroom}")
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.target_wait = target_wait
        self.low_wait = low
        self.headroom = headroom
        self.up_cooldown = up_cooldown
        self.down_after = down_after
        self.down_cooldown = down_cooldown
        self.last_up: float | None = None
        self.last_change: float | None = None
        self.low_since: float | None = None  # when the trainer's wait last went below low_wait
        self.ready_since: float | None = None  # when the workers asked for were last all serving

    def clamp(self, n: int) -> int:
        n = max(n, self.min_workers)
        return n if self.max_workers is None else min(n, self.max_workers)

    def need(self, r: Reading) -> int | None:
        """Workers that would keep up with the trainer (None: not measured yet)."""
        if not r.active:
            return self.min_workers
        if r.demand is None or not r.per_worker:
            return None
        return max(math.ceil(r.demand * self.headroom / r.per_worker - 1e-9), 1)

    def decide(self, r: Reading) -> Decision | None:
        """The decision for this reading, or None to keep the pool as it is."""
        need = self.need(r)
        if r.requested > r.workers:
            self.ready_since = None
        elif self.ready_since is None:
            self.ready_since = r.time
        if r.requested < self.min_workers:
            return self._made(r, "up", self.clamp(r.requested), f"below min_workers={self.min_workers}")
        if self.max_workers is not None and r.workers > self.max_workers:
            return self._made(r, "down", self.max_workers, f"above max_workers={self.max_workers}")
        if r.active and r.wait > self.target_wait:
            self.low_since = None
            return self._up(r, need)
        if r.wait >= self.low_wait:
            self.low_since = None  # hysteresis: between the bands nothing changes
            return None
        if self.low_since is None:
            self.low_since = r.time
        return self._down(r, need)

    def _up(self, r: Reading, need: int | None) -> Decision | None:
        ceiling = self.max_workers
        if ceiling is not None and r.requested >= ceiling:
            return None  # the controller says so once (it knows whether it is stuck there)
        shown = "" if need is None else f"; about {need} would keep up"
        why = f"the trainer waits {r.wait:.0%} of the time (target {self.target_wait:.0%}){shown}"
        if r.requested > r.workers:  # some are still starting: only a larger need asks for more
            if need is not None and need > r.requested:
                return self._made(r, "up", self.clamp(need), why)
            return None
        # a step up shows in the wait only once its workers serve: the cool-down starts then
        settled = max(self.last_up or -math.inf, self.ready_since if self.ready_since is not None else r.time)
        if self.last_up is not None and r.time - settled < self.up_cooldown:
            return None
        target = self.clamp(max(need or 0, r.requested + 1))
        return self._made(r, "up", target, why) if target > r.requested else None

    def _down(self, r: Reading, need: int | None) -> Decision | None:
        if need is None or r.requested > r.workers or r.workers <= self.min_workers:
            return None
        assert self.low_since is not None
        if r.time - self.low_since < self.down_after:
            return None
        if self.last_change is not None and r.time - self.last_change < self.down_cooldown:
            return None
        target = self.clamp(max(need, r.workers - r.workers // 2))
        if target >= r.workers:
            return None
        if r.active:
            why = (
                f"the trainer waited {r.wait:.0%} of the time for {r.time - self.low_since:.0f} s; "
                f"about {need} would keep up"
            )
        else:
            why = f"the trainer took no batch for {r.time - self.low_since:.0f} s"
        return self._made(r, "down", target, why)

    def _made(self, r: Reading, action: str, target: int, reason: str) -> Decision:
        self.last_change = r.time
        if action == "up":
            self.last_up = r.time
        return Decision(r.time, action, r.requested if action == "up" else r.workers, target, reason)


__all__ = ["Decision", "Policy", "Reading"]
