"""What both kinds of pass share: the consumer's ``__next__``, its wait, its statistics, closing.

A pass is the iterator of one epoch: :class:`~torchfeed.loader.passes.MapPass` over a
map-style dataset, :class:`~torchfeed.loader.iterable.IterablePass` over an iterable-style
one, each started by the loader with a :class:`~torchfeed.loader.plan.PassPlan`.
:class:`Pass` owns what they do alike; a subclass says how the next batch is found
(:meth:`Pass._poll`), what a batch that is late means (:meth:`Pass._late`) and what closing
releases (:meth:`Pass._closing`); both handle worker faults with the pass's
:class:`~torchfeed.loader.faults.Faults`.

The consumer (the user's thread) waits on the condition ``_ready`` of the pass's lock;
the threads that record results (see the NOTE in passes.py and iterable.py's docstring)
notify it. Warnings and events noticed meanwhile are emitted by the consumer, at the
user's line (:mod:`torchfeed.notices`, :mod:`torchfeed.events`), also while it waits.
Statistics go to ``plan.stats`` (:class:`~torchfeed.loader.passstats.PassObserver`),
called unconditionally.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import events, notices
from .faults import Faults
from .plan import PassPlan, live, loader_length

POLL_SECONDS = 0.05  # the longest the consumer waits before it looks again (stalls, warnings)


@dataclass(frozen=True, slots=True)
class Delivery:
    """The next batch of a pass: its value (when not ``ok``, the error its loading ended
    with, raised in its turn), its number of samples and, map-style, its sample keys."""

    ok: bool
    value: Any
    samples: int
    keys: Any = None


class Pass:
    """The iterator of one pass (see the module doc); ``length_source`` names where ``len()``
    comes from in its error."""

    length_source = "its sampler"

    def __init__(self, plan: PassPlan):
        self._plan = plan
        self._config = plan.config
        self._source = plan.source
        self._timeout = plan.config.timeout  # 0: none (as torch)
        self._stats = plan.stats
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)  # the consumer waits here
        self._notices = notices.Pending()
        self._closed = False
        self._complete = False  # the pass delivered its last batch
        self._fatal: BaseException | None = None  # ends the pass at the consumer's next batch
        # worker losses, poison, the wait for a worker, joins and drains (with the lock held)
        self._faults = Faults(plan.source, plan.stats, plan.config.max_retries, self._timeout, time.monotonic)

    def _track(self) -> None:
        """From here (the end of a subclass's set-up) the pass is closed at interpreter exit,
        before the connections, if it is still open then (``plan.live``)."""
        live.add(self)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return loader_length(self._config, self.length_source)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the consumer ----------------------------------------------------------------------
    def __next__(self):
        self._plan.progress.confirm()  # the consumer is done with the batch it had
        stats = self._stats
        entered = stats.enter()
        got: Delivery | None = None
        try:
            got = self._next_delivery()
        except (StopIteration, KeyboardInterrupt):
            self.close()  # after Ctrl-C nothing more is loaded or reported
            raise
        finally:
            self._notices.emit()
            events.flush()
            if got is None:
                stats.left()  # the wait counts as waited (the end, an error, a caught Timeout)
                if self._complete:
                    stats.finished()  # the figures of a finished pass are final when it ends
        stats.consumed(entered, got.samples)
        if not got.ok:
            raise got.value
        stats.inspect(got.value)
        return got.value

    def _next_delivery(self) -> Delivery:
        """Wait for the next batch, at most the loader's ``timeout`` (none when 0)."""
        deadline = time.monotonic() + self._timeout if self._timeout else None
        with self._lock:
            while True:
                if self._closed:
                    raise StopIteration
                got = self._poll()
                if got is not None:
                    return got
                now = time.monotonic()
                self._check_wait(now, deadline)
                if deadline is not None and now >= deadline:
                    raise self._late()
                self._lock.release()  # warnings noticed meanwhile are emitted while waiting
                try:
                    self._notices.emit()
                    events.flush()
                finally:
                    self._lock.acquire()
                self._ready.wait(POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - now))

    def _poll(self) -> Delivery | None:
        """The next batch if it is here (lock held); None: wait. Raises at the end of the pass
        (:meth:`_end`) or for an error that ends it (:meth:`_fail`)."""
        raise NotImplementedError

    def _check_wait(self, now: float, deadline: float | None) -> None:
        """Raise if waiting until ``now`` already means the pass cannot go on (lock held): no
        worker came back or joined in time."""
        stalled = self._faults.stalled(now, deadline)
        if stalled is not None:
            self._fail(stalled)

    def _late(self) -> BaseException:
        """The error for a batch that did not arrive within the loader's ``timeout``."""
        raise NotImplementedError

    def _end(self) -> NoReturn:
        """The pass delivered its last batch (lock held)."""
        self._plan.progress.finished = True
        self._complete = True
        self._close_locked()
        raise StopIteration

    def _fail(self, exc: BaseException) -> NoReturn:
        """``exc`` ends the pass (lock held)."""
        self._close_locked()
        raise exc

    # -- membership (the dataset's threads, held as a MembershipListener; no pass lock on entry) --
    def worker_joined(self, address: str) -> None:
        """A worker joined the dataset or came back: once prepared for this pass, it serves it."""
        if self._closed or address not in self._source.alive_workers():
            return
        if self._plan.fetchers.ensure([address]):
            return  # it cannot be prepared: it stays out of this pass
        self._membership_changed(address, self._faults.joined, self._joined)

    def worker_removed(self, address: str) -> None:
        """A worker left the dataset: it finishes what it holds and gets no more."""
        self._membership_changed(address, self._faults.draining, self._removed)

    def _membership_changed(
        self, address: str, note: Callable[[str], None], hook: Callable[[str], None]
    ) -> None:
        """Under the lock, unless the pass is closed: ``note`` the change in the faults, then
        tell the pass's ``hook``."""
        with self._lock:
            if self._closed:
                return
            note(address)
            hook(address)

    def _joined(self, address: str) -> None:
        """Put ``address`` to work (lock held)."""

    def _removed(self, address: str) -> None:
        """Stop giving ``address`` work (lock held)."""

    # -- shutdown --------------------------------------------------------------------------
    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        live.discard(self)
        self._stats.ended()  # pass_seconds stops here
        self._closing()

    def _closing(self) -> None:
        """Release what the pass holds (lock held, once, when it closes)."""

    def close(self) -> None:
        """Stop this pass (requests still in flight end unused)."""
        with self._lock:
            self._close_locked()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a pass collected half made (its __init__ failed)
            pass
