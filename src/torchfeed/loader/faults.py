"""What a pass does when its workers fail, come back, join or leave: one policy for both kinds.

A pass (:class:`~torchfeed.loader.passes.MapPass`, :class:`~torchfeed.loader.iterable.IterablePass`)
owns one :class:`Faults` and calls it with its lock held; the pass moves its own work (the
scheduler requeues batches, streams reopen elsewhere) and this object decides and says the rest:

* **loss**: said once per worker, as an event (quiet when this process closed the connection
  on purpose); the dataset is told (it retries the worker with backoff and, when it answers
  again, reports it as joined); the statistics count the work that moved;
* **retry budget and poison**: a loss is blamed on the unit of work the worker was running
  when it died (a map-style batch, or the batch a stream was producing). A unit blamed more
  than ``max_retries`` times killed that many workers in a row: it is poison, and the pass ends
  with :class:`~torchfeed.errors.PoisonSampleError` naming it instead of killing every worker;
* **no worker left**: the pass waits (the loader's ``timeout``, else :data:`STALL_SECONDS`)
  for a worker to come back or join, then ends with :class:`~torchfeed.errors.WorkerLost`
  naming each worker's last error;
* **join and drain** (the dataset's membership, read from an address file or DNS): a worker
  that joins ends a wait for one; a removed worker finishes what it holds and gets no more.

No thread of its own, no I/O: events are queued for the consumer to emit (:mod:`torchfeed.events`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from .. import events
from ..errors import PoisonSampleError, WorkerLost
from .plan import quiet, short

STALL_SECONDS = 120.0  # how long a pass without a worker waits for one when the loader has no timeout


class Faults:
    """One pass's worker faults (see the module doc); every method is called with the pass's lock held."""

    def __init__(self, source: Any, stats: Any, max_retries: int, timeout: float, clock: Callable[[], float]):
        self._source = source  # the dataset: retries lost workers, tells who is alive
        self._stats = stats
        self.max_retries = max_retries
        self.stall_limit = timeout or STALL_SECONDS
        self._clock = clock
        self.errors: dict[str, str] = {}  # worker -> its last error (what a final WorkerLost names)
        self.losses: dict[Hashable, int] = {}  # unit of work -> worker deaths blamed on it
        self.stalled_since: float | None = None  # when the last worker serving the pass was lost

    # -- losses ------------------------------------------------------------------------------
    def unreachable(self, address: str, exc: BaseException) -> None:
        """``address`` could not be prepared when the pass started: skipped, retried by the dataset."""
        self.errors[address] = repr(exc)
        self._source.worker_lost(address, exc)
        events.worker_unreachable(address, exc)

    def lost(self, address: str, exc: BaseException, moved: int) -> bool:
        """``address`` is gone; ``moved`` units of its work go elsewhere. Returns whether the loss
        was this process's own doing (a connection closed on purpose), which blames nothing."""
        was_quiet = quiet(exc)
        self.errors[address] = repr(exc)
        self._source.worker_lost(address, exc)
        if was_quiet:
            events.closed(address)
        else:  # an event (logged), no warning: nothing to change in code
            events.worker_lost(address, exc, moved)
        self._stats.requeued(address, moved)
        return was_quiet

    def blame(self, unit: Hashable, address: str, what: str, indices: list[Any]) -> PoisonSampleError | None:
        """Count ``address``'s death against ``unit`` (described as ``what``, loading ``indices``
        when known); the error that ends the pass when the unit has used up its retries."""
        losses = self.losses[unit] = self.losses.get(unit, 0) + 1
        if losses <= self.max_retries:
            return None
        samples = f"samples {short(indices)} ({what})" if indices else what
        error = PoisonSampleError(
            f"loading {samples} killed {losses} worker processes in a row (the last: {address}); "
            f"giving up after max_retries={self.max_retries}. Fix or exclude these samples.",
            indices,
            [address],
        )
        events.poison(str(error))
        return error

    # -- no worker left ------------------------------------------------------------------------
    def none_left(self, announce: bool) -> None:
        """No worker serves the pass any more: start waiting for one (said when ``announce``)."""
        if self.stalled_since is not None:
            return
        self.stalled_since = self._clock()
        if announce:
            lost = ", ".join(self.errors) or ", ".join(self._source.workers)
            events.no_worker_left(lost, self.stall_limit)

    def stalled(self, now: float, deadline: float | None) -> WorkerLost | None:
        """The error that ends a wait for a worker which lasted too long (the stall limit, or the
        consumer's own deadline), else None."""
        since = self.stalled_since
        if since is None or (now - since <= self.stall_limit and (deadline is None or now < deadline)):
            return None
        return WorkerLost(
            f"no worker is left (waited {now - since:.1f} s for one to come back or join): "
            + "; ".join(f"{w}: {e}" for w, e in self.errors.items()),
            dict(self.errors),
        )

    # -- membership --------------------------------------------------------------------------
    def joined(self, address: str) -> None:
        """``address`` joined the pass, or came back: a wait for a worker ends."""
        self._stats.joined(address)  # no longer draining, if it was removed this pass
        self.stalled_since = None

    def draining(self, address: str) -> None:
        """``address`` was removed from the dataset: it finishes what it holds."""
        self._stats.draining(address)
