"""Cluster glue: launcher environments, worker discovery, Slurm heterogeneous jobs.

``environment()`` tells this process's rank, world size and rendezvous address from
torchrun, Slurm, Dask, MPI or nothing; ``init_distributed()`` starts torch.distributed
from it; ``workers()`` finds this trainer's data-loading workers; ``device_group()`` gives
a model-parallel replica its devices; ``SlurmJob`` writes and submits the heterogeneous
batch script behind ``torchfeed slurm``; ``SlurmPool`` runs workers as Slurm jobs that
``torchfeed.autoscale`` grows and shrinks.

Names are imported on first use (the command line reads ``slurm`` without torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..util import lazy_exports

_EXPORTS = {
    "Environment": "env",
    "SlurmJob": "slurm",
    "SlurmPool": "pool",
    "choose_port": "env",
    "device_group": "env",
    "environment": "env",
    "init_distributed": "env",
    "pool_script": "pool",
    "sbatch_script": "slurm",
    "split_workers": "discovery",
    "workers": "discovery",
}

__all__ = [
    "Environment",
    "SlurmJob",
    "SlurmPool",
    "choose_port",
    "device_group",
    "environment",
    "init_distributed",
    "pool_script",
    "sbatch_script",
    "split_workers",
    "workers",
]
assert sorted(__all__) == sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .discovery import split_workers, workers
    from .env import Environment, choose_port, device_group, environment, init_distributed
    from .pool import SlurmPool, pool_script
    from .slurm import SlurmJob, sbatch_script
