"""A loader's statistics as the user reads them: :class:`LoaderStats`, :class:`WorkerStats`, advice.

:meth:`~torchfeed.stats.Accounting.snapshot` fills them from its counters; :func:`advise`
turns the measured rates into one sentence (input-bound or not, how many workers would
keep up, whether the link or the sample cache is the bottleneck).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

INPUT_BOUND = 0.3  # wait fractions above this are called input-bound
LINK_BOUND = 0.6  # an input-bound loader whose replies spend this share of the time arriving is link-bound


@dataclass(slots=True)  # made for every worker at every stats() call: slots make that cheaper
class WorkerStats:
    """What one worker did for this loader."""

    address: str
    state: str  # serving | draining | lost | reconnecting
    samples_per_s: float  # over the last 30 s
    batches: int  # delivered since the loader was made
    samples: int  # the same in samples
    inflight: int  # requests it holds now
    mean_batch_seconds: float | None  # the scheduler's estimate of its time per batch
    requeued: int  # batches it held when it was lost, sent elsewhere
    hedged: int  # overdue batches of it duplicated elsewhere
    cache_bytes: int | None = None  # decoded samples its cache holds (torchfeed.cached datasets)
    cache_hits: int | None = None  # this loader's dataset's samples found in the pool's cache


@dataclass
class LoaderStats:
    """A snapshot of a loader: see :meth:`torchfeed.RemoteDataLoader.stats`."""

    wait_fraction: float  # share of wall time inside __next__ waiting, since the pass started
    wait_fraction_30s: float  # the same over the last 30 s
    samples_per_s: float  # delivered to the trainer, over the last 30 s
    batches: int  # delivered in this pass
    samples: int  # delivered in this pass
    bytes_received: int  # reply bytes received for this loader since it was made
    pass_seconds: float  # the current pass's length so far (the last pass's, once it ended)
    wait_seconds: float  # waited in __next__ since the loader was made (all passes)
    workers: dict[str, WorkerStats] = field(default_factory=dict)
    advice: str = ""
    wire_bytes_received: int = 0  # the same as they crossed the network (compressed, sealed)
    link_busy: float = 0.0  # share of the last 30 s the workers' replies spent arriving (mean per worker)
    float_images: bool = False  # batches hold float32 images (N, C, H, W): uint8 would cross in a quarter
    cache_hit_rate: float | None = None  # torchfeed.cached datasets: share of samples found cached, this pass
    cache_full: bool = False  # some worker's cache is at its --cache-size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data (for any logger)."""
        return asdict(self)

    def scalars(self, prefix: str = "torchfeed/") -> dict[str, float]:
        """Flat ``name -> number`` pairs, e.g. for TensorBoard's ``add_scalar``."""
        out = {
            f"{prefix}wait_fraction": self.wait_fraction,
            f"{prefix}wait_fraction_30s": self.wait_fraction_30s,
            f"{prefix}samples_per_s": self.samples_per_s,
            f"{prefix}bytes_received": float(self.bytes_received),
            f"{prefix}wire_bytes_received": float(self.wire_bytes_received),
        }
        for address, w in self.workers.items():
            out[f"{prefix}workers/{address}/samples_per_s"] = w.samples_per_s
        if self.cache_hit_rate is not None:
            out[f"{prefix}cache_hit_rate"] = self.cache_hit_rate
        return out

    def table(self) -> str:
        """The per-worker table and the advice, as text."""
        head = ["worker", "state", "samples/s", "batches", "inflight", "s/batch", "requeued", "hedged"]
        rows = [
            [
                w.address,
                w.state,
                f"{w.samples_per_s:.1f}",
                str(w.batches),
                str(w.inflight),
                "-" if w.mean_batch_seconds is None else f"{w.mean_batch_seconds:.4f}",
                str(w.requeued),
                str(w.hedged),
            ]
            for w in self.workers.values()
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths)) for r in [head, *rows]]
        lines.append(
            f"trainer: waits {self.wait_fraction:.0%} of the pass ({self.wait_fraction_30s:.0%} over 30 s), "
            f"{self.samples_per_s:.1f} samples/s, {self.batches} batches, {self.bytes_received / 1e6:.1f} MB"
        )
        if self.cache_hit_rate is not None:
            held = sum(w.cache_bytes or 0 for w in self.workers.values())
            lines.append(
                f"cache: {self.cache_hit_rate:.0%} of this pass's samples found, {held / 1e6:.1f} MB held"
            )
        lines.append(self.advice)
        return "\n".join(lines)


def _cache_advice(s: LoaderStats) -> str:
    """What the cache adds to an input-bound verdict (empty when it is not the bottleneck)."""
    rate = s.cache_hit_rate
    if rate is None or rate >= 0.9:
        return ""
    if s.cache_full:
        return (
            f"; the sample cache finds only {rate:.0%} of samples and is full: raise the workers' "
            "--cache-size (or cache a smaller form of each sample)"
        )
    return f"; the sample cache finds {rate:.0%} of samples so far (it fills during the first epoch)"


def advise(s: LoaderStats, batches: int, busy: float) -> str:
    """One sentence from measured rates: input-bound or not, and how many workers would keep up."""
    wait = s.wait_fraction_30s if batches else s.wait_fraction
    serving = [w for w in s.workers.values() if w.state in ("serving", "draining")]
    now_count = len(serving)
    if batches < 2:
        return "not enough batches yet to tell whether the trainer waits for data"
    if wait <= INPUT_BOUND:
        return f"not input-bound: the trainer waits {wait:.0%} of the time"
    # the trainer could take batches at 1 / (its own time per batch); workers give their measured rates
    own = max(busy / batches, 1e-4)  # below 0.1 ms per batch the trainer does nothing measurable
    per_batch = s.samples / s.batches if s.batches else 1.0
    demand = per_batch / own  # samples/s the trainer would take if it never waited
    if s.link_busy >= LINK_BOUND:
        return _link_advice(s, wait)
    rates = [w.samples_per_s for w in serving if w.samples_per_s > 0]
    if not rates:
        return f"input-bound: the trainer waits {wait:.0%} of the time and no worker delivered lately"
    per_worker = sum(rates) / len(rates)
    need = max(math.ceil(demand / per_worker), now_count + 1)
    shown = f"about {need}" if need <= 1000 else "more than 1000"
    return (
        f"input-bound: the trainer waits {wait:.0%} of the time; {shown} workers (now {now_count}) "
        "would keep up" + _cache_advice(s)
    )


def _link_advice(s: LoaderStats, wait: float) -> str:
    shrink = s.wire_bytes_received / s.bytes_received if s.bytes_received else 1.0
    text = (
        f"link-bound: the trainer waits {wait:.0%} of the time while the workers' replies spend {s.link_busy:.0%} "
        f"of it arriving (on the wire: {shrink:.2f} of their bytes); more workers will not help: "
    )
    if s.float_images:
        return text + (
            "send images as uint8 (a quarter of float32's bytes) and normalise them on the trainer's device, "
            "e.g. batch.to(device).float().div_(255), or give the link more bandwidth"
        )
    if shrink > 0.95:
        return (
            text
            + "send smaller dtypes or crops, leave compression='auto' on, or give the link more bandwidth"
        )
    return text + "send smaller dtypes or crops, or give the link more bandwidth"
