"""torchfeed worker processes next to Dask workers (:func:`start_workers`, :func:`stop_workers`)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Sequence

import distributed
from distributed.comm.addressing import get_address_host
from distributed.diagnostics.plugin import WorkerPlugin

from ..protocol import auth
from ..util import restore_env
from ..worker.group import WorkerGroup
from ..worker.options import WorkerOptions
from ..worker.process import WorkerProcess
from .comms import refuse_clear_transport

log = logging.getLogger(__name__)

PLUGIN_NAME = "torchfeed-workers"

STOP_TIMEOUT = 10.0  # seconds a torchfeed worker has to stop after SIGTERM before it is killed


class WorkerProcesses(WorkerPlugin):
    """Lives in each Dask worker: the torchfeed worker processes it started (a
    :class:`~torchfeed.worker.group.WorkerGroup` per :meth:`start`, owned by this plugin),
    stopped at teardown.

    The secret, or a secret file's path (read here), is handed to the processes on their
    standard input, never in an environment (theirs nor this process's): subprocesses of
    dataset code or of Dask tasks would inherit it. With ``--watch-stdin`` a process ends when
    its standard input closes, i.e. when the Dask worker that started it is gone, even one
    killed with no chance to clean up. :meth:`start` and :meth:`stop` run on a thread of the
    Dask worker's (``asyncio.to_thread``), one at a time.
    """

    idempotent = False

    def __init__(self):
        self.groups: list[WorkerGroup] = []
        self.addresses: list[str] = []
        self._previous: tuple[auth.Secret | None] | None = None  # set when this plugin adopted one

    @property
    def processes(self) -> list[WorkerProcess]:
        """The torchfeed worker processes started, in order."""
        return [p for group in self.groups for p in group.processes]

    def setup(self, worker) -> None:
        pass

    async def teardown(self, worker) -> None:
        await asyncio.to_thread(self.stop)

    def start(
        self,
        n: int,
        secret: auth.Secret | str,
        host: str,
        options: WorkerOptions,
        args: Sequence[str],
        timeout: float,
    ) -> list[str]:
        """``secret``: the secret, or the path of a secret file this machine shares with the driver."""
        env = {k: v for k, v in os.environ.items() if k != auth.ENV_SECRET}
        env["PYTHONUNBUFFERED"] = "1"
        if isinstance(secret, str):
            env[auth.ENV_SECRET_FILE] = secret  # for what the workers start, as a worker started by hand
            secret = auth.secret_from_file(secret)
        group = WorkerGroup(
            n,
            host=host,
            options=options,
            extra_args=args,
            secret=secret.value,
            env=env,
            name="torchfeed worker",
            label="[torchfeed worker {address}] ",
        )
        self.groups.append(group)
        try:
            self.addresses.extend(group.start(timeout, stop_timeout=STOP_TIMEOUT))
        except BaseException:
            self.stop()
            raise
        # tasks in this Dask worker (ranks started by run()) reach the workers with the same secret
        previous = auth.adopt_secret(secret)
        if self._previous is None:
            self._previous = (previous,)
        return list(self.addresses)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every process: SIGTERM, SIGKILL for those still running ``timeout`` seconds later."""
        groups, self.groups, self.addresses = self.groups, [], []
        deadline = time.monotonic() + timeout
        for group in groups:
            group.stop(max(0.0, deadline - time.monotonic()))
        if self._previous is not None:
            (previous,), self._previous = self._previous, None
            auth.adopt_secret(previous)


async def _start_on_worker(
    n: int,
    secret: auth.Secret | str,
    host: str | None,
    options: WorkerOptions,
    args: Sequence[str],
    timeout: float,
    dask_worker=None,
) -> list[str]:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise RuntimeError("the torchfeed worker plugin is not installed on this Dask worker")
    bind = host or get_address_host(dask_worker.address)
    return await asyncio.to_thread(plugin.start, n, secret, bind, options, list(args), timeout)


class WorkerAddresses(list):
    """The ``host:port`` list of the torchfeed workers, with ``secret`` and ``by_dask_worker``.

    Pickles as a plain list: the secret never travels with it.
    """

    secret: auth.Secret
    by_dask_worker: dict[str, list[str]]

    def __reduce__(self):
        return (list, (list(self),))


_exported: dict[str, str | None] = {}  # "previous" and "ours": this process's TORCHFEED_SECRET


def prepare_secret(
    client: distributed.Client,
    secret: auth.SecretLike,
    secret_file: str | os.PathLike[str] | None,
    allow_insecure: bool,
    export_secret: bool,
    what: str,
) -> tuple[auth.Secret | str, auth.Secret, list[str] | None]:
    """What to send through Dask (the secret, or a shared file's path), the secret, and the Dask
    workers checked (send the secret to these only; None: a path, any worker). Raises
    ValueError before anything is sent when the secret would cross a network in clear."""
    sent: auth.Secret | str
    targets: list[str] | None = None
    if secret_file is not None:
        if secret is not None:
            raise ValueError("give secret= or secret_file=, not both")
        sent = os.path.abspath(os.path.expanduser(os.fspath(secret_file)))
        sec = auth.secret_from_file(sent)
    else:
        if not allow_insecure:  # before anything is sent; then only to the workers checked
            targets = refuse_clear_transport(client, what)
        if secret is None:
            sec = auth.Secret(secrets.token_hex(32).encode(), f"generated by {what}")
        else:
            sec = auth.load_secret(secret)
        sent = sec
    if export_secret:
        try:
            sec.value.decode()
        except UnicodeDecodeError:
            raise ValueError(
                "the secret must be text to be exported as TORCHFEED_SECRET: use a str, e.g. "
                "secrets.token_hex(32), or export_secret=False"
            ) from None
    return sent, sec, targets


def export(sec: auth.Secret) -> None:
    """Set ``TORCHFEED_SECRET`` in this process (:func:`unexport` restores what was there)."""
    _exported.setdefault("previous", os.environ.get(auth.ENV_SECRET))
    _exported["ours"] = os.environ[auth.ENV_SECRET] = sec.value.decode()


def unexport() -> None:
    """Undo :func:`export` (unless someone changed ``TORCHFEED_SECRET`` since)."""
    if _exported and os.environ.get(auth.ENV_SECRET) == _exported.get("ours"):
        restore_env({auth.ENV_SECRET: _exported.get("previous")})
    _exported.clear()


def start_workers(
    client: distributed.Client,
    procs_per_worker: int = 1,
    *,
    secret: auth.SecretLike = None,
    secret_file: str | os.PathLike[str] | None = None,
    allow_insecure: bool = False,
    export_secret: bool = True,
    host: str | None = None,
    parallel: int | None = None,
    threads: int | None = None,
    worker_args: Sequence[str] = (),
    start_timeout: float = 60.0,
    cache_size: int | str | None = None,
    options: WorkerOptions | None = None,
) -> WorkerAddresses:
    """Start torchfeed worker processes next to every Dask worker; return their addresses.

    Each Dask worker starts ``procs_per_worker`` ``torchfeed worker`` processes with
    ``subprocess`` (which Dask's daemonic worker processes may do, unlike
    ``multiprocessing``), bound to the address Dask reaches that worker on. A Dask worker
    plugin tracks them: they stop on :func:`stop_workers`, when their Dask worker closes,
    and on their own if their Dask worker dies. Calling this again replaces them.

    The secret reaches the Dask workers through Dask's own connections, so it is refused
    (ValueError) when any of them is clear text that leaves this machine (not ``tls://``,
    host not loopback), unless ``allow_insecure=True``: use Dask's TLS, or ``secret_file``.
    The torchfeed worker processes get it on their standard input, never in their
    environment. By default a fresh random secret is made for these workers, and set as
    ``TORCHFEED_SECRET`` in this process (``export_secret``, undone by :func:`stop_workers`)
    and adopted (:func:`torchfeed.protocol.auth.adopt_secret`, not put in the environment)
    by the Dask worker processes (for ranks started by :func:`run`), so
    ``RemoteDataset(addresses, ...)`` works as is in both places.

    Parameters
    ----------
    client : distributed.Client
    procs_per_worker : int
        torchfeed worker processes per Dask worker (one uses about one core).
    secret : str or bytes, optional
        Use this secret instead of a fresh one.
    secret_file : str or path, optional
        A secret file that this process and every Dask worker's machine can read at the same
        path (a shared home directory): the workers read it themselves and only the path is
        sent through Dask, which then needs no TLS.
    allow_insecure : bool
        Send the secret through Dask even over clear-text connections that leave this machine
        (only on networks no one else can listen on).
    export_secret : bool
        Set ``TORCHFEED_SECRET`` in this process (otherwise use ``.secret`` yourself).
    host : str, optional
        Interface the workers bind; default: the Dask worker's own address.
    parallel, threads : int, optional
        ``--parallel`` and ``--threads`` of each worker (default 1 each).
    worker_args : sequence of str
        More ``torchfeed worker`` options, e.g. ``["--timeout", "300"]``.
    start_timeout : float
        Seconds for the workers to report ready.
    cache_size : int or str, optional
        ``--cache-size`` of each worker (bytes or ``"8GiB"``): memory for the decoded samples
        of :func:`torchfeed.cached` datasets (the worker's default 1 GiB if None).
    options : WorkerOptions, optional
        Every other worker option (:class:`torchfeed.worker.options.WorkerOptions`);
        ``parallel``, ``threads`` and ``cache_size``, when given, replace its own.

    Returns
    -------
    WorkerAddresses
        A list of ``host:port`` strings, with ``.secret`` and ``.by_dask_worker``.
    """
    if procs_per_worker < 1:
        raise ValueError(f"procs_per_worker must be >= 1, got {procs_per_worker}")
    sent, sec, targets = prepare_secret(
        client, secret, secret_file, allow_insecure, export_secret, "torchfeed.dask.start_workers"
    )
    options = (options or WorkerOptions()).merged(parallel=parallel, threads=threads, cache_size=cache_size)
    client.register_plugin(WorkerProcesses(), name=PLUGIN_NAME)
    results = (
        {}
        if targets == []
        else client.run(
            _start_on_worker,
            procs_per_worker,
            sent,
            host,
            options,
            list(worker_args),
            start_timeout,
            on_error="return",
            workers=targets,
        )
    )
    failures = {w: r for w, r in results.items() if isinstance(r, BaseException)}
    if failures or not results:
        stop_workers(client)
        if not results:
            raise ValueError(
                "the Dask cluster has no workers: start some, or wait with client.wait_for_workers(n)"
            )
        detail = "".join(f"\n- {w}: {type(e).__name__}: {str(e).rstrip()}" for w, e in failures.items())
        raise RuntimeError(
            f"could not start torchfeed workers on {len(failures)} of {len(results)} Dask workers:{detail}"
        ) from next(iter(failures.values()))
    by_worker = {w: results[w] for w in sorted(results)}
    addresses = WorkerAddresses(a for w in by_worker for a in by_worker[w])
    addresses.secret = sec
    addresses.by_dask_worker = by_worker
    if export_secret:
        export(sec)
    return addresses


def stop_workers(client: distributed.Client) -> None:
    """Stop the torchfeed workers started by :func:`start_workers` and undo its ``TORCHFEED_SECRET``."""
    try:
        client.unregister_worker_plugin(PLUGIN_NAME)
    except ValueError:
        pass  # none running
    except Exception as exc:  # noqa: BLE001 - a Dask worker leaving meanwhile; its workers stop with it
        log.warning(
            "stop_workers could not reach every Dask worker (%s: %s); torchfeed workers of a Dask "
            "worker that closes or dies stop on their own",
            type(exc).__name__,
            exc,
        )
    unexport()
