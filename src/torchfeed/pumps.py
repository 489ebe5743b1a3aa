"""Reading child processes' output so that they never block on a full pipe.

A worker started with its stdout on a pipe prints its address line there; anything it
prints later (a dataset's ``print``, a warning) must still be read, or the worker blocks
once the pipe's 64 KiB buffer is full. :class:`Pump` reads a pipe to its end on a thread
of its own and writes each line, prefixed with the worker's name, to this process's
``sys.stdout`` or ``sys.stderr`` (looked up at each write, so redirections apply). The
first line can be taken instead (the address). Used by :class:`torchfeed.LocalWorkers`
and by ``torchfeed worker --procs N``. No torch here: the command line imports it.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Callable
from typing import TextIO

_CHUNK = 65536
_LONGEST_LINE = 1 << 20  # a line longer than this is written in pieces
_write_lock = threading.Lock()  # one writer at a time: lines of different workers never interleave


class Pump:
    """Forward the lines of pipe ``fd`` (a binary file) to ``target()``, each after ``prefix``.

    With ``first_line=True`` the first line is kept for :meth:`wait_first_line` instead of
    being forwarded. With ``hold=True`` lines are kept until :meth:`release`. The last
    lines are kept in :attr:`tail` (for error messages).
    """

    def __init__(
        self,
        stream,
        target: Callable[[], TextIO],
        prefix: str = "",
        *,
        first_line: bool = False,
        name: str = "torchfeed-pump",
        hold: bool = False,
    ):
        self._stream = stream
        self._held: list | None = [] if hold else None
        self._target = target
        self.prefix = prefix
        self._want_first = first_line
        self._first: str | None = None
        self._first_event = threading.Event()
        self._lock = threading.Lock()
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fd = self._stream.fileno()
        pending = b""
        try:
            while True:
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._line(line.decode(errors="replace"))
                while len(pending) > _LONGEST_LINE:
                    self._line(pending[:_LONGEST_LINE].decode(errors="replace"))
                    pending = pending[_LONGEST_LINE:]
        except (OSError, ValueError):  # closed under us
            pass
        finally:
            if pending:
                self._line(pending.decode(errors="replace"))
            self._first_event.set()  # end of output: nobody waits for a first line any more

    def _line(self, text: str) -> None:
        self.tail.append(text)
        if self._want_first and self._first is None:
            self._first = text.strip()
            self._first_event.set()
            return
        with self._lock:
            if self._held is not None:
                self._held.append(text)
                return
            self._write([text])

    def _write(self, lines) -> None:
        with _write_lock:
            try:
                out = self._target()
                out.write("".join(f"{self.prefix}{text}\n" for text in lines))
                out.flush()
            except (OSError, ValueError, AttributeError):  # the target was closed: drop the lines
                pass

    def release(self) -> None:
        """Write the held lines (with the current prefix) and forward from now on."""
        with self._lock:
            held, self._held = self._held, None
            if held:
                self._write(held)

    def wait_first_line(self, timeout: float) -> str | None:
        """The first line, or None if the output ended (or ``timeout`` passed) without one."""
        self._first_event.wait(timeout)
        return self._first

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def to_stdout() -> TextIO:
    return sys.stdout


def to_stderr() -> TextIO:
    return sys.stderr
