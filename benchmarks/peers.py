"""Issue 32: torchfeed against the loaders a user would pick instead, in the same run.

    python benchmarks/peers.py [--cases jpeg,big,tiny] [--systems torch,torchfeed,ray,...]
                               [--rounds 3] [--images 600] [--json out.json]

Peers that are not installed (`pip install -e '.[bench]'` installs them) are reported as such.
What is measured and how: torchfeed.tools.bench_peers. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

from torchfeed.tools import bench_peers, bench_systems


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=_names, default=list(bench_peers.CASES), help="comma-separated")
    p.add_argument("--systems", type=_names, default=list(bench_systems.SYSTEMS), help="comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    p.add_argument("--epochs", type=int, default=3, help="passes per run: epoch 1, then later epochs")
    p.add_argument("--images", type=int, default=600, help="JPEGs of the jpeg case")
    p.add_argument("--big-batches", type=int, default=40, help="batches per pass of the big case")
    p.add_argument("--tiny-samples", type=int, default=2000, help="samples per pass of the tiny case")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    os.environ.setdefault("TORCHFEED_SECRET", secrets.token_hex(32))
    try:
        result = bench_peers.run(
            args.cases,
            args.systems,
            rounds=args.rounds,
            images=args.images,
            big_batches=args.big_batches,
            tiny_samples=args.tiny_samples,
            epochs=args.epochs,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except ValueError as exc:
        p.error(str(exc))
    for line in bench_peers.iter_table(result):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
