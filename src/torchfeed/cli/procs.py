"""``torchfeed worker --procs N``: N worker processes on this machine, supervised.

Start: all N processes get ready, their address lines are printed (and filed with
``--address-file``), or none keeps running and one line says which could not start and why.

Then this process watches them (NOTE on threads: the main thread alone supervises; each
child's output is drained by the two pump threads of its :class:`WorkerProcess`, so a child
never blocks on its pipes, and signals only set an event the main thread polls):

- a process that ends unasked (a crash, the OOM killer's SIGKILL) is reaped at once (no
  zombie), its end is said on stderr (exit code or signal), its address is taken out of the
  address file, and it is started again on its port after a backoff (:data:`FIRST_DELAY`,
  doubling up to :data:`MOST_DELAY`). Its new address is filed and printed when it is ready;
- a process that ends :data:`CRASH_LOOP_DEATHS` times within :data:`CRASH_LOOP_WINDOW`
  seconds (a start that fails counts: another user holding its port, say) is a crash loop:
  that process is given up, one line says which, how it ended the last time and where to see
  why, and the others keep serving; when none is left the command ends (status 1), and a
  stop after one was given up ends with status 1 too;
- the address file is written by this process alone; a write that fails (the file replaced
  by a link, its folder made unwritable) is said on stderr and the processes keep serving;
- SIGTERM or SIGINT stops every process (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT`).
"""

from __future__ import annotations

import collections
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from ..protocol.addrfile import UnsafeAddressFile, append_lines, remove_lines
from ..util import double_delay
from ..worker.options import WorkerOptions
from ..worker.process import WorkerExited, WorkerProcess, exit_reason, worker_command

START_TIMEOUT = 300.0  # seconds a process has to print its address
STOP_TIMEOUT = 10.0  # seconds a process has to stop after SIGTERM before it is killed
POLL = 0.2  # seconds between two looks at the processes
FIRST_DELAY = 0.5  # seconds before the first restart of a process
MOST_DELAY = 30.0  # the longest wait before a restart
CRASH_LOOP_DEATHS = 5  # ends of one process within CRASH_LOOP_WINDOW that stop everything
CRASH_LOOP_WINDOW = 120.0


def say(text: str) -> None:
    print(f"torchfeed worker: {text}", file=sys.stderr, flush=True)


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


@dataclass
class Slot:
    """Process ``index`` of N: the one running now (or starting), and its recent ends."""

    index: int
    port: int  # the port it binds (0: a free one each start)
    process: WorkerProcess | None = None
    address: str | None = None  # announced (printed and filed) while it runs
    started: float = 0.0
    deaths: collections.deque[float] = field(default_factory=collections.deque)
    delay: float = 0.0
    restart_at: float | None = None
    given_up: bool = False  # it crash-looped: not started again


class Supervisor:
    """The processes of ``torchfeed worker --procs N`` (see the module's docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        procs: int,
        options: WorkerOptions,
        *,
        log_level: str,
        secret: bytes,
        address_file: str | None,
    ):
        self.host, self.procs, self.options = host, procs, options
        self.log_level, self.secret, self.address_file = log_level, secret, address_file
        self.slots = [Slot(i, port + i if port else 0) for i in range(procs)]
        self.stopping = threading.Event()

    def _name(self, slot: Slot) -> str:
        return f"process {slot.index + 1} of {self.procs}"

    def _spawn(self, slot: Slot, *, hold_errors: bool) -> None:
        argv = worker_command(
            self.host,
            slot.port,
            self.options.for_process(slot.index),
            "--log-level",
            self.log_level,
            "--secret-on-stdin",
        )
        slot.process = WorkerProcess(
            argv, name=f"process {slot.index}", secret=self.secret, hold_errors=hold_errors
        )
        slot.started = time.monotonic()

    def _stop_all(self) -> list[int]:
        running = [s.process for s in self.slots if s.process is not None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT
        return [p.reap(max(0.0, deadline - time.monotonic())) for p in running]

    def _announce(self, slot: Slot, address: str) -> None:
        """File and print the address of a process that is ready (a file that cannot be
        written is said; the process serves all the same)."""
        slot.address = address
        assert slot.process is not None
        slot.process.label(f"[{address}] ")
        if self.address_file:
            try:
                append_lines(self.address_file, [address])
            except (OSError, UnsafeAddressFile) as exc:
                say(f"--address-file {self.address_file}: cannot add {address} to it: {_why(exc)}")
        sys.stdout.write(address + "\n")
        sys.stdout.flush()

    def _withdraw(self, slot: Slot) -> None:
        """Take the address of a process that ended out of the address file."""
        address, slot.address = slot.address, None
        if address and self.address_file:
            try:
                remove_lines(self.address_file, [address])
            except (OSError, UnsafeAddressFile) as exc:
                say(f"--address-file {self.address_file}: cannot take {address} out of it: {_why(exc)}")

    # -- start -----------------------------------------------------------------------------
    def start(self) -> int:
        """Start every process; 0 when all are ready and announced, else the exit status."""
        for slot in self.slots:
            self._spawn(slot, hold_errors=True)
        addresses = []
        for slot in self.slots:
            assert slot.process is not None
            try:
                addresses.append(slot.process.wait_address(START_TIMEOUT, self.stopping.is_set))
            except (WorkerExited, TimeoutError, InterruptedError) as exc:
                if isinstance(exc, WorkerExited):
                    why = (
                        exc.tail[-1].strip().removeprefix("torchfeed worker: ")
                        if exc.tail
                        else (f"it exited with code {exc.returncode}")
                    )
                elif isinstance(exc, InterruptedError):
                    why = "interrupted"
                else:
                    why = f"not ready within {START_TIMEOUT:g} s"
                self._stop_all()
                say(
                    f"process {slot.index + 1} of {self.procs} ({self.host}:{slot.port}) could not start: "
                    f"{why}; all {self.procs} processes were stopped"
                )
                return 1
        if self.address_file:
            try:
                append_lines(self.address_file, addresses)
            except (OSError, UnsafeAddressFile) as exc:
                self._stop_all()
                say(f"error: --address-file {self.address_file}: cannot append to it: {_why(exc)}")
                return 2
        for address in addresses:  # one line, one write
            sys.stdout.write(address + "\n")
            sys.stdout.flush()
        for slot, address in zip(self.slots, addresses):
            assert slot.process is not None
            slot.address = address
            slot.process.label(f"[{address}] ")
            slot.process.release_errors()
        return 0

    # -- supervision -------------------------------------------------------------------------
    def run(self) -> int:
        """Start, then supervise until a signal (0, or a process's failing exit status at the
        stop) or a crash loop (1)."""

        def stop(signum=None, _frame=None):
            self.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        code = self.start()
        if code:
            return code
        while not self.stopping.wait(POLL):
            for slot in self.slots:
                if not slot.given_up:
                    self._look(slot)
            if all(slot.given_up for slot in self.slots):
                say(f"no process of {self.procs} is left: stopping")
                return 1
        codes = self._stop_all()
        failed = [c for c in codes if c]  # the first failure decides; a signal death reads as 128 + signal
        if failed:
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        return 1 if any(slot.given_up for slot in self.slots) else 0

    def _look(self, slot: Slot) -> None:
        """Check one process: reap and restart it when it ended (give it up on a crash loop)."""
        now = time.monotonic()
        p = slot.process
        if p is None:
            if slot.restart_at is not None and now >= slot.restart_at:
                slot.restart_at = None
                self._spawn(slot, hold_errors=False)
            return
        if slot.address is None:  # restarted, not ready yet
            try:
                address = p.wait_address(0.0)
            except TimeoutError:
                if now - slot.started < START_TIMEOUT:
                    return
                p.stop(STOP_TIMEOUT)
                self._ended(slot, f"was not ready within {START_TIMEOUT:g} s")
                return
            except WorkerExited as exc:
                p.close()
                last = exc.tail[-1].strip().removeprefix("torchfeed worker: ") if exc.tail else ""
                self._ended(slot, exit_reason(exc.returncode) + (f" ({last})" if last else ""))
                return
            self._announce(slot, address)
            say(f"{self._name(slot)} is back: {address}")
            return
        if p.poll() is None:
            return
        p.close()  # reaped by poll(); its pipes read to their end
        self._ended(slot, exit_reason(p.returncode or 0))

    def _ended(self, slot: Slot, how: str) -> None:
        where = slot.address or f"{self.host}:{slot.port}"
        self._withdraw(slot)
        slot.process = None
        now = time.monotonic()
        slot.deaths.append(now)
        while slot.deaths and slot.deaths[0] < now - CRASH_LOOP_WINDOW:
            slot.deaths.popleft()
        if len(slot.deaths) >= CRASH_LOOP_DEATHS:
            slot.given_up = True
            left = sum(not s.given_up for s in self.slots)
            say(
                f"{self._name(slot)} ({where}) ended {len(slot.deaths)} times within "
                f"{CRASH_LOOP_WINDOW:g} s, the last time it {how}: giving it up, {left} of {self.procs} "
                f"keep serving. Its stderr above (lines starting [process {slot.index}] or with its address) "
                f"says why; run `torchfeed worker` without --procs to see it alone"
            )
            return
        slot.delay = double_delay(slot.delay if len(slot.deaths) > 1 else 0.0, FIRST_DELAY, MOST_DELAY)
        slot.restart_at = now + slot.delay
        say(f"{self._name(slot)} ({where}) {how}; starting it again in {slot.delay:g} s")
