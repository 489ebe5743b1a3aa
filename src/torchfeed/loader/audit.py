"""Proof that an epoch delivered every sample exactly once: audit records in loader states.

With ``RemoteDataLoader(..., audit=True)`` a loader records the integer sample keys it hands
to its consumer in the current epoch, and every :meth:`~torchfeed.RemoteDataLoader.state_dict`
holds them (``state["audit"]``) beside what it resumes. The record of one loader from where its
job began or resumed is a *segment*; a state carries its own segment and those of the states it
resumed through. :func:`verify` takes the states a job saved (every rank's, from every
checkpoint it kept) and follows the chain back from the finished epoch: the final segments,
then at each resume the segments of the job before, as they stood at the checkpoint resumed
from; it reports the keys delivered twice and the keys never delivered.

Segments of one job are told apart without any communication between ranks: a job's id comes
from what every one of its ranks knows alike (the epoch, the world size, the job it resumed
from and the position there). A position is job-wide: the global sample position of a
:class:`~torchfeed.DistributedSampler` (ranks may change in number), else the batches each rank
consumed (every rank moves in step).

Keys are kept as a bitmap (zlib-compressed in a state: about ``H(1/W)`` bits per sample of
the dataset for a rank of ``W``) plus the keys a segment delivered more than once.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..util import is_count

FORMAT = "torchfeed.audit/1"
MAX_KEYS = 1 << 28  # keys an audit records (a bitmap of 32 MiB in a state: 268 million samples)


class KeySet:
    """A multiset of non-negative integer keys: a bitmap and the repeats."""

    def __init__(self) -> None:
        self.bits = np.zeros(0, dtype=bool)
        self.repeats: dict[int, int] = {}  # key -> times seen beyond the first

    def add(self, keys: Sequence[Any]) -> None:
        if not len(keys):
            return
        try:
            arr = np.asarray([_key(k) for k in keys], dtype=np.int64)
        except TypeError as e:
            raise TypeError(f"{e}; audit=True records integer sample keys (map-style datasets)") from None
        top = int(arr.max()) + 1
        if top > MAX_KEYS:
            raise ValueError(
                f"sample key {top - 1} is beyond what audit=True records (keys below {MAX_KEYS})"
            )
        if top > len(self.bits):
            self.bits = np.concatenate(
                [self.bits, np.zeros(max(top, 2 * len(self.bits)) - len(self.bits), bool)]
            )
        uniq, counts = np.unique(arr, return_counts=True)
        for k in uniq[self.bits[uniq]].tolist():  # already here: one more each
            self.repeats[k] = self.repeats.get(k, 0) + 1
        for k, c in zip(uniq.tolist(), counts.tolist()):
            if c > 1:
                self.repeats[k] = self.repeats.get(k, 0) + c - 1
        self.bits[uniq] = True

    def without(self, keys: Sequence[Any]) -> KeySet:
        """A copy with one occurrence of each of ``keys`` taken out."""
        out = KeySet()
        out.bits, out.repeats = self.bits.copy(), dict(self.repeats)
        for k in keys:
            k = _key(k)
            if out.repeats.get(k):
                out.repeats[k] -= 1
                if not out.repeats[k]:
                    del out.repeats[k]
            elif k < len(out.bits):
                out.bits[k] = False
        return out

    def counts(self, length: int) -> np.ndarray:
        """How many times each key in ``[0, length)`` was delivered (keys beyond are ignored)."""
        out = np.zeros(length, dtype=np.int64)
        n = min(length, len(self.bits))
        out[:n] += self.bits[:n]
        for k, extra in self.repeats.items():
            if k < length:
                out[k] += extra
        return out

    def to_state(self) -> dict:
        size = int(np.flatnonzero(self.bits).max()) + 1 if self.bits.any() else 0
        return {
            "size": size,
            "bits": zlib.compress(np.packbits(self.bits[:size]).tobytes(), 6),
            "repeats": sorted([k, n] for k, n in self.repeats.items()),
        }

    @classmethod
    def from_state(cls, state: Any, length: int) -> KeySet:
        """The keys a state's record holds, for a dataset of ``length`` keys: a record that
        names more keys, or is not what :meth:`to_state` writes, is refused before anything
        of its size is allocated."""
        bits, repeats = (state.get("bits"), state.get("repeats")) if isinstance(state, dict) else (None, None)
        size = state.get("size") if isinstance(state, dict) else None
        if not (isinstance(size, int) and is_count(size) and size <= min(length, MAX_KEYS)):
            raise ValueError(
                f"an audit record names {size!r} keys, for a dataset of {length}: not a record of this dataset"
            )
        if not isinstance(bits, bytes) or not isinstance(repeats, list):
            raise ValueError("an audit record's keys are not what torchfeed writes")
        raw = zlib.decompressobj()
        try:
            packed = raw.decompress(bits, (size + 7) // 8 + 1)
        except zlib.error as e:
            raise ValueError(f"an audit record's bitmap does not decompress: {e}") from None
        if len(packed) != (size + 7) // 8 or raw.unconsumed_tail:
            raise ValueError("an audit record's bitmap does not match its key count")
        out = cls()
        out.bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=size).astype(bool)
        for pair in repeats:
            ok = isinstance(pair, list) and len(pair) == 2 and is_count(pair[0]) and is_count(pair[1])
            if not (ok and pair[0] < size and 0 < pair[1] <= MAX_KEYS):
                raise ValueError(f"an audit record's repeat {pair!r} is not one torchfeed writes")
            out.repeats[pair[0]] = pair[1]
        return out


def _key(k: Any) -> int:
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 0:
        raise TypeError(f"sample key {k!r} is not a non-negative integer")
    return int(k)


def job_id(epoch: int, world_size: int, origin: int, parent: str | None) -> str:
    """The id every rank of one job gives its segment, from what they all know alike."""
    text = f"{epoch}:{world_size}:{origin}:{parent or ''}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Audit:
    """A loader's record of the current epoch: its own segment and the inherited ones."""

    def __init__(
        self, epoch: int, rank: int, world_size: int, origin: int = 0, resumed: dict | None = None
    ) -> None:
        self.epoch, self.rank, self.world_size, self.origin = epoch, rank, world_size, origin
        self.inherited: list[dict] = []
        self.parent: str | None = None
        if resumed is not None:
            entries = entries_of(resumed, epoch)
            own = [e for e in entries if e.get("own")]
            self.parent = own[0]["job"] if own else None
            self.inherited = [{k: v for k, v in e.items() if k != "own"} for e in entries]
        self.job = job_id(epoch, world_size, origin, self.parent)
        self.keys = KeySet()

    def handed(self, keys: Sequence[Any]) -> None:
        self.keys.add(keys)

    def to_state(self, upto: int, complete: bool, left_out: Sequence[Any] = ()) -> dict:
        """The record for a state at job-wide position ``upto`` (``complete``: the epoch ended),
        leaving out the keys of the batches the state leaves out."""
        keys = self.keys.without(left_out) if left_out else self.keys
        own = {
            "epoch": self.epoch,
            "job": self.job,
            "parent": self.parent,
            "origin": self.origin,
            "upto": upto,
            "rank": self.rank,
            "world_size": self.world_size,
            "complete": complete,
            "keys": keys.to_state(),
            "own": True,
        }
        return {"format": FORMAT, "entries": [*self.inherited, own]}


def entries_of(record: Any, epoch: int | None = None) -> list[dict]:
    """The entries of an audit record (``state["audit"]``), checked; those of ``epoch`` only."""
    if (
        not isinstance(record, dict)
        or record.get("format") != FORMAT
        or not isinstance(record.get("entries"), list)
    ):
        raise ValueError(
            "this is not a torchfeed audit record (a loader state's 'audit', made with audit=True)"
        )
    out = []
    for e in record["entries"]:
        if not isinstance(e, dict):
            raise ValueError("an audit record holds an entry that is not one torchfeed writes")
        for name in ("epoch", "origin", "upto", "rank", "world_size"):
            if not is_count(e.get(name)):
                raise ValueError(f"an audit entry's {name!r} is {e.get(name)!r}: not one torchfeed writes")
        if not (isinstance(e.get("job"), str) and (e.get("parent") is None or isinstance(e["parent"], str))):
            raise ValueError("an audit entry's job or parent is not one torchfeed writes")
        if not isinstance(e.get("complete"), bool) or not isinstance(e.get("keys"), dict):
            raise ValueError("an audit entry's completion or keys are not what torchfeed writes")
        if not 0 <= e["rank"] < e["world_size"]:
            raise ValueError(f"an audit entry names rank {e['rank']} of a world of {e['world_size']}")
        if epoch is None or e["epoch"] == epoch:
            out.append(e)
    return out


@dataclass
class Report:
    """What :func:`verify` found for one epoch: ``missing`` keys (never delivered) and
    ``duplicates`` (key -> times delivered, for keys delivered more than once), each over the
    dataset's ``length``; ``problems`` names records it needed and did not get."""

    epoch: int
    length: int
    missing: list[int] = field(default_factory=list)
    duplicates: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    segments: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicates or self.problems)

    def __str__(self) -> str:
        if self.ok:
            return f"epoch {self.epoch}: all {self.length} samples delivered exactly once ({self.segments} segments)"
        parts = [f"epoch {self.epoch}:"]
        if self.missing:
            parts.append(f"{len(self.missing)} samples never delivered {_short(self.missing)};")
        if self.duplicates:
            parts.append(
                f"{len(self.duplicates)} delivered more than once {_short(sorted(self.duplicates))};"
            )
        parts += self.problems
        return " ".join(parts)


def _short(keys: list[int]) -> str:
    return str(keys) if len(keys) <= 10 else f"[{', '.join(map(str, keys[:10]))}, ...]"


def verify(states: Iterable[Any], length: int, epoch: int | None = None) -> Report:
    """Check one epoch from the loader states a job saved (``RemoteDataLoader(audit=True)``):
    give every rank's state at the end of the epoch and, for each resume, every rank's state at
    the checkpoint it resumed from (the states of other checkpoints are ignored). ``epoch``
    defaults to the latest finished one among them. Returns a :class:`Report`."""
    entries: dict[tuple, dict] = {}
    for state in states:
        record = state.get("audit") if isinstance(state, dict) and "entries" not in state else state
        if record is None:
            raise ValueError("a state holds no audit record: create the loader with audit=True")
        for e in entries_of(record):
            e = {k: v for k, v in e.items() if k != "own"}
            entries[(e["job"], e["rank"], e["upto"], e["complete"])] = e
    finished = [e for e in entries.values() if e["complete"]]
    if epoch is None:
        if not finished:
            raise ValueError("none of these states is of a finished epoch: give the states saved at its end")
        epoch = max(e["epoch"] for e in finished)
    report = Report(epoch=epoch, length=length)
    finals = {e["job"] for e in finished if e["epoch"] == epoch}
    if len(finals) != 1:
        report.problems.append(
            f"{len(finals)} jobs finished epoch {epoch} in these states (give those of one run)"
            if finals
            else f"no state of the end of epoch {epoch}"
        )
        return report
    counts = np.zeros(length, dtype=np.int64)
    job, upto, complete = finals.pop(), None, True
    while job is not None:
        mine = [
            e
            for e in entries.values()
            if e["job"] == job and (e["complete"] if complete else e["upto"] == upto)
        ]
        if not mine:
            report.problems.append(f"no state of job {job} at position {upto}, where the next job resumed")
            break
        world = mine[0]["world_size"]
        by_rank = {e["rank"]: e for e in mine}
        lacking = [r for r in range(world) if r not in by_rank]
        if lacking:
            where = "at the end of the epoch" if complete else f"at position {upto}"
            report.problems.append(
                f"no state of rank(s) {lacking} of job {job} {where}: give every rank's state"
            )
        for e in by_rank.values():
            counts += KeySet.from_state(e["keys"], length).counts(length)
            report.segments += 1
        first = mine[0]
        job, upto, complete = first["parent"], first["origin"], False
    report.missing = np.flatnonzero(counts == 0).tolist()
    report.duplicates = {int(k): int(counts[k]) for k in np.flatnonzero(counts > 1)}
    return report
