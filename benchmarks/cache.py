"""Issue 21: decode once with torchfeed.cached (600 JPEGs, 2 workers). Results: benchmarks/README.md.

    python benchmarks/cache.py [--json out.json] [--plot benchmarks/cache.png]

What is measured and how: torchfeed.tools.bench_cache (also ``torchfeed bench cache``).
"""

from __future__ import annotations

import argparse
import os

from torchfeed.tools import bench_cache, scripts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the numbers here")
    p.add_argument(
        "--plot", default=os.path.join(os.path.dirname(__file__), "cache.png"), help="PNG of the epochs"
    )
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    scripts.throwaway_secret()
    result = bench_cache.run(epochs=args.epochs)
    targets = {
        "epoch 2 >= 5x epoch 1": result["epoch2_over_epoch1"] >= 5,
        "hit rate >= 0.9 from epoch 2": all(h is not None and h >= 0.9 for h in result["hit_rates"][1:]),
        "two jobs <= 1.3x the worker CPU of one": result["two_jobs_over_one"] <= 1.3,
        "RSS growth < 80 MB with --cache-size 16MiB": max(result["budget_rss_growth_mb"]) < 80,
    }
    result["targets"] = targets
    for name, ok in targets.items():
        print(f"{'met' if ok else 'MISSED'}: {name}")
    scripts.write_json(result, args.json)
    if bench_cache.plot(result, args.plot):
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
