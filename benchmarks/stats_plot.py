"""The picture of the README's "Is my GPU waiting for data?" section (docs/assets/stats-timeline.png).

Three local sleep-bound workers, one of them 3x slower. The trainer first computes 30 ms
per batch (not input-bound), then almost nothing (input-bound); meanwhile a worker is
killed and restarted. Prints ``loader.stats()`` at the end of each phase. ~15 s.

    PYTHONPATH=src python benchmarks/stats_plot.py docs/assets/stats-timeline.png
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time

import torchfeed
from torchfeed.plots import Timeline
from torchfeed.tools.measure import CountSampler, SleepyDataset


def main(path: str) -> None:
    os.environ.setdefault("TORCHFEED_SECRET", secrets.token_hex(32))
    with torchfeed.LocalWorkers(3) as workers:
        slow = {workers.processes[2].pid: 3.0}
        ds = torchfeed.RemoteDataset(workers.addresses, SleepyDataset, 1 << 30, 0.002, slow_pids=slow)
        sampler = CountSampler()
        sampler.n = 1 << 30
        loader = torchfeed.RemoteDataLoader(ds, batch_size=8, sampler=sampler)
        timeline = Timeline(every=0.25)
        start = time.monotonic()
        restarted = False
        for _ in loader:
            timeline.sample(loader)
            elapsed = time.monotonic() - start
            if elapsed < 6.0:
                time.sleep(0.03)  # the trainer's own work per batch
            elif not restarted and elapsed > 8.0:
                restarted = True
                print(loader.stats().table(), "\n")
                workers.kill(0)
                threading.Timer(1.0, workers.restart, args=(0,)).start()
            if elapsed > 16.0:
                break
        print(loader.stats().table())
        timeline.plot(
            path, title="3 workers (one 3x slower); trainer busy, then fast; worker 1 killed and restarted"
        )
    print(f"wrote {path} ({os.path.getsize(path) / 1e3:.0f} kB)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "stats-timeline.png")
