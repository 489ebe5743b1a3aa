"""torchfeed.autoscale on a Dask LocalCluster: grow while the trainer waits, shrink when it slows.

    python benchmarks/autoscale.py [--phase-seconds 75]

Samples take 20 ms on a worker (sleep-bound, one executor per worker: 50 samples/s each,
so several workers fit this 2-core machine). The pool starts with 1 worker and has no
maximum of its own. Phase 1: the trainer takes 5 ms a sample (200 samples/s: 4 workers
needed). Phase 2: 50 ms a sample (20 samples/s: 1 worker). The autoscaler runs with its
defaults. Targets (issue 23): in phase 1 the trainer receives >= 150 samples/s over some
15 s within 75 s, never with more than 6 workers; in phase 2 at most 2 workers remain
within 75 s; every epoch completed saw each sample exactly once. Prints a timeline and
the decisions.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from distributed import LocalCluster

import torchfeed
import torchfeed.dask as tfd
from torchfeed.tools.measure import SleepIndexDataset

N = 400  # samples an epoch
BATCH = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=75.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    decisions: list[str] = []
    start = time.monotonic()

    class Keep(logging.Handler):
        def emit(self, record):
            decisions.append(f"{time.monotonic() - start:6.1f} s  {record.getMessage()}")

    logging.getLogger("torchfeed.autoscale").addHandler(Keep(logging.INFO))
    logging.getLogger("torchfeed.autoscale").setLevel(logging.INFO)
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        tfd.Pool(cluster, parallel=1, poll=0.5) as pool,
    ):
        ds = torchfeed.RemoteDataset(pool.wait(1, 120), SleepIndexDataset, N, 0.02)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=BATCH, shuffle=True)
        received: list[tuple[float, int, float]] = []  # (time, samples, waited) per batch
        timeline: list[tuple] = []
        epochs_ok = epochs = 0
        most = 1
        with torchfeed.autoscale(loader, pool) as scaler:
            start = time.monotonic()
            phases = [("fast", 0.005), ("slow", 0.05)]
            ends = [start + args.phase_seconds, start + 2 * args.phase_seconds]
            next_row = start
            for (phase, per_sample), end in zip(phases, ends):
                while time.monotonic() < end:
                    seen: list[int] = []
                    finished = True
                    it = iter(loader)
                    while True:
                        t0 = time.monotonic()
                        try:
                            batch = next(it)
                        except StopIteration:
                            break
                        now = time.monotonic()
                        received.append((now, len(batch), now - t0))
                        seen += batch.tolist()
                        time.sleep(per_sample * len(batch))
                        s = scaler.stats()
                        most = max(most, len(s.workers) + len(s.draining), s.requested + len(s.draining))
                        if now >= next_row:
                            next_row += 5.0
                            recent = [r for r in received if r[0] > now - 5.0]
                            timeline.append(
                                (
                                    now - start,
                                    phase,
                                    len(s.workers),
                                    s.requested,
                                    len(s.draining),
                                    sum(r[1] for r in recent) / 5.0,
                                    sum(r[2] for r in recent) / 5.0,
                                )
                            )
                        if time.monotonic() > end + 30:  # a pass never ends past its phase for long
                            finished = False
                            break
                    if finished:
                        epochs += 1
                        epochs_ok += sorted(seen) == list(range(N))
            stats = scaler.stats()
        print(f"{'t (s)':>6}  phase  workers  asked  draining  samples/s  wait")
        for t, phase, w, r, d, rate, wait in timeline:
            print(f"{t:6.0f}  {phase:5}  {w:7d}  {r:5d}  {d:8d}  {rate:9.0f}  {wait:4.0%}")
        print("\ndecisions:")
        print("\n".join(decisions))
        # phase 1: the best 15 s within the first phase
        best, best_end = 0.0, None
        fast = [r for r in received if r[0] <= ends[0]]
        for t, _, _ in fast:
            if t - start < 15:
                continue
            rate = sum(r[1] for r in fast if t - 15 < r[0] <= t) / 15
            if rate > best:
                best, best_end = rate, t - start
        slow_rows = [row for row in timeline if row[1] == "slow"]
        down_at = next(
            (row[0] - args.phase_seconds for row in slow_rows if row[2] + row[4] <= 2 and row[3] <= 2), None
        )
        print(
            f"\nphase 1: best 15 s: {best:.0f} samples/s (ending at {best_end or 0:.0f} s); most workers: {most}"
        )
        print(f"phase 2: at most 2 workers after {down_at if down_at is None else round(down_at)} s")
        print(f"epochs: {epochs_ok} of {epochs} saw each sample exactly once")
        print(f"final: {stats.workers} asked {stats.requested}")
        ok = best >= 150 and most <= 6 and down_at is not None and down_at <= 75 and epochs_ok == epochs
        print("targets met" if ok else "TARGETS MISSED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
