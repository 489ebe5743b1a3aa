"""The worker's sample cache: one byte budget per worker process, shared by every dataset on it.

:func:`torchfeed.cached` datasets (:mod:`torchfeed.loader.cache`) keep decoded samples
here, keyed by ``(dataset key, sample key)``: trainers and jobs that build an equal
dataset on this worker use the same entries. The budget is ``torchfeed worker
--cache-size`` (:data:`DEFAULT_SIZE` unless set; 0 turns caching off).

Past the budget the cache **keeps what it has**: a new sample is not stored (it is decoded
again when asked for), except that entries of datasets no trainer holds any more are
evicted, oldest first, to make room. Keeping rather than evicting the least recently used
entry is what a scan over the data wants: every epoch reads every sample, so LRU would
evict each sample just before it is read again and hit nothing, while keeping a fixed
part hits that part every epoch. Results are the same either way (a sample not cached is
decoded again).

Also here: the settings of this worker's *lane* (the secret and interface its peers use,
set by :func:`torchfeed.worker.server.run_worker`), and :func:`parse_size`.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_SIZE = 1 << 30  # 1 GiB: ``torchfeed worker --cache-size`` unless set
MISSING: Any = object()
NOTE_BYTES = 160  # what a note (see Elsewhere) counts against the budget


@dataclass(frozen=True)
class Elsewhere:
    """A note in place of a sample: the peer lane that keeps it (its owner keeps the note)."""

    lane: str


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes from ``"512MiB"``, ``"8GiB"``, ``"1.5G"``, ``"100MB"`` or a plain number of bytes.

    KiB/MiB/GiB/TiB (and K/M/G/T) are powers of 1024, KB/MB/GB/TB powers of 1000."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a cache size cannot be negative, got {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cache size {text!r} not understood: write a number of bytes with an optional unit, "
            "e.g. 512MiB, 8GiB, 1.5G, 100MB, or 0 to turn the cache off"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def sizeof(obj: Any, _depth: int = 0) -> int:
    """Bytes a sample holds: tensors' and arrays' memory, bytes, images, and their containers."""
    nbytes = getattr(obj, "nbytes", None)  # numpy arrays
    if isinstance(nbytes, int):
        return nbytes + 112
    storage = getattr(obj, "untyped_storage", None)  # torch tensors: the whole storage a view keeps
    if callable(storage) and hasattr(obj, "element_size"):
        try:
            return int(storage().nbytes()) + 200
        except Exception:  # noqa: BLE001 - a tensor subclass without storage: its elements
            return int(obj.element_size() * obj.numel()) + 200
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj) + 50
    if _depth < 8 and isinstance(obj, (list, tuple, set, frozenset)):
        return 56 + 8 * len(obj) + sum(sizeof(x, _depth + 1) for x in obj)
    if _depth < 8 and isinstance(obj, dict):
        return 232 + sum(sizeof(k, _depth + 1) + sizeof(v, _depth + 1) for k, v in obj.items())
    size = getattr(obj, "size", None)  # PIL images: width x height x bands
    bands = getattr(obj, "getbands", None)
    if isinstance(size, tuple) and len(size) == 2 and callable(bands):
        return int(size[0]) * int(size[1]) * len(bands()) + 200
    return sys.getsizeof(obj)


@dataclass
class Figures:
    """The cache's numbers, as a worker's STATS reports them."""

    budget: int
    bytes: int
    entries: int  # samples kept here
    notes: int  # samples this worker owns and a peer keeps (see Elsewhere)
    hits: int
    misses: int
    refused: int  # samples not stored: over the budget (notes not counted)
    evicted: int  # entries of datasets no trainer holds, dropped to make room


class Tally:
    """Lookups of cached datasets' samples: found (hits, here or at a peer) or not (misses)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def tally(self, hit: bool) -> None:
        """Count one lookup."""
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1


class Store(Tally):
    """Samples kept within a byte budget (thread-safe; the lock is held for a few instructions),
    and this worker's lookups of them (:meth:`tally`, under the same lock)."""

    def __init__(self, budget: int = DEFAULT_SIZE):
        super().__init__()
        self.budget = budget
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()  # oldest first
        self._holders: dict[bytes, int] = {}  # dataset key -> datasets built on it and alive
        self._dataset_bytes: dict[bytes, int] = {}  # dataset key -> bytes of its entries
        self._bytes = 0
        self._notes = 0  # entries that are notes
        self.refused = self.evicted = 0

    def peek(self, dataset: bytes, key: Any) -> Any:
        """The kept sample or :data:`MISSING` (counting nothing: see :meth:`tally`)."""
        with self._lock:
            found = self._entries.get((dataset, key))
        return MISSING if found is None or isinstance(found[0], Elsewhere) else found[0]

    def where(self, dataset: bytes, key: Any) -> str | None:
        """The lane a note names for this sample (see :meth:`note`), or None."""
        with self._lock:
            found = self._entries.get((dataset, key))
        return found[0].lane if found is not None and isinstance(found[0], Elsewhere) else None

    def note(self, dataset: bytes, key: Any, lane: str) -> bool:
        """Remember that the peer at ``lane`` keeps this sample (unless it is kept here)."""
        return self.put(dataset, key, Elsewhere(lane), NOTE_BYTES)

    def put(self, dataset: bytes, key: Any, value: Any, nbytes: int | None = None) -> bool:
        """Keep ``value`` if it fits (after evicting entries of datasets nobody holds).

        A sample already kept stays; a note (:class:`Elsewhere`) is replaced by what comes,
        and stays when that does not fit."""
        size = sizeof(value) if nbytes is None else nbytes
        entry_key = (dataset, key)
        with self._lock:
            old = self._entries.get(entry_key)
            if old is not None and not isinstance(old[0], Elsewhere):
                return True
            excess = self._excess(entry_key, size)
            if 0 < excess <= self._orphan_bytes(keep=entry_key):  # else evicting would not do
                self._evict_orphans(excess, keep=entry_key)  # (the note it replaces stays)
            if self._excess(entry_key, size) > 0:
                self.refused += not isinstance(value, Elsewhere)
                return False
            if old is not None:
                self._drop(entry_key)
            self._entries[entry_key] = (value, size)
            self._bytes += size
            self._dataset_bytes[dataset] = self._dataset_bytes.get(dataset, 0) + size
            self._notes += isinstance(value, Elsewhere)
            return True

    def _excess(self, entry_key: tuple, size: int) -> int:
        """Bytes over the budget once ``size`` bytes replace the entry at ``entry_key`` (the lock held)."""
        old = self._entries.get(entry_key)
        return self._bytes - (old[1] if old is not None else 0) + size - self.budget

    def _drop(self, entry_key: tuple) -> int:
        """Remove an entry (the lock held); its size."""
        value, size = self._entries.pop(entry_key)
        self._bytes -= size
        left = self._dataset_bytes[entry_key[0]] - size
        if left:
            self._dataset_bytes[entry_key[0]] = left
        else:
            del self._dataset_bytes[entry_key[0]]
        self._notes -= isinstance(value, Elsewhere)
        return size

    def _orphan_bytes(self, keep: tuple) -> int:
        """Bytes of the entries of datasets nobody holds, but ``keep``'s (the lock held): what
        evicting could free. A sum over datasets, so a full cache refuses without a scan."""
        total = sum(n for d, n in self._dataset_bytes.items() if self._holders.get(d, 0) == 0)
        kept = self._entries.get(keep)
        if kept is not None and self._holders.get(keep[0], 0) == 0:
            total -= kept[1]
        return total

    def _evict_orphans(self, needed: int, keep: tuple) -> None:
        for entry_key in list(self._entries):
            if needed <= 0:
                return
            if entry_key == keep or self._holders.get(entry_key[0], 0) > 0:
                continue
            needed -= self._drop(entry_key)
            self.evicted += 1

    def hold(self, dataset: bytes) -> None:
        with self._lock:
            self._holders[dataset] = self._holders.get(dataset, 0) + 1

    def release(self, dataset: bytes) -> None:
        with self._lock:
            left = self._holders.get(dataset, 0) - 1
            if left > 0:
                self._holders[dataset] = left
            else:
                self._holders.pop(dataset, None)

    def resize(self, budget: int) -> None:
        """A new budget; entries over it are dropped, newest first (what fits is kept)."""
        with self._lock:
            self.budget = budget
            while self._bytes > budget and self._entries:
                self._drop(next(reversed(self._entries)))

    def figures(self) -> Figures:
        with self._lock:
            return Figures(
                self.budget,
                self._bytes,
                len(self._entries) - self._notes,
                self._notes,
                self.hits,
                self.misses,
                self.refused,
                self.evicted,
            )


store = Store()  # this process's cache


@dataclass
class Lane:
    """Where this worker's peers reach its cache: an interface, the pool's secret, and the
    worker's options (a :class:`~torchfeed.worker.options.WorkerOptions`), under which its lane
    (a second server) serves too."""

    host: str
    secret: Any
    options: Any


_lane: Lane | None = None


def configure(size: int | None = None, *, lane: Lane | None = None) -> None:
    """Set this process's cache budget (bytes) and lane (``torchfeed worker`` does, at start)."""
    global _lane
    if size is not None:
        store.resize(size)
    if lane is not None:
        _lane = lane


def lane() -> Lane | None:
    """The lane settings, or None in a process that is not a ``torchfeed worker``."""
    return _lane


def figures() -> dict[str, int]:
    """The cache's figures as plain numbers (for a worker's STATS)."""
    f = store.figures()
    return {
        "cache_budget": f.budget,
        "cache_bytes": f.bytes,
        "cache_entries": f.entries,
        "cache_notes": f.notes,
        "cache_hits": f.hits,
        "cache_misses": f.misses,
        "cache_refused": f.refused,
    }
