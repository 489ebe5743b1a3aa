"""Issue 32: the first epoch of a JPEG pipeline, torchfeed against torch's DataLoader (cold starts).

    python benchmarks/jpeg.py [--rounds 3] [--json out.json]

What is measured and how: torchfeed.tools.bench_jpeg. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets

from torchfeed.tools import bench_jpeg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per side and round")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    os.environ.setdefault("TORCHFEED_SECRET", secrets.token_hex(32))
    result = bench_jpeg.run(rounds=args.rounds, epochs=args.epochs)
    for line in bench_jpeg.iter_summary(result):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
