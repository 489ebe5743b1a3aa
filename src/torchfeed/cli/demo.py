"""``torchfeed demo``: local workers feed a small CNN (the runner is :mod:`torchfeed.tools.demo`)."""

from __future__ import annotations

import argparse

HELP = "train a small CNN on scikit-learn's digits, fed by local workers"
DESCRIPTION = (
    "Start local workers, train a small CNN on scikit-learn's 8x8 digits fed by RemoteDataLoader, then "
    "compare loading throughput with torch's DataLoader."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="local worker processes to start (default 2)")
    p.add_argument("--epochs", type=int, default=8, help="training epochs (default 8)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per batch (default 64)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the shuffle order and augmentation (default 0)"
    )
    p.add_argument(
        "--connect",
        nargs="*",
        metavar="HOST:PORT",
        help="use these running workers instead of starting local ones",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default="torchfeed-demo.png",
        help="draw per-worker throughput and the trainer's wait during training here (default "
        "torchfeed-demo.png; needs matplotlib; '' for none)",
    )


def run(args: argparse.Namespace) -> int:
    from ..tools.demo import run_demo  # imports torch

    return run_demo(args)
