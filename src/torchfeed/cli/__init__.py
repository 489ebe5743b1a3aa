"""The ``torchfeed`` command: ``torchfeed worker | demo | bench | top | slurm``.

Parsing (and ``--help``, ``--version``) imports no torch: it answers at once. The
``--help`` text is written for a terminal (no reStructuredText markup): the list of
commands in it is made from the subcommands themselves.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..tools import BENCH_CASES  # `torchfeed bench` cases (light: the runners import torch)
from . import worker


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (no usage block, no traceback)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_demo_parser(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's digits, fed by local workers",
        description="Start local workers, train a small CNN on scikit-learn's 8x8 digits fed by "
        "RemoteDataLoader, then compare loading throughput with torch's DataLoader.",
    )
    d.add_argument("--workers", type=int, default=2, help="local worker processes to start (default 2)")
    d.add_argument("--epochs", type=int, default=8, help="training epochs (default 8)")
    d.add_argument("--batch-size", type=int, default=64, help="samples per batch (default 64)")
    d.add_argument(
        "--seed", type=int, default=0, help="seed of the shuffle order and augmentation (default 0)"
    )
    d.add_argument(
        "--connect",
        nargs="*",
        metavar="HOST:PORT",
        help="use these running workers instead of starting local ones",
    )
    d.add_argument(
        "--plot",
        metavar="FILE.png",
        default="torchfeed-demo.png",
        help="draw per-worker throughput and the trainer's wait during training here (default "
        "torchfeed-demo.png; needs matplotlib; '' for none)",
    )


def _add_bench_parser(sub) -> None:
    listed = "; ".join(f"{name}: {what}" for name, what in BENCH_CASES.items())
    b = sub.add_parser(
        "bench",
        help="compare with torch's DataLoader (see benchmarks/)",
        description=f"Measure RemoteDataLoader against torch's DataLoader. Cases: {listed}.",
    )
    b.add_argument(
        "cases",
        nargs="*",
        default=[],
        metavar="CASE",
        help=f"cases to run (default: all): {', '.join(BENCH_CASES)}",
    )
    b.add_argument("--workers", type=int, default=2, help="worker processes per side (default 2)")
    b.add_argument("--seconds", type=float, default=6.0, help="approximate time per measurement (default 6)")
    b.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the torchfeed runs: per-worker samples/s and the trainer's wait over time "
        "(needs matplotlib: pip install 'torchfeed[plot]')",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="torchfeed")
    parser.add_argument("--version", action="version", version=f"torchfeed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    worker.add_parser(sub)
    _add_demo_parser(sub)
    _add_bench_parser(sub)
    from . import top  # [stats hook]

    top.add_parser(sub)
    from ..cluster import slurm

    slurm.add_parser(sub)
    commands = list(sub.choices)
    parser.description = (
        f"Feed PyTorch training from remote data-loading workers. Commands: {', '.join(commands)} "
        "(torchfeed COMMAND --help for each)."
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return worker.run(args)
    if args.command == "demo":
        from ..tools.demo import run_demo

        return run_demo(args)
    if args.command == "bench":
        unknown = [c for c in args.cases if c not in BENCH_CASES]
        if unknown:
            print(
                f"torchfeed bench: error: unknown benchmark case(s) {', '.join(unknown)}; choose from "
                f"{', '.join(BENCH_CASES)}",
                file=sys.stderr,
            )
            return 2
        from ..tools.bench import run_bench

        return run_bench(args)
    if args.command == "top":  # [stats hook]
        from . import top

        return top.run(args)
    if args.command == "slurm":
        from ..cluster import slurm

        return slurm.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
