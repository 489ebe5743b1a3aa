"""The per-batch records of a map-style pass: keys, results, requests in flight, cancels.

A :class:`Ledger` holds no lock of its own: every method runs with the pass's lock held
(see the NOTE in passes.py). Cancels are only collected here; the dispatch thread (or
``close``) takes them with :meth:`Ledger.take_cancels` and sends them with no lock held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .basepass import Delivery
from .views import keys_of


@dataclass(frozen=True, slots=True)
class Outcome:
    """How loading one batch ended: its batch (``ok``) or the error it failed with."""

    ok: bool
    value: Any


class Ledger:
    """What a map-style pass knows about each batch it pulled (by sequence number)."""

    def __init__(self, auto_collation: bool):
        self.auto = auto_collation
        self.indices: dict[int, Any] = {}  # seq -> the sampler's output (keys)
        self.results: dict[int, Outcome] = {}  # not yet handed over
        self.requests: dict[int, dict[str, int]] = {}  # seq -> {address: request id}
        self.to_cancel: dict[str, list[int]] = {}  # address -> request ids, sent by the dispatch thread

    def keys(self, seq: int) -> list[Any]:
        """The sample keys of batch ``seq`` (for messages and counting)."""
        return keys_of(self.indices.get(seq), self.auto)

    def sent(self, seq: int, address: str, rid: int) -> None:
        """Batch ``seq`` runs as request ``rid`` on ``address``."""
        self.requests.setdefault(seq, {})[address] = rid

    def cancel(self, address: str, rid: int) -> None:
        self.to_cancel.setdefault(address, []).append(rid)

    def cancel_all(self, cancels: dict[str, list[int]]) -> None:
        for address, rids in cancels.items():
            self.to_cancel.setdefault(address, []).extend(rids)

    def settle(self, seq: int, ok: bool, value: Any, others: list[str]) -> None:
        """Batch ``seq`` has its outcome: keep it, cancel its copies on ``others``."""
        self.results[seq] = Outcome(ok, value)
        requests = self.requests.pop(seq, {})
        for address in others:
            rid = requests.get(address)
            if rid is not None:
                self.cancel(address, rid)

    def take(self, seq: int) -> Delivery | None:
        """Hand over batch ``seq`` (None if it is not here yet)."""
        if seq not in self.results:
            return None
        result = self.results.pop(seq)
        keys = keys_of(self.indices.pop(seq, None), self.auto)
        return Delivery(result.ok, result.value, len(keys), keys)

    def take_cancels(self) -> dict[str, list[int]]:
        cancels, self.to_cancel = self.to_cancel, {}
        return cancels

    def close(self) -> None:
        """The pass ends: every request still in flight is to be cancelled; results are dropped."""
        for requests in self.requests.values():
            for address, rid in requests.items():
                self.cancel(address, rid)
        self.requests.clear()
        self.results.clear()
