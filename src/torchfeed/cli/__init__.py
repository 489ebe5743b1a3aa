"""The ``torchfeed`` command: ``torchfeed worker | demo | bench | top | slurm``.

Parsing (and ``--help``, ``--version``) imports no torch: it answers at once. The
``--help`` text is written for a terminal (no reStructuredText markup): the list of
commands in it is made from the subcommands themselves.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from .. import __version__
from ..local import ENV_SYS_PATH  # set by LocalWorkers: the parent's sys.path, for imports
from ..tools import BENCH_CASES  # `torchfeed bench` cases (light: the runners import torch)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
START_TIMEOUT = 300.0  # seconds the processes of --procs N have to get ready


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (no usage block, no traceback)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value!r}")
    return n


def _procs(value: str) -> int:
    if value == "auto":
        from ..util import cpu_count

        return cpu_count()
    try:
        return _positive(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive number or 'auto', got {value!r}") from None


def _level(value: str) -> str:
    level = value.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


def _add_worker_parser(sub) -> None:
    p = sub.add_parser(
        "worker",
        help="run a data-loading worker daemon",
        description="Serve remote data loading. Prints one host:port line per worker "
        "process on stdout when ready (all of them, or none: with --procs N, "
        "if one process cannot start, all stop).",
    )
    p.add_argument("--host", default="0.0.0.0", help="interface to bind (default: all)")
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="port to bind; 0 picks a free one; with --procs N, process i binds port+i",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds of client silence before its connection is dropped (default 120)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="requests executing concurrently in one process (threads, default 1)",
    )
    p.add_argument(
        "--procs",
        type=_procs,
        default=1,
        help="worker processes to start (one Python process uses one core); 'auto' = usable CPUs. "
        "Each prints its own host:port line: give the trainer all of them (or use "
        "--address-file)",
    )
    p.add_argument(
        "--address-file",
        help="also append each address line to this file (under a lock); "
        "RemoteDataset.from_file(path, ...) reads and watches it",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process (default 1)")
    p.add_argument(
        "--cache-size",
        type=_cache_size,
        default=None,
        metavar="SIZE",
        help="memory for decoded samples of torchfeed.cached datasets, per process (e.g. 512MiB, 8GiB; "
        "0: no cache; default 1GiB); past it the cache keeps what it has",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve this worker's figures to Prometheus on this port (HTTP, /metrics; needs "
        "prometheus_client: pip install 'torchfeed[metrics]'); with --procs N, process i uses PORT+i",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        metavar="HOST",
        help="interface the metrics port binds (default: --host)",
    )
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=10.0,
        help="seconds a new connection has to authenticate (default 10)",
    )
    p.add_argument(
        "--log-level",
        type=_level,
        default="WARNING",
        help=f"log level: {', '.join(LOG_LEVELS)} (default WARNING)",
    )
    p.add_argument(
        "--watch-stdin",
        action="store_true",
        help="stop when standard input reaches its end (for a parent that holds a pipe to it: "
        "the worker ends with its parent, even if the parent is killed)",
    )
    p.add_argument(  # how LocalWorkers, --procs and the Dask plugin hand over the secret
        "--secret-on-stdin", action="store_true", help=argparse.SUPPRESS
    )
    limits = p.add_argument_group("limits (per client and per worker) and security")
    limits.add_argument(
        "--max-call-bytes",
        type=_positive,
        default=1 << 30,
        help="largest call (pickled arguments plus tensors) a client may send (default 1 GiB)",
    )
    limits.add_argument(
        "--max-queued-requests",
        type=_positive,
        default=1024,
        help="requests one client may have waiting for replies (default 1024)",
    )
    limits.add_argument(
        "--max-worker-queued-requests",
        type=_positive,
        default=8192,
        help="calls of all clients together a worker process holds (being received, waiting or "
        "running; default 8192)",
    )
    limits.add_argument(
        "--max-worker-queued-bytes",
        type=_positive,
        default=4 << 30,
        help="total announced size of those calls (default 4 GiB)",
    )
    limits.add_argument(
        "--max-refs",
        type=_positive,
        default=4096,
        help="live remote references (datasets, fetchers) one client may hold (default 4096)",
    )
    limits.add_argument(
        "--max-handshakes",
        type=_positive,
        default=128,
        help="unauthenticated connections held at once; beyond it the oldest of the source holding the most is dropped (default 128)",
    )
    limits.add_argument(
        "--trusted-network-no-encryption",
        action="store_true",
        help="also accept clients that set TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION=1: their "
        "traffic is authenticated but NOT encrypted. Only for networks no one else can "
        "listen on",
    )
    limits.add_argument(
        "--reachable-at",
        action="append",
        default=[],
        type=_reachable,
        metavar="HOST:PORT",
        help="an endpoint trainers may dial to reach this worker besides its own addresses "
        "(port forwarding, NAT, containers, tunnels; repeatable; *:PORT for any address with "
        "that port, * for any). Without it, a connection that arrives for another endpoint, "
        "as a relay sending another worker's trainers here would make it, is refused",
    )


_LIMIT_OPTIONS = (
    "max_call_bytes",
    "max_queued_requests",
    "max_worker_queued_requests",
    "max_worker_queued_bytes",
    "max_refs",
    "max_handshakes",
)


def _limit_args(args) -> list[str]:
    """The limit and security options again, for child processes."""
    out = []
    for name in _LIMIT_OPTIONS:
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    for entry in args.reachable_at:
        out += ["--reachable-at", entry]
    return out + (["--trusted-network-no-encryption"] if args.trusted_network_no_encryption else [])


def _reachable(value: str) -> str:
    from ..worker.names import parse_reachable

    try:
        parse_reachable(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _adopt_parent_path() -> None:
    """Make importable here what the parent process could import (LocalWorkers sets the variable)."""
    listed = [p for p in os.environ.get(ENV_SYS_PATH, "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in listed if p not in sys.path]


def _watch_stdin() -> None:
    def watch():
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="torchfeed-stdin-watch", daemon=True).start()


def _address_file_error(path: str, why: str) -> None:
    print(f"torchfeed worker: error: --address-file {path}: {why}", file=sys.stderr, flush=True)


def _cache_size(text: str) -> int:
    from ..worker.samplestore import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run_workers(args) -> int:
    import logging

    if args.address_file:
        from ..protocol.addrfile import why_unwritable

        why = why_unwritable(args.address_file)
        if why is not None:
            _address_file_error(args.address_file, why)
            return 2

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    secret = _take_secret(args.secret_on_stdin)  # before --watch-stdin reads on
    if secret is None:
        return 2
    _adopt_parent_path()
    if args.watch_stdin:
        _watch_stdin()
    if args.procs > 1:
        return _run_many(args, secret)
    from ..worker.server import ConnectionLimits, run_worker

    try:
        run_worker(
            args.host,
            args.port,
            args.timeout,
            args.parallel,
            secret=secret,
            address_file=args.address_file,
            torch_threads=args.threads,
            handshake_timeout=args.handshake_timeout,
            limits=ConnectionLimits(
                max_queued_requests=args.max_queued_requests,
                max_call_bytes=args.max_call_bytes,
                max_refs=args.max_refs,
                max_worker_queued_requests=args.max_worker_queued_requests,
                max_worker_queued_bytes=args.max_worker_queued_bytes,
            ),
            max_handshakes=args.max_handshakes,
            integrity_only=True if args.trusted_network_no_encryption else None,
            reachable_at=args.reachable_at,
            cache_size=args.cache_size,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
    except ImportError as exc:  # --metrics-port without prometheus_client
        print(f"torchfeed worker: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    except ValueError as exc:  # a --reachable-at host that does not resolve
        print(f"torchfeed worker: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    except OSError as exc:  # the port is taken, the interface does not exist, the file cannot be written
        if args.address_file and _about_address_file(exc, args.address_file):
            _address_file_error(args.address_file, f"cannot append to it: {exc.strerror or exc}")
            os._exit(2)
        print(
            f"torchfeed worker: cannot serve on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    # Leave without interpreter finalization: daemon executor threads may still be
    # inside torch code, and tearing torch down under them aborts the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _take_secret(on_stdin: bool):
    """The worker's secret, out of the environment: dataset code's subprocesses do not inherit
    ``TORCHFEED_SECRET``. None (after a one-line error) when it is missing or too weak."""
    from ..errors import AuthenticationError
    from ..protocol import auth

    try:
        if on_stdin:
            secret = auth.read_handover(0)
            auth.adopt_secret(secret)
            os.environ.pop(auth.ENV_SECRET, None)
            return secret
        return auth.take_secret_from_environment()
    except AuthenticationError as exc:
        print(f"torchfeed worker: error: {exc}", file=sys.stderr, flush=True)
        return None


def _about_address_file(exc: OSError, path: str) -> bool:
    from ..protocol.addrfile import UnsafeAddressFile

    return isinstance(exc, UnsafeAddressFile) or exc.filename == path


def _child_command(args, i: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchfeed",
        "worker",
        "--host",
        args.host,
        "--port",
        str(args.port + i if args.port else 0),
        "--timeout",
        str(args.timeout),
        "--parallel",
        str(args.parallel),
        "--threads",
        str(args.threads),
        "--log-level",
        args.log_level,
        "--handshake-timeout",
        str(args.handshake_timeout),
        "--watch-stdin",
        "--secret-on-stdin",
        *_limit_args(args),
        *([] if args.cache_size is None else ["--cache-size", str(args.cache_size)]),
        *_metrics_args(args, i),
    ]


def _metrics_args(args, i: int) -> list[str]:
    """--metrics-port for process ``i`` of --procs N (PORT+i; 0 stays 0: a free one each)."""
    if args.metrics_port is None:
        return []
    port = args.metrics_port + i if args.metrics_port else 0
    return ["--metrics-port", str(port)] + (
        ["--metrics-host", args.metrics_host] if args.metrics_host else []
    )


def _run_many(args, secret) -> int:
    """--procs N: all processes ready, their lines printed and filed, or none left running.
    Each gets the secret on its standard input (not in its environment)."""
    from ..protocol.auth import handover_line
    from ..pumps import Pump, to_stderr, to_stdout

    children: list[subprocess.Popen] = []
    outs: list[Pump] = []
    errs: list[Pump] = []
    stopping = threading.Event()

    def stop_all(signum=None, _frame=None):
        stopping.set()
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    for i in range(args.procs):  # stdin: a pipe they watch, so they end with this process
        c = subprocess.Popen(
            _child_command(args, i), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        children.append(c)
        assert c.stdin is not None  # stdin=PIPE
        try:
            c.stdin.write(handover_line(secret.value))
            c.stdin.flush()
        except OSError:
            pass  # it died at once: reported below, from its stderr
        outs.append(Pump(c.stdout, to_stdout, first_line=True, name=f"torchfeed-out-{i}"))
        errs.append(Pump(c.stderr, to_stderr, f"[process {i}] ", name=f"torchfeed-err-{i}", hold=True))
    addresses = []
    deadline = time.monotonic() + START_TIMEOUT
    for i, (c, out) in enumerate(zip(children, outs)):
        address = None
        while address is None and not stopping.is_set() and time.monotonic() < deadline:
            address = out.wait_first_line(0.2)
            if address is None and c.poll() is not None:
                break
        if address is None:
            if stopping.is_set():
                why = "interrupted"
            elif c.poll() is not None:
                errs[i].join(2.0)
                last = [line.strip() for line in errs[i].tail if line.strip()]
                why = (
                    last[-1].removeprefix("torchfeed worker: ")
                    if last
                    else f"it exited with code {c.returncode}"
                )
            else:
                why = f"not ready within {START_TIMEOUT:g} s"
            stop_all()
            for other in children:
                other.wait()
            port = args.port + i if args.port else 0
            print(
                f"torchfeed worker: process {i + 1} of {args.procs} ({args.host}:{port}) could not start: "
                f"{why}; all {args.procs} processes were stopped",
                file=sys.stderr,
                flush=True,
            )
            return 1
        addresses.append(address)
    if args.address_file:
        from ..protocol.addrfile import append_lines

        try:
            append_lines(args.address_file, addresses)
        except OSError as exc:
            stop_all()
            for c in children:
                c.wait()
            _address_file_error(args.address_file, f"cannot append to it: {exc.strerror or exc}")
            return 2
    for address in addresses:  # one line, one write
        sys.stdout.write(address + "\n")
        sys.stdout.flush()
    for address, out, err in zip(addresses, outs, errs):
        out.prefix = err.prefix = f"[{address}] "
        err.release()
    while any(c.poll() is None for c in children):
        time.sleep(0.2)  # short sleeps: a signal handled by another thread still gets to run
    for c in children:  # the first failure decides; a signal death reads as 128 + signal
        if c.returncode:
            return c.returncode if c.returncode > 0 else 128 - c.returncode
    return 0


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
    _add_worker_parser(sub)
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
        return _run_workers(args)
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
