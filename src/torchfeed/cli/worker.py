"""``torchfeed worker``: its options, the secret's hand-over, and one worker process.

The options that shape how a worker serves belong to :class:`WorkerOptions`, which adds
them to the parser itself; this module adds where to bind, how many processes (``--procs N``:
:mod:`torchfeed.cli.procs` supervises them), the address file, the log level and how the
parent hands over the secret and watches the child.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..worker.options import WorkerOptions, positive
from ..worker.process import ENV_SYS_PATH  # set by LocalWorkers: the parent's sys.path, for imports

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _procs(value: str) -> int:
    if value == "auto":
        from ..util import cpu_count

        return cpu_count()
    try:
        return positive(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive number or 'auto', got {value!r}") from None


def _level(value: str) -> str:
    level = value.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


HELP = "run a data-loading worker daemon"
DESCRIPTION = (
    "Serve remote data loading. Prints one host:port line per worker process on stdout when ready "
    "(all of them, or none: with --procs N, if one process cannot start, all stop; one that ends "
    "later is started again)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0", help="interface to bind (default: all)")
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="port to bind; 0 picks a free one; with --procs N, process i binds port+i",
    )
    p.add_argument(
        "--procs",
        type=_procs,
        default=1,
        help="worker processes to start (one Python process uses one core); 'auto' = usable CPUs. "
        "Each prints its own host:port line: give the trainer all of them (or use "
        "--address-file). A process that ends is started again (its new line printed and filed); "
        "one that keeps ending stops them all",
    )
    p.add_argument(
        "--address-file",
        help="also append each address line to this file (under a lock); "
        "RemoteDataset.from_file(path, ...) reads and watches it",
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
    WorkerOptions.add_arguments(p)


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


def _error(text: str) -> None:
    print(f"torchfeed worker: error: {text}", file=sys.stderr, flush=True)


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
        _error(str(exc))
        return None


def _about_address_file(exc: OSError, path: str) -> bool:
    from ..protocol.addrfile import UnsafeAddressFile

    return isinstance(exc, UnsafeAddressFile) or exc.filename == path


def run(args) -> int:
    """Execute ``torchfeed worker`` with parsed ``args``."""
    import logging

    try:
        options = WorkerOptions.from_args(args)
    except ValueError as exc:
        _error(str(exc))
        return 2
    if args.address_file:
        from ..protocol.addrfile import why_unwritable

        why = why_unwritable(args.address_file)
        if why is not None:
            _error(f"--address-file {args.address_file}: {why}")
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
        from .procs import Supervisor

        return Supervisor(
            args.host,
            args.port,
            args.procs,
            options,
            log_level=args.log_level,
            secret=secret.value,
            address_file=args.address_file,
        ).run()
    return _serve(args, options, secret)


def _serve(args, options: WorkerOptions, secret) -> int:
    """One worker process, serving here until a signal; the process leaves through os._exit."""
    from ..worker.server import run_worker

    try:
        run_worker(args.host, args.port, secret=secret, address_file=args.address_file, options=options)
    except ImportError as exc:  # --metrics-port without prometheus_client
        _error(str(exc))
        os._exit(2)
    except ValueError as exc:  # a --reachable-at host that does not resolve
        _error(str(exc))
        os._exit(2)
    except OSError as exc:  # the port is taken, the interface does not exist, the file cannot be written
        if args.address_file and _about_address_file(exc, args.address_file):
            _error(f"--address-file {args.address_file}: cannot append to it: {exc.strerror or exc}")
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
