"""`torchfeed slurm`: generated heterogeneous batch scripts, dry-run and on a real Slurm cluster.

The real-cluster tests start munged, slurmctld and three slurmd (nodes g1 in partition
gpu, c1 and c2 in partition cpu) on this machine (see tests/slurm_cluster.py). They are
skipped when the Slurm or munge programs are missing (`apt-get install slurm-wlm munge`).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from slurm_cluster import started_for_tests
from torchfeed import cli
from torchfeed.cluster import SlurmJob, sbatch_script
from torchfeed.cluster.slurm import parse_signal

pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parent
TRAIN = [sys.executable, str(TESTS / "cluster_train.py")]
SAMPLES, BATCH, EPOCHS = 64, 4, 2


def _directives(script: str):
    """The #SBATCH options of each heterogeneous group."""
    groups: list[list[str]] = [[]]
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            option = line[len("#SBATCH ") :]
            if option == "hetjob":
                groups.append([])
            else:
                groups[-1].append(option)
    return groups


def _bash_syntax_ok(script: str) -> bool:
    return subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0


# -- scripts, without Slurm ----------------------------------------------------------------


def test_dry_run_multi_node_layout(capsys, tmp_path):
    """(d) A multi-node layout: 2 GPU nodes x 4 GPUs, 2 GPUs per model, 3 CPU nodes x 8 workers."""
    job_dir = str(tmp_path / "runs" / "%j")
    code = cli.main(
        [
            "slurm",
            "--dry-run",
            "--job-dir",
            job_dir,
            "--partition",
            "gpu",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--gpus-per-model",
            "2",
            "--cpus-per-task",
            "6",
            "--worker-partition",
            "cpu",
            "--worker-nodes",
            "3",
            "--workers-per-node",
            "8",
            "--cpus-per-worker",
            "2",
            "--time",
            "12:00:00",
            "--sbatch=--account=proj",
            "--worker-sbatch=--mem=64G",
            "--signal",
            "USR1@90",
            "--python",
            "/opt/py/bin/python",
            "--",
            "python",
            "train.py",
            "--lr",
            "0.1",
            "--name",
            "my run",
        ]
    )
    script = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "runs").exists()  # printed only
    assert script.startswith("#!/bin/bash\n") and _bash_syntax_ok(script)
    trainers, workers = _directives(script)
    assert trainers == [
        "--job-name=torchfeed",
        f"--output={tmp_path}/runs/%j.out",
        "--open-mode=append",
        "--requeue",
        "--signal=B:USR1@90",
        "--time=12:00:00",
        "--partition=gpu",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=6",
        "--gpus-per-node=4",
        "--account=proj",
    ]
    assert workers == [
        "--partition=cpu",
        "--nodes=3",
        "--ntasks-per-node=8",
        "--cpus-per-task=2",
        "--time=12:00:00",
        "--mem=64G",
    ]
    lines = script.splitlines()
    assert f'JOB_DIR={tmp_path}/runs/"${{SLURM_JOB_ID}}"' in script
    assert "export TORCHFEED_GPUS_PER_MODEL=2" in lines and "unset TORCHFEED_SECRET" in lines
    assert 'export TORCHFEED_SECRET_FILE="$JOB_DIR/secret"' in lines
    assert any(line.startswith("(umask 077 && ") for line in lines)
    assert any(
        line.startswith('(umask 077 && mkdir -p "$JOB_DIR") && chmod 700 "$JOB_DIR"') for line in lines
    )
    assert any(line.startswith('(umask 077 && : > "$JOB_DIR/workers")') for line in lines)
    assert "srun --het-group=1 --kill-on-bad-exit=1 --ntasks-per-node=8 --cpus-per-task=2 \\" in lines
    assert (
        '    "$PYTHON" -m torchfeed worker --host 0.0.0.0 --port 0 --address-file "$JOB_DIR/workers" \\'
        in lines
    )
    assert any('wait-workers "$JOB_DIR/workers" 24 ' in line for line in lines)
    assert (
        "export TORCHFEED_WORKERS" in lines
        and 'export MASTER_PORT=$("$PYTHON" -m torchfeed.cluster port)' in lines
    )
    assert "srun --het-group=0 --kill-on-bad-exit=1 --ntasks-per-node=2 --cpus-per-task=6 \\" in lines
    assert "    python train.py --lr 0.1 --name 'my run' &" in lines
    assert any(
        line.startswith("trap ") and line.endswith(" USR1") and "kill -USR1 $TRAINERS_PID" in line
        for line in lines
    )
    assert lines[-1] == "exit $STATUS"


def test_dry_run_torchrun(capsys):
    """(d) --torchrun: one torchrun per node with c10d rendezvous; `python` before the script is dropped."""
    script = sbatch_script(
        ["python", "train.py", "--x"],
        nodes=3,
        gpus_per_node=8,
        gpus_per_model=2,
        cpus_per_task=4,
        torchrun=True,
        python="/p/python",
    )
    trainers, _ = _directives(script)
    assert "--ntasks-per-node=1" in trainers and "--cpus-per-task=16" in trainers
    assert "srun --het-group=0 --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=16 \\" in script
    assert (
        '"$PYTHON" -m torch.distributed.run --nnodes=3 --nproc-per-node=4 --rdzv-backend=c10d \\\n'
        '    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" train.py --x &'
    ) in script
    assert "PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in script
    assert _bash_syntax_ok(script)
    assert cli.main(["slurm", "--dry-run", "--torchrun", "--", "python", "-m", "pkg.train"]) == 0
    assert '--rdzv-id="$SLURM_JOB_ID" -m pkg.train &' in capsys.readouterr().out


def test_invalid_layouts_are_explained(capsys, tmp_path):
    assert cli.main(["slurm", "--dry-run", "--gpus-per-node", "3", "--gpus-per-model", "2", "--", "x"]) == 2
    assert "not a multiple of --gpus-per-model" in capsys.readouterr().err
    assert cli.main(["slurm", "--dry-run", "--"]) == 2
    assert "no training command" in capsys.readouterr().err
    with pytest.raises(ValueError, match="last path component"):
        SlurmJob(["x"], job_dir="runs/%j/sub").script()
    with pytest.raises(ValueError, match="4 tasks per node x 2 GPUs"):
        SlurmJob(["x"], gpus_per_node=4, gpus_per_model=2, ntasks_per_node=4).script()
    assert parse_signal("B:SIGUSR1@60") == ("USR1", 60) and parse_signal("none") is None
    with pytest.raises(ValueError, match="unknown or uncatchable"):
        parse_signal("KILL@10")
    no_signal = sbatch_script(["x"], signal=None)
    assert "--signal" not in no_signal and "trap" not in no_signal


def test_write_and_submit_without_slurm(capsys, tmp_path, monkeypatch):
    job_dir = tmp_path / "jobs" / "%j"
    assert cli.main(["slurm", "--job-dir", str(job_dir), "--", "python", "t.py"]) == 0
    script = tmp_path / "jobs" / "torchfeed.sbatch"
    assert f"wrote {script}; submit it with: sbatch {script}" in capsys.readouterr().out
    assert script.read_text() == sbatch_script(["python", "t.py"], job_dir=str(job_dir))
    assert stat.S_IMODE(script.stat().st_mode) == 0o700  # yours alone, as its folder
    assert stat.S_IMODE(script.parent.stat().st_mode) == 0o700
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert cli.main(["slurm", "--submit", "--job-dir", str(job_dir), "--", "x"]) == 2
    assert "sbatch not found" in capsys.readouterr().err


# -- a real Slurm cluster ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    with started_for_tests() as cluster:
        yield cluster


def _job(tmp: Path, command, **kw) -> SlurmJob:
    return SlurmJob(
        list(command),
        job_dir=str(tmp / "%j"),
        partition="gpu",
        worker_partition="cpu",
        ntasks_per_node=2,
        worker_nodes=2,
        workers_per_node=1,
        time="10",
        worker_timeout=120,
        **kw,
    )


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    """Submit the jobs together (the cluster has room for all): they run while the tests wait."""
    root = tmp_path_factory.mktemp("jobs")
    launcher_vars = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHFEED_WORKERS",
    )
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}  # whatever other tests left
    args = ["--samples", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", str(EPOCHS)]
    submitted = {}
    for name, job in {
        "preempt": _job(root, [*TRAIN, *args, "--preempt", "--step-sleep", "0.3"]),
        "srun": _job(root, [*TRAIN, *args]),
        "torchrun": _job(root, [*TRAIN, *args], torchrun=True),
        "fails": _job(root, [sys.executable, "-c", "import sys; sys.exit(3)"]),
    }.items():
        job_id = job.submit(root / f"{name}.sbatch", env=env)
        submitted[name] = (job_id, Path(str(job.job_dir).replace("%j", job_id)))
    return submitted


def _finished(slurm, job_id: str, job_dir: Path, timeout: float = 240.0) -> dict:
    info = slurm.wait_job(job_id, timeout)
    output = Path(str(job_dir) + ".out")
    log = output.read_text() if output.exists() else "(no output)"
    assert info["JobState"] == "COMPLETED", f"job {job_id} ended {info['JobState']}:\n{log}"
    return json.loads((job_dir / "result.json").read_text())


def _seen_once_per_epoch(job_dir: Path, world: int) -> None:
    seen = [tuple(p) for r in range(world) for p in json.loads((job_dir / f"seen.{r}.json").read_text())]
    counts = Counter(seen)
    assert set(counts) == {(e, i) for e in range(EPOCHS) for i in range(SAMPLES)}
    assert max(counts.values()) == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_preemption_checkpoints_requeues_and_resumes(slurm, jobs):
    """(c) Signal the running job: it checkpoints, requeues itself, resumes, ends as an uninterrupted run."""
    job_id, job_dir = jobs["preempt"]
    progress = job_dir / "progress"
    deadline = time.monotonic() + 240
    while not (progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= 3):
        info = slurm.job(job_id)
        assert info.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), f"job ended early: {info}"
        assert time.monotonic() < deadline, "training never reached step 3"
        time.sleep(0.2)
    slurm.signal_batch(job_id, "USR2")  # what Slurm does before the time limit (--signal=B:USR2@120)
    deadline = time.monotonic() + 120
    while True:  # requeued: pending again with one restart, held by Slurm's requeue delay (BeginTime)
        info = slurm.job(job_id)
        if info.get("JobState") == "PENDING" and info.get("Restarts") == "1":
            if info.get("Reason") == "BeginTime":
                slurm.release(job_id)  # skip the ~2 minute delay; the job restarts at once
        elif info.get("Restarts") == "1" and info.get("JobState") in ("RUNNING", "COMPLETED"):
            break
        if info.get("JobState") in ("FAILED", "CANCELLED"):
            output = Path(str(job_dir) + ".out")
            tail = output.read_text()[-3000:] if output.exists() else "(no output)"
            ctld = slurm.root / "slurmctld.log"
            ctld_tail = "\n".join(ctld.read_text().splitlines()[-40:]) if ctld.exists() else ""
            raise AssertionError(
                f"job was not requeued: {info}\n--- job output:\n{tail}\n--- slurmctld:\n{ctld_tail}"
            )
        assert time.monotonic() < deadline, f"job not requeued and restarted within 120 s: {info}"
        time.sleep(0.5)
    resumed = _finished(slurm, job_id, job_dir)
    log = Path(str(job_dir) + ".out").read_text()
    assert "SIGUSR2 received, forwarding it to the trainers" in log and "rank 0: checkpoint at step" in log
    assert resumed["restarts"] == 1 and resumed["steps"] == EPOCHS * SAMPLES // (2 * BATCH)
    _seen_once_per_epoch(job_dir, 2)
    uninterrupted = _finished(slurm, *jobs["srun"])
    assert resumed["params"] == uninterrupted["params"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hetjob_trains_every_sample_once(slurm, jobs):
    """(a) Two gloo DDP trainer tasks (srun) fed by two workers on the CPU partition."""
    job_id, job_dir = jobs["srun"]
    result = _finished(slurm, job_id, job_dir)
    assert (result["world_size"], result["source"], result["restarts"]) == (2, "slurm", 0)
    assert len(result["workers"]) == 1  # split: one of the two workers per rank
    registered = (job_dir / "workers").read_text().split()
    assert len(registered) == 2 and result["workers"][0] in registered
    assert stat.S_IMODE((job_dir / "secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((job_dir / "workers").stat().st_mode) == 0o600
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    _seen_once_per_epoch(job_dir, 2)
    assert slurm.job(job_id)["ExitCode"] == "0:0"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hetjob_with_torchrun(slurm, jobs):
    """(b) The same training launched by srun + torchrun (c10d rendezvous)."""
    result = _finished(slurm, *jobs["torchrun"])
    assert (result["world_size"], result["source"]) == (2, "torchrun")
    _seen_once_per_epoch(jobs["torchrun"][1], 2)
    assert result["params"] == _finished(slurm, *jobs["srun"])["params"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_job_exit_code_is_the_trainers(slurm, jobs):
    job_id, job_dir = jobs["fails"]
    info = slurm.wait_job(job_id, 240)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0"
    assert len((job_dir / "workers").read_text().split()) == 2  # the workers had started, then were stopped
