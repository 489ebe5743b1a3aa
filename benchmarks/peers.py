"""Issue 32: torchfeed against the loaders a user would pick instead, in the same run.

    python benchmarks/peers.py [--cases jpeg,big,tiny] [--systems torch,torchfeed,ray,...]
                               [--rounds 3] [--images 600] [--json out.json]

Peers that are not installed (`pip install -e '.[bench]'` installs them) are reported as such.
What is measured and how: torchfeed.tools.bench_peers. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys

from torchfeed.tools import bench_peers, bench_systems, scripts


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


# bench_peers.run()'s integer settings, keyword -> (default, help): each is the option --KEYWORD (- for _)
SETTINGS = {
    "rounds": (3, "interleaved rounds (medians are reported)"),
    "epochs": (3, "passes per run: epoch 1, then later epochs"),
    "images": (600, "JPEGs of the jpeg case"),
    "big_batches": (40, "batches per pass of the big case"),
    "tiny_samples": (2000, "samples per pass of the tiny case"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=_names, default=list(bench_peers.CASES), help="comma-separated")
    p.add_argument("--systems", type=_names, default=list(bench_systems.SYSTEMS), help="comma-separated")
    for name, (default, text) in SETTINGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=text)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    scripts.throwaway_secret()
    try:
        result = bench_peers.run(
            args.cases,
            args.systems,
            log=lambda line: print(line, file=sys.stderr, flush=True),
            **{name: getattr(args, name) for name in SETTINGS},
        )
    except ValueError as exc:
        p.error(str(exc))
    scripts.report(bench_peers.iter_table(result), result, args.json)


if __name__ == "__main__":
    main()
