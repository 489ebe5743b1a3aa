"""Where this process stands in a distributed job, read from its launcher's environment.

:func:`environment` recognises torchrun (and plain ``env://`` variables), a Dask worker,
a Slurm task (``srun``, heterogeneous groups included), Open MPI, MPICH/Hydra and PMI
launchers, and otherwise reports a single process. :func:`init_distributed` starts
``torch.distributed`` from it; :func:`device_group` gives a model-parallel replica its
devices (worker discovery is in :mod:`torchfeed.cluster.discovery`).

``MASTER_ADDR`` and ``MASTER_PORT`` already in the environment always win. Otherwise
the port is derived from the job id (every rank computes the same number, so nothing
needs to be exchanged), and :func:`choose_port` — run by generated batch scripts on the
host of rank 0 — also checks that it is free there, trying the next derived candidates
when it is not.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from ..errors import TorchfeedError
from ..util import free_port

PORT_MIN = 15000
PORT_SPAN = 15000  # derived ports lie in [15000, 30000): below Linux's ephemeral range
ENV_GPUS_PER_MODEL = "TORCHFEED_GPUS_PER_MODEL"


@dataclass(frozen=True)
class Environment:
    """This process's place in a distributed job.

    Attributes
    ----------
    rank, world_size : int
        Global rank and number of processes.
    local_rank, local_world_size : int
        Rank among the processes on this node, and their number.
    node_rank : int
        Index of this node among the job's nodes.
    master_addr : str or None
        Host of rank 0 (None when the launcher does not tell it: set ``MASTER_ADDR``).
    master_port : int
        Rendezvous port on ``master_addr``.
    source : str
        ``"torchrun"``, ``"env"``, ``"dask"``, ``"slurm"``, ``"openmpi"``, ``"mpich"``,
        ``"pmi"`` or ``"single"``.
    job_id : str or None
        The scheduler's job id, when there is one.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = "127.0.0.1"
    master_port: int = 0
    source: str = "single"
    job_id: str | None = None

    @property
    def distributed(self) -> bool:
        """True when there is more than one process."""
        return self.world_size > 1


# -- ports ------------------------------------------------------------------------


def derive_port(key: str, attempt: int = 0) -> int:
    """A port in ``[15000, 30000)`` derived from ``key`` (a job id), the same on every host."""
    digest = hashlib.sha256(f"torchfeed:{key}:{attempt}".encode()).digest()
    return PORT_MIN + int.from_bytes(digest[:8], "big") % PORT_SPAN


def port_is_free(port: int, host: str = "") -> bool:
    """True when ``port`` can be bound on ``host`` now (all interfaces by default)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(
    job_id: str | None = None, *, host: str = "", attempts: int = 64, environ: Mapping[str, str] | None = None
) -> int:
    """Pick the rendezvous port on the host of rank 0: derived from the job id, checked free.

    ``MASTER_PORT`` in the environment is returned unchanged. Otherwise candidates derived
    from ``job_id`` (default: the scheduler's job id) are tried in a fixed order and the
    first free one is returned; without any job id, the operating system picks a free port.

    Parameters
    ----------
    job_id : str, optional
        Job identifier; two jobs with different ids get different candidate sequences.
    host : str
        Interface to check (all by default).
    attempts : int
        Number of derived candidates to try before giving up.
    environ : mapping, optional
        Environment to read (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_PORT"):
        return int_var(environ, "MASTER_PORT")
    job_id = job_id or _job_id(environ)
    if not job_id:
        return free_port(host)
    for attempt in range(attempts):
        port = derive_port(job_id, attempt)
        if port_is_free(port, host):
            return port
    raise TorchfeedError(
        f"none of the {attempts} ports derived from job id {job_id!r} is free on this host; "
        f"set MASTER_PORT to a free port"
    )


# -- helpers ----------------------------------------------------------------------


def int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise TorchfeedError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise TorchfeedError(f"environment variable {name}={value!r} is not an integer") from None


def _job_id(environ: Mapping[str, str]) -> str | None:
    for name in (
        "SLURM_JOB_ID",
        "TORCHELASTIC_RUN_ID",
        "PBS_JOBID",
        "LSB_JOBID",
        "PMIX_NAMESPACE",
        "OMPI_MCA_ess_base_jobid",
        "PMI_KVSNAME",
    ):
        if environ.get(name):
            return environ[name]
    return None


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm host list such as ``"gpu[01-03,7],cpu1"`` (as ``scontrol show hostnames``)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", expr):
        parts = [item]
        while any("[" in p for p in parts):
            expanded = []
            for p in parts:
                m = re.match(r"^(.*?)\[([^\]]*)\](.*)$", p)
                if not m:
                    expanded.append(p)
                    continue
                head, ranges, tail = m.groups()
                for r in ranges.split(","):
                    lo, _, hi = r.partition("-")
                    if hi:
                        expanded += [f"{head}{i:0{len(lo)}d}{tail}" for i in range(int(lo), int(hi) + 1)]
                    else:
                        expanded.append(f"{head}{lo}{tail}")
            parts = expanded
        hosts += parts
    return hosts


def expand_tasks_per_node(expr: str) -> list[int]:
    """Expand Slurm's ``"2(x3),1"`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in expr.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise TorchfeedError(f"cannot parse Slurm tasks-per-node list {expr!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


# -- launchers --------------------------------------------------------------------


def _from_env_vars(environ: Mapping[str, str]) -> Environment:
    rank, world = int_var(environ, "RANK"), int_var(environ, "WORLD_SIZE")
    local_world = int_var(environ, "LOCAL_WORLD_SIZE", 1)
    node_rank = int_var(environ, "GROUP_RANK", int_var(environ, "NODE_RANK", rank // max(local_world, 1)))
    return Environment(
        rank,
        int_var(environ, "LOCAL_RANK", 0),
        world,
        local_world,
        node_rank,
        environ.get("MASTER_ADDR"),
        int_var(environ, "MASTER_PORT", 0),
        "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env",
        _job_id(environ),
    )


def _slurm_rank0_host(environ: Mapping[str, str], nodes: list[str]) -> str:
    """Node of rank 0: first node of the lowest het group taking part in the step."""
    if environ.get("SLURM_HET_SIZE"):
        in_step = set(nodes)
        for g in range(int_var(environ, "SLURM_HET_SIZE")):
            group = expand_hostlist(environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}", ""))
            mine = [n for n in group if n in in_step]
            if mine:
                return mine[0]
    return nodes[0]


def _from_slurm(environ: Mapping[str, str]) -> Environment:
    rank = int_var(environ, "SLURM_PROCID")
    world = int_var(environ, "SLURM_STEP_NUM_TASKS")
    nodes = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", ""))
    counts = expand_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or str(world))
    me = environ.get("SLURMD_NODENAME")
    if me in nodes and len(counts) == len(nodes):
        local_world = counts[nodes.index(me)]
    else:
        local_world = counts[0] if len(set(counts)) == 1 else int_var(environ, "SLURM_NTASKS_PER_NODE", 1)
    job = environ.get("SLURM_JOB_ID")
    if environ.get("MASTER_PORT"):
        port = int_var(environ, "MASTER_PORT")
    elif environ.get("SLURM_STEP_RESV_PORTS"):  # ports Slurm reserved for this step (srun --resv-ports)
        port = int(re.split(r"[-,]", environ["SLURM_STEP_RESV_PORTS"])[0])
    else:
        port = derive_port(f"{job}.{environ.get('SLURM_STEP_ID', '')}")
    addr = environ.get("MASTER_ADDR") or (_slurm_rank0_host(environ, nodes) if nodes else None)
    return Environment(
        rank,
        int_var(environ, "SLURM_LOCALID", 0),
        world,
        local_world,
        int_var(environ, "SLURM_NODEID", 0),
        addr,
        port,
        "slurm",
        job,
    )


def _mpi(
    environ: Mapping[str, str], source: str, rank: str, size: str, local_rank: str, local_size: str
) -> Environment:
    r, world = int_var(environ, rank), int_var(environ, size)
    lr, lws = int_var(environ, local_rank, 0), int_var(environ, local_size, 1)
    job = _job_id(environ)
    addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if lws >= world else None)
    port = int_var(environ, "MASTER_PORT", 0) or derive_port(job or f"{source}:{environ.get('HOSTNAME', '')}")
    return Environment(r, lr, world, lws, r // max(lws, 1), addr, port, source, job)


def _from_dask(environ: Mapping[str, str]) -> Environment | None:
    """Rank among the Dask cluster's workers (sorted by address), when running in a Dask task."""
    distributed = sys.modules.get("distributed")
    if distributed is None:
        return None
    try:
        me = distributed.get_worker()
    except ValueError:  # not inside a task running on a worker
        return None
    client = distributed.get_client()
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # older distributed: no n_workers argument, every worker is listed
        info = client.scheduler_info()
    addresses = sorted(info["workers"])
    host_of = getattr(getattr(distributed, "comm", None), "get_address_host", None)
    hosts = [host_of(a) if host_of else a.split("://")[-1].rsplit(":", 1)[0] for a in addresses]
    rank = addresses.index(me.address)
    host = hosts[rank]
    node_hosts = sorted(set(hosts))
    same = [a for a, h in zip(addresses, hosts) if h == host]
    job = str(info.get("address") or info.get("id") or "dask")
    port = int_var(environ, "MASTER_PORT", 0) or derive_port(job)
    return Environment(
        rank,
        same.index(me.address),
        len(addresses),
        len(same),
        node_hosts.index(host),
        environ.get("MASTER_ADDR") or hosts[0],
        port,
        "dask",
        job,
    )


def environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Describe this process's place in the job, from its launcher's environment.

    Checked in this order: torchrun / ``env://`` variables (``RANK`` and ``WORLD_SIZE``),
    a Dask worker task, a Slurm task (``SLURM_PROCID`` within a step), Open MPI
    (``OMPI_COMM_WORLD_*``), MPICH/Hydra (``PMI_RANK`` with ``MPI_LOCALRANKID``), PMI
    (``PMI_RANK``, ``PMI_SIZE``); otherwise a single process.

    Parameters
    ----------
    environ : mapping, optional
        Variables to read (default ``os.environ``); nothing is written.

    Returns
    -------
    Environment
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_env_vars(environ)
    dask_env = _from_dask(environ) if environ is os.environ else None
    if dask_env is not None:
        return dask_env
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        return _from_slurm(environ)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _mpi(
            environ,
            "openmpi",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )
    if "PMI_RANK" in environ and "PMI_SIZE" in environ:
        if "MPI_LOCALRANKID" in environ:
            return _mpi(environ, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        return _mpi(environ, "pmi", "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")
    job = _job_id(environ)
    port = int_var(environ, "MASTER_PORT", 0) or (derive_port(job) if job else 0)
    return Environment(master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port, job_id=job)


# -- torch.distributed -----------------------------------------------------------


def _export(env: Environment) -> None:
    """Publish the usual variables for user code, keeping any that are already set."""
    values = {
        "RANK": env.rank,
        "WORLD_SIZE": env.world_size,
        "LOCAL_RANK": env.local_rank,
        "LOCAL_WORLD_SIZE": env.local_world_size,
        "GROUP_RANK": env.node_rank,
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": env.master_port,
    }
    for name, value in values.items():
        os.environ.setdefault(name, str(value))


def init_distributed(
    backend: str | None = None,
    timeout: float | timedelta = 600.0,
    *,
    gpus_per_model: int | None = None,
    env: Environment | None = None,
) -> Environment:
    """Initialise ``torch.distributed`` from :func:`environment` (a no-op for one process).

    The backend defaults to ``nccl`` when CUDA is available, else ``gloo``; with CUDA the
    current device becomes the first device of this process's :func:`device_group`.
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are set for user code when missing; existing values are kept.

    Parameters
    ----------
    backend : str, optional
        ``"nccl"``, ``"gloo"``, ...
    timeout : float or timedelta
        Rendezvous and collective timeout (seconds).
    gpus_per_model : int, optional
        Devices per replica (default ``TORCHFEED_GPUS_PER_MODEL`` or 1).
    env : Environment, optional
        Use this instead of detecting it.

    Returns
    -------
    Environment
    """
    import torch
    import torch.distributed as dist

    env = env or environment()
    if env.world_size <= 1:
        return env
    if dist.is_initialized():
        if dist.get_rank() != env.rank or dist.get_world_size() != env.world_size:
            raise TorchfeedError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the {env.source} environment says rank "
                f"{env.rank} of {env.world_size}"
            )
        return env
    if env.master_addr is None:
        raise TorchfeedError(
            f"the {env.source} launcher does not say which host runs rank 0: set MASTER_ADDR "
            f"(and MASTER_PORT) for every process, e.g. `mpirun -x MASTER_ADDR=$(hostname)`"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(device_group(gpus_per_model, local_rank=env.local_rank)[0])
    _export(env)
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    try:
        dist.init_process_group(
            backend or ("nccl" if cuda else "gloo"),
            init_method=f"tcp://{host}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    except Exception as exc:  # noqa: BLE001 - only re-worded when it is a port clash
        text = str(exc).lower()
        if "address already in use" in text or f"errno: {errno.EADDRINUSE}" in text:
            raise TorchfeedError(
                f"rank 0 cannot listen on {env.master_addr}:{env.master_port} (already in use, "
                f"port from {env.source}): set MASTER_PORT to a free port, or launch with "
                f"`torchfeed slurm`, which picks a free one per job"
            ) from exc
        raise
    return env


# -- model-parallel replicas -----------------------------------------------------


def device_group(gpus_per_model: int | None = None, *, local_rank: int | None = None) -> list:
    """Devices of this process's model replica: local rank r gets GPUs r*g ... r*g+g-1.

    When each task sees only its own ``g`` GPUs (Slurm ``--gpus-per-task``) they are
    0 ... g-1. Without CUDA every entry is the CPU device (for tests and CPU runs).

    Parameters
    ----------
    gpus_per_model : int, optional
        Devices per replica ``g`` (default ``TORCHFEED_GPUS_PER_MODEL`` or 1).
    local_rank : int, optional
        Rank on this node (default: from :func:`environment`).

    Returns
    -------
    list of torch.device
    """
    import torch

    g = gpus_per_model if gpus_per_model is not None else int_var(os.environ, ENV_GPUS_PER_MODEL, 1)
    if g < 1:
        raise ValueError(f"gpus_per_model must be >= 1, got {g}")
    r = environment().local_rank if local_rank is None else local_rank
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * g
    visible = torch.cuda.device_count()
    if visible >= (r + 1) * g:
        first = r * g
    elif visible == g:
        first = 0
    else:
        raise TorchfeedError(
            f"local rank {r} needs GPUs {r * g}..{r * g + g - 1} but this node shows {visible}: "
            f"run at most {visible // g} task(s) per node with gpus_per_model={g} "
            f"(`torchfeed slurm --gpus-per-model {g}` sizes tasks to match)"
        )
    return [torch.device("cuda", i) for i in range(first, first + g)]
