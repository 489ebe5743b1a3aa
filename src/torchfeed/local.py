"""Start worker processes on this machine (demos, tests, benchmarks, single-node jobs)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence

from .pumps import Pump, to_stderr, to_stdout

ENV_SYS_PATH = "TORCHFEED_SYS_PATH"  # the parent's sys.path, read by `torchfeed worker` for imports

_open: weakref.WeakSet = weakref.WeakSet()  # LocalWorkers not closed yet


@atexit.register
def _close_open_workers() -> None:
    """Workers left running at interpreter exit are stopped cleanly (they would stop anyway)."""
    for workers in list(_open):
        try:
            workers.close(timeout=5.0)
        except Exception:
            pass


def _parent_sys_path() -> str:
    """This process's sys.path ('' as the current directory), for the workers to import from."""
    return os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path if isinstance(p, str))


class LocalWorkers:
    """``n`` worker processes on this machine, each on a free loopback port.

    Use as a context manager; ``addresses`` lists their ``host:port``.

    The workers can import what this process can (they get its ``sys.path``). Their
    output never blocks them: it is read continuously and written to this process's
    stdout and stderr, each line prefixed with ``[worker i host:port]``. They run in a
    session of their own (Ctrl-C in a terminal reaches the trainer only) and stop with
    this process, even if it is killed (they watch a pipe from it).

    Parameters
    ----------
    n : int
        Number of worker processes.
    parallel : int
        ``--parallel`` of each worker.
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
    """

    def __init__(
        self,
        n: int = 2,
        *,
        parallel: int = 1,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        start_timeout: float = 60.0,
        extra_args: Sequence[str] = (),
        cache_size: int | str | None = None,
    ):
        if n < 1:
            raise ValueError(f"need at least one worker, got n={n}")
        from .protocol.auth import ENV_SECRET, ENV_SECRET_FILE, adopted_secret, handover_line

        self.host = host
        self._env = {**os.environ, ENV_SYS_PATH: _parent_sys_path(), **(env or {})}
        self._env.setdefault("PYTHONUNBUFFERED", "1")
        self._args = ["--parallel", str(parallel), "--watch-stdin", *extra_args]
        if cache_size is not None:
            from .worker.samplestore import parse_size

            self._args += ["--cache-size", str(parse_size(cache_size))]
        secret = self._env.pop(ENV_SECRET, "").encode()  # not inherited by what dataset code starts
        if not secret and not {ENV_SECRET, ENV_SECRET_FILE} & set(env or {}):
            # a process that adopted its secret (a worker, a Dask worker after start_workers)
            # has none in its environment: its workers get the one it uses
            adopted = adopted_secret()
            secret = adopted.value if adopted is not None else b""
        self._secret_line = handover_line(secret) if secret else b""
        if secret:
            self._args.append("--secret-on-stdin")
        self.processes: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self._pumps: list[tuple] = []
        _open.add(self)
        try:
            for i in range(n):
                self._spawn(i, 0)
            self.addresses = [self._read_address(i, start_timeout) for i in range(n)]
        except BaseException:
            self.close()
            raise

    def _spawn(self, i: int, port: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torchfeed",
            "worker",
            "--host",
            self.host,
            "--port",
            str(port),
            *self._args,
        ]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env,
            start_new_session=True,
        )
        if self._secret_line:
            assert proc.stdin is not None  # stdin=PIPE
            try:
                proc.stdin.write(self._secret_line)
                proc.stdin.flush()
            except OSError:
                pass  # it died at once: _read_address reports its stderr
        pumps = (
            Pump(proc.stdout, to_stdout, f"[worker {i}] ", first_line=True, name=f"torchfeed-worker-{i}-out"),
            Pump(proc.stderr, to_stderr, f"[worker {i}] ", name=f"torchfeed-worker-{i}-err"),
        )
        if i < len(self.processes):
            self.processes[i], self._pumps[i] = proc, pumps
        else:
            self.processes.append(proc)
            self._pumps.append(pumps)

    def _read_address(self, i: int, timeout: float) -> str:
        proc, (out, err) = self.processes[i], self._pumps[i]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            address = out.wait_first_line(0.1)
            if address:
                out.prefix = err.prefix = f"[worker {i} {address}] "
                return address
            if proc.poll() is not None:
                err.join(2.0)
                tail = "\n".join(err.tail)
                raise RuntimeError(
                    f"worker process {i} exited with code {proc.returncode} before it was ready"
                    + (f"; its stderr ends with:\n{tail}" if tail else "")
                )
        raise TimeoutError(f"worker process {i} did not print its address within {timeout:g} s")

    def restart(self, i: int, timeout: float = 60.0) -> str:
        """Start worker ``i`` again on its old port (after it died or was killed)."""
        old = self.processes[i]
        if old.poll() is None:
            old.kill()
            old.wait()
        self._close_pipes(i)
        port = int(self.addresses[i].rsplit(":", 1)[1])
        self._spawn(i, port)
        self.addresses[i] = self._read_address(i, timeout)
        return self.addresses[i]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        self.processes[i].send_signal(sig)

    def _close_pipes(self, i: int) -> None:
        proc = self.processes[i]
        for pump in self._pumps[i]:
            pump.join(2.0)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream:
                try:
                    stream.close()
                except OSError:
                    pass

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (this process's connections to them close first, quietly)."""
        _open.discard(self)
        if self.addresses:
            from .client.session import close_connections_everywhere

            close_connections_everywhere(self.addresses)  # every session's, not only the default's
        for p in self.processes:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.terminate()
                except ProcessLookupError:
                    pass
        for i, p in enumerate(self.processes):
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            self._close_pipes(i)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
