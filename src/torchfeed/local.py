"""Start worker processes on this machine (demos, tests, benchmarks, single-node jobs)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Sequence

from .worker import forkserver
from .worker.forked import ForkedWorker, fork_is_safe
from .worker.group import WorkerGroup
from .worker.options import WorkerOptions
from .worker.process import ENV_SYS_PATH, WorkerProcess

_open: weakref.WeakSet = weakref.WeakSet()  # LocalWorkers not closed yet


@atexit.register
def _close_open_workers() -> None:
    """Workers left running at interpreter exit are stopped cleanly (they would stop anyway)."""
    for workers in list(_open):
        try:
            workers.close(timeout=5.0)
        except Exception:
            pass


def _interpreter_variables(env: dict[str, str] | None) -> list[str]:
    """The variables of ``env`` that a Python interpreter reads when it starts (``PYTHONPATH`` ...)."""
    return sorted(k for k in env or {} if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED")


def _parent_sys_path() -> str:
    """This process's sys.path ('' as the current directory), for the workers to import from."""
    return os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path if isinstance(p, str))


class LocalWorkers:
    """``n`` worker processes on this machine, each on a free loopback port.

    Use as a context manager; ``addresses`` lists their ``host:port``.

    The processes are a :class:`~torchfeed.worker.group.WorkerGroup` this object owns
    (:attr:`group`): all of them start or none (one ``start_timeout`` for all; the error
    names the worker that could not start and why), :meth:`restart` binds a worker's port
    again, and :meth:`close` stops them under one deadline (SIGTERM, then SIGKILL). The
    thread that made this object, or one at a time, calls its methods.

    The workers can import what this process can (they get its ``sys.path``). Their
    output never blocks them: it is read continuously and written to this process's
    stdout and stderr, each line prefixed with ``[worker i host:port]``. They run in a
    session of their own (Ctrl-C in a terminal reaches the trainer only) and stop with
    this process, even if it is killed (they watch a pipe from it).

    Forked workers (``start="auto"`` or ``"forkserver"``) come from this process's fork server
    (:mod:`torchfeed.worker.forkserver`): a clean interpreter, started at the first such
    LocalWorkers and shared by the later ones (:attr:`fork_server`), that imported torch
    once and holds nothing of this process (no trainer objects, no ``TORCHFEED_SECRET`` in
    its environment); it stops with this process, even if it is killed.

    Parameters
    ----------
    n : int
        Number of worker processes.
    parallel : int, optional
        ``--parallel`` of each worker (default ``options.parallel``, 1).
    host : str
        Interface to bind.
    env : dict, optional
        Extra environment variables for the workers (``TORCHFEED_SECRET``, ``PYTHONPATH`` ...).
        ``TORCHFEED_SECRET`` (given here or inherited) is handed to each worker on its
        standard input instead, so it never sits in a worker's environment; without one,
        a process that adopted its secret (a worker, a Dask worker after
        :func:`torchfeed.dask.start_workers`) hands over that one.
    start_timeout : float
        Seconds to wait for every worker to print its address.
    extra_args : sequence of str
        More ``torchfeed worker`` options.
    cache_size : int or str, optional
        ``--cache-size`` of each worker (bytes, or ``"512MiB"``): memory for the decoded
        samples of :func:`torchfeed.cached` datasets (the worker's default 1 GiB if None).
    options : WorkerOptions, optional
        Every other worker option (:class:`torchfeed.worker.options.WorkerOptions`);
        ``parallel`` and ``cache_size``, when given, replace its own.
    stop_timeout : float
        Seconds a worker has to stop after SIGTERM before it is killed (:meth:`close`).
    start : {"auto", "forkserver", "spawn", "fork"}
        How the worker processes start. ``"spawn"``: a new interpreter each, which imports
        torch (a second or more per worker). ``"forkserver"``: forked from the fork server
        (ready in a fraction of a second once it runs; starting it imports torch once; Linux
        only; CUDA in this process does not matter). ``"fork"``: forked from this process, as
        torch's DataLoader starts its workers: they see this process's modules as they are
        now, and hold a copy of all its memory (the secret, credentials, weights) and its
        initial environment, so code sent to them can read those; not after CUDA was
        initialised here. ``"auto"`` (the default): ``"forkserver"`` where there is one (Linux)
        and ``env`` sets no interpreter variable (``PYTHON*``, which only a new interpreter
        reads), else spawn.
    """

    def __init__(
        self,
        n: int = 2,
        *,
        parallel: int | None = None,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        start_timeout: float = 60.0,
        extra_args: Sequence[str] = (),
        cache_size: int | str | None = None,
        options: WorkerOptions | None = None,
        stop_timeout: float = 10.0,
        start: str = "auto",
    ):
        if n < 1:
            raise ValueError(f"need at least one worker, got n={n}")
        from .protocol.auth import ENV_SECRET, ENV_SECRET_FILE, adopted_secret

        if start not in ("auto", "forkserver", "spawn", "fork"):
            raise ValueError(f"LocalWorkers(start={start!r}): use 'auto', 'forkserver', 'spawn' or 'fork'")
        if start == "fork" and not fork_is_safe():
            raise RuntimeError(
                "LocalWorkers(start='fork'): cannot fork workers from this process (not Linux, or CUDA "
                "is initialised here); use start='forkserver' (Linux) or start='spawn'"
            )
        if start == "forkserver" and not forkserver.available():
            raise RuntimeError(
                f"LocalWorkers(start='forkserver'): no fork server on {sys.platform} (Linux only); "
                "use start='spawn'"
            )
        interpreter_variables = _interpreter_variables(env)
        if start in ("fork", "forkserver") and interpreter_variables:
            raise ValueError(
                f"LocalWorkers(start={start!r}, env=...): a forked worker cannot apply "
                f"{', '.join(interpreter_variables)} (only a new interpreter reads them); "
                "use start='spawn'"
            )
        if start == "auto":
            start = "forkserver" if forkserver.available() and not interpreter_variables else "spawn"
        self.start = start
        self.fork = start != "spawn"  # forked (from the fork server or this process), not a new interpreter
        self.host = host
        self.options = (options or WorkerOptions()).merged(parallel=parallel, cache_size=cache_size)
        self.stop_timeout = stop_timeout
        env_ = {**os.environ, ENV_SYS_PATH: _parent_sys_path(), **(env or {})}
        env_.setdefault("PYTHONUNBUFFERED", "1")
        secret = env_.pop(ENV_SECRET, "").encode()  # handed over on stdin, never in their environment
        if not secret and not {ENV_SECRET, ENV_SECRET_FILE} & set(env or {}):
            # a process that adopted its secret (a worker, a Dask worker after start_workers)
            # has none in its environment: its workers get the one it uses
            adopted = adopted_secret()
            secret = adopted.value if adopted is not None else b""
        self.fork_server: forkserver.ForkServer | None = None
        self.group = WorkerGroup(
            n,
            host=host,
            options=self.options,
            extra_args=extra_args,
            secret=secret,
            env=env_,
            new_session=True,
            fork=self.fork,
        )
        self.addresses: list[str] = []  # kept after close()
        _open.add(self)
        try:
            if start == "forkserver":
                self.fork_server = self.group.fork_parent = forkserver.shared(start_timeout)
            self.addresses = self.group.start(start_timeout, stop_timeout=stop_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> list[WorkerProcess]:
        """The workers, in order (each a :class:`~torchfeed.worker.process.WorkerProcess`)."""
        return self.group.processes

    @property
    def processes(self) -> list[subprocess.Popen | ForkedWorker]:
        """The workers' processes, in order (:class:`subprocess.Popen`, or ForkedWorker when forked)."""
        return [w.popen for w in self.workers]

    def restart(self, i: int, timeout: float = 60.0) -> str:
        """Start worker ``i`` again on its old port (after it died or was killed)."""
        if self.fork_server is not None and not self.fork_server.running:  # it died: a new one
            self.fork_server = self.group.fork_parent = forkserver.shared(timeout)
        self.addresses[i] = self.group.restart(i, timeout, self.stop_timeout)
        return self.addresses[i]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        self.group.send_signal(i, sig)

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers (this process's connections to them close first, quietly): SIGTERM,
        and SIGKILL for those still running ``timeout`` seconds later (default ``stop_timeout``)."""
        _open.discard(self)
        if self.addresses:
            from .client.session import close_connections_everywhere

            close_connections_everywhere(self.addresses)  # every session's, not only the default's
        self.group.stop(self.stop_timeout if timeout is None else timeout)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
