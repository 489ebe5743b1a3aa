"""Cluster glue: launcher environments, worker discovery, Slurm heterogeneous jobs.

``environment()`` tells this process's rank, world size and rendezvous address from
torchrun, Slurm, Dask, MPI or nothing; ``init_distributed()`` starts torch.distributed
from it; ``workers()`` finds this trainer's data-loading workers; ``device_group()`` gives
a model-parallel replica its devices; ``SlurmJob`` writes and submits the heterogeneous
batch script behind ``torchfeed slurm``.
"""

from .discovery import split_workers, workers
from .env import Environment, choose_port, device_group, environment, init_distributed
from .slurm import SlurmJob, sbatch_script

__all__ = sorted([
    "Environment",
    "SlurmJob",
    "choose_port",
    "device_group",
    "environment",
    "init_distributed",
    "sbatch_script",
    "split_workers",
    "workers",
])
