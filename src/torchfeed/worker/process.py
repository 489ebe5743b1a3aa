"""One ``torchfeed worker`` child process, seen from the process that started it.

:class:`WorkerProcess` is the one way torchfeed starts a worker process (``torchfeed worker
--procs N``, :class:`torchfeed.LocalWorkers`, :func:`torchfeed.dask.start_workers`). It

- starts the child with its three standard streams on pipes; the secret, when given, is the
  first line on its stdin (``--secret-on-stdin``), and the pipe stays open: a child started
  with ``--watch-stdin`` ends when its parent does, even one killed with no chance to clean up;
- reads its address, the first line of its stdout (:meth:`WorkerProcess.wait_address`);
- drains both of its output pipes to their end on two :class:`torchfeed.pumps.Pump` threads,
  owned by this object, which forward each line with a prefix (:meth:`WorkerProcess.label`)
  to this process's stdout and stderr: a child never blocks on a full pipe, whatever its
  dataset prints;
- stops it (:meth:`WorkerProcess.stop`): SIGTERM, then SIGKILL after an explicit timeout, and
  reaps it, so that no zombie is left; its pipes are closed once the pumps read their end.

No torch here: the command line imports it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from ..protocol.auth import handover_line
from ..pumps import Pump, to_stderr, to_stdout
from .forked import ForkedWorker, Parent
from .options import WorkerOptions

ENV_SYS_PATH = "TORCHFEED_SYS_PATH"  # a parent's sys.path, for `torchfeed worker` to import from
PUMP_JOIN = 2.0  # seconds the pumps get to read what a process that ended left in its pipes


class WorkerExited(RuntimeError):
    """The worker process ended before it printed its address."""

    def __init__(self, message: str, returncode: int, tail: list[str]):
        super().__init__(message)
        self.returncode = returncode
        self.tail = tail


def worker_command(
    host: str, port: int, options: WorkerOptions, *extra: str, python: str = sys.executable
) -> list[str]:
    """``python -m torchfeed worker`` on ``host:port`` with ``options`` and more arguments
    (``extra``), ending with its parent (``--watch-stdin``)."""
    return [
        python,
        "-m",
        "torchfeed",
        "worker",
        "--host",
        host,
        "--port",
        str(port),
        "--watch-stdin",
        *options.to_args(),
        *extra,
    ]


def exit_reason(returncode: int) -> str:
    """``"exited with code 3"``, or ``"was killed by signal SIGKILL"`` (a ``Popen.returncode``)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


class WorkerProcess:
    """A started ``torchfeed worker`` process: its address, its output forwarded, its stop.

    Parameters
    ----------
    argv : sequence of str
        The command (:func:`worker_command` makes one).
    name : str
        How messages and the output's prefix name it (``"worker 0"``).
    secret : bytes
        Handed over as the first line of its stdin (with ``--secret-on-stdin`` in ``argv``);
        empty: nothing is written.
    env : mapping, optional
        Its environment (default: this process's).
    new_session : bool
        Start it in a session of its own (a terminal's Ctrl-C reaches this process only).
    out, err : callable
        Where its stdout (after the address line) and its stderr lines go, looked up at each
        write (default: this process's ``sys.stdout`` and ``sys.stderr``).
    hold_errors : bool
        Keep its stderr lines until :meth:`release_errors` (a caller that reports a failed
        start in one line of its own).
    fork : bool
        Fork it (:class:`~torchfeed.worker.forked.ForkedWorker`) instead of starting a new
        interpreter; ``argv`` must then be a :func:`worker_command`.
    fork_parent : Parent, optional
        With ``fork``: the process that forks it (a fork server,
        :mod:`torchfeed.worker.forkserver`); by default this one.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        secret: bytes = b"",
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
        out: Callable[[], TextIO] = to_stdout,
        err: Callable[[], TextIO] = to_stderr,
        hold_errors: bool = False,
        fork: bool = False,
        fork_parent: Parent | None = None,
    ):
        self.name = name
        self.address: str | None = None
        self.popen: subprocess.Popen | ForkedWorker
        if fork:
            if list(argv[1:3]) != ["-m", "torchfeed"]:
                raise ValueError(
                    f"only a `python -m torchfeed ...` command can be forked, got {list(argv)!r}"
                )
            self.popen = ForkedWorker(
                argv[3:],
                env=os.environ if env is None else env,
                new_session=new_session,
                parent=fork_parent,
            )
        else:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=None if env is None else dict(env),
                start_new_session=new_session,
            )
        self.pid = self.popen.pid
        if secret:
            assert self.popen.stdin is not None  # stdin=PIPE
            try:
                self.popen.stdin.write(handover_line(secret))
                self.popen.stdin.flush()
            except OSError:
                pass  # it died at once: wait_address says so, with its stderr
        prefix = f"[{name}] "
        self._out = Pump(self.popen.stdout, out, prefix, first_line=True, name=f"torchfeed-{name}-out")
        self._err = Pump(self.popen.stderr, err, prefix, name=f"torchfeed-{name}-err", hold=hold_errors)
        self._closed = False

    def wait_address(self, timeout: float, interrupted: Callable[[], bool] | None = None) -> str:
        """Its ``host:port`` line. Raises :class:`WorkerExited` (with the end of its stderr) if it
        ends first, TimeoutError after ``timeout`` seconds, InterruptedError once ``interrupted()``."""
        deadline = time.monotonic() + timeout
        while True:
            address = self._out.wait_first_line(min(0.1, max(0.0, deadline - time.monotonic())))
            if address:
                self.address = address
                return address
            code = self.popen.poll()
            if code is not None:
                self._err.join(PUMP_JOIN)
                tail = [line for line in self._err.tail if line.strip()]
                shown = "\n".join(tail)
                raise WorkerExited(
                    f"{self.name} {exit_reason(code)} before it was ready"
                    + (f"; its stderr ends with:\n{shown}" if shown else ""),
                    code,
                    tail,
                )
            if interrupted is not None and interrupted():
                raise InterruptedError(f"{self.name}: interrupted before it was ready")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} did not print its address in time ({timeout:g} s)")

    def label(self, prefix: str) -> None:
        """Prefix its output lines from now on with ``prefix``."""
        self._out.prefix = self._err.prefix = prefix

    def release_errors(self) -> None:
        """Write the stderr lines held so far (``hold_errors``) and forward from now on."""
        self._err.release()

    def poll(self) -> int | None:
        """Its exit status (reaping it), or None while it runs."""
        return self.popen.poll()

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM; SIGCONT first, for a stopped one); :meth:`stop` waits."""
        self.send_signal(signal.SIGCONT)
        self.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> int:
        """Stop it: SIGTERM, SIGKILL when it is still there ``timeout`` seconds later; reap it and
        close its pipes. Returns its exit status."""
        self.terminate()
        return self.reap(timeout)

    def reap(self, timeout: float) -> int:
        """Wait ``timeout`` seconds for it to end (SIGKILL after that), then close its pipes."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self.close()
        assert self.popen.returncode is not None
        return self.popen.returncode

    def close(self) -> None:
        """Close its pipes once it ended (the pumps get :data:`PUMP_JOIN` seconds to read theirs)."""
        if self._closed:
            return
        self._closed = True
        self._out.join(PUMP_JOIN)
        self._err.join(PUMP_JOIN)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def stderr_tail(self) -> list[str]:
        """Its last stderr lines (for error messages)."""
        return list(self._err.tail)
