"""The executors' queue: ready calls served round-robin across connections.

Each connection (any hashable owner) has its own FIFO of ready calls; the connections
that have one wait in a ring. :meth:`FairQueue.get` takes the oldest call of the
connection at the head of the ring and, if that connection has more, puts it back at
the tail. So a trainer with hundreds of calls queued delays another trainer's call by
at most one call per executor per connection ahead of it in the ring, instead of by
its whole backlog, and the calls of one connection still start in the order they
arrived (a connection never sees its calls reordered by the fairness).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from typing import Any

__all__ = ["FairQueue"]


class FairQueue:
    """Ready calls, one FIFO per owner, taken round-robin by any number of threads."""

    def __init__(self):
        self._cond = threading.Condition()
        self._fifos: dict[Hashable, deque] = {}  # owner -> its ready calls (never empty)
        self._ring: deque = deque()  # owners with ready calls, next to be served first
        self._closed = False

    def put(self, owner: Hashable, item: Any) -> bool:
        """Queue ``item`` behind ``owner``'s earlier items; False once closed (nothing queued)."""
        with self._cond:
            if self._closed:
                return False
            fifo = self._fifos.get(owner)
            if fifo is None:
                fifo = self._fifos[owner] = deque()
                self._ring.append(owner)
            fifo.append(item)
            self._cond.notify()
            return True

    def get(self) -> Any:
        """The next item (blocks while there is none), or None once closed."""
        with self._cond:
            while not self._ring and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            owner = self._ring.popleft()
            fifo = self._fifos[owner]
            item = fifo.popleft()
            if fifo:
                self._ring.append(owner)  # its next call waits for one turn of the others
            else:
                del self._fifos[owner]
            return item

    def drop(self, owner: Hashable) -> list:
        """Remove and return ``owner``'s queued items (its connection closed)."""
        with self._cond:
            fifo = self._fifos.pop(owner, None)
            if fifo is None:
                return []
            self._ring.remove(owner)
            return list(fifo)

    def close(self) -> list:
        """Wake every waiting :meth:`get` with None from now on; return the items never taken."""
        with self._cond:
            self._closed = True
            left = [item for fifo in self._fifos.values() for item in fifo]
            self._fifos.clear()
            self._ring.clear()
            self._cond.notify_all()
            return left

    def __len__(self) -> int:
        with self._cond:
            return sum(len(f) for f in self._fifos.values())
