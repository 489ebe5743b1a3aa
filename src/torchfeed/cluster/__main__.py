"""Helpers called by generated batch scripts: ``python -m torchfeed.cluster port | wait-workers``."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import TorchfeedError
from ..util import pid_alive
from .discovery import wait_for_addresses
from .env import choose_port


def _alive(pid: int):
    def check() -> bool:
        # a zombie child (exited, not yet reaped by the batch shell) counts as dead
        return pid_alive(pid)

    return check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchfeed.cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "port",
        help="print a rendezvous port: $MASTER_PORT, or one derived from the job id and free on this host",
    )
    p.add_argument("--job-id", help="default: the scheduler's job id ($SLURM_JOB_ID, ...)")
    w = sub.add_parser("wait-workers", help="wait until N addresses are in FILE; print them space-separated")
    w.add_argument("file")
    w.add_argument("count", type=int)
    w.add_argument("--timeout", type=float, default=300.0)
    w.add_argument(
        "--pid", type=int, help="stop waiting with an error when this process (the workers' srun) ends"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "port":
            if os.environ.get("MASTER_PORT"):
                print(
                    f"torchfeed: keeping MASTER_PORT={os.environ['MASTER_PORT']} from the environment",
                    file=sys.stderr,
                )
            print(choose_port(args.job_id))
        else:
            alive = _alive(args.pid) if args.pid else None
            print(" ".join(wait_for_addresses(args.file, args.count, args.timeout, alive=alive)))
    except TorchfeedError as exc:
        print(f"torchfeed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
