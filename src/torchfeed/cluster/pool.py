"""A pool of torchfeed workers run as Slurm jobs: what :func:`torchfeed.autoscale` sizes on Slurm.

:class:`SlurmPool` implements :class:`torchfeed.scaling.pool.WorkerPool`. Growing submits one job array
(one ``sbatch`` call, however many workers: one request to slurmctld, one line in ``squeue``
for the pending ones) whose tasks each run one ``torchfeed worker``; a task is retired by
cancelling it alone (``scancel ARRAY_TASK``). Each worker appends its ``host:port`` to a
0600 file of its own, named after its task, in the pool's 0700 directory: the pool lists
the addresses of the tasks ``squeue`` shows running. Slurm decides where and when the jobs
run; jobs it queues (no room) are said in one log line, and the pool keeps what it has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import Timeout, TorchfeedError
from ..protocol import auth
from ..protocol.addrfile import UnsafeAddressFile, read_address_file
from ..worker.options import WorkerOptions
from . import private
from .slurm import render_template

log = logging.getLogger("torchfeed.cluster")

SCRIPT_TEMPLATE = "pool.tmpl"  # package data of torchfeed.cluster
COMMAND_TIMEOUT = 60.0  # seconds sbatch, squeue or scancel may take (slurmctld busy)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


@dataclass
class _Task:
    """One array task: one worker. ``id`` as ``squeue -r`` shows it (``ARRAYID_INDEX``)."""

    id: str
    submitted: float
    state: str = "PENDING"
    reason: str = ""
    address: str | None = None
    reported: bool = False  # its long wait in the queue was logged
    refused: bool = False  # its address file was unsafe (logged once)


class SlurmPool:
    """torchfeed workers as Slurm jobs, grown by job arrays and shrunk by ``scancel``.

    Parameters
    ----------
    directory : str, optional
        The pool's directory (made 0700): the batch script, the secret, the workers'
        address files and the jobs' logs (``logs/ARRAY_INDEX.out``). It must be on a file
        system the worker nodes share. Default: a new directory under ``./torchfeed-pools``.
    partition, time : str, optional
        ``--partition`` and ``--time`` of the worker jobs.
    cpus_per_worker : int
        ``--cpus-per-task`` of each worker job.
    parallel : int
        Requests a worker executes concurrently (``torchfeed worker --parallel``).
    sbatch : sequence of str
        Extra ``#SBATCH`` options, e.g. ``["--account=abc", "--mem=8G"]``.
    python : str
        Interpreter running torchfeed on the nodes (default: this one).
    worker_args : sequence of str
        Extra ``torchfeed worker`` options.
    options : WorkerOptions, optional
        Every other worker option (:class:`torchfeed.worker.options.WorkerOptions`);
        ``parallel``, when given, replaces its own.
    env : mapping, optional
        Variables the script exports to the workers (written into it: no secrets here).
    secret_file : str, optional
        A secret file the nodes share (0600, in a directory only you can write); default:
        a fresh random secret in ``directory/secret``. Trainers use it through
        :attr:`secret` (``torchfeed.Session(secret=pool.secret)``).
    job_name : str
        Slurm job name of the worker jobs.
    pending_warning : float
        Seconds a job may wait in the queue before the pool says so (once per job).
    poll_interval : float
        Seconds ``squeue``'s answer is reused for (``addresses()`` is called often).
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        partition: str | None = None,
        time: str | None = None,
        cpus_per_worker: int = 1,
        parallel: int | None = None,
        sbatch: Sequence[str] = (),
        python: str = sys.executable,
        worker_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        secret_file: str | os.PathLike | None = None,
        job_name: str = "torchfeed-pool",
        pending_warning: float = 30.0,
        poll_interval: float = 1.0,
        options: WorkerOptions | None = None,
    ):
        if cpus_per_worker < 1:
            raise ValueError(f"cpus_per_worker must be >= 1, got {cpus_per_worker}")
        self.partition, self.time, self.job_name = partition, time, job_name
        self.options = (options or WorkerOptions()).merged(parallel=parallel)
        self.cpus_per_worker = int(cpus_per_worker)
        self.sbatch, self.worker_args = [s.strip() for s in sbatch], list(worker_args)
        self.python, self.env = python, _checked_env(env)
        self.pending_warning, self.poll_interval = float(pending_warning), float(poll_interval)
        self._commands = {name: _find(name) for name in ("sbatch", "squeue", "scancel")}
        # folders 0700 under folders no other user can change; files made through their
        # folder's handle (cluster/private.py): nobody else can swap what sbatch is given
        if directory is None:
            pools = private.private_dir("torchfeed-pools", given=True)  # checked; made 0700 when missing
            try:
                folder, name = private.new_private_dir(pools, "pool-")
            finally:
                os.close(pools)
            directory = Path("torchfeed-pools", name)
        else:
            folder = private.private_dir(directory)
        self.directory = Path(directory).absolute()
        try:
            for sub in ("workers", "logs"):
                private.sub_dir(folder, sub)
            self._own_secret = secret_file is None
            if secret_file is None:
                secret_file = self.directory / "secret"
                private.write_file(folder, "secret", secrets.token_hex(32) + "\n")
            self.secret_file = Path(secret_file).absolute()
            self.secret = auth.secret_from_file(self.secret_file)  # checked now: 0600, private directory
            self.script_path = self.directory / "worker.sbatch"
            self._script = self.script()  # submitted from memory; the file is for the user to read
            private.write_file(folder, "worker.sbatch", self._script)
        finally:
            os.close(folder)
        self._lock = threading.RLock()
        self._tasks: dict[str, _Task] = {}
        self._arrays: list[str] = []
        self._polled = float("-inf")
        self._squeue_failing = False  # said once, until squeue answers again
        self._closed = False

    def script(self) -> str:
        """The worker jobs' batch script (array tasks get ``--array`` from ``sbatch``'s command line)."""
        return pool_script(
            self.directory,
            self.secret_file,
            partition=self.partition,
            time=self.time,
            cpus_per_worker=self.cpus_per_worker,
            options=self.options,
            sbatch=self.sbatch,
            python=self.python,
            worker_args=self.worker_args,
            env=self.env,
            job_name=self.job_name,
        )

    # -- the Pool protocol ------------------------------------------------------------------
    def addresses(self) -> list[str]:
        """The ``host:port`` of every worker whose job runs and that announced itself."""
        with self._lock:
            self._refresh()
            return [a for a in map(self._address, list(self._tasks.values())) if a is not None]

    def requested(self) -> int:
        """Worker jobs submitted and neither retired nor ended: running or waiting in the queue."""
        with self._lock:
            self._refresh()
            return len(self._tasks)

    def scale(self, n: int) -> None:
        """Submit jobs until ``n`` are requested; a smaller ``n`` cancels jobs still waiting in
        the queue (never a running worker: those leave through :meth:`retire`, drained)."""
        with self._lock:
            if self._closed:
                raise TorchfeedError("this SlurmPool is closed: make a new one")
            self._refresh()
            missing = n - len(self._tasks)
            if missing > 0:
                self._submit(missing)
            elif missing < 0:
                queued = [t for t in self._tasks.values() if t.state == "PENDING"][::-1][:-missing]
                if queued:
                    log.info("SlurmPool: cancelling %d worker job(s) still queued", len(queued))
                    self._cancel([t.id for t in queued])

    def retire(self, addresses: Sequence[str]) -> None:
        """Cancel the jobs of these workers (already drained by the caller). Slurm sends them
        SIGTERM, on which a worker closes its connections and exits, then SIGKILL after its
        ``KillWait``. Addresses of jobs that already ended are ignored."""
        wanted = set(addresses)
        with self._lock:
            tasks = [t.id for t in self._tasks.values() if t.address in wanted]
            unknown = wanted - {self._tasks[i].address for i in tasks}
            if unknown:
                log.debug(
                    "SlurmPool: no running job for %s (ended already): nothing to cancel", sorted(unknown)
                )
            if tasks:
                log.info("SlurmPool: cancelling worker job(s) %s", " ".join(tasks))
                self._cancel(tasks)

    def close(self) -> None:
        """Cancel every job this pool submitted (running or queued); the directory stays (logs)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._arrays:
                self._scancel(self._arrays)
            for task in list(self._tasks):
                self._forget(task)
            if self._own_secret:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.secret_file)

    def __enter__(self) -> SlurmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SlurmPool({str(self.directory)!r}, partition={self.partition!r}, jobs={len(self._tasks)})"

    def wait(self, n: int, timeout: float = 300.0) -> list[str]:
        """Block until ``n`` workers are ready (for use without autoscaling); their addresses."""
        deadline = time.monotonic() + timeout
        while len(ready := self.addresses()) < n:
            if time.monotonic() > deadline:
                with self._lock:
                    waiting = sorted({t.reason for t in self._tasks.values() if t.state == "PENDING"})
                raise Timeout(
                    f"{len(ready)} of {n} workers ready after {timeout:g} s "
                    f"({len(self._tasks)} jobs requested; queue reasons: {', '.join(waiting) or 'none'}): "
                    f"see the logs in {self.directory / 'logs'}"
                )
            time.sleep(min(self.poll_interval, 0.5))
        return ready

    # -- Slurm --------------------------------------------------------------------------------
    def _run(self, name: str, args: list[str], stdin: str = "") -> subprocess.CompletedProcess | None:
        env = {k: v for k, v in os.environ.items() if k not in (auth.ENV_SECRET, "TORCHFEED_WORKERS")}
        try:
            return subprocess.run(
                [self._commands[name], *args],
                input=stdin,  # sbatch reads the batch script from its standard input
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
                env=env,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.error("SlurmPool: %s %s failed: %s", name, " ".join(args), exc)
            return None

    def _submit(self, k: int) -> None:
        output = self.directory / "logs" / "%A_%a.out"  # here, not in the script: the path may hold spaces
        done = self._run(
            "sbatch", ["--parsable", f"--array=0-{k - 1}", f"--output={output}"], stdin=self._script
        )
        if done is None or done.returncode != 0:
            why = (done.stderr.strip() or done.stdout.strip()) if done is not None else "see above"
            log.error(
                "SlurmPool: sbatch refused %d more worker job(s) (%s); the pool keeps its %d: "
                "check partition=%r, time=%r, cpus_per_worker=%d and sbatch=%r",
                k,
                why,
                len(self._tasks),
                self.partition,
                self.time,
                self.cpus_per_worker,
                self.sbatch,
            )
            return
        array = done.stdout.strip().split(";")[0]
        self._arrays.append(array)
        now = time.monotonic()
        for i in range(k):
            self._tasks[f"{array}_{i}"] = _Task(f"{array}_{i}", now)
        log.info(
            "SlurmPool: submitted job array %s: %d worker job(s), %d requested in all",
            array,
            k,
            len(self._tasks),
        )

    def _scancel(self, ids: list[str]) -> None:
        done = self._run("scancel", ["--quiet", *ids])
        if done is not None and done.returncode != 0:
            log.debug("SlurmPool: scancel %s: %s", " ".join(ids), done.stderr.strip())

    def _cancel(self, ids: list[str]) -> None:
        self._scancel(ids)
        for task in ids:
            self._forget(task)

    def _forget(self, task: str) -> None:
        self._tasks.pop(task, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / "workers" / task)

    def _refresh(self) -> None:
        """Update the tasks' states from ``squeue`` (at most once per ``poll_interval``)."""
        now = time.monotonic()
        if not self._tasks or now - self._polled < self.poll_interval:
            return
        args = ["-h", "-r", "-u", str(os.getuid()), "-n", self.job_name, "-o", "%i|%T|%r"]
        done = self._run("squeue", args)
        if done is None or done.returncode != 0:
            if done is not None and not self._squeue_failing:
                log.warning(
                    "SlurmPool: squeue failed (%s); keeping the last known states", done.stderr.strip()
                )
            self._squeue_failing = True
            return
        self._polled, self._squeue_failing = now, False
        seen = {}
        for line in done.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3:
                seen[parts[0]] = parts
        for task in list(self._tasks.values()):
            if task.id not in seen or seen[task.id][1] not in _LIVE:
                log.warning(
                    "SlurmPool: worker job %s ended before it was retired (last seen %s); its log: %s",
                    task.id,
                    task.state,
                    self.directory / "logs" / f"{task.id}.out",
                )
                self._forget(task.id)
                continue
            _, state, reason = seen[task.id]
            if task.reported and task.state == "PENDING" and state != "PENDING":
                log.info(
                    "SlurmPool: queued worker job %s started after %.0f s", task.id, now - task.submitted
                )
            task.state, task.reason = state, reason
        self._report_queued(now)

    def _report_queued(self, now: float) -> None:
        late = [
            t
            for t in self._tasks.values()
            if t.state == "PENDING" and not t.reported and now - t.submitted >= self.pending_warning
        ]
        if not late:
            return
        for t in late:
            t.reported = True
        running = sum(t.state == "RUNNING" for t in self._tasks.values())
        reasons = ", ".join(sorted({t.reason for t in late}))
        arrays = ",".join(sorted({t.id.split("_")[0] for t in late}))
        log.warning(
            "SlurmPool: %d worker job(s) still queued after %g s (Slurm's reason: %s): the cluster has no "
            "room for them now; training goes on with the %d running, and they join when Slurm starts "
            "them (squeue -j %s; fewer cpus_per_worker, another partition or a lower max_workers avoid "
            "the wait)",
            len(late),
            self.pending_warning,
            reasons,
            running,
            arrays,
        )

    def _address(self, task: _Task) -> str | None:
        """The address a running task announced (None: not running, or not announced yet)."""
        if task.state != "RUNNING" or task.refused:
            return None
        if task.address is None:
            path = self.directory / "workers" / task.id
            try:
                lines = read_address_file(str(path))
            except UnsafeAddressFile as exc:
                log.error("SlurmPool: ignoring worker job %s: %s", task.id, exc)
                task.refused = True
                return None
            task.address = lines[-1] if lines else None
        return task.address


def pool_script(
    directory: str | os.PathLike,
    secret_file: str | os.PathLike,
    *,
    partition: str | None = None,
    time: str | None = None,
    cpus_per_worker: int = 1,
    parallel: int | None = None,
    sbatch: Sequence[str] = (),
    python: str = sys.executable,
    worker_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    job_name: str = "torchfeed-pool",
    options: WorkerOptions | None = None,
) -> str:
    """Text of :class:`SlurmPool`'s worker script for a pool in ``directory`` (options: its own)."""
    env = _checked_env(env)
    options = (options or WorkerOptions()).merged(parallel=parallel)
    directory = Path(directory)
    directives = [
        f"--job-name={job_name}",
        "--no-requeue",  # a worker that lost its node is gone: the pool submits another
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={int(cpus_per_worker)}",
    ]
    if partition:
        directives.append(f"--partition={partition}")
    if time:
        directives.append(f"--time={time}")
    directives += [s.strip() for s in sbatch]
    return render_template(
        SCRIPT_TEMPLATE,
        {
            "directives": "\n".join(f"#SBATCH {d}" for d in directives),
            "secret_file": _quote(secret_file),
            "exports": "\n".join(f"export {k}={_quote(v)}" for k, v in env.items()),
            "pool_dir": _quote(directory),
            "python": _quote(python),
            "parallel": str(options.parallel),
            "worker_args": "".join(
                " " + _quote(a) for a in [*options.to_args(leave_out=("parallel",)), *worker_args]
            ),
        },
    )


def _checked_env(env: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(env or {})
    for key in env:
        if not _NAME.fullmatch(key) or key == auth.ENV_SECRET:
            raise ValueError(
                f"env={{{key!r}: ...}}: not a variable the script can export"
                + (
                    " (the secret goes in secret_file=, never into the script)"
                    if key == auth.ENV_SECRET
                    else ""
                )
            )
    return env


def _quote(word) -> str:
    return shlex.quote(str(word))


def _find(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise TorchfeedError(
            f"{name} not found: SlurmPool submits worker jobs with sbatch, so run it on a Slurm login "
            f"or compute node (with Slurm's programs on PATH)"
        )
    return found
