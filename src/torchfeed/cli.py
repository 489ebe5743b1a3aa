"""The ``torchfeed`` command: ``torchfeed worker | demo | bench | slurm``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional


def _procs(value: str) -> int:
    if value == "auto":
        return len(os.sched_getaffinity(0))
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("--procs must be >= 1 or 'auto'")
    return n


def _add_worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run a data-loading worker daemon",
                       description="Serve remote data loading. Prints one host:port line per worker "
                                   "process on stdout when ready.")
    p.add_argument("--host", default="0.0.0.0", help="interface to bind (default: all)")
    p.add_argument("--port", type=int, default=0,
                   help="port to bind; 0 picks a free one; with --procs N, process i binds port+i")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds of client silence before its connection is dropped")
    p.add_argument("--parallel", type=int, default=1,
                   help="requests executing concurrently in one process (threads)")
    p.add_argument("--procs", type=_procs, default=1,
                   help="worker processes to start (one Python process uses one core); 'auto' = CPUs")
    p.add_argument("--address-file", help="also append each address line to this file (under a lock)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process (default 1)")
    p.add_argument("--handshake-timeout", type=float, default=10.0,
                   help="seconds a new connection has to authenticate (default 10)")
    p.add_argument("--log-level", default="WARNING")
    limits = p.add_argument_group("per-client limits and security")
    limits.add_argument("--max-call-bytes", type=int, default=1 << 30,
                        help="largest call (pickled arguments plus tensors) a client may send (default 1 GiB)")
    limits.add_argument("--max-queued-requests", type=int, default=1024,
                        help="requests one client may have waiting for replies (default 1024)")
    limits.add_argument("--max-refs", type=int, default=4096,
                        help="live remote references (datasets, fetchers) one client may hold (default 4096)")
    limits.add_argument("--max-handshakes", type=int, default=128,
                        help="unauthenticated connections held at once; beyond it the oldest is dropped "
                             "(default 128)")
    limits.add_argument("--trusted-network-no-encryption", action="store_true",
                        help="also accept clients that set TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION=1: their "
                             "traffic is authenticated but NOT encrypted. Only for networks no one else can "
                             "listen on")


_LIMIT_OPTIONS = ("max_call_bytes", "max_queued_requests", "max_refs", "max_handshakes")


def _limit_args(args) -> List[str]:
    """The limit and security options again, for child processes."""
    out = []
    for name in _LIMIT_OPTIONS:
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out + (["--trusted-network-no-encryption"] if args.trusted_network_no_encryption else [])


def _run_workers(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if args.procs == 1:
        from .worker import ConnectionLimits, run_worker

        limits = ConnectionLimits(max_queued_requests=args.max_queued_requests, max_call_bytes=args.max_call_bytes,
                                  max_refs=args.max_refs)
        run_worker(args.host, args.port, args.timeout, args.parallel, address_file=args.address_file,
                   torch_threads=args.threads, handshake_timeout=args.handshake_timeout, limits=limits,
                   max_handshakes=args.max_handshakes,
                   integrity_only=True if args.trusted_network_no_encryption else None)
        # Leave without interpreter finalization: daemon executor threads may still be
        # inside torch code, and tearing torch down under them aborts the process.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # One child per process; each prints (and files) its own address line.
    children = []
    for i in range(args.procs):
        cmd = [sys.executable, "-m", "torchfeed", "worker", "--host", args.host,
               "--port", str(args.port + i if args.port else 0), "--timeout", str(args.timeout),
               "--parallel", str(args.parallel), "--threads", str(args.threads), "--log-level", args.log_level,
               "--handshake-timeout", str(args.handshake_timeout), *_limit_args(args)]
        if args.address_file:
            cmd += ["--address-file", args.address_file]
        children.append(subprocess.Popen(cmd))

    def forward(signum, _frame):
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(c.poll() is None for c in children):
        time.sleep(0.2)  # short sleeps: a signal handled by another thread still gets to run
    for c in children:  # the first failure decides; a signal death reads as 128 + signal
        if c.returncode:
            return c.returncode if c.returncode > 0 else 128 - c.returncode
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="torchfeed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_worker_parser(sub)
    d = sub.add_parser("demo", help="train a small CNN on scikit-learn's digits, fed by local workers")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--epochs", type=int, default=8)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--connect", nargs="*", help="use these running workers instead of starting local ones")
    b = sub.add_parser("bench", help="compare with torch's DataLoader (see benchmarks/)")
    b.add_argument("cases", nargs="*", default=[])
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--seconds", type=float, default=6.0, help="approximate time per measurement")
    from .cluster import slurm

    slurm.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "worker":
        return _run_workers(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args)
    if args.command == "slurm":
        return slurm.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
