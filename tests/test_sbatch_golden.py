"""`torchfeed slurm`'s batch script (and SlurmPool's worker script), compared byte for byte with reviewed copies in tests/golden/.

After an intended change to the script (cluster/sbatch.tmpl, pool.tmpl, SlurmJob or pool_script), regenerate the
copies and review the diff before committing it:

    TORCHFEED_REGENERATE_GOLDEN=1 python -m pytest tests/test_sbatch_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from torchfeed.cluster import SlurmJob, pool_script
from torchfeed.worker.options import WorkerOptions

GOLDEN = Path(__file__).parent / "golden"

CONFIGS: dict[str, dict[str, Any]] = {
    # the defaults: one trainer node, one worker, USR2 120 s before the limit
    "minimal": dict(command=["python", "train.py"]),
    # torchrun on GPU nodes, partitions, extra options, forwarded signal through torchrun
    "torchrun": dict(
        command=["python", "train.py", "--epochs", "10", "--name", "it's mine"],
        job_dir="/scratch/runs/%j",
        partition="gpu",
        nodes=2,
        gpus_per_node=4,
        cpus_per_task=8,
        worker_partition="cpu",
        worker_nodes=3,
        workers_per_node=16,
        cpus_per_worker=2,
        time="04:00:00",
        sbatch=["--account=proj42", " --mem=0 "],
        worker_sbatch=["--mem-per-cpu=2G"],
        torchrun=True,
        signal="USR1@90",
        job_name="resnet",
        worker_args=["--log-level", "INFO"],
        worker_timeout=600,
    ),
    # one task per GPU (no torchrun), model parallel, no warning signal, fixed job directory
    "tasks_no_signal": dict(
        command=["python", "-m", "mypkg.train", "--config", "a b.yaml"],
        job_dir="jobs/fixed",
        gpus_per_node=8,
        gpus_per_model=2,
        signal=None,
        time="30",
        worker_nodes=2,
        workers_per_node=4,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_script_matches_golden_file(name):
    _compare(name, SlurmJob(python="/usr/bin/python3", **CONFIGS[name]).script())


def test_pool_worker_script_matches_golden_file():
    """SlurmPool's worker jobs: the secret file's path (never the secret), options, env, worker arguments."""
    text = pool_script(
        "/scratch/pools/run 1",
        "/home/me/.torchfeed/secret",
        partition="cpu",
        time="02:00:00",
        cpus_per_worker=4,
        options=WorkerOptions(parallel=4),
        sbatch=["--account=proj42", " --mem=16G "],
        python="/usr/bin/python3",
        worker_args=["--log-level", "INFO"],
        env={"PYTHONPATH": "/home/me/src", "DATA": "/data/it's here"},
    )
    _compare("pool_worker", text)


def _compare(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("TORCHFEED_REGENERATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} is missing: regenerate it (see this file's docstring)"
    assert text == path.read_text(), (
        f"the batch script for {name!r} differs from {path}; if the change is intended, regenerate "
        f"the golden files (see this file's docstring) and review the diff"
    )
