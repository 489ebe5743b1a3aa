"""Start worker processes on this machine (demos, tests, benchmarks, single-node jobs)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence


class LocalWorkers:
    """``n`` worker processes on this machine, each on a free loopback port.

    Use as a context manager; ``addresses`` lists their ``host:port``.

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
    start_timeout : float
        Seconds to wait for every worker to print its address.
    """

    def __init__(self, n: int = 2, *, parallel: int = 1, host: str = "127.0.0.1",
                 env: Optional[Dict[str, str]] = None, start_timeout: float = 60.0,
                 extra_args: Sequence[str] = ()):
        if n < 1:
            raise ValueError(f"need at least one worker, got n={n}")
        self.host = host
        self._env = dict(os.environ, **(env or {}))
        self._env.setdefault("PYTHONUNBUFFERED", "1")
        self._args = ["--parallel", str(parallel), *extra_args]
        self.processes: List[subprocess.Popen] = []
        self.addresses: List[str] = []
        try:
            for _ in range(n):
                self.processes.append(self._spawn(0))
            self.addresses = [self._read_address(p, start_timeout) for p in self.processes]
        except BaseException:
            self.close()
            raise

    def _spawn(self, port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torchfeed", "worker", "--host", self.host, "--port", str(port), *self._args]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, env=self._env, text=True)

    @staticmethod
    def _read_address(proc: subprocess.Popen, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if sel.select(timeout=0.1):
                    line = proc.stdout.readline()
                    if line:
                        return line.strip()
                if proc.poll() is not None:
                    raise RuntimeError(f"worker process exited with code {proc.returncode} before it was ready")
            raise TimeoutError(f"worker process did not print its address within {timeout:g} s")
        finally:
            sel.close()

    def restart(self, i: int, timeout: float = 60.0) -> str:
        """Start worker ``i`` again on its old port (after it died or was killed)."""
        old = self.processes[i]
        if old.poll() is None:
            old.kill()
            old.wait()
        port = int(self.addresses[i].rsplit(":", 1)[1])
        self.processes[i] = self._spawn(port)
        self.addresses[i] = self._read_address(self.processes[i], timeout)
        return self.addresses[i]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        self.processes[i].send_signal(sig)

    def close(self, timeout: float = 10.0) -> None:
        for p in self.processes:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.terminate()
                except ProcessLookupError:
                    pass
        for p in self.processes:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()

    def __enter__(self) -> "LocalWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
