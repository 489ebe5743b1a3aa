"""Pictures of a run: per-worker throughput and the trainer's wait over time (matplotlib).

Record with a :class:`Timeline` (``timeline.sample(loader)`` once per step: it reads
``loader.stats()`` at most every ``every`` seconds), then ``timeline.plot("run.png")``.
matplotlib is an optional extra: ``pip install 'torchfeed[plot]'``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Point:
    t: float  # seconds since the timeline started
    wait: float  # share of the interval the trainer waited in __next__
    rates: dict[str, float] = field(default_factory=dict)  # worker -> samples/s over the interval


class Timeline:
    """Samples of a loader's statistics over time (several loaders one after another work too)."""

    def __init__(self, every: float = 0.25, clock=time.monotonic):
        self.every = every
        self._clock = clock
        self.start = clock()
        self.points: list[Point] = []
        # (loader id, time, wait seconds, {worker: samples})
        self._last: tuple[int, float, float, dict[str, int]] | None = None
        self._due = self.start

    def sample(self, loader) -> None:
        """Record a point if ``every`` seconds passed since the last one (cheap otherwise)."""
        now = self._clock()
        if now < self._due:
            return
        self._due = now + self.every
        s = loader.stats()
        counts = {a: w.samples for a, w in s.workers.items()}
        last, self._last = self._last, (id(loader), now, s.wait_seconds, counts)
        if last is None or last[0] != id(loader):
            return  # a new loader: this is its baseline
        span = max(now - last[1], 1e-9)
        rates = {a: max(n - last[3].get(a, 0), 0) / span for a, n in counts.items()}
        wait = min(max((s.wait_seconds - last[2]) / span, 0.0), 1.0)
        self.points.append(Point(now - self.start, wait, rates))

    def plot(self, path: str, title: str = "torchfeed: is the trainer waiting for data?") -> str:
        """Write a PNG: per-worker samples/s (top) and the trainer's wait (bottom). Returns ``path``."""
        figure = _figure_class()
        fig = figure(figsize=(7.0, 4.6))
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
        ts = [p.t for p in self.points]
        workers = sorted({a for p in self.points for a in p.rates})
        for address in workers:
            top.plot(ts, [p.rates.get(address, 0.0) for p in self.points], label=address, linewidth=1.2)
        if len(workers) > 1:
            top.plot(
                ts,
                [sum(p.rates.values()) for p in self.points],
                label="all workers",
                color="black",
                linewidth=1.0,
                linestyle="--",
            )
        top.set_ylabel("samples/s")
        top.set_title(title, fontsize=10)
        if workers:
            top.legend(fontsize=7, loc="upper left", ncol=2)
        top.grid(alpha=0.3)
        bottom.fill_between(ts, [100 * p.wait for p in self.points], step="mid", alpha=0.5, color="tab:red")
        bottom.set_ylim(0, 100)
        bottom.set_ylabel("trainer waits %")
        bottom.set_xlabel("seconds")
        bottom.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        return path


def _figure_class():
    """matplotlib's Figure (no pyplot: no global backend or window is involved)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plots need matplotlib, an optional extra: pip install 'torchfeed[plot]' (or pip install matplotlib)"
        ) from exc
    return Figure


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        _figure_class()
    except ImportError:
        return False
    return True
