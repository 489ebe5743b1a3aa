"""Zero-gap epochs: the next pass's first batches, loaded while the current one drains.

When the order of the next pass can be known without touching anything the user can
see (``seed=`` is given, so the base seed is (seed, epoch); and the sampler is
sequential, the loader's own seeded shuffle, or torch's ``DistributedSampler``, whose
order follows ``set_epoch``), the ending pass predicts the next pass's first batches of
keys and sends them to the workers' unused credits. The next pass compares every batch
its real sampler yields with the prediction: while they are equal it takes the
prefetched request (finished or still running) instead of sending its own; at the
first difference the rest is cancelled and dropped. So results are those of a pass
without prefetch, and ``state_dict`` (which counts batches handed to the user) is not
affected. See the NOTE in passes.py for the threads and the lock order.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import operator
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .. import client
from ..errors import WorkerLost
from ..util import weak_callback
from .ledger import Outcome
from .plan import BatchRequests
from .resume import Sampling, shuffle_seed

_LOOKAHEAD_RATIO = 1.5  # a worker this much slower than the fastest gets later batches
_LOOKAHEAD_MARGIN = 1.15  # ... needed this much later than it is expected to finish them


class ResultSink(Protocol):
    """Where the outcome of a claimed, still running prefetched batch goes (a map-style pass).

    Called on a connection's reader thread with no lock held: record and wake only.
    """

    def on_result(self, address: str, seq: int, ok: bool, value: Any) -> None: ...


def predict(
    loader: Sampling, epoch: int, count: int, shuffle_generator: torch.Generator | None
) -> list[Any] | None:
    """The first ``count`` batches of keys of the map-style pass of ``epoch``, or None if unknown.

    ``loader`` is the loader's :class:`~torchfeed.loader.resume.Sampling` (seed,
    per_sample_seeding, batch_sampler);
    ``shuffle_generator`` is the loader's own seeded shuffle generator, if it has one.
    Uses copies (or fresh generators): nothing the user's samplers hold is touched.
    """
    if loader.seed is None or not loader.per_sample_seeding or count < 1:
        return None
    batches = loader.batch_sampler
    if type(batches) is not BatchSampler:
        return None
    sampler = batches.sampler
    ahead: Sampler
    if type(sampler) is SequentialSampler:
        ahead = sampler
    elif (
        type(sampler) is RandomSampler
        and shuffle_generator is not None
        and sampler.generator is shuffle_generator
    ):
        shuffled = copy.copy(sampler)
        generator = torch.Generator()
        generator.manual_seed(shuffle_seed(loader.seed, epoch))
        shuffled.generator = generator
        ahead = shuffled
    elif type(sampler) is DistributedSampler:
        distributed = copy.copy(sampler)
        distributed.set_epoch(sampler.epoch + 1)  # what a training loop calling set_epoch(e) does next
        ahead = distributed
    else:
        return None
    return list(itertools.islice(iter(BatchSampler(ahead, batches.batch_size, batches.drop_last)), count))


def place(
    unsent: list[int],
    estimates: dict[str, float],
    free: dict[str, int],
    busy: dict[str, int],
    loading: int,
    prefetching: dict[str, int],
) -> list[tuple[str, int]]:
    """Which predicted batches go to which worker now, as (address, seq); taken out of
    ``unsent`` (sorted positions of batches not sent yet).

    ``free``: credits the ending pass leaves unused per worker; ``busy``: requests each worker
    still holds for that pass; ``loading``: that pass's batches not loaded yet;
    ``prefetching``: predicted batches each worker holds already; ``estimates``: seconds
    per batch. Faster workers go first and take the lowest batches. A worker much slower
    than the fastest gets, for each of its credits, the first batch the consumer will need
    only after the worker can have finished it (behind the requests it holds): by then all
    workers together load the ending pass's ``loading`` batches and as many of this pass's
    as the one looked for, with a margin.
    """
    picks = []
    fastest = min(estimates.values(), default=None)
    rate = sum(1.0 / s for s in estimates.values() if s > 0)
    for address in sorted(free, key=lambda a: estimates.get(a, fastest or 0.0)):
        mine = prefetching.get(address, 0)
        queued = busy.get(address, 0) + mine
        own = estimates.get(address)
        for _ in range(max(free[address] - mine, 0)):
            start = 0
            if own and fastest and own > _LOOKAHEAD_RATIO * fastest:
                start = max(int(rate * own * (queued + 1) * _LOOKAHEAD_MARGIN) - loading, 0)
            i = bisect.bisect_left(unsent, start)
            if i >= len(unsent):
                break
            picks.append((address, unsent.pop(i)))
            queued += 1
    return picks


@dataclass(frozen=True, slots=True)
class Miss:
    """A claimed batch that was not prefetched (or not in time): the pass sends it itself."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """A claimed batch that is loaded already: its outcome, from ``address``, of ``nbytes``."""

    address: str
    outcome: Outcome
    nbytes: int


@dataclass(frozen=True, slots=True)
class Running:
    """A claimed batch still loading on ``address`` as request ``rid`` since ``started``: its
    result goes to the claiming pass."""

    address: str
    rid: int
    started: float


Claim = Miss | Loaded | Running
MISS = Miss()


class _Entry:
    __slots__ = ("state", "address", "rid", "started", "result", "nbytes", "owner")

    def __init__(self):
        self.state = "unsent"  # unsent | sending | running | done | lost | dropped
        self.address: str | None = None
        self.rid: int | None = None
        self.started = 0.0
        self.result: Outcome | None = None
        self.nbytes = 0  # the reply's size, for the loader's statistics
        self.owner: weakref.ref[ResultSink] | None = None  # the pass that claimed it


class Head:
    """The prefetched first batches of one predicted pass (see the module doc)."""

    def __init__(
        self, requests: BatchRequests, *, epoch: int, indices: list[Any], estimates: dict[str, float]
    ):
        self.requests = requests  # how its batches are asked for: as the pass it predicts would
        self.pass_id = requests.pass_id
        self.epoch = epoch
        self.indices = indices
        self._estimates = dict(estimates)
        self._lock = threading.Lock()
        self._entries = [_Entry() for _ in indices]
        self._unsent = list(range(len(indices)))
        self._in_flight: dict[str, int] = {}
        self._dead = False
        self.waker: Callable[[], None] | None = (
            None  # wakes the dispatch thread of the pass that fills this head
        )

    def matches(self, plan) -> bool:
        """Whether a pass built from ``plan`` loads what this head predicted (keys aside)."""
        return (
            not self._dead
            and plan.progress.batches == 0
            and plan.progress.record.epoch == self.epoch
            and BatchRequests.of(plan, self.pass_id) == self.requests
        )

    # -- sending (the dispatch thread of the pass that ends; no lock held) ------------------
    def fill(self, free: dict[str, int], busy: dict[str, int], loading: int) -> None:
        """Send predicted batches to the credits the ending pass leaves free (see :func:`place`:
        ``free``, ``busy`` and ``loading`` are its arguments)."""
        with self._lock:
            if self._dead:
                return
            picks = place(self._unsent, self._estimates, free, busy, loading, self._in_flight)
            for address, seq in picks:
                entry = self._entries[seq]
                entry.state, entry.address, entry.started = "sending", address, time.monotonic()
                self._in_flight[address] = self._in_flight.get(address, 0) + 1
        for address, seq in picks:
            self._send(address, seq)

    def _send(self, address: str, seq: int) -> None:
        try:
            rid = self.requests.send(address, self.indices[seq], weak_callback(self._on_result, address, seq))
        except Exception:  # noqa: BLE001 - a prefetch that cannot go out is simply not used
            with self._lock:
                self._finish(self._entries[seq], "lost")
            return
        cancel = False
        with self._lock:
            entry = self._entries[seq]
            entry.rid = rid
            if entry.state == "sending":
                entry.state = "running"
            elif entry.state == "dropped":
                cancel = True
        fetcher = self.requests.fetchers.get(address)
        if cancel and fetcher is not None:
            fetcher.cancel([rid])

    def _finish(self, entry: _Entry, state: str) -> None:
        if entry.state in ("sending", "running") and entry.address is not None:
            self._in_flight[entry.address] -= 1
        entry.state = state

    # -- results (reader threads) ----------------------------------------------------------
    def _on_result(self, address: str, seq: int, ok: bool, value: Any) -> None:
        with self._lock:
            entry = self._entries[seq]
            owner = entry.owner() if entry.owner is not None else None
            if owner is None:
                if entry.state in ("sending", "running"):
                    lost = not ok and isinstance(value, WorkerLost)
                    self._finish(entry, "lost" if lost else "done")
                    if not lost:
                        entry.result = Outcome(ok, value)
                        entry.nbytes = client.reply_bytes()
                waker = self.waker if not self._dead and self._unsent else None
            else:
                self._finish(entry, "claimed")
        if owner is not None:
            owner.on_result(address, seq, ok, value)  # outside the head's lock
        elif waker is not None:
            waker()  # a credit is free for the next predicted batch

    # -- the next pass (its lock held: takes only the head's lock) -----------------------------
    def claim(self, seq: int, idx: Any, owner: ResultSink) -> Claim | None:
        """What the pass ``owner`` gets for its batch ``seq`` with keys ``idx`` (see :data:`Claim`);
        None: no more prefetched batches for it (the head is used up, or this batch differs:
        the rest is dropped, its cancels via :meth:`take_cancels`)."""
        with self._lock:
            if self._dead or seq >= len(self._entries):
                self._dead = True
                return None
            if _keys(idx) != _keys(self.indices[seq]):
                self._dead = True
                return None
            entry = self._entries[seq]
            state = entry.state
            if state == "unsent":
                self._unsent.remove(seq)
                entry.state = "dropped"
                return MISS
            if state == "done" and entry.address is not None and entry.result is not None:
                entry.state = "claimed"
                result, entry.result = entry.result, None
                return Loaded(entry.address, result, entry.nbytes)
            if state == "running" and entry.address is not None and entry.rid is not None:
                entry.owner = weakref.ref(owner)
                return Running(entry.address, entry.rid, entry.started)
            if state == "sending":
                self._finish(entry, "dropped")  # its sender cancels it once it has an id
            return MISS

    def adopt(self, seq: int, idx: Any, owner: ResultSink, sched, ledger) -> Claim | None:
        """The pass ``owner`` pulled batch ``seq`` (keys ``idx``): take the prefetched copy into its
        scheduler ``sched`` and ``ledger`` (its lock held). Returns the claim (see :meth:`claim`),
        or None when this head has nothing more for it (its leftovers are then cancelled)."""
        claim = self.claim(seq, idx, owner)
        if claim is None:  # used up, or this pass differs from the prediction
            ledger.cancel_all(self.take_cancels())
            return None
        if isinstance(claim, Loaded):
            sched.preloaded(seq)
            ledger.results[seq] = claim.outcome
        elif isinstance(claim, Running):
            if sched.adopt(claim.address, claim.started, seq):
                ledger.sent(seq, claim.address, claim.rid)
            else:  # its worker does not serve this pass: sent again as usual
                released = self.release(seq)
                if released is not None:
                    ledger.cancel(*released)
        return claim

    def release(self, seq: int) -> tuple | None:
        """The claiming pass could not use the running batch ``seq``: (address, rid) to cancel."""
        with self._lock:
            entry = self._entries[seq]
            entry.owner = None
            if entry.state != "running":
                return None
            self._finish(entry, "dropped")
            return entry.address, entry.rid

    def take_cancels(self) -> dict[str, list[int]]:
        """Drop everything not claimed; return the requests to cancel (sent by the caller,
        with no lock held)."""
        cancels: dict[str, list[int]] = {}
        with self._lock:
            self._dead = True
            self._unsent.clear()
            for entry in self._entries:
                if entry.owner is not None:
                    continue
                if entry.state == "running" and entry.address is not None and entry.rid is not None:
                    cancels.setdefault(entry.address, []).append(entry.rid)
                if entry.state in ("sending", "running", "done"):
                    self._finish(entry, "dropped")
                    entry.result = None
        return cancels

    def discard(self) -> None:
        """Drop this head from a thread that holds no pass lock."""
        for address, rids in self.take_cancels().items():
            fetcher = self.requests.fetchers.get(address)
            if fetcher is not None:
                fetcher.cancel(rids)


def _keys(idx: Any) -> Any:
    """Comparable keys of a sampler output (tensors and numpy ints as Python ints)."""
    if isinstance(idx, (list, tuple)):
        return [_keys(i) for i in idx]
    if isinstance(idx, torch.Tensor):
        return idx.tolist()
    try:
        return operator.index(idx)
    except TypeError:
        return idx
