"""``torchfeed worker --procs N``: N worker processes on this machine, supervised.

The processes are a :class:`~torchfeed.worker.group.WorkerGroup` that this process owns;
this module adds what the command says and files.

Start: all N processes get ready, their address lines are printed (and filed with
``--address-file``), or none keeps running and one line says which could not start and why.

Then this process watches them (NOTE on threads: the main thread alone supervises, through
:meth:`WorkerGroup.supervise`; each child's output is drained by the two pump threads of its
:class:`~torchfeed.worker.process.WorkerProcess`, so a child never blocks on its pipes, and
signals only set an event the main thread polls):

- a process that ends unasked (a crash, the OOM killer's SIGKILL) is reaped at once (no
  zombie), its end is said on stderr (exit code or signal), its address is taken out of the
  address file, and it is started again on its port after a backoff
  (:class:`~torchfeed.worker.group.RestartPolicy`: 0.5 s, doubling up to 30 s). Its new
  address is filed and printed when it is ready;
- a process that ends 5 times within 120 s (a start that fails counts: another user holding
  its port, say) is a crash loop: that process is given up, one line says which, how it ended
  the last time and where to see why, and the others keep serving; when none is left the
  command ends (status 1), and a stop after one was given up ends with status 1 too;
- the address file is written by this process alone; a write that fails (the file replaced
  by a link, its folder made unwritable) is said on stderr and the processes keep serving;
- SIGTERM or SIGINT stops every process (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT`).
"""

from __future__ import annotations

import signal
import sys
import threading

from ..protocol.addrfile import UnsafeAddressFile, append_lines, remove_lines
from ..worker.group import Change, RestartPolicy, StartError, WorkerGroup
from ..worker.options import WorkerOptions

START_TIMEOUT = 300.0  # seconds a process has to print its address
STOP_TIMEOUT = 10.0  # seconds a process has to stop after SIGTERM before it is killed
POLL = 0.2  # seconds between two looks at the processes


def say(text: str) -> None:
    print(f"torchfeed worker: {text}", file=sys.stderr, flush=True)


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


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
        self.group = WorkerGroup(
            procs,
            host=host,
            options=options,
            per_process=True,
            extra_args=["--log-level", log_level],
            port=port,
            secret=secret,
            hold_errors=True,
            name="process {index}",
            label="[{address}] ",
        )
        self.policy = RestartPolicy()
        self.stopping = threading.Event()

    def _name(self, index: int) -> str:
        return f"process {index + 1} of {self.procs}"

    def _file(self, address: str) -> None:
        """File and print the address of a process that is ready again (a file that cannot be
        written is said; the process serves all the same)."""
        if self.address_file:
            try:
                append_lines(self.address_file, [address])
            except (OSError, UnsafeAddressFile) as exc:
                say(f"--address-file {self.address_file}: cannot add {address} to it: {_why(exc)}")
        sys.stdout.write(address + "\n")
        sys.stdout.flush()

    def _withdraw(self, address: str) -> None:
        """Take the address of a process that ended out of the address file."""
        if self.address_file and address:
            try:
                remove_lines(self.address_file, [address])
            except (OSError, UnsafeAddressFile) as exc:
                say(f"--address-file {self.address_file}: cannot take {address} out of it: {_why(exc)}")

    # -- start -----------------------------------------------------------------------------
    def start(self) -> int:
        """Start every process; 0 when all are ready and announced, else the exit status."""
        try:
            addresses = self.group.start(START_TIMEOUT, self.stopping.is_set, stop_timeout=STOP_TIMEOUT)
        except StartError as exc:
            say(
                f"{self._name(exc.index)} ({exc.where}) could not start: {exc.reason}; "
                f"all {self.procs} processes were stopped"
            )
            return 1
        if self.address_file:
            try:
                append_lines(self.address_file, addresses)
            except (OSError, UnsafeAddressFile) as exc:
                self.group.stop(STOP_TIMEOUT)
                say(f"error: --address-file {self.address_file}: cannot append to it: {_why(exc)}")
                return 2
        for address in addresses:  # one line, one write
            sys.stdout.write(address + "\n")
            sys.stdout.flush()
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
        given_up = 0
        while not self.stopping.wait(POLL):
            for change in self.group.supervise(self.policy, START_TIMEOUT, STOP_TIMEOUT):
                given_up += change.kind == "given up"
                self._said(change, self.procs - given_up)
            if given_up == self.procs:
                say(f"no process of {self.procs} is left: stopping")
                return 1
        codes = self.group.stop(STOP_TIMEOUT)
        failed = [c for c in codes if c]  # the first failure decides; a signal death reads as 128 + signal
        if failed:
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        return 1 if given_up else 0

    def _said(self, change: Change, left: int) -> None:
        """Say and file what the group saw happen to one process."""
        name = self._name(change.index)
        if change.kind == "back":
            self._file(change.address)
            say(f"{name} is back: {change.address}")
            return
        self._withdraw(change.address)
        if change.kind == "given up":
            say(
                f"{name} ({change.where}) ended {self.policy.ends(change.index)} times within "
                f"{self.policy.crash_loop_window:g} s, the last time it {change.how}: giving it up, {left} of "
                f"{self.procs} keep serving. Its stderr above (lines starting [process {change.index}] or with "
                f"its address) says why; run `torchfeed worker` without --procs to see it alone"
            )
        else:
            say(f"{name} ({change.where}) {change.how}; starting it again in {change.delay:g} s")
