"""``torchfeed bench``: RemoteDataLoader against torch's DataLoader (the runners are
:mod:`torchfeed.tools.bench`)."""

from __future__ import annotations

import argparse
import sys

from ..tools import BENCH_CASES  # the cases' names and descriptions (light: the runners import torch)

HELP = "compare with torch's DataLoader (see benchmarks/)"
DESCRIPTION = (
    "Measure RemoteDataLoader against torch's DataLoader. Cases: "
    + "; ".join(f"{name}: {what}" for name, what in BENCH_CASES.items())
    + "."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "cases",
        nargs="*",
        default=[],
        metavar="CASE",
        help=f"cases to run (default: all): {', '.join(BENCH_CASES)}",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes per side (default 2)")
    p.add_argument("--seconds", type=float, default=6.0, help="approximate time per measurement (default 6)")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the torchfeed runs: per-worker samples/s and the trainer's wait over time "
        "(needs matplotlib: pip install 'torchfeed[plot]')",
    )


def run(args: argparse.Namespace) -> int:
    unknown = [c for c in args.cases if c not in BENCH_CASES]
    if unknown:
        print(
            f"torchfeed bench: error: unknown benchmark case(s) {', '.join(unknown)}; choose from "
            f"{', '.join(BENCH_CASES)}",
            file=sys.stderr,
        )
        return 2
    from ..tools.bench import run_bench  # imports torch

    return run_bench(args)
