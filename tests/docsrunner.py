"""A warm interpreter that runs the documentation's code blocks (tests/test_docs.py).

Each block is a script that imports torch and torchfeed; a fresh interpreter spends seconds
on those imports alone. This runner imports them once and forks a child per script, so a
block starts with them already loaded, as its first lines would leave them, and with
nothing else of the runner: the child starts a session of its own, leaves the runner's
channel, takes the script's directory, environment, argv and ``sys.path[0]``, and runs the
script as ``__main__`` (``runpy``), so ``if __name__ == "__main__"`` blocks and classes
sent by value behave as in ``python script.py``. It then ends as an interpreter does:
``SystemExit`` carries the script's exit code out of :func:`main`, after which the
interpreter joins the script's non-daemon threads and runs its ``atexit`` handlers.

The runner touches no torch operation before forking (no thread pools exist yet), and a
torchfeed child forgets whatever this process started (the fork server is per process).

NOTE [the runner's channel and its processes]

* ``python docsrunner.py`` reads one JSON request per line on stdin
  (``{"script", "cwd", "env", "output"}``), forks, and writes ``{"pid": N}`` on stdout;
  when that child ends it writes ``{"pid": N, "status": S}`` (an exit code, or minus the
  signal). The script's stdout and stderr go to the ``output`` file.
* The runner has one thread: it waits (``select``) on stdin and on a wakeup pipe that
  SIGCHLD writes to, and reaps its children (only it can: it is their parent). No thread
  runs at a fork, so no lock is held in a child.
* In the test process, :class:`Runner` reads the reports on a thread of its own
  (``docsrunner-reports``) into a queue; a timeout is the caller's: it kills the child's
  process group (the child is a session leader) and waits for the report that follows.
* The runner ends when its stdin closes (the test session ended): it kills the process
  groups of the children still running and exits.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

WARM = ("torch", "numpy", "torchfeed")  # what every block imports first


def _child(request: dict[str, Any], runner_fds: list[int]) -> None:
    """The forked child: become the script's process and run it (never returns normally)."""
    import runpy
    import traceback

    os.setsid()
    for fd in runner_fds:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)  # over the runner's channel
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in {null, out} - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # out of main(): the interpreter's own shutdown follows


def main() -> None:
    for module in WARM:
        __import__(module)
    if threading.active_count() != 1:  # a fork copies one thread: the others' locks could be held
        raise SystemExit(f"docsrunner: importing {WARM} started threads: {threading.enumerate()}")
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler, so the wakeup fd is written
    signal.set_wakeup_fd(wake_write)
    children: set[int] = set()
    pending = b""

    def say(message: dict[str, Any]) -> None:
        os.write(1, (json.dumps(message) + "\n").encode())

    while True:
        ready = select.select([0, wake_read], [], [])[0]
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 4096):
                        break
                except BlockingIOError:
                    break
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say({"pid": pid, "status": os.waitstatus_to_exitcode(status)})
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _child(json.loads(line), [wake_read, wake_write])
            children.add(pid)
            say({"pid": pid})
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Runner:
    """The test process's handle on a warm runner: :meth:`run` one script at a time."""

    def __init__(self, env: dict[str, str]):
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._reports: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read_reports, name="docsrunner-reports", daemon=True).start()

    def run(self, script: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
        """Run ``script`` in its directory with ``env``: (exit code, or None on timeout; its output)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        output = script.with_suffix(".out")
        request = {"script": str(script), "cwd": str(script.parent), "env": env, "output": str(output)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._read(60)
        if answer is None:
            raise RuntimeError("the docs runner did not answer within 60 s")
        pid = answer["pid"]
        status = self._wait(pid, timeout)
        if status is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait(pid, 30)
        return status, output.read_text(errors="replace") if output.exists() else ""

    def _read(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The runner's next report (None when ``timeout`` seconds pass first)."""
        try:
            report = self._reports.get(timeout=timeout)
        except queue.Empty:
            return None
        if report is None:
            raise RuntimeError(f"the docs runner ended (exit code {self._proc.wait()})")
        return report

    def _read_reports(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._reports.put(json.loads(line))
        self._reports.put(None)

    def _wait(self, pid: int, timeout: float) -> int | None:
        """The exit code of child ``pid``, or None when ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            report = self._read(left)
            if report is not None and report.get("pid") == pid and "status" in report:
                return report["status"]
        return None

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


if __name__ == "__main__":
    main()
