"""Measure how fast torchfeed recovers from worker failures (numbers for README).

    python benchmarks/recovery.py

Each scenario runs a loader over local workers whose dataset sleeps a little per
sample (so batches take a known time), injects one failure mid-epoch, and reports:
detection (failure -> the loader's "lost worker" warning) and the longest gap between
two delivered batches around the failure. Every scenario also checks that each sample
was delivered exactly once, in order.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
import warnings

import torch

import torchfeed
from torchfeed.tools.measure import SleepIndexDataset


def run(scenario: str, heartbeat) -> dict:
    torchfeed.set_heartbeat(*heartbeat)
    n, per_item, batch = (8000 if scenario == "restart" else 3000), 0.002, 4
    with torchfeed.LocalWorkers(3) as w:
        ds = torchfeed.RemoteDataset(w.addresses, SleepIndexDataset, n, per_item, pid=True)
        hedge = None if scenario in ("sigstop", "kill") else 4.0
        loader = torchfeed.RemoteDataLoader(ds, batch_size=batch, straggler_factor=hedge)
        times, rows, injected, detected, rejoined, old_pid = [], [], None, None, None, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, b in enumerate(loader):
                now = time.monotonic()
                times.append(now)
                rows.append(b)
                if (
                    detected is None
                    and injected is not None
                    and any("lost worker" in str(c.message) for c in caught)
                ):
                    detected = now
                if i == 40:
                    injected = now
                    if scenario == "kill":
                        w.kill(0)
                    elif scenario in ("sigstop", "sigstop+hedging"):
                        w.kill(0, signal.SIGSTOP)
                    elif scenario == "restart":
                        old_pid = w.processes[0].pid
                        w.kill(0)
                        w.processes[0].wait()
                        threading.Thread(target=w.restart, args=(0,), daemon=True).start()
                if scenario == "restart" and injected is not None and rejoined is None:
                    pid = w.processes[0].pid
                    if pid != old_pid and pid in b[:, 1].tolist():
                        rejoined = now
        w.kill(0, signal.SIGCONT)
        idx = torch.cat(rows)[:, 0].tolist()
        assert idx == list(range(n)), "samples lost or repeated"
        assert injected is not None, "the fault was never injected"
        after = [t for t in times if t >= injected]
        gaps = [b - a for a, b in zip(after, after[1:])]
        normal = sorted(b - a for a, b in zip(times[:40], times[1:40]))
        return {
            "scenario": scenario,
            "heartbeat": f"{heartbeat[0]:g}/{heartbeat[1]:g} s",
            "detected_s": None if detected is None else round(detected - injected, 2),
            "longest_gap_s": round(max(gaps), 2),
            "typical_gap_s": round(normal[len(normal) // 2], 4),
            "epoch_s": round(times[-1] - times[0], 2),
            "rejoined_s": None if rejoined is None else round(rejoined - injected, 2),
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="skip the default-heartbeat SIGSTOP case (15 s)")
    args = p.parse_args(argv)
    cases = [
        ("kill", (2.0, 15.0)),
        ("sigstop", (0.5, 3.0)),
        ("sigstop+hedging", (2.0, 15.0)),
        ("restart", (2.0, 15.0)),
    ]
    if not args.quick:
        cases.insert(1, ("sigstop", (2.0, 15.0)))
    print(
        f"{'scenario':18} {'heartbeat':>12} {'detected':>9} {'longest gap':>12} {'typical gap':>12} {'epoch':>7}"
    )
    for scenario, hb in cases:
        r = run(scenario, hb)
        det = "-" if r["detected_s"] is None else f"{r['detected_s']:.2f} s"
        back = (
            ""
            if r["rejoined_s"] is None
            else f"   restarted worker serving again after {r['rejoined_s']:.2f} s"
        )
        print(
            f"{r['scenario']:18} {r['heartbeat']:>12} {det:>9} {r['longest_gap_s']:>10.2f} s "
            f"{r['typical_gap_s']:>10.4f} s {r['epoch_s']:>5.1f} s{back}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
