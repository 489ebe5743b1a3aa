"""What a loader hands each of its passes: the plan of the pass and the worker-side fetchers.

:class:`PassPlan` is everything a pass (map-style, :mod:`torchfeed.loader.passes`, or
iterable-style, :mod:`torchfeed.loader.iterable`) starts from, including the hooks through which
it reports back to its loader. :class:`FetcherSet` keeps one loader's fetchers, one
remote object per worker, across passes.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import events
from ..client import wait_all
from ..client.refs import RemoteRef
from ..errors import ConnectionClosed, RemoteError, Timeout, WorkerLost
from .passstats import PassObserver
from .scheduler import Scheduler
from .views import Source

log = logging.getLogger("torchfeed.loader")
_pass_ids = itertools.count(1)


class _LivePasses:
    """The passes not closed yet; at interpreter exit they close first and go quiet."""

    def __init__(self):
        self.passes: weakref.WeakSet = weakref.WeakSet()
        self.exiting = False

    def add(self, p) -> None:
        self.passes.add(p)

    def discard(self, p) -> None:
        self.passes.discard(p)

    def close_all(self) -> None:
        """Before the sessions close their connections: no 'lost worker' noise at exit."""
        self.exiting = True
        for p in list(self.passes):
            try:
                p.close()
            except Exception:  # noqa: BLE001 - exiting
                pass


live = _LivePasses()
atexit.register(
    live.close_all
)  # registered after the sessions' close (client is imported first): runs before


def quiet(exc: BaseException) -> bool:
    """Whether losing a connection with ``exc`` is this process's own doing (closed on purpose
    by ``close_connections`` or at interpreter exit): not a lost worker."""
    return live.exiting or sys.is_finalizing() or isinstance(exc, ConnectionClosed)


def new_pass_id() -> int:
    """A number for a new pass, unique in this process (workers key per-pass setup by it)."""
    return next(_pass_ids)


class FetcherSet:
    """One loader's worker-side objects (made by ``make(address)``), one per worker."""

    def __init__(self, make: Callable[[str], Any], timeout: float, secret, alive: Callable[[], list[str]]):
        self._make = make
        self._alive = alive  # the workers whose dataset objects are still held
        self._timeout = timeout
        self._secret = secret
        self._refs: dict[str, RemoteRef] = {}
        self._lock = threading.Lock()

    def ensure(self, workers: Sequence[str]) -> dict[str, BaseException]:
        """Create the fetchers not made yet (or lost with their connection); return the failures."""
        with self._lock:
            missing = [w for w in workers if w not in self._refs or self._refs[w].closed]
            if not missing:
                return {}
            futs = {w: self._make(w) for w in missing}
            failed = {}
            results = wait_all(futs, self._timeout)
            alive = set(self._alive()) if any(isinstance(v, RemoteError) for v in results.values()) else ()
            for w, v in results.items():
                # the dataset's error, unless the dataset object was lost with its connection
                # meanwhile (the worker then refused the stale reference): that worker is lost
                if isinstance(v, RemoteError) and w in alive:
                    raise v
                if isinstance(v, BaseException):
                    failed[w] = v
                else:
                    self._refs[w] = v
            return failed

    def get(self, address: str) -> RemoteRef | None:
        return self._refs.get(address)


class LoaderFetchers:
    """A loader's worker-side fetchers (:class:`~torchfeed.worker.fetch.Fetcher`), one set made
    with the loader's ``collate_fn`` and ``worker_init_fn``: a pass that starts after either was
    assigned gets a new set (torch reads them at every ``iter()``), unless the workers are
    persistent (torch's keep what they started with). A prefetched head made with an older set
    is then not used (``Head.matches`` compares the set)."""

    def __init__(self, source: Source, auto_collation: bool, persistent: bool):
        self._source = source
        self._auto = auto_collation
        self._persistent = persistent
        self._made_with: tuple = ()
        self.current: FetcherSet | None = None

    def for_pass(self, collate_fn: Callable, worker_init_fn: Callable | None) -> FetcherSet:
        inputs = (collate_fn, worker_init_fn)
        changed = any(now is not then for now, then in zip(inputs, self._made_with))
        if self.current is None or (changed and not self._persistent):
            source = self._source

            def make(address: str):
                from ..protocol import limits
                from ..worker.fetch import Fetcher  # the worker side's module, sent by reference

                args = (source.target(address), collate_fn, self._auto, worker_init_fn, self._persistent)
                return source.session.rpc_async(
                    address,
                    Fetcher,
                    args=(*args, limits.reply_limits()),
                    rref=True,
                    timeout=source.timeout,
                    secret=source.secret,
                )

            self.current = FetcherSet(make, source.timeout, source.secret, source.alive_workers)
            self._made_with = inputs
        return self.current


@dataclass(frozen=True)
class LoaderConfig:
    """A loader's settings as a pass sees them, frozen when the pass starts (passes never
    hold the loader itself)."""

    batch_size: int | None
    drop_last: bool
    pin_memory: bool
    timeout: float  # 0: none (as torch)
    prefetch_factor: int
    max_retries: int
    straggler_factor: float | None
    straggler_min_seconds: float
    length: int | None  # len(loader) when the pass starts; None when it has no length
    reply_policy: Any  # how batches are loaded (protocol.replies.ReplyPolicy)
    compression: int = 0  # how batches may travel (a protocol.codec.MODES value)
    split_first: bool = False  # a pass's first batch may be split across workers (loader/split.py)


@dataclass
class PassPlan:
    """What the loader hands a pass: where the indices come from and how to load them."""

    config: LoaderConfig
    source: Source
    fetchers: FetcherSet
    sampler_iter: Any
    progress: Any  # resume.Progress
    auto_collation: bool
    sample_seed: int | None  # per-sample seeding's base seed, None when off
    base_seed: int  # the pass's base seed (worker seeds are base_seed + id, as in torch)
    # -- what the loader hears from the pass (hooks; called with no pass lock held) --------
    estimates: dict[str, float] = field(default_factory=dict)  # the previous pass's batch times
    on_estimates: Callable[[dict[str, float]], None] | None = None  # map-style: when it closes
    # iterable-style, at close: (pass id, snapshot, the snapshot without an unconfirmed last batch)
    on_snapshot: Callable[[int, dict, dict], None] | None = None
    # map-style, once its last batch is dispatched: start the next pass's prefetch (a Head, or None)
    next_head: Callable[[Any], Any] | None = None
    stats: PassObserver = field(default_factory=PassObserver)  # what the pass counts goes here


@dataclass(frozen=True)
class BatchRequests:
    """How a map-style pass asks a worker for one batch, the same for the pass and for the
    prefetch of its first batches (:class:`~torchfeed.loader.prefetch.Head`): the batch's keys as
    the worker's dataset knows them, the seeds and worker context of torch's workers, and how the
    reply is to be made (pinned, its policy, its compression)."""

    fetchers: FetcherSet
    source: Source
    auto: bool  # automatic batching: a request carries a batch of keys
    pin: bool
    policy: Any  # protocol.replies.ReplyPolicy
    compression: int  # a protocol.codec.MODES value
    pass_id: int
    base_seed: int
    sample_seed: int | None

    @classmethod
    def of(cls, plan: PassPlan, pass_id: int) -> BatchRequests:
        config = plan.config
        return cls(
            plan.fetchers,
            plan.source,
            plan.auto_collation,
            config.pin_memory,
            config.reply_policy,
            config.compression,
            pass_id,
            plan.base_seed,
            plan.sample_seed,
        )

    def send(self, address: str, idx: Any, callback: Callable[[bool, Any], None]) -> int:
        """Ask ``address`` for the batch of sampler output ``idx``; the request's id. Raises
        WorkerLost (or the connection's OSError) when the worker cannot be asked, and the
        dataset's error for keys it cannot map."""
        fetcher = self.fetchers.get(address)
        if fetcher is None:
            raise WorkerLost(f"no fetcher on worker {address}")
        keys = self.source.map_index(idx, self.auto)
        worker_id, num_workers = self.source.worker_id(address)
        return fetcher.request(
            (keys, self.sample_seed, (self.pass_id, worker_id, num_workers, self.base_seed)),
            callback=callback,
            pin=self.pin,
            policy=self.policy,
            compression=self.compression,
        )


def loader_length(config: LoaderConfig, source_of_length: str) -> int:
    """``len()`` of a pass: its loader's length, or TypeError naming what has none."""
    if config.length is None:
        raise TypeError(f"this loader has no length: {source_of_length} has none")
    return config.length


def pass_length(config: LoaderConfig, progress) -> int | None:
    """Batches a pass will load, when the sampler says (fewer after a resume)."""
    return None if config.length is None else max(config.length - progress.batches, 0)


def short(items: list[Any]) -> str:
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"


def scheduler(plan: PassPlan, workers: list[str]) -> Scheduler:
    """The scheduler of a map-style pass over ``workers`` (the reachable ones)."""
    credits = pipeline_depth(plan.config.prefetch_factor, plan.estimates, plan.stats.mean_batch_bytes())
    # reorder slack beyond the credits, so one slow worker does not stall the rest
    n = max(len(workers), len(plan.source.workers), 1)
    return Scheduler(
        workers,
        credits=credits,
        window=max(2 * credits * n, n + 2 * credits),
        pass_length=pass_length(plan.config, plan.progress),
        estimates=plan.estimates,
    )


class Room(NamedTuple):
    """What a pass's scheduler leaves for the next pass's prefetch (``Head.fill``'s arguments)."""

    free: dict[str, int]  # unused credits per worker
    busy: dict[str, int]  # requests each of those workers still holds
    loading: int  # batches of the pass not loaded yet


def prefetch_room(sched) -> Room:
    """What the scheduler ``sched`` of a pass leaves for the next pass's prefetch."""
    free: dict[str, int] = {}
    busy: dict[str, int] = {}
    for w in sched.workers.values():
        if w.alive and len(w.in_flight) < sched.credits:
            free[w.address] = sched.credits - len(w.in_flight)
            busy[w.address] = len(w.in_flight)
    return Room(free, busy, max(sched.known - sched.delivered - len(sched.done), 0))


def hedges(sched, factor: float | None, min_seconds: float, stats: PassObserver) -> list[tuple[str, int]]:
    """Overdue batches to duplicate now, as (address, seq) (none when ``factor`` is None);
    each is an event, and counted for the slow worker in ``stats``."""
    if factor is None:
        return []
    out = sched.hedge(factor, min_seconds)
    for address, seq in out:
        slow = next((h for h in sched.holders(seq) if h != address), "?")
        events.batch_hedged(seq, slow, address)
        stats.hedged(slow)
    return out


# Small, fast batches: more requests in flight per worker than prefetch_factor (see
# pipeline_depth). Bounds: at most this many bytes per batch and seconds per batch.
SMALL_BATCH_BYTES = 256 * 1024
FAST_BATCH_SECONDS = 0.005


def pipeline_depth(prefetch_factor: int, estimates: dict | None, mean_batch_bytes: float | None) -> int:
    """Requests in flight per worker for the next pass.

    ``prefetch_factor`` (torch's meaning: batches loaded ahead per worker), except for
    batches the previous passes measured as small (<= SMALL_BATCH_BYTES on average) and
    fast (the fastest worker takes < FAST_BATCH_SECONDS each): then twice as many. Such
    batches are bound by the round trip, not by the worker: with only ``prefetch_factor``
    requests queued, a worker finishes them before the next request reaches it and idles
    (more so across a real network than on loopback). The memory this holds is at most
    a few MB (small batches), and the order of the batches does not change.
    """
    if not estimates or not mean_batch_bytes:
        return prefetch_factor
    if mean_batch_bytes <= SMALL_BATCH_BYTES and min(estimates.values()) < FAST_BATCH_SECONDS:
        return 2 * prefetch_factor
    return prefetch_factor


def late_error(seq: int, keys: list[Any], timeout: float, holders: list[str]) -> Timeout:
    """Batch ``seq`` did not arrive within the loader's ``timeout``."""
    held = ", ".join(holders) or "no worker (not dispatched yet)"
    return Timeout(
        f"DataLoader timed out after {timeout} seconds: batch {seq} (indices {short(keys)}) did not arrive; "
        f"it is held by {held}"
    )
