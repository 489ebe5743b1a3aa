"""A worker's options, in one place: :class:`WorkerOptions`.

One frozen object owns every ``torchfeed worker`` option that shapes how a worker process
serves (not where it binds, nor how its parent starts it): its default, its check, its
``--help`` text and its command-line form. The command line adds them with
:meth:`WorkerOptions.add_arguments` and reads them back with :meth:`WorkerOptions.from_args`;
whoever starts worker processes (``--procs N``, :class:`torchfeed.LocalWorkers`,
:func:`torchfeed.dask.start_workers`, :class:`torchfeed.cluster.SlurmJob`, the Slurm pool)
writes them with :meth:`WorkerOptions.to_args`, and :func:`torchfeed.run_worker` takes the
object itself. No torch here: the command line imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .names import parse_reachable
from .objects import ConnectionLimits
from .samplestore import parse_size

HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has to authenticate
_LIMITS = ConnectionLimits()  # the per-client and per-worker bounds' defaults


def positive(value: str) -> int:
    """argparse type: an integer >= 1 (the worker's counts: --procs, limits)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value!r}")
    return n


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _reachable(value: str) -> str:
    try:
        parse_reachable(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _cli(help: str, type: Any = None, metavar: str | None = None, group: str = "") -> dict[str, Any]:
    """A field's command-line form: ``--NAME`` (the field's name with dashes), its parser and help."""
    return {"help": help, "type": type, "metavar": metavar, "group": group}


_LIMITS_GROUP = "limits (per client and per worker) and security"


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker process serves: ``torchfeed worker``'s options, checked when made.

    Every field is the option ``--FIELD-NAME`` (underscores as dashes); ``None`` means the
    worker's own default. ``cache_size`` also takes a size as text (``"8GiB"``).
    :meth:`to_args` writes the options that differ from the defaults, so a command line
    stays as short as the user's choices.
    """

    timeout: float = field(
        default=120.0,
        metadata=_cli("seconds of client silence before its connection is dropped (default 120)", float, "S"),
    )
    parallel: int = field(
        default=1,
        metadata=_cli("requests executing concurrently in one process (threads, default 1)", int, "N"),
    )
    threads: int = field(default=1, metadata=_cli("torch threads per worker process (default 1)", int, "N"))
    handshake_timeout: float = field(
        default=HANDSHAKE_TIMEOUT,
        metadata=_cli(
            f"seconds a new connection has to authenticate (default {HANDSHAKE_TIMEOUT:g})", float, "S"
        ),
    )
    cache_size: int | None = field(
        default=None,
        metadata=_cli(
            "memory for decoded samples of torchfeed.cached datasets, per process (e.g. 512MiB, 8GiB; "
            "0: no cache; default 1GiB); past it the cache keeps what it has",
            _size,
            "SIZE",
        ),
    )
    shm_bytes: int = field(
        default=1 << 30,
        metadata=_cli(
            "shared memory for the batches of each trainer on this machine (the same-host path; e.g. "
            "256MiB; default 1GiB, taken as batches need it); past it batches travel through the socket",
            _size,
            "SIZE",
        ),
    )
    metrics_port: int | None = field(
        default=None,
        metadata=_cli(
            "also serve this worker's figures to Prometheus on this port (HTTP, /metrics; needs "
            "prometheus_client: pip install 'torchfeed[metrics]'); with --procs N, process i uses PORT+i",
            int,
            "PORT",
        ),
    )
    metrics_host: str | None = field(
        default=None, metadata=_cli("interface the metrics port binds (default: --host)", None, "HOST")
    )
    max_call_bytes: int = field(
        default=_LIMITS.max_call_bytes,
        metadata=_cli(
            "largest call (pickled arguments plus tensors) a client may send (default 1 GiB)",
            positive,
            "N",
            _LIMITS_GROUP,
        ),
    )
    max_queued_requests: int = field(
        default=_LIMITS.max_queued_requests,
        metadata=_cli(
            "requests one client may have waiting for replies (default 1024)", positive, "N", _LIMITS_GROUP
        ),
    )
    max_queued_bytes: int = field(
        default=_LIMITS.max_queued_bytes,
        metadata=_cli(
            "total size of the calls one client may have waiting (default 2 GiB)",
            positive,
            "N",
            _LIMITS_GROUP,
        ),
    )
    max_unsent_bytes: int = field(
        default=_LIMITS.max_unsent_bytes,
        metadata=_cli(
            "reply bytes produced for one client and not yet sent; above it the worker stops reading "
            "that client's calls until it reads replies (default 1 GiB)",
            positive,
            "N",
            _LIMITS_GROUP,
        ),
    )
    max_worker_queued_requests: int = field(
        default=_LIMITS.max_worker_queued_requests,
        metadata=_cli(
            "calls of all clients together a worker process holds (being received, waiting or "
            "running; default 8192)",
            positive,
            "N",
            _LIMITS_GROUP,
        ),
    )
    max_worker_queued_bytes: int = field(
        default=_LIMITS.max_worker_queued_bytes,
        metadata=_cli("total announced size of those calls (default 4 GiB)", positive, "N", _LIMITS_GROUP),
    )
    max_refs: int = field(
        default=_LIMITS.max_refs,
        metadata=_cli(
            "live remote references (datasets, fetchers) one client may hold (default 4096)",
            positive,
            "N",
            _LIMITS_GROUP,
        ),
    )
    max_handshakes: int = field(
        default=128,
        metadata=_cli(
            "unauthenticated connections held at once; beyond it the oldest of the source holding "
            "the most is dropped (default 128)",
            positive,
            "N",
            _LIMITS_GROUP,
        ),
    )
    trusted_network_no_encryption: bool = field(
        default=False,
        metadata=_cli(
            "also accept clients that set TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION=1: their "
            "traffic is authenticated but NOT encrypted. Only for networks no one else can listen on",
            group=_LIMITS_GROUP,
        ),
    )
    reachable_at: tuple[str, ...] = field(
        default=(),
        metadata=_cli(
            "an endpoint trainers may dial to reach this worker besides its own addresses "
            "(port forwarding, NAT, containers, tunnels; repeatable; *:PORT for any address with "
            "that port, * for any). Without it, a connection that arrives for another endpoint, "
            "as a relay sending another worker's trainers here would make it, is refused",
            _reachable,
            "HOST:PORT",
            _LIMITS_GROUP,
        ),
    )

    def __post_init__(self) -> None:
        if self.cache_size is not None:
            object.__setattr__(self, "cache_size", parse_size(self.cache_size))
        object.__setattr__(self, "shm_bytes", parse_size(self.shm_bytes))
        object.__setattr__(self, "reachable_at", tuple(self.reachable_at))
        for entry in self.reachable_at:
            parse_reachable(entry)
        for name in ("parallel", "threads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout", "handshake_timeout"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a port number (0: a free one), got {self.metrics_port}")
        self.limits()  # its own checks (every bound >= 1)
        if self.max_handshakes < 1:
            raise ValueError(f"max_handshakes must be >= 1, got {self.max_handshakes}")

    # -- derived values -------------------------------------------------------------
    def limits(self) -> ConnectionLimits:
        """The per-client and per-worker bounds these options set."""
        return ConnectionLimits(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(ConnectionLimits)}
        )

    def merged(self, **given: Any) -> WorkerOptions:
        """These options with the keywords given that are not None (constructors' shortcuts such
        as ``LocalWorkers(cache_size=...)`` land here)."""
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"unknown worker option {', '.join(map(repr, unknown))}: the options are the fields of "
                f"torchfeed.worker.options.WorkerOptions ({', '.join(f.name for f in dataclasses.fields(self))})"
            )
        chosen = {name: value for name, value in given.items() if value is not None}
        return dataclasses.replace(self, **chosen) if chosen else self

    def for_process(self, i: int) -> WorkerOptions:
        """The options of process ``i`` of several on one machine: metrics port PORT+i (0 stays 0)."""
        if not self.metrics_port:
            return self
        return dataclasses.replace(self, metrics_port=self.metrics_port + i)

    # -- the command line -------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, title: str | None = None) -> None:
        """Add every option to ``parser`` (under ``title`` when given; the bounds in a group of their own)."""
        groups: dict[str, Any] = {"": parser if title is None else parser.add_argument_group(title)}
        for f in dataclasses.fields(cls):
            cli = f.metadata
            where = groups.get(cli["group"]) or groups.setdefault(
                cli["group"], parser.add_argument_group(cli["group"])
            )
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                where.add_argument(flag, action="store_true", help=cli["help"])
            elif f.name == "reachable_at":
                where.add_argument(
                    flag,
                    action="append",
                    default=[],
                    type=cli["type"],
                    metavar=cli["metavar"],
                    help=cli["help"],
                )
            else:
                where.add_argument(
                    flag, type=cli["type"], default=f.default, metavar=cli["metavar"], help=cli["help"]
                )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerOptions:
        """The options parsed by a parser :meth:`add_arguments` filled."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def to_args(self, *, leave_out: Sequence[str] = ()) -> list[str]:
        """The command-line form of the options that differ from the defaults (``leave_out``:
        field names written elsewhere)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in leave_out or value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag)
            elif isinstance(value, tuple):
                for entry in value:
                    out += [flag, entry]
            else:
                out += [flag, str(value)]
        return out


def options_table() -> str:
    """Every option as a Markdown table: docs/workers.md holds it, and a test checks that the
    page and the fields agree."""
    rows = ["| option | what it sets |", "|---|---|"]
    for f in dataclasses.fields(WorkerOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.metadata["metavar"]:
            flag += " " + f.metadata["metavar"]
        text = f.metadata["help"].replace("*", "\\*").replace("|", "\\|")
        rows.append(f"| `{flag}` | {text} |")
    return "\n".join(rows) + "\n"
