"""The fork server process (``python -m torchfeed.worker.forkserver``): its loop and :func:`main`.

One thread, the process's main one, waits (``select``) on the channel
(:mod:`torchfeed.worker.forkchannel`), on a wakeup pipe that SIGCHLD and SIGTERM write to and
on a pidfd of the trainer; it forks workers on request, signals and reaps them, reports their
ends, and stops them when the trainer is gone. Its processes, threads and shutdown are
described once, in the NOTE of :mod:`torchfeed.worker.forkserver`, with the trainer's side.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

from .forkchannel import close_all, receive, send
from .forked import become_worker

STOP_GRACE = 5.0  # seconds the server gives its workers after SIGTERM, when it stops, before SIGKILL
_PARENT_CHECK = 1.0  # seconds between two looks at the server's parent (no pidfd)


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
    """The server's loop (see the NOTE in :mod:`torchfeed.worker.forkserver`); one thread, the
    process's main one."""

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
            send(self.sock, message)
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
                message, fds = receive(self.sock, max_fds=3)
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
            close_all(fds)

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
    for process ``PARENT`` (the channel's messages: :mod:`torchfeed.worker.forkserver`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, parent = int(argv[0]), int(argv[1])
    sock = socket.socket(fileno=fd)
    server = _Server(sock, parent)
    _preload()
    try:
        send(sock, {"op": "ready"})
        server.run()
    except OSError:  # the channel broke: the trainer is gone
        pass
    finally:
        server.stop_children()
    return 0
