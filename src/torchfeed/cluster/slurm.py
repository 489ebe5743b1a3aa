"""Heterogeneous Slurm jobs: trainers on GPU nodes, data-loading workers on CPU nodes.

:class:`SlurmJob` builds the batch script that ``torchfeed slurm`` writes and submits.
Group 0 runs the training command (``srun``, or ``srun`` + torchrun); group 1 runs
``torchfeed worker`` processes. The script makes a per-job secret, starts the workers,
waits until all have registered, exports ``TORCHFEED_WORKERS`` and
``TORCHFEED_SECRET_FILE``, runs the trainers, stops the workers and exits with the
trainers' status. Slurm's warning signal before the time limit is forwarded to the
trainers, where :class:`torchfeed.checkpoint.Preemption` turns it into a checkpoint and a
requeue.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal as _signal
import string
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import TorchfeedError
from ..worker.options import WorkerOptions
from . import private

_PYTHON_NAME = re.compile(r"python[0-9.]*$")


def parse_signal(spec: str | None) -> tuple[str, int] | None:
    """``"USR2@120"`` -> ``("USR2", 120)``; ``None``/``"none"`` -> None. ``B:``/``SIG`` prefixes are accepted."""
    if spec is None or spec.strip().lower() in ("", "none", "off"):
        return None
    text = spec.strip()
    text = re.sub(r"^[BR]{1,2}:", "", text)
    name, _, seconds = text.partition("@")
    name = name.upper()
    name = name[3:] if name.startswith("SIG") else name
    if not hasattr(_signal, f"SIG{name}") or name in ("KILL", "STOP"):
        raise ValueError(
            f"--signal {spec!r}: unknown or uncatchable signal {name!r}; use e.g. USR2@120 or USR1@90"
        )
    try:
        secs = int(seconds) if seconds else 120
    except ValueError:
        raise ValueError(f"--signal {spec!r}: seconds after '@' must be an integer") from None
    if not 0 <= secs <= 65535:
        raise ValueError(f"--signal {spec!r}: seconds must be within 0..65535")
    return name, secs


SCRIPT_TEMPLATE = "sbatch.tmpl"  # package data of torchfeed.cluster


class _Template(string.Template):
    delimiter = "@"  # the script is bash: $ is its own


def render_template(name: str, values: Mapping[str, str]) -> str:
    """Fill in template ``name`` of this package: ``@{key}`` becomes ``values[key]``.

    A line holding nothing but one placeholder whose value is empty is left out, so optional
    blocks leave no blank line behind. A placeholder without a value raises ``KeyError``.
    """
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    kept = [line for line in text.splitlines() if not _empty_block(line, values)]
    return _Template("\n".join(kept) + "\n").substitute(values)


def _empty_block(line: str, values: Mapping[str, str]) -> bool:
    match = re.fullmatch(r"@\{(\w+)\}", line)
    return match is not None and values.get(match.group(1)) == ""


def _q(word: str) -> str:
    return shlex.quote(str(word))


@dataclass
class SlurmJob:
    """A heterogeneous Slurm job: trainers (group 0) fed by torchfeed workers (group 1).

    Parameters
    ----------
    command : sequence of str
        Training command run by every trainer task (with ``torchrun=True``: what follows
        torchrun, i.e. a script, ``-m module`` or ``--no-python prog``; a leading
        ``python`` is dropped).
    job_dir : str
        Directory of the job's files (secret, worker addresses, logs, checkpoints);
        ``%j`` in its last component becomes the job id.
    partition, nodes, ntasks_per_node, gpus_per_node, cpus_per_task
        Trainer group. ``ntasks_per_node`` defaults to ``gpus_per_node // gpus_per_model``
        (at least 1).
    worker_partition, worker_nodes, workers_per_node, cpus_per_worker
        Worker group: ``worker_nodes * workers_per_node`` worker processes.
    time : str, optional
        Time limit (``--time``), for both groups.
    sbatch, worker_sbatch : sequence of str
        Extra ``#SBATCH`` options for the trainer group (job-wide ones such as
        ``--account`` belong there) and for the worker group.
    torchrun : bool
        Run one torchrun per trainer node (c10d rendezvous) instead of one task per process.
    gpus_per_model : int
        GPUs of one model replica (model parallel); sizes tasks per node and is exported as
        ``TORCHFEED_GPUS_PER_MODEL`` for :func:`torchfeed.cluster.device_group`.
    signal : str or None
        Warning signal before the time limit, ``NAME[@SECONDS]`` (``"USR1@90"`` for NCCL
        jobs that use USR2 otherwise); None for none.
    job_name, python, worker_args, worker_timeout
        Job name; interpreter running torchfeed on the nodes; extra ``torchfeed worker``
        options; seconds to wait for all workers to register.
    cache_size : int or str, optional
        Each worker's ``--cache-size`` (``"8GiB"``): memory for :func:`torchfeed.cached` samples.
    options : WorkerOptions, optional
        Every other worker option (:class:`torchfeed.worker.options.WorkerOptions`), written
        into the workers' command line; ``cache_size``, when given, replaces its own.
    """

    command: Sequence[str]
    job_dir: str = "torchfeed-jobs/%j"
    partition: str | None = None
    nodes: int = 1
    ntasks_per_node: int | None = None
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    worker_partition: str | None = None
    worker_nodes: int = 1
    workers_per_node: int = 1
    cpus_per_worker: int = 1
    time: str | None = None
    sbatch: Sequence[str] = field(default_factory=tuple)
    worker_sbatch: Sequence[str] = field(default_factory=tuple)
    torchrun: bool = False
    gpus_per_model: int = 1
    signal: str | None = "USR2@120"
    job_name: str = "torchfeed"
    python: str = sys.executable
    worker_args: Sequence[str] = field(default_factory=tuple)
    worker_timeout: float = 300.0
    cache_size: int | str | None = None  # each worker's --cache-size (torchfeed.cached); None: its default
    options: WorkerOptions | None = None

    # -- derived values ---------------------------------------------------------
    def _check(self) -> None:
        if not self.command:
            raise ValueError(
                "no training command: give it after `--`, e.g. `torchfeed slurm -- python train.py`"
            )
        for name in ("nodes", "worker_nodes", "workers_per_node", "cpus_per_worker", "gpus_per_model"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node and self.gpus_per_node % self.gpus_per_model:
            raise ValueError(
                f"--gpus-per-node {self.gpus_per_node} is not a multiple of --gpus-per-model "
                f"{self.gpus_per_model}: each replica needs whole GPUs on one node"
            )
        if (
            self.ntasks_per_node
            and self.gpus_per_node
            and self.ntasks_per_node * self.gpus_per_model > self.gpus_per_node
        ):
            raise ValueError(
                f"{self.ntasks_per_node} tasks per node x {self.gpus_per_model} GPUs per model needs "
                f"{self.ntasks_per_node * self.gpus_per_model} GPUs, but --gpus-per-node is "
                f"{self.gpus_per_node}: lower --ntasks-per-node or leave it out"
            )
        if "%j" in os.path.dirname(self.job_dir):
            raise ValueError(
                f"--job-dir {self.job_dir!r}: %j may only appear in the last path component "
                f"(the directory above must exist when the job is submitted)"
            )
        parse_signal(self.signal)

    def worker_options(self) -> WorkerOptions:
        """The workers' options: ``options`` with ``cache_size`` when given."""
        return (self.options or WorkerOptions()).merged(cache_size=self.cache_size)

    @property
    def procs_per_node(self) -> int:
        """Trainer processes per node (model replicas per node)."""
        if self.ntasks_per_node:
            return int(self.ntasks_per_node)
        return max(1, self.gpus_per_node // self.gpus_per_model) if self.gpus_per_node else 1

    @property
    def num_workers(self) -> int:
        """Worker processes in the job."""
        return self.worker_nodes * self.workers_per_node

    @property
    def output(self) -> str:
        """Path of the job's Slurm output file (``%j`` = job id)."""
        if "%j" in self.job_dir:
            return self.job_dir.rstrip("/") + ".out"
        return os.path.join(self.job_dir, "slurm-%j.out")

    def _trainer_line(self) -> str:
        """The trainers' program: the command itself, or torchrun running it."""
        cmd = list(self.command)
        if not self.torchrun:
            return " ".join(_q(w) for w in cmd)
        if _PYTHON_NAME.match(os.path.basename(cmd[0])):
            cmd = cmd[1:]
            if not cmd:
                raise ValueError("with --torchrun, give the training script after `python`")
        return (
            f'"$PYTHON" -m torch.distributed.run --nnodes={self.nodes} --nproc-per-node={self.procs_per_node} '
            f'--rdzv-backend=c10d \\\n    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" '
            + " ".join(_q(w) for w in cmd)
        )

    # -- the script ---------------------------------------------------------------
    def _directives(self) -> list[str]:
        sig = parse_signal(self.signal)
        lines = [f"--job-name={self.job_name}", f"--output={self.output}", "--open-mode=append", "--requeue"]
        if sig:
            lines.append(f"--signal=B:{sig[0]}@{sig[1]}")
        if self.time:
            lines.append(f"--time={self.time}")
        if self.partition:
            lines.append(f"--partition={self.partition}")
        lines.append(f"--nodes={self.nodes}")
        cpus = self.cpus_per_task
        if self.torchrun:  # one torchrun per node, which starts the node's trainer processes
            lines.append("--ntasks-per-node=1")
            cpus = cpus and cpus * self.procs_per_node
        else:
            lines.append(f"--ntasks-per-node={self.procs_per_node}")
        if cpus:
            lines.append(f"--cpus-per-task={cpus}")
        if self.gpus_per_node:
            lines.append(f"--gpus-per-node={self.gpus_per_node}")
        lines += [s.strip() for s in self.sbatch]
        lines.append("hetjob")
        if self.worker_partition:
            lines.append(f"--partition={self.worker_partition}")
        lines += [
            f"--nodes={self.worker_nodes}",
            f"--ntasks-per-node={self.workers_per_node}",
            f"--cpus-per-task={self.cpus_per_worker}",
        ]
        if self.time:
            lines.append(f"--time={self.time}")
        lines += [s.strip() for s in self.worker_sbatch]
        return [f"#SBATCH {line}" for line in lines]

    def script(self) -> str:
        """The batch script, as text: ``sbatch.tmpl`` (package data) filled in for this job."""
        self._check()
        sig = parse_signal(self.signal)
        job_dir = '"${SLURM_JOB_ID}"'.join(_q(part) if part else "" for part in self.job_dir.split("%j"))
        trainer_cpus = (
            self.cpus_per_task * (self.procs_per_node if self.torchrun else 1) if self.cpus_per_task else 0
        )
        trainer_srun = [
            "srun",
            "--het-group=0",
            "--kill-on-bad-exit=1",
            f"--ntasks-per-node={1 if self.torchrun else self.procs_per_node}",
        ]
        if trainer_cpus:
            trainer_srun.append(f"--cpus-per-task={trainer_cpus}")
        worker = (
            f"srun --het-group=1 --kill-on-bad-exit=1 --ntasks-per-node={self.workers_per_node} "
            f'--cpus-per-task={self.cpus_per_worker} \\\n    "$PYTHON" -m torchfeed worker --host 0.0.0.0 '
            f'--port 0 --address-file "$JOB_DIR/workers"'
        )
        options = self.worker_options()
        words = [*self.worker_args, *options.to_args()]
        if words:
            worker += " " + " ".join(_q(a) for a in words)
        values = {
            "nodes": str(self.nodes),
            "procs_per_node": str(self.procs_per_node),
            "trainer_where": (f" on partition {self.partition}" if self.partition else "")
            + (" (torchrun per node)" if self.torchrun else ""),
            "worker_nodes": str(self.worker_nodes),
            "workers_per_node": str(self.workers_per_node),
            "worker_where": f" on partition {self.worker_partition}" if self.worker_partition else "",
            "directives": "\n".join(self._directives()),
            "python": _q(self.python),
            "job_dir": job_dir,
            "gpus_per_model": str(self.gpus_per_model),
            "preempt_export": f"export TORCHFEED_PREEMPT_SIGNAL={sig[0]}   # torchfeed.checkpoint.Preemption listens for it"
            if sig
            else "",
            "worker_srun": worker,
            "num_workers": str(self.num_workers),
            "worker_timeout": f"{self.worker_timeout:g}",
            "torchrun_signals": "",
            "signal_trap": "",
            "trainer_srun": " ".join(trainer_srun) + " \\\n    " + self._trainer_line(),
        }
        if self.torchrun and sig:
            handled = f"SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIG{sig[0]}"
            values["torchrun_signals"] = (
                "# torchrun passes the warning signal on to its trainer processes.\n"
                f"export PET_SIGNALS_TO_HANDLE={handled} TORCHELASTIC_SIGNALS_TO_HANDLE={handled}"
            )
        if sig:
            values["signal_trap"] = (
                f"\n# Slurm sends SIG{sig[0]} to this script {sig[1]} s before the time limit: pass it to the "
                "trainers, which checkpoint and requeue the job.\n"
                f'trap \'echo "torchfeed: SIG{sig[0]} received, forwarding it to the trainers" >&2; '
                f"kill -{sig[0]} $TRAINERS_PID 2>/dev/null' {sig[0]}"
            )
        return render_template(SCRIPT_TEMPLATE, values)

    # -- writing and submitting -------------------------------------------------------
    def default_path(self) -> Path:
        """Where :meth:`write` puts the script by default: next to the job directories."""
        base = os.path.dirname(self.job_dir.rstrip("/")) if "%j" in self.job_dir else self.job_dir
        return Path(base or ".") / f"{self.job_name}.sbatch"

    def write(self, path: os.PathLike | None = None) -> Path:
        """Write the script (mode 0700) and create the directory of the Slurm output file (0700,
        as every folder on the way that is missing; see cluster/private.py)."""
        return self._write(self.script(), path)

    def _write(self, text: str, path: os.PathLike | None) -> Path:
        # folders 0700 under folders no other user can change, the script made through its
        # folder's handle, never through a link (cluster/private.py)
        # existing folders (the working directory, a --job-dir or --script folder of the
        # user's) are checked, not changed
        path = Path(path) if path is not None else self.default_path()
        os.close(private.private_dir(os.path.dirname(self.output) or ".", given=True))
        folder = private.private_dir(path.parent, given=True)
        try:
            private.write_file(folder, path.name, text, 0o700)
        finally:
            os.close(folder)
        return path

    def submit(
        self, path: os.PathLike | None = None, *, sbatch: str = "sbatch", env: Mapping[str, str] | None = None
    ) -> str:
        """Write the script and submit it with ``sbatch``; return the job id.

        ``env`` is the environment sbatch runs with, and so the job's (default: this process's).
        """
        exe = shutil.which(sbatch, path=(env or os.environ).get("PATH"))
        if exe is None:
            raise TorchfeedError(
                f"{sbatch} not found: submit from a Slurm login node, or write the script "
                f"with `torchfeed slurm` (no --submit) and run `sbatch` on it there"
            )
        text = self.script()
        script = self._write(text, path)
        done = subprocess.run(
            [exe, "--parsable"],
            input=text,  # from memory, on sbatch's standard input: never a path someone could swap
            capture_output=True,
            text=True,
            timeout=120,
            env=None if env is None else dict(env),
        )
        if done.returncode != 0:
            raise TorchfeedError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip().split(";")[0]


def sbatch_script(command: Sequence[str], **options) -> str:
    """Text of the batch script for ``command``; ``options`` are :class:`SlurmJob`'s."""
    return SlurmJob(list(command), **options).script()
