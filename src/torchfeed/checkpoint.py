"""Atomic checkpoints and preemption handling for jobs that requeue themselves.

``save(obj, path_or_url)`` never leaves a half-written checkpoint where ``load`` looks:
on local disk it writes a temporary file in the same directory, flushes and fsyncs it,
then renames it over the target (and fsyncs the directory); other fsspec URLs
(``s3://``, ``memory://`` ...) are written to a temporary name and moved into place.

:class:`Preemption` turns the warning signal a scheduler sends before the time limit
(``USR2`` by default; ``torchfeed slurm --signal`` chooses it) into a flag the training
loop checks between steps, so the checkpoint is written in normal code rather than in
a signal handler; :meth:`Preemption.requeue` then puts the Slurm job back in the queue::

    pre = Preemption()
    for step, batch in enumerate(loader, start):
        ...
        if pre.should_stop():                      # every rank agrees on the same step
            if rank == 0:
                checkpoint.save({"model": ..., "optimizer": ..., "loader": loader.state_dict()}, path)
            pre.requeue()                          # rank 0 runs `scontrol requeue $SLURM_JOB_ID`
            break
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import TorchfeedError
from .util import atomic_write

log = logging.getLogger("torchfeed.checkpoint")

PathOrURL = str | os.PathLike
ENV_SIGNAL = "TORCHFEED_PREEMPT_SIGNAL"


def _local_path(path_or_url: PathOrURL) -> Path | None:
    text = os.fspath(path_or_url)
    if "://" not in text:
        return Path(text)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    return None


def _fs(url: str, storage_options: dict[str, Any] | None):
    try:
        import fsspec
    except ImportError:
        raise TorchfeedError(
            f"saving to {url!r} needs fsspec: pip install fsspec (plus s3fs, gcsfs, ... for the storage)"
        ) from None
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-{socket.gethostname()}-"


def _remove_stale_temps(path: Path) -> None:
    """Delete temporary files left by saves on this host whose process died (killed mid-save)."""
    prefix = _temp_prefix(path)
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(path.parent / name)
            except OSError:
                pass


def save(obj: Any, path_or_url: PathOrURL, *, storage_options: dict[str, Any] | None = None) -> None:
    """Save ``obj`` with ``torch.save``, atomically: readers see the old file or the new one.

    Parameters
    ----------
    obj : object
        What to save (state dicts, tensors, plain Python data).
    path_or_url : str or path
        Local path (parent directories are created) or an fsspec URL.
    storage_options : dict, optional
        Passed to fsspec for URLs.
    """
    import torch

    local = _local_path(path_or_url)
    if local is None:
        fs, target = _fs(os.fspath(path_or_url), storage_options)
        tmp = f"{target}.tmp-{secrets.token_hex(6)}"
        try:
            with fs.open(tmp, "wb") as f:
                torch.save(obj, f)
            fs.mv(tmp, target)
        except BaseException:
            try:
                fs.rm(tmp)
            except Exception:  # noqa: BLE001 - best effort; the target is untouched either way
                pass
            raise
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(local)
    atomic_write(local, lambda f: torch.save(obj, f), temp_prefix=_temp_prefix(local))


def load(
    path_or_url: PathOrURL,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Load a checkpoint written by :func:`save`.

    Parameters
    ----------
    path_or_url : str or path
        Local path or fsspec URL.
    map_location : optional
        As in ``torch.load`` (default: everything on the CPU).
    weights_only : bool
        ``torch.load``'s safe mode, as torch's own default: tensors, containers, numbers,
        strings and bytes load (model, optimizer and loader states do), and a crafted file
        runs no code. Pass False only for a checkpoint you wrote that holds objects of your
        own classes (or allow them with ``torch.serialization.add_safe_globals``).
    storage_options : dict, optional
        Passed to fsspec for URLs.
    """
    import torch

    local = _local_path(path_or_url)
    if local is not None:
        if not local.exists():
            raise FileNotFoundError(f"no checkpoint at {local}")
        return torch.load(local, map_location=map_location, weights_only=weights_only)
    fs, target = _fs(os.fspath(path_or_url), storage_options)
    if not fs.exists(target):
        raise FileNotFoundError(f"no checkpoint at {path_or_url}")
    with fs.open(target, "rb") as f:
        data = f.read()
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)


def exists(path_or_url: PathOrURL, *, storage_options: dict[str, Any] | None = None) -> bool:
    """True when a checkpoint is at ``path_or_url`` (to decide whether to resume)."""
    local = _local_path(path_or_url)
    if local is not None:
        return local.is_file()
    fs, target = _fs(os.fspath(path_or_url), storage_options)
    return fs.exists(target)


def _signal_number(sig: int | str) -> int:
    if isinstance(sig, int):
        return sig
    name = sig.strip().upper()
    num = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
    if not isinstance(num, int):
        raise ValueError(f"unknown signal {sig!r}: use a name such as 'USR2' or 'SIGUSR1'")
    return int(num)


class Preemption:
    """Turn preemption / time-limit warning signals into a flag checked by the training loop.

    The handler only records the signal; checkpointing happens in normal code. Use it as
    a context manager (or call :meth:`close`) to restore the previous handlers.

    Parameters
    ----------
    signals : sequence of int or str, optional
        Signals to catch. Default: ``TORCHFEED_PREEMPT_SIGNAL`` (set by scripts from
        ``torchfeed slurm``), else ``SIGUSR2``.
    requeue : bool
        Whether :meth:`requeue` asks Slurm to requeue the job.
    """

    def __init__(self, signals: Sequence[int | str] | None = None, *, requeue: bool = True):
        if signals is None:
            signals = [os.environ.get(ENV_SIGNAL) or "USR2"]
        if threading.current_thread() is not threading.main_thread():
            raise TorchfeedError(
                "Preemption must be created in the main thread (Python delivers signals there)"
            )
        self.signals = [_signal_number(s) for s in signals]
        self.do_requeue = requeue
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    @property
    def requested(self) -> bool:
        """True once this process has received one of the signals."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Whether to checkpoint and stop now; with torch.distributed, agreed by all ranks.

        When a process group is initialised this is a collective (a one-element
        all-reduce): every rank must call it at the same points, and all get the same
        answer even though the signal reaches them at slightly different times.
        """
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def requeue(self, job_id: str | None = None, *, timeout: float = 60.0) -> bool:
        """Requeue the Slurm job (``scontrol requeue``) from rank 0, after all ranks got here.

        Call it after the checkpoint is saved. Slurm then ends this run and starts the job
        again from the top (the same job id and job directory), where the training script
        loads the checkpoint. Returns True when the requeue was requested by this process.
        """
        import torch.distributed as dist

        from .cluster.env import environment

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            rank = dist.get_rank()
        else:
            rank = environment().rank
        if rank != 0 or not self.do_requeue:
            return False
        job_id = job_id or os.environ.get("SLURM_JOB_ID")
        if not job_id:
            log.warning("not running under Slurm (no SLURM_JOB_ID): nothing to requeue")
            return False
        try:
            done = subprocess.run(
                ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.error("could not requeue job %s: %s", job_id, exc)
            return False
        if done.returncode != 0:
            log.error(
                "`scontrol requeue %s` failed: %s (is the job requeueable? sbatch --requeue)",
                job_id,
                done.stderr.strip(),
            )
            return False
        log.warning("job %s requeued after preemption signal %s", job_id, self.received)
        return True

    def close(self) -> None:
        """Restore the signal handlers that were there before."""
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
