"""A torchfeed worker on every Dask worker, as the cluster grows and shrinks (:class:`DaskPool`).

The pool implements :class:`torchfeed.scaling.pool.WorkerPool` for :func:`torchfeed.autoscale` on any
Dask cluster that scales (``LocalCluster``, dask-jobqueue's ``SLURMCluster``,
dask-kubernetes): ``scale(n)`` calls ``cluster.scale(n)``; a Dask worker plugin starts one
``torchfeed worker`` process next to each Dask worker, including the ones that join later,
and stops it when its Dask worker closes; ``retire`` stops the (drained) torchfeed worker
first, then retires its Dask worker. A background thread polls the plugin on every Dask
worker for the addresses that are ready, so :meth:`DaskPool.addresses` returns at once.

The plugin, which the scheduler hands to every Dask worker (also to the ones that join
later), carries no secret: only a ``secret_file`` path, when one is given. A secret given
by value is sent to each Dask worker on its own, once the pool's thread has seen it join and
decided that its connection is encrypted or stays on this machine (TLS, or a loopback
address: dask/comms.py); a worker that is not is refused, said once under
``torchfeed.dask`` with the reason, and its torchfeed worker never starts
(``allow_insecure=True`` sends to every worker). The scheduler's own address is checked
when the pool is made, as for :func:`start_workers`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import distributed
from distributed.comm.addressing import get_address_host

from ..protocol import auth
from ..scaling.pool import BasePool
from ..worker.options import WorkerOptions
from .comms import in_clear
from .workers import WorkerProcesses, export, prepare_secret, unexport

log = logging.getLogger("torchfeed.dask")

POOL_PLUGIN = "torchfeed-pool"


class PoolProcesses(WorkerProcesses):
    """Lives in each Dask worker: starts its torchfeed worker at setup (in a thread, so that the
    Dask worker comes up at once), stops it at teardown."""

    def __init__(
        self,
        sent: auth.Secret | str | None,
        host: str | None,
        options: WorkerOptions,
        args: list[str],
        timeout: float,
    ):
        super().__init__()
        self.sent = sent  # a secret file's path, or None: the secret comes later (receive_secret)
        self.host = host
        self.options = options
        self.args = args
        self.timeout = timeout
        self.state = "new"  # waiting (for the secret) | starting | ready | failed | stopped
        self.bind = ""
        self.error = ""
        self.starter: threading.Thread | None = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "starter"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.starter = None

    def setup(self, worker) -> None:
        self.bind = self.host or get_address_host(worker.address)
        if self.sent is None:
            self.state = "waiting"  # the pool sends the secret once it has checked this worker
            return
        self._begin()

    def receive_secret(self, secret: auth.Secret) -> None:
        if self.state == "waiting":
            self.sent = secret
            self._begin()

    def _begin(self) -> None:
        self.state = "starting"
        self.starter = threading.Thread(
            target=self._start, args=(self.bind,), name="torchfeed-pool-start", daemon=True
        )
        self.starter.start()

    def _start(self, bind: str) -> None:
        try:
            assert self.sent is not None  # _begin runs once the secret (or its path) is here
            self.start(1, self.sent, bind, self.options, self.args, self.timeout)
        except BaseException as exc:  # noqa: BLE001 - reported to the driver by report()
            self.state, self.error = "failed", f"{type(exc).__name__}: {str(exc).rstrip()}"
        else:
            self.state = "ready" if self.state == "starting" else self.state

    def stop_all(self, timeout: float = 10.0) -> None:
        self.state = "stopped"
        if self.starter is not None:
            self.starter.join(self.timeout + 1.0)
        self.stop(timeout)

    async def teardown(self, worker) -> None:
        await asyncio.to_thread(self.stop_all)

    def report(self) -> dict[str, Any]:
        ready = self.state == "ready"
        return {"state": self.state, "addresses": list(self.addresses) if ready else [], "error": self.error}


def _report(dask_worker=None) -> dict[str, Any] | None:
    plugin = dask_worker.plugins.get(POOL_PLUGIN)
    return plugin.report() if plugin is not None else None


def _receive_secret(secret: auth.Secret, dask_worker=None) -> None:
    plugin = dask_worker.plugins.get(POOL_PLUGIN)
    if plugin is not None:
        plugin.receive_secret(secret)


async def _stop_here(dask_worker=None) -> None:
    plugin = dask_worker.plugins.get(POOL_PLUGIN)
    if plugin is not None:
        await asyncio.to_thread(plugin.stop_all)


class DaskPool(BasePool):
    """torchfeed workers on a Dask cluster that scales: a :class:`torchfeed.scaling.pool.WorkerPool`.

    One ``torchfeed worker`` process runs next to each Dask worker (give it more
    executor threads with ``parallel``); Dask workers that join later get theirs too.

    Its thread (``torchfeed-dask-pool``, see :class:`~torchfeed.scaling.pool.BasePool`) scales the
    cluster, retires Dask workers, polls the plugin and sends the secret to the Dask workers
    it checked; :meth:`close` waits up to 60 s for it, then unregisters the plugin (the
    torchfeed workers stop, the Dask workers stay) and closes the pool's own client.

    Parameters
    ----------
    cluster_or_client : distributed.deploy.Cluster or distributed.Client
        A cluster (the pool makes its own client, closed with it), or a client; a client
        connected to a scheduler by address has no cluster to scale: the pool then uses
        the Dask workers there are and says so when asked to grow.
    n : int, optional
        Workers to ask for at once (default: as many as the cluster has).
    secret, secret_file, allow_insecure, export_secret, host, parallel, threads, worker_args, options
        As for :func:`torchfeed.dask.start_workers`.
    start_timeout : float
        Seconds a torchfeed worker has to report ready on its Dask worker.
    poll : float
        Seconds between two looks at the Dask workers (a quarter of it while some start).
    """

    label = "torchfeed.dask.Pool"
    thread_name = "torchfeed-dask-pool"
    close_timeout = 60.0
    unknown_holder = "no Dask worker hosts"
    wait_failed_text = (
        "{label}: {ready} of {n} torchfeed workers ready after {timeout:g} s (asked the cluster for "
        "{requested}); see the Dask workers' logs"
    )

    def __init__(
        self,
        cluster_or_client: Any,
        n: int | None = None,
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
        poll: float = 1.0,
        options: WorkerOptions | None = None,
    ):
        if isinstance(cluster_or_client, distributed.Client):
            self.client, self._own_client = cluster_or_client, False
            self.cluster = getattr(cluster_or_client, "cluster", None)
        else:
            self.cluster = cluster_or_client
            self.client = distributed.Client(cluster_or_client, set_as_default=False)
            self._own_client = True
        try:
            sent, self.secret, _ = prepare_secret(
                self.client, secret, secret_file, allow_insecure, export_secret, "torchfeed.dask.Pool"
            )
        except BaseException:
            self._close_client()
            raise
        super().__init__(poll, log)
        self._ready: dict[str, list[str]] = {}  # Dask worker -> its torchfeed worker's addresses
        self._names: dict[str, Any] = {}  # Dask worker -> its name (the cluster's key for it)
        self._failed: set[str] = set()  # Dask workers whose torchfeed worker did not start (logged)
        self._retiring: set[str] = set()  # Dask workers being retired
        self._refusal: str | None = None  # the last reason the cluster did not grow (logged once)
        self._secret = sent if isinstance(sent, auth.Secret) else None  # sent per worker, once checked
        self._allow_insecure = allow_insecure
        self._refused: set[str] = set()  # Dask workers not sent the secret (logged)
        options = (options or WorkerOptions()).merged(parallel=parallel, threads=threads)
        plugin = PoolProcesses(
            sent if self._secret is None else None, host, options, list(worker_args), start_timeout
        )
        self.client.register_plugin(plugin, name=POOL_PLUGIN)
        if export_secret:
            export(self.secret)
        self._exported = export_secret
        present = len(self.client.scheduler_info(n_workers=-1).get("workers", {}))
        self._target = max(present, len(getattr(self.cluster, "worker_spec", None) or ()))
        if n is not None and n > self._target:
            self.scale(n)
        self._refresh()
        self._start_thread()

    # -- the engine's steps (BasePool's hooks) ------------------------------------------------
    def _ready_addresses(self) -> list[str]:
        return [a for w in sorted(self._ready) if w not in self._retiring for a in self._ready[w]]

    def _claim(self, addresses: Sequence[str]) -> tuple[list[str], int, list[str]]:
        # the torchfeed worker is stopped first, then its Dask worker is retired
        gone = set(addresses)
        workers = [w for w, own in self._ready.items() if gone & set(own) and w not in self._retiring]
        self._retiring.update(workers)
        return workers, len(workers), [a for w in workers for a in self._ready[w]]

    def _poll_wait(self) -> float:
        with self._lock:
            starting = self._target > sum(1 for w in self._ready if w not in self._retiring)
        return self.poll / 4 if starting else self.poll

    def _step(self) -> None:
        self._refresh()

    def _release(self) -> None:
        try:
            self.client.unregister_worker_plugin(POOL_PLUGIN)
        except Exception as exc:  # noqa: BLE001 - Dask workers leaving meanwhile stop theirs on their own
            log.debug("torchfeed.dask.Pool: unregistering the plugin: %s: %s", type(exc).__name__, exc)
        with self._lock:
            self._ready.clear()
        if self._exported:
            unexport()
        self._close_client()

    def _close_client(self) -> None:
        if self._own_client:
            self.client.close()

    def _refresh(self) -> None:
        """Read which Dask workers there are and the state of their torchfeed worker."""
        info = self.client.scheduler_info(n_workers=-1).get("workers", {})
        reports = self.client.run(_report, on_error="return") if info else {}
        waiting: list[str] = []
        with self._lock:
            for w in [w for w in self._ready if w not in info]:
                del self._ready[w]
            self._retiring &= set(info)
            for w, d in info.items():
                self._names[w] = d.get("name", w)
                r = reports.get(w)
                if not isinstance(r, dict):
                    continue
                if r["state"] == "ready":
                    self._ready[w] = r["addresses"]
                    continue
                self._ready.pop(w, None)
                if r["state"] == "waiting" and w not in self._refused:
                    waiting.append(w)
                if r["state"] == "failed" and w not in self._failed:
                    self._failed.add(w)
                    log.warning(
                        "torchfeed.dask.Pool: the torchfeed worker on Dask worker %s did not start: %s",
                        w,
                        r["error"],
                    )
        if waiting:
            self._send_secret(waiting)

    def _send_secret(self, workers: list[str]) -> None:
        """Send the secret to the Dask workers among ``workers`` whose connection cannot be read
        on a network (checked here, per worker, before anything secret leaves); log the rest."""
        checked = []
        for w in workers:
            if self._allow_insecure or not in_clear(w):
                checked.append(w)
                continue
            self._refused.add(w)
            log.warning(
                "torchfeed.dask.Pool: not sending the torchfeed secret to Dask worker %s, which joined "
                "over a connection that is not encrypted and leaves this machine: anyone reading that "
                "network would get the secret. Its torchfeed worker does not start. Run the cluster over "
                "TLS, pass secret_file=PATH (a file the workers' machines share), or allow_insecure=True "
                "on a network no one else can listen on",
                w,
            )
        if checked and self._secret is not None:
            self.client.run(_receive_secret, self._secret, workers=checked, on_error="return")

    def _grow(self, n: int) -> None:
        if self.cluster is None:
            why = (
                "this Dask client has no cluster object to scale (it was connected to a scheduler "
                "by address): start Dask workers yourself (`dask worker SCHEDULER`; each gets a torchfeed "
                "worker), or give the pool the cluster"
            )
        else:
            try:
                self.cluster.scale(n)
                self._refusal = None
                return
            except Exception as exc:  # noqa: BLE001 - the cluster's own limits; keep what there is
                why = f"{type(self.cluster).__name__}.scale({n}) failed: {type(exc).__name__}: {exc}"
        if why != self._refusal:
            self._refusal = why
            log.warning("torchfeed.dask.Pool: cannot grow to %d workers: %s", n, why)

    def _shrink(self, workers: list[str]) -> None:
        # the torchfeed worker first (the caller drained it), then its Dask worker
        self.client.run(_stop_here, workers=workers, on_error="return")
        with self._lock:
            names = [self._names.get(w, w) for w in workers]
            n = self._target
        cluster = self.cluster
        scale_down = getattr(cluster, "scale_down", None)
        if (
            cluster is not None
            and getattr(cluster, "worker_spec", None) is not None
            and scale_down is not None
        ):
            cluster.sync(scale_down, names)  # a SpecCluster retires them and forgets their spec
            return
        self.client.retire_workers(workers=workers, close_workers=True, remove=True)
        if self.cluster is not None:
            self.cluster.scale(n)


Pool = DaskPool  # the name torchfeed.dask.Pool documents

__all__ = ["DaskPool", "Pool", "PoolProcesses", "POOL_PLUGIN"]
