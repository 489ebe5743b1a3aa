"""The trainer's books of an iterable-style pass, one :class:`StreamSlot` per stream, and the
snapshot format a resume reads back (:func:`check_snapshot`): plain data, no I/O, no threads
(the pass holds its lock while it reads and writes them, see iterable.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..client.refs import RemoteRef
from ..util import is_count
from ..worker.streams import BATCH

SNAPSHOT_FORMAT = "torchfeed.streams/1"  # a format name, not a module path: kept for saved states


@dataclass(frozen=True, slots=True)
class StreamResult:
    """One numbered reply of a stream: a batch, its end or an error (``kind``), and where the
    stream's iterator stood after it (``state``, ``rng``, the shard grants it had ``taken``)."""

    kind: int
    payload: Any
    state: bytes | None
    rng: bytes | None
    taken: int


class StreamSlot:
    """Trainer side of one stream: where it runs and what it delivered."""

    def __init__(self, index: int):
        self.index = index
        self.worker: str | None = None
        self.ref: RemoteRef | None = None
        self.incarnation = 0  # bumped on every (re)open; older replies are ignored
        self.opening = False
        self.delivered = 0  # batches yielded to the user
        self.results: dict[int, StreamResult] = {}
        self.inflight = 0
        self.ended = False
        self.state: bytes | None = None  # captured with the last delivered batch
        self.rng: bytes | None = None
        self.taken = 0  # grants taken by the iterator at that batch
        self.latest_taken = 0  # the latest reply's count (for granting)
        self.grants: list[Any] = []  # every shard granted to this stream, in order
        # tickets (the pass's request count) of its requests not answered yet, oldest first: on a
        # worker with several streams, the oldest ticket is the request the worker was running
        self.tickets: deque[int] = deque()

    def contiguous(self) -> int:
        """Batches held here in order after the last one delivered."""
        n = 0
        while (result := self.results.get(self.delivered + n)) is not None and result.kind == BATCH:
            n += 1
        return n

    def detach(self) -> None:
        """Its worker is lost or leaves: keep what arrived in order, drop what came after a gap
        (it is made again), and void the replies still on their way (a new incarnation)."""
        keep = self.delivered + self.contiguous()
        self.results = {n: r for n, r in self.results.items() if n < keep}
        if self.ref is not None:
            self.ref.release()
        self.ref, self.worker = None, None
        self.tickets.clear()
        self.incarnation += 1

    def snapshot(self) -> dict:
        return {
            "delivered": self.delivered,
            "ended": self.ended,
            "state": self.state,
            "rng": self.rng,
            "taken": self.taken,
            "grants": list(self.grants),
        }


MAX_STREAMS = 1 << 16  # far more streams than any job runs (one per worker by default)


def check_snapshot(snapshot: Any) -> None:
    """Refuse what no iterable-style pass saved: another format, a stream count beyond
    :data:`MAX_STREAMS`, slots that do not match it, counts that are not counts."""
    if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT:
        raise ValueError("this state does not describe a pass over an iterable-style dataset")
    streams, slots = snapshot.get("streams"), snapshot.get("slots")
    if not is_count(streams, 1, MAX_STREAMS) or not isinstance(slots, list) or len(slots) != streams:
        raise ValueError(
            f"this iterable-style state has {streams!r} streams and "
            f"{len(slots) if isinstance(slots, list) else slots!r} stream records: not a state a loader saves"
        )
    if not is_count(snapshot.get("turn"), 0, streams - 1):
        raise ValueError(
            f"this iterable-style state's turn {snapshot.get('turn')!r} is not one of its streams"
        )
    for saved in slots:
        ok = (
            isinstance(saved, dict)
            and is_count(saved.get("delivered"))
            and is_count(saved.get("taken"))
            and isinstance(saved.get("ended"), bool)
            and isinstance(saved.get("grants"), list)
            and all(saved.get(k) is None or isinstance(saved.get(k), bytes) for k in ("state", "rng"))
        )
        if not ok:
            raise ValueError("this iterable-style state holds a stream record no loader saves")
