"""A ``torchfeed worker`` forked, not started: no interpreter start, no ``import torch``.

:class:`ForkedWorker` offers the part of :class:`subprocess.Popen` that
:class:`~torchfeed.worker.process.WorkerProcess` uses (``pid``, the three pipes, ``poll``,
``wait``, ``send_signal``, ``kill``, ``returncode``), for a child made with :func:`os.fork`
that runs ``torchfeed worker`` in a copy of an interpreter that imported torch already. A
child started this way is ready in milliseconds, where a new interpreter spends a second or
more importing torch. Who forks it:

- a fork server (``parent=``, a :class:`Parent`: :mod:`torchfeed.worker.forkserver`), a clean
  process that holds none of this process's memory and no secret in its environment; it
  forks, signals and reaps the child, and reports its exit status (LocalWorkers
  ``start='forkserver'``/``'auto'``);
- or this process itself (no ``parent``), as torch's DataLoader forks its workers: the child
  holds a copy of everything this process holds, and starts with its environment block
  (``/proc/PID/environ``) (LocalWorkers ``start='fork'``).

Either way, this process makes the three pipes, and the child, before it serves
(:func:`become_worker`):

- its standard streams become those pipes, with new ``sys.stdin``/``stdout``/``stderr``
  objects (the forking process's may have been locked by another thread at the fork);
- every other inherited descriptor is pointed at ``/dev/null``: the parent's sockets and pipes
  are not held open there (a peer sees their end when the parent closes them, a sibling's
  ``--watch-stdin`` pipe ends with the parent), and an inherited Python object that closes its
  descriptor later closes ``/dev/null``, never a descriptor the child opened since;
- signal handlers, the signal wakeup descriptor, alarms and the root logger's handlers go back
  to their defaults;
- the client sessions forget their connections (:mod:`torchfeed.client.session` registers that
  with ``os.register_at_fork``).

The rules of forking from this process apply as for torch's workers: CUDA must not be
initialised here (:func:`fork_is_safe`), and the child sees this process's modules as they
were at the fork. A fork server has neither concern: it never initialises CUDA, and its
children import what they need from the ``sys.path`` they are given.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import NoReturn, Protocol

_POLL = 0.01  # seconds between two looks at a child that has not ended yet (wait)


def fork_is_safe() -> bool:
    """Whether a worker may be forked from this process: Linux, and CUDA not initialised here."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return False
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return False
        except Exception:  # noqa: BLE001 - a torch without CUDA support: nothing to protect
            pass
    return True


class Parent(Protocol):
    """The process that forks, signals and reaps a :class:`ForkedWorker` for this one (a fork server)."""

    def fork_worker(
        self, args: Sequence[str], env: Mapping[str, str], new_session: bool, fds: tuple[int, int, int]
    ) -> int:
        """Fork a child that runs :func:`become_worker` with ``fds`` (its stdin, stdout and
        stderr, which the caller closes afterwards); its pid."""
        ...

    def exit_status(self, pid: int) -> int | None:
        """Child ``pid``'s exit status once it ended (as :attr:`subprocess.Popen.returncode`), else None."""
        ...

    def signal_worker(self, pid: int, sig: int) -> None:
        """Send ``sig`` to child ``pid`` unless it ended."""
        ...


class ForkedWorker:
    """A child forked to run ``torchfeed worker args`` (the arguments after ``torchfeed``),
    here, or by ``parent`` when given (see the module's docstring)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        new_session: bool,
        parent: Parent | None = None,
    ):
        self.args = list(args)
        self.returncode: int | None = None
        self.parent = parent
        child_in, parent_in = os.pipe()
        parent_out, child_out = os.pipe()
        parent_err, child_err = os.pipe()
        try:
            if parent is not None:
                pid = parent.fork_worker(self.args, env, new_session, (child_in, child_out, child_err))
            else:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the child never returns from here
                    become_worker(self.args, dict(env), new_session, child_in, child_out, child_err)
        except BaseException:
            for fd in (parent_in, parent_out, parent_err):
                os.close(fd)
            raise
        finally:
            for fd in (child_in, child_out, child_err):
                os.close(fd)
        self.pid = pid
        self.stdin = open(parent_in, "wb", buffering=0)  # noqa: SIM115 - closed by WorkerProcess
        self.stdout = open(parent_out, "rb", buffering=0)  # noqa: SIM115
        self.stderr = open(parent_err, "rb", buffering=0)  # noqa: SIM115

    def poll(self) -> int | None:
        """Its exit status (reaping it; negative: the signal that ended it), or None while it runs."""
        if self.returncode is None and self.parent is not None:
            self.returncode = self.parent.exit_status(self.pid)
        elif self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            if self.parent is not None:
                self.parent.signal_worker(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _blank_inherited_descriptors() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != null:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:  # the listing's own descriptor, closed already
                pass
    os.close(null)


def become_worker(
    args: list[str],
    env: dict[str, str],
    new_session: bool,
    stdin: int,
    stdout: int,
    stderr: int,
    cwd: str | None = None,
) -> NoReturn:
    """In a child just forked: run ``torchfeed worker args`` with ``env`` as its environment,
    ``stdin``/``stdout``/``stderr`` as its standard streams and ``cwd`` (if given) as its
    directory; never returns (the process ends with the worker's exit code)."""
    code = 1
    try:
        if new_session:
            os.setsid()
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        if cwd is not None:
            os.chdir(cwd)  # a failure is said on its stderr (the pipe now)
        _blank_inherited_descriptors()
        signal.alarm(0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.set_wakeup_fd(-1)
        for sig in (
            signal.SIGTERM,
            signal.SIGHUP,
            signal.SIGALRM,
            signal.SIGUSR1,
            signal.SIGUSR2,
            signal.SIGCHLD,
        ):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.environ.clear()
        os.environ.update(env)
        import logging

        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        import runpy

        sys.argv = ["torchfeed", *args]  # what `python -m torchfeed ...` runs, in this interpreter
        runpy.run_module("torchfeed", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - said on its stderr; the parent reads it
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
