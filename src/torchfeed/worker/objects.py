"""What a worker keeps for its clients: the limits on one connection and on all of them
together (ConnectionLimits, Budget) and the objects clients hold by reference (Registry:
remote datasets and ``rref=True`` results)."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Any

from ..errors import LimitExceeded, TorchfeedError
from ..protocol import wire


@dataclass(frozen=True)
class ConnectionLimits:
    """What one authenticated client may hold on a worker at once, and (``max_worker_*``)
    what all its clients together may hold: many clients cannot add up to more."""

    max_queued_requests: int = 1024  # received, not yet answered
    max_unsent_bytes: int = 1 << 30  # replies produced, not yet sent: reading pauses above this
    max_call_bytes: int = 1 << 30  # pickled arguments plus buffers of one call
    max_queued_bytes: int = 2 << 30  # the size of the calls waiting
    max_refs: int = 4096  # live remote references
    # all connections together: calls announced (being received, waiting or running) and their size
    max_worker_queued_requests: int = 8192
    max_worker_queued_bytes: int = 4 << 30

    def __post_init__(self):
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def frame_limits(self) -> wire.Limits:
        return wire.Limits(
            max_meta=self.max_call_bytes,
            max_buffers=65536,
            max_buffer_bytes=self.max_call_bytes,
            knob="raise it with `torchfeed worker --max-call-bytes N` or pass less data per call "
            "(build large objects inside the dataset on the worker)",
        )


class Budget:
    """Calls held by the worker for all its clients together, and their announced size.

    A call is counted from its authenticated header on (before any of its bytes are
    received, so a call being received counts in full) until it is answered or dropped;
    memory for it is only committed as its records arrive.
    """

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self._lock = threading.Lock()
        self.calls = 0
        self.bytes = 0

    def take(self, nbytes: int) -> LimitExceeded | None:
        """Count one call of ``nbytes``; or, when that would go over a limit, the error to answer."""
        lim = self.limits
        with self._lock:
            if (
                self.calls < lim.max_worker_queued_requests
                and self.bytes + nbytes <= lim.max_worker_queued_bytes
            ):
                self.calls += 1
                self.bytes += nbytes
                return None
            calls, held = self.calls, self.bytes
        if calls >= lim.max_worker_queued_requests:
            return LimitExceeded(
                f"the worker already holds {calls} calls of all its clients together (its limit): retry "
                "later, or start the worker with a larger --max-worker-queued-requests"
            )
        return LimitExceeded(
            f"a call of {nbytes:,} bytes would take the calls the worker holds for all its clients together "
            f"from {held:,} bytes over its limit of {lim.max_worker_queued_bytes:,}: retry later, send "
            "smaller calls, or start the worker with a larger --max-worker-queued-bytes"
        )

    def give(self, nbytes: int) -> None:
        """A call counted by :meth:`take` was answered or dropped."""
        with self._lock:
            self.calls -= 1
            self.bytes -= nbytes


class UnknownReference(TorchfeedError, KeyError):
    pass


class Registry:
    """Objects kept on this worker on behalf of clients (remote references)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._objects: dict[int, tuple] = {}  # id -> (object, owner connection id)

    def put(self, obj: Any, owner: int, limit: int | None = None) -> int:
        with self._lock:
            if limit is not None and sum(1 for v in self._objects.values() if v[1] == owner) >= limit:
                raise LimitExceeded(
                    f"this client already holds {limit} remote references on the worker (the limit): "
                    "release references you no longer need (RemoteRef.release()), or start the worker "
                    "with a larger --max-refs"
                )
            while True:
                ref_id = secrets.randbits(63) or 1
                if ref_id not in self._objects:
                    self._objects[ref_id] = (obj, owner)
                    return ref_id

    def get(self, ref_id: int, address: str = "?") -> Any:
        try:
            return self._objects[ref_id][0]
        except KeyError:
            raise UnknownReference(
                f"remote reference {ref_id} (made on {address}) is not held by this worker: it was "
                "released, its client disconnected, or it belongs to another worker"
            ) from None

    def release(self, ids, owner: int) -> None:
        with self._lock:
            for ref_id in ids:
                entry = self._objects.get(ref_id)
                if entry is not None and entry[1] == owner:
                    del self._objects[ref_id]

    def drop_owner(self, owner: int) -> None:
        with self._lock:
            for ref_id in [k for k, v in self._objects.items() if v[1] == owner]:
                del self._objects[ref_id]

    def __len__(self) -> int:
        return len(self._objects)
