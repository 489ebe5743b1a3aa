"""The fork server: a clean process that forks workers, so that they never hold the trainer's memory.

A worker forked from the trainer starts in milliseconds, but holds a copy of everything the
trainer holds (credentials, model weights, the secret) and starts with the trainer's
environment block (``/proc/PID/environ``, ``TORCHFEED_SECRET`` included when the trainer was
started with it): code that runs on the worker, which anyone holding the secret can send,
could read all of it. A :class:`ForkServer` keeps the fast start without that: a new
interpreter (``python -m torchfeed.worker.forkserver``), started with this process's
environment less ``TORCHFEED_SECRET``, imports torch, numpy and the worker's modules once and
then forks each worker (:class:`~torchfeed.worker.forked.ForkedWorker` with ``parent=``) from
that state, which holds nothing of the trainer.

The channel is one end of a Unix socket pair, inherited when the server starts (nothing in
the filesystem, no port): length-prefixed JSON messages. This process asks ``fork`` (the
worker's arguments, environment, session and directory; its three pipe ends travel as
``SCM_RIGHTS``) and ``signal``; the server answers ``ready`` once, then ``forked`` (the pid)
or ``failed`` (why) to each ``fork``, and reports ``exit`` (pid, exit status) for each child
it reaps. The secret never crosses it: :class:`~torchfeed.worker.process.WorkerProcess`
writes it on the worker's stdin pipe, whose ends only this process and the worker hold; the
server holds no end of the workers' pipes after the fork.

This module holds the trainer's side (:class:`ForkServer`, the :func:`shared` server) and the
``python -m`` entry; the server process's loop is :mod:`torchfeed.worker.forkloop`, and
the channel's messages are framed by :mod:`torchfeed.worker.forkchannel`.

NOTE [processes, threads and shutdown]

* The **server process** runs on one thread: it waits (``select``) on the channel, on a
  wakeup pipe that SIGCHLD and SIGTERM write to, and on a pidfd of this process; it forks on
  request, reaps its children (only it can: it is their parent, so no pid it signals has been
  reused) and reports their ends. It runs in a session of its own (a terminal's Ctrl-C reaches
  the trainer only) and ignores SIGINT.
* Its **children** are the workers (:func:`~torchfeed.worker.forked.become_worker`): each
  watches its stdin pipe, held by this process, and ends with it as a spawned worker does.
* In this process, one **reader thread** per server (``torchfeed-forkserver``, a daemon)
  reads the answers and the exit reports, and a :class:`~torchfeed.pumps.Pump` forwards the
  server's stderr prefixed ``[torchfeed fork server]``.
* The server stops when its channel ends: :meth:`ForkServer.stop` closes this end (the
  shared server stops at interpreter exit, after :class:`torchfeed.LocalWorkers` closed its
  workers), and the end closes with this process however it ends, SIGKILL included. Should a
  process forked from this one keep a copy of that end open (a child forked by Python closes
  its copy, see below; one forked by C code does not), the server still notices that its
  parent ended (the pidfd, or ``getppid`` once a second). It then SIGTERMs the workers it
  still has, SIGKILLs those left after :data:`STOP_GRACE` seconds, reaps and reports them,
  and exits. SIGTERM to the server does the same. Not ``PR_SET_PDEATHSIG``: it fires when
  the *thread* that started the server ends, and a LocalWorkers may be made on any thread.
* A server that was killed leaves its workers running until their trainer closes them;
  signals then go to them by pid, and one that ended reads as exit status 255 (lost).
* A child forked from this process forgets the shared server (``os.register_at_fork``); its
  own first LocalWorkers starts a server of its own.

Linux only (:func:`available`).
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..protocol.auth import ENV_SECRET
from ..pumps import Pump, to_stderr
from ..util import pid_alive
from .forkchannel import receive, send
from .forkloop import STOP_GRACE, main

MODULE = "torchfeed.worker.forkserver"
FORK_TIMEOUT = 60.0  # seconds to wait for the answer to a fork
LOST = 255  # the exit status of a worker whose server died before it reported it
_PUMP_JOIN = 2.0


def available() -> bool:
    """Whether workers can be forked by a fork server here (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


# -- the trainer's side -------------------------------------------------------------------------


class ForkServer:
    """A started fork server and this process's end of its channel (a
    :class:`~torchfeed.worker.forked.Parent` for :class:`~torchfeed.worker.forked.ForkedWorker`).

    Starting it waits up to ``start_timeout`` seconds for it to import torch. Most code uses
    the one :func:`shared` server of this process. See the module's NOTE for its life.
    """

    def __init__(self, *, start_timeout: float = 120.0):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k != ENV_SECRET}  # nor does a worker's
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", MODULE, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.process.pid
        self._sock = ours
        self._err = Pump(  # held until it is ready: a failed start says it in its error
            self.process.stderr,
            to_stderr,
            "[torchfeed fork server] ",
            name="torchfeed-forkserver-err",
            hold=True,
        )
        self._send_lock = threading.Lock()
        self._fork_lock = threading.Lock()  # one fork request at a time: answers come in order
        self._seq = 0  # the last fork request's number
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._statuses: dict[int, int] = {}
        self._status_lock = threading.Lock()
        self.ended = False  # the channel ended: the server stopped or died
        self._stopped = False
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.stop(timeout=0.0)
            raise
        self._err.release()
        self._reader = threading.Thread(target=self._read, name="torchfeed-forkserver", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float) -> None:
        self._sock.settimeout(timeout)
        try:
            message, _ = receive(self._sock)
        except TimeoutError:
            raise TimeoutError(
                f"the torchfeed fork server did not start in {timeout:g} s (importing torch); "
                "give LocalWorkers a longer start_timeout, or use start='spawn'"
            ) from None
        finally:
            self._sock.settimeout(None)
        if message is None or message.get("op") != "ready":
            code = self.process.wait()
            self._err.join(_PUMP_JOIN)
            shown = "\n".join(line for line in self._err.tail if line.strip())
            raise RuntimeError(
                f"the torchfeed fork server ended before it was ready (exit code {code})"
                + (f"; its stderr ends with:\n{shown}\n" if shown else "; ")
                + f"check that `{sys.executable} -m {MODULE}` can import torch and torchfeed, "
                "or use LocalWorkers(start='spawn')"
            )

    def _read(self) -> None:
        try:
            while True:
                message, _ = receive(self._sock)
                if message is None:
                    break
                if message["op"] == "exit":
                    with self._status_lock:
                        self._statuses[message["pid"]] = message["code"]
                else:
                    self._answers.put(message)
        except (OSError, ValueError):  # closed under us (stop) or not our format: the channel is over
            pass
        finally:
            self.ended = True
            self._answers.put(None)  # wakes a fork waiting for its answer

    def fork_worker(
        self, args: Sequence[str], env: Mapping[str, str], new_session: bool, fds: tuple[int, int, int]
    ) -> int:
        self._seq += 1
        request = {
            "op": "fork",
            "seq": self._seq,  # echoed: an answer to a request that timed out is told apart
            "args": list(args),
            "env": dict(env),
            "new_session": new_session,
            "cwd": os.getcwd(),
        }
        with self._fork_lock:
            if self.ended:
                raise RuntimeError(self._gone())
            with self._send_lock:
                send(self._sock, request, fds)
            deadline = time.monotonic() + FORK_TIMEOUT
            while True:
                try:
                    answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"the torchfeed fork server did not fork a worker in {FORK_TIMEOUT:g} s"
                    ) from None
                if answer is None or answer.get("seq") == request["seq"]:
                    break  # (an answer to an earlier request that gave up waiting is dropped)
        if answer is None:
            raise RuntimeError(self._gone())
        if answer["op"] != "forked":
            raise OSError(f"the torchfeed fork server could not fork a worker: {answer.get('error')}")
        return int(answer["pid"])

    def _gone(self) -> str:
        return (
            f"the torchfeed fork server (pid {self.pid}) has ended ({self.process.poll()!r}); "
            "a new LocalWorkers starts another one"
        )

    def exit_status(self, pid: int) -> int | None:
        ended = self.ended  # read first: the reader records every report before it sets it
        with self._status_lock:
            code = self._statuses.pop(pid, None)
        if code is not None:
            return code
        if ended and not pid_alive(pid):  # the server died before it reported this one
            return LOST
        return None

    def signal_worker(self, pid: int, sig: int) -> None:
        if not self.ended:
            try:
                with self._send_lock:
                    send(self._sock, {"op": "signal", "pid": pid, "sig": int(sig)})
                return
            except OSError:  # it just ended
                pass
        if pid_alive(pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    @property
    def running(self) -> bool:
        """Whether it can still fork workers."""
        return not self.ended and not self._stopped

    def stop(self, timeout: float = STOP_GRACE + 5.0) -> None:
        """End its channel: it stops its remaining workers (SIGTERM, SIGKILL after
        :data:`STOP_GRACE` s) and exits; SIGKILL if it is still there ``timeout`` s later."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the server reads the end; its last reports still come
        except OSError:
            pass
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(timeout)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._err.join(_PUMP_JOIN)
        self._sock.close()
        if self.process.stderr is not None:
            self.process.stderr.close()

    def forget(self) -> None:
        """In a child forked from the process that started it: drop this copy of the channel
        (its descriptors close here only; the server goes on serving the parent)."""
        self._stopped = True
        self.ended = True
        self._sock.close()
        if self.process.stderr is not None:
            try:
                self.process.stderr.close()
            except OSError:
                pass


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared(start_timeout: float = 120.0) -> ForkServer:
    """This process's fork server, started at the first call (again if it ended since)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.running:
            if _shared is not None:
                _shared.stop(timeout=0.0)
            _shared = ForkServer(start_timeout=start_timeout)
        return _shared


@atexit.register
def _stop_shared() -> None:
    if _shared is not None:
        _shared.stop()


def _forget_in_child() -> None:
    global _shared, _shared_lock
    _shared_lock = threading.Lock()
    if _shared is not None:
        _shared.forget()
        _shared = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
