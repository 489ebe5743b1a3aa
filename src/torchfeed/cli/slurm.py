"""``torchfeed slurm``: write (and submit) the batch script of a
:class:`~torchfeed.cluster.slurm.SlurmJob` from the command line."""

from __future__ import annotations

import argparse
import os
import sys

from ..cluster.slurm import SlurmJob
from ..errors import TorchfeedError
from ..worker.options import WorkerOptions

HELP = "write (and submit) a heterogeneous Slurm job: trainers fed by torchfeed workers"
DESCRIPTION = (
    "Write a heterogeneous sbatch script: group 0 runs COMMAND on trainer nodes, group 1 runs torchfeed "
    "workers; with --submit, submit it. Usage: torchfeed slurm [options] -- COMMAND ARGS..."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--job-dir",
        default="torchfeed-jobs/%j",
        help="job files directory; %%j = job id (default torchfeed-jobs/%%j)",
    )
    p.add_argument("--partition", help="trainer partition (GPU nodes)")
    p.add_argument("--nodes", type=int, default=1, help="trainer nodes")
    p.add_argument(
        "--ntasks-per-node",
        type=int,
        help="trainer processes per node (default: gpus-per-node / gpus-per-model, or 1)",
    )
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per trainer node (default 0)")
    p.add_argument("--cpus-per-task", type=int, help="CPUs per trainer process")
    p.add_argument("--gpus-per-model", type=int, default=1, help="GPUs per model replica (model parallel)")
    p.add_argument(
        "--torchrun", action="store_true", help="launch trainers with srun + torchrun (c10d rendezvous)"
    )
    p.add_argument("--worker-partition", help="worker partition (CPU nodes)")
    p.add_argument("--worker-nodes", type=int, default=1, help="worker nodes (default 1)")
    p.add_argument(
        "--workers-per-node",
        type=int,
        default=1,
        help="torchfeed worker processes per worker node (default 1)",
    )
    p.add_argument("--cpus-per-worker", type=int, default=1, help="CPUs per worker process (default 1)")
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        dest="worker_args",
        metavar="ARG",
        help="extra `torchfeed worker` argument (repeatable), e.g. --worker-arg=--parallel=4",
    )
    p.add_argument("--time", help="time limit, e.g. 1-00:00:00")
    p.add_argument(
        "--signal",
        default="USR2@120",
        help="warning signal before the time limit, NAME[@SECONDS] "
        "(default USR2@120; NCCL jobs: USR1@120; 'none' for no signal)",
    )
    p.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="LINE",
        help="extra #SBATCH option for the trainer group (repeatable), e.g. --sbatch=--account=abc",
    )
    p.add_argument(
        "--worker-sbatch",
        action="append",
        default=[],
        metavar="LINE",
        help="extra #SBATCH option for the worker group (repeatable)",
    )
    p.add_argument("--job-name", default="torchfeed", help="Slurm job name (default torchfeed)")
    p.add_argument("--python", default=sys.executable, help="python on the nodes (default: this one)")
    p.add_argument("--worker-timeout", type=float, default=300.0, help="seconds to wait for the workers")
    p.add_argument("--script", help="where to write the script (default: JOB_DIR's parent/JOB_NAME.sbatch)")
    p.add_argument("--dry-run", action="store_true", help="print the script, write and submit nothing")
    p.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    WorkerOptions.add_arguments(p, title="each torchfeed worker's options (torchfeed worker --help)")
    p.add_argument(
        "train_command", nargs="*", metavar="COMMAND", help="the training command and its arguments, after --"
    )


def run(args) -> int:
    """Execute ``torchfeed slurm`` with parsed ``args``."""
    command = list(args.train_command)
    if command and command[0] == "--":
        command = command[1:]
    job_dir = os.path.abspath(args.job_dir)
    try:
        job = SlurmJob(
            command,
            job_dir=job_dir,
            partition=args.partition,
            nodes=args.nodes,
            ntasks_per_node=args.ntasks_per_node,
            gpus_per_node=args.gpus_per_node,
            cpus_per_task=args.cpus_per_task,
            worker_partition=args.worker_partition,
            worker_nodes=args.worker_nodes,
            workers_per_node=args.workers_per_node,
            cpus_per_worker=args.cpus_per_worker,
            time=args.time,
            sbatch=args.sbatch,
            worker_sbatch=args.worker_sbatch,
            torchrun=args.torchrun,
            gpus_per_model=args.gpus_per_model,
            signal=args.signal,
            job_name=args.job_name,
            python=args.python,
            worker_args=args.worker_args,
            worker_timeout=args.worker_timeout,
            options=WorkerOptions.from_args(args),
        )
        if args.dry_run:
            sys.stdout.write(job.script())
            return 0
        if args.submit:
            job_id = job.submit(args.script)
            print(
                f"submitted job {job_id}; output: {job.output.replace('%j', job_id)}; "
                f"files: {job.job_dir.replace('%j', job_id)}"
            )
        else:
            path = job.write(args.script)
            print(f"wrote {path}; submit it with: sbatch {path}")
    except (ValueError, TorchfeedError) as exc:
        print(f"torchfeed slurm: {exc}", file=sys.stderr)
        return 2
    return 0
