"""The iterator ``iter(RemoteDataLoader)`` returns: a pass that starts at its first ``next()``.

Frameworks make iterators they never read (Lightning checks that a loader is iterable by
calling ``iter()``; its fit loop calls ``iter()`` before it sets the sampler's epoch and
before a resumed loader state applies to the epoch). torch's single-process iterator pulls
nothing from its sampler before the first ``next()`` either. So ``iter()`` only draws the
base seed (where torch's iterator draws it) and this object begins the pass, with the
sampler's epoch and the loader's state as they are then, at the first ``next()``. An
iterator dropped unread loads nothing and leaves the loader's epoch and state as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PendingPass:
    """An iterator over one pass that begins it (``start()``) at the first ``next()``.

    Before that, ``len()`` is the loader's length and ``close()`` makes it empty; after it,
    both and every other attribute are the running pass's
    (:class:`~torchfeed.loader.passes.MapPass` or
    :class:`~torchfeed.loader.iterable.IterablePass`).
    """

    def __init__(self, start: Callable[[], Any], length: Callable[[], int]):
        self._start: Callable[[], Any] | None = start
        self._length = length
        self._running: Any = None

    def __iter__(self) -> PendingPass:
        return self

    def __next__(self):
        if self._running is None:
            if self._start is None:  # closed before it started
                raise StopIteration
            start, self._start = self._start, None
            self._running = start()
        return next(self._running)

    def __len__(self) -> int:
        return len(self._running) if self._running is not None else self._length()

    @property
    def started(self) -> bool:
        """Whether the pass has begun (a ``next()`` was called)."""
        return self._running is not None

    def close(self) -> None:
        """End the pass (one never started is simply dropped)."""
        self._start = None
        if self._running is not None:
            self._running.close()

    def __getattr__(self, name: str):
        # only reached for names this class lacks: the running pass's (``prefetched``, ...)
        running = self.__dict__.get("_running")
        if running is None:
            raise AttributeError(f"{name!r}: the pass has not started (it starts at the first next())")
        return getattr(running, name)
