"""Honest connect latency while one source floods a worker with idle connections.

A worker process listens on 127.0.0.1; a flooder process (tests/flooder.py) keeps
``--flood`` connections open from 127.0.0.2 that never send anything, reconnecting every
one the worker drops (a sustained, bounded flood); meanwhile this process connects ``--connects`` times from
127.0.0.1 (a full handshake each) and prints the median and 90th percentile latency and
the failures. Run it with and without ``--flood 0`` to compare::

    python benchmarks/handshake_flood.py --flood 400 --connects 60
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLOODER = Path(__file__).resolve().parent.parent / "tests" / "flooder.py"  # the flood itself


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flood", type=int, default=400, help="idle connections the flooder holds (default 400)")
    p.add_argument("--connects", type=int, default=60, help="honest connections timed (default 60)")
    p.add_argument("--seconds", type=float, default=30.0, help="upper bound on the flood's length")
    p.add_argument(
        "--max-handshakes", type=int, default=128, help="the worker's --max-handshakes (default 128)"
    )
    args = p.parse_args()
    os.environ.setdefault("TORCHFEED_SECRET", secrets.token_hex(32))
    from torchfeed import client
    from torchfeed.protocol import auth

    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchfeed",
            "worker",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--log-level",
            "ERROR",
            "--max-handshakes",
            str(args.max_handshakes),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    flooder = None
    try:
        assert worker.stdout is not None
        address = worker.stdout.readline().strip()
        host, port = address.rsplit(":", 1)
        if args.flood:
            flooder = subprocess.Popen(
                [sys.executable, str(FLOODER), host, port, str(args.flood), str(args.seconds)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert flooder.stdout is not None
            assert flooder.stdout.readline().strip() == "ready"
            time.sleep(1.0)
        secret = auth.load_secret()
        times, failures = [], []
        for _ in range(args.connects):
            start = time.perf_counter()
            try:
                client.Connection(address, secret, 10.0, session=client.default_session()).close()
                times.append(time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                failures.append(repr(exc))
        ms = sorted(t * 1000 for t in times)
        if ms:
            p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
            print(
                f"flood {args.flood}: {len(ms)} connects, median {statistics.median(ms):.1f} ms, "
                f"p90 {p90:.1f} ms, max {ms[-1]:.1f} ms; {len(failures)} failed {failures[:3]}"
            )
        else:
            print(f"flood {args.flood}: every connect failed: {failures[:3]}")
    finally:
        if flooder is not None:
            out, _ = flooder.communicate(timeout=10)
            print(out.strip())
        worker.terminate()
        worker.wait(10)


if __name__ == "__main__":
    main()
