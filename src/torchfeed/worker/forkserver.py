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
import json
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..protocol.auth import ENV_SECRET
from ..pumps import Pump, to_stderr
from ..util import pid_alive
from .forked import become_worker

MODULE = "torchfeed.worker.forkserver"
STOP_GRACE = 5.0  # seconds the server gives its workers after SIGTERM, when it stops, before SIGKILL
FORK_TIMEOUT = 60.0  # seconds to wait for the answer to a fork
LOST = 255  # the exit status of a worker whose server died before it reported it
_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 64 << 20  # bytes: a request is a worker's arguments and environment
_PARENT_CHECK = 1.0  # seconds between two looks at the server's parent (no pidfd)
_PUMP_JOIN = 2.0


def available() -> bool:
    """Whether workers can be forked by a fork server here (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


# -- the channel: length-prefixed JSON, descriptors as SCM_RIGHTS ----------------------------


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else 0
    sock.sendall(payload[sent:])


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; (None, []) at the channel's end."""
    header, fds = b"", []
    while len(header) < _HEADER.size:
        if max_fds and not header:
            chunk, got, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
            fds += got
        else:
            chunk = sock.recv(_HEADER.size - len(header))
        if not chunk:
            _close_all(fds)
            return None, []
        header += chunk
    (size,) = _HEADER.unpack(header)
    if size > _MAX_MESSAGE:
        _close_all(fds)
        raise OSError(f"fork server channel: a message of {size} bytes (at most {_MAX_MESSAGE})")
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            _close_all(fds)
            return None, []
        data += chunk
    return json.loads(data), fds


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


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
            message, _ = _receive(self._sock)
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
                message, _ = _receive(self._sock)
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
                _send(self._sock, request, fds)
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
                    _send(self._sock, {"op": "signal", "pid": pid, "sig": int(sig)})
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


# -- the server process ---------------------------------------------------------------------------


def _preload() -> None:
    """What every worker imports, imported once here (no CUDA, no thread pools started)."""
    import cloudpickle  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401

    from . import server  # noqa: F401 - the worker daemon and the protocol under it


def _parent_watch(parent: int) -> int | None:
    """A descriptor readable once process ``parent`` ended (a pidfd), or None where there is none."""
    try:
        return os.pidfd_open(parent)
    except (AttributeError, OSError):
        return None


class _Server:
    """The server's loop (see the module's NOTE); one thread, the process's main one."""

    def __init__(self, sock: socket.socket, parent: int):
        self.sock = sock
        self.parent = parent
        self.children: set[int] = set()
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through the pipe
        signal.signal(signal.SIGTERM, self._stop)
        self.watch = _parent_watch(parent)

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _report(self, message: dict[str, Any]) -> None:
        try:
            _send(self.sock, message)
        except OSError:  # the trainer is gone: nobody to tell
            pass

    def reap(self, block: bool = False) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            if pid in self.children:
                self.children.discard(pid)
                self._report({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def parent_gone(self, readable: list) -> bool:
        return (self.watch is not None and self.watch in readable) or os.getppid() != self.parent

    def run(self) -> None:
        if os.getppid() != self.parent:
            return  # the trainer died while this one started
        watched: list = [self.sock, self.wake_r] + ([self.watch] if self.watch is not None else [])
        while not self.stopping:
            readable = select.select(watched, [], [], _PARENT_CHECK)[0]
            if self.wake_r in readable:
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            self.reap()
            if self.parent_gone(readable):
                return
            if self.sock in readable:
                message, fds = _receive(self.sock, max_fds=3)
                if message is None:
                    return
                self.handle(message, fds)

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        try:
            if message["op"] == "fork" and len(fds) == 3:
                self.fork(message, fds)
            elif message["op"] == "fork":
                self._report({"op": "failed", "seq": message.get("seq"), "error": "its pipes did not arrive"})
            elif message["op"] == "signal" and message["pid"] in self.children:
                try:
                    os.kill(message["pid"], message["sig"])
                except ProcessLookupError:
                    pass
        finally:
            _close_all(fds)

    def fork(self, request: dict[str, Any], fds: list[int]) -> None:
        try:
            pid = os.fork()
        except OSError as exc:
            self._report({"op": "failed", "seq": request.get("seq"), "error": f"fork: {exc.strerror or exc}"})
            return
        if pid == 0:  # the worker: never returns
            self.sock.close()
            become_worker(
                list(request["args"]),
                dict(request["env"]),
                bool(request["new_session"]),
                fds[0],
                fds[1],
                fds[2],
                cwd=request.get("cwd"),
            )
        self.children.add(pid)
        self._report({"op": "forked", "seq": request.get("seq"), "pid": pid})

    def stop_children(self) -> None:
        """SIGTERM the workers still here, SIGKILL those left after :data:`STOP_GRACE` s; reap them."""
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for pid in self.children:
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_GRACE
        while self.children and time.monotonic() < deadline:
            select.select([self.wake_r], [], [], 0.1)
            self.reap()
        for pid in self.children:
            os.kill(pid, signal.SIGKILL)
        self.reap(block=True)


def main(argv: Sequence[str]) -> int:
    """``python -m torchfeed.worker.forkserver FD PARENT``: serve the channel inherited as ``FD``
    for process ``PARENT`` (see the module's docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, parent = int(argv[0]), int(argv[1])
    sock = socket.socket(fileno=fd)
    server = _Server(sock, parent)
    _preload()
    try:
        _send(sock, {"op": "ready"})
        server.run()
    except OSError:  # the channel broke: the trainer is gone
        pass
    finally:
        server.stop_children()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
