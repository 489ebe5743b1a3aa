"""DDP on Dask: one ``torch.distributed`` rank per Dask worker (:func:`run`)."""

from __future__ import annotations

import logging
import os
import re
import socket
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import distributed
import torch
from distributed.comm.addressing import get_address_host

from ..errors import RemoteError
from ..util import free_port, restore_env

log = logging.getLogger(__name__)

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankError(RemoteError):
    """A rank started by :func:`run` raised; ``rank`` says which one.

    Attributes
    ----------
    rank, world_size : int
        The failed rank and the number of ranks.
    address : str
        The Dask worker that ran it.
    remote_type, remote_message, remote_traceback : str
        The exception type, its message and the traceback text from the worker.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        address: str,
        remote_type: str,
        remote_message: str,
        remote_traceback: str,
    ):
        self.rank = rank
        self.world_size = world_size
        super().__init__(address, remote_type, remote_message, remote_traceback)

    def _render(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size} (Dask worker {self.address}) raised "
            f"{self.remote_type}: {self.remote_message}\n"
            f"--- remote traceback ---\n{self.remote_traceback.rstrip()}"
        )

    def __reduce__(self):
        return (
            RankError,
            (
                self.rank,
                self.world_size,
                self.address,
                self.remote_type,
                self.remote_message,
                self.remote_traceback,
            ),
        )


@dataclass(frozen=True)
class _Rank:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    worker: str


def _describe_worker(dask_worker=None) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "name": str(dask_worker.name)}


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _order_workers(infos: Mapping[str, dict[str, Any]]) -> list[str]:
    """Workers grouped by host (hosts sorted), in natural order of their names within a host."""
    by_pid: dict[tuple, str] = {}
    for addr, info in infos.items():
        other = by_pid.setdefault((info["host"], info["pid"]), addr)
        if other != addr:
            raise RuntimeError(
                f"Dask workers {other} and {addr} run in the same process: DDP needs one process "
                "per rank. Use worker processes (e.g. LocalCluster(processes=True))"
            )
    return sorted(infos, key=lambda a: (infos[a]["host"], _natural(infos[a]["name"]), a))


def _qualname(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _run_rank(fn, args: tuple, kwargs: dict, spec: _Rank, backend: str | None, init_kwargs: dict | None):
    import torch.distributed as dist

    values = (
        spec.rank,
        spec.world_size,
        spec.local_rank,
        spec.local_world_size,
        spec.master_addr,
        spec.master_port,
    )
    saved = {k: os.environ.get(k) for k in _RANK_ENV}
    os.environ.update({k: str(v) for k, v in zip(_RANK_ENV, values)})
    try:
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this Dask worker process (another "
                "rank or an unfinished run?): one run() at a time per worker"
            )
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        options = {"init_method": "env://", **(init_kwargs or {})}
        dist.init_process_group(backend=chosen, rank=spec.rank, world_size=spec.world_size, **options)
        try:
            if chosen == "gloo":
                # every rank's connections are made before any rank runs fn: a rank that fails
                # at once must not close them under a peer still connecting (nccl connects lazily)
                dist.barrier()
            return fn(*args, **kwargs)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - never hide the function's own outcome
                log.warning("rank %d: destroy_process_group failed", spec.rank, exc_info=True)
    except Exception as exc:
        raise RankError(
            spec.rank, spec.world_size, spec.worker, _qualname(type(exc)), str(exc), traceback.format_exc()
        ) from None
    finally:
        restore_env(saved)


def run(
    client: distributed.Client,
    fn,
    *args,
    backend: str | None = None,
    init_kwargs: dict[str, Any] | None = None,
    **kwargs,
) -> list[distributed.Future]:
    """Run ``fn(*args, **kwargs)`` once on every Dask worker, each as one DDP rank.

    Ranks are grouped by host (hosts sorted by name, workers by name within a host), so
    ``LOCAL_RANK`` counts the workers of one host. Each task is pinned to its worker.
    ``MASTER_ADDR`` is rank 0's worker address and ``MASTER_PORT`` a port found free on
    rank 0's host just before the start. In each rank, ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set (as
    torchrun does), ``init_process_group`` runs before ``fn`` and
    ``destroy_process_group`` after it, even when it raises.

    Parameters
    ----------
    client : distributed.Client
        Client of the cluster; every worker gets one rank (one per GPU with dask-cuda).
    fn : callable
        The training function; it runs in a Dask worker thread.
    *args, **kwargs
        Passed to ``fn`` (futures among them are resolved by Dask).
    backend : str, optional
        ``init_process_group`` backend; default ``"nccl"`` where CUDA is available, else ``"gloo"``.
    init_kwargs : dict, optional
        More ``init_process_group`` arguments, e.g. ``{"timeout": datetime.timedelta(minutes=5)}``.

    Returns
    -------
    list of distributed.Future
        One future per rank, in rank order; a failed rank's future raises
        :class:`RankError` naming the rank.
    """
    infos = client.run(_describe_worker)
    if not infos:
        raise ValueError(
            "the Dask cluster has no workers: start some, or wait with client.wait_for_workers(n)"
        )
    order = _order_workers(infos)
    master = order[0]
    port = client.run(free_port, "", workers=[master])[master]
    master_addr = get_address_host(master)
    hosts: dict[str, list[str]] = {}
    for addr in order:
        hosts.setdefault(infos[addr]["host"], []).append(addr)
    token = uuid.uuid4().hex[:8]
    name = getattr(fn, "__name__", "fn")
    futures = []
    for rank, addr in enumerate(order):
        local = hosts[infos[addr]["host"]]
        spec = _Rank(rank, len(order), local.index(addr), len(local), master_addr, port, addr)
        futures.append(
            client.submit(
                _run_rank,
                fn,
                args,
                kwargs,
                spec,
                backend,
                init_kwargs,
                key=f"torchfeed-rank-{rank}-{name}-{token}",
                workers=[addr],
                allow_other_workers=False,
                pure=False,
            )
        )
    return futures
