"""Issue 32: the first epoch of a JPEG pipeline, torchfeed against torch's DataLoader (cold starts).

    python benchmarks/jpeg.py [--rounds 3] [--json out.json]

What is measured and how: torchfeed.tools.bench_jpeg. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse

from torchfeed.tools import bench_jpeg, scripts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per side and round")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    scripts.throwaway_secret()
    result = bench_jpeg.run(rounds=args.rounds, epochs=args.epochs)
    scripts.report(bench_jpeg.iter_summary(result), result, args.json)


if __name__ == "__main__":
    main()
