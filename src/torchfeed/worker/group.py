"""N ``torchfeed worker`` processes of one owner, started, watched and stopped together.

:class:`WorkerGroup` is the one group of worker processes in torchfeed: ``torchfeed worker
--procs N`` (:mod:`torchfeed.cli.procs`), :class:`torchfeed.LocalWorkers` and the Dask plugin
(:mod:`torchfeed.dask.workers`) each hold one. Each member is a
:class:`~torchfeed.worker.process.WorkerProcess` (a new interpreter, or forked).

Invariants:

- **Threads.** The owner calls the group's methods from one thread at a time; the group
  starts no thread of its own. The only other threads are each process's two output pumps
  (owned by its :class:`WorkerProcess`), which forward its lines and never block it.
- **Ownership.** The group starts its processes and is the only one that reaps them. A process
  that ended is reaped by the look that saw it end (:meth:`WorkerGroup.supervise`), by
  :meth:`WorkerGroup.restart` or by :meth:`WorkerGroup.stop`: none is left a zombie.
- **Start: all or none.** :meth:`WorkerGroup.start` starts every process, then waits for
  their addresses under one shared deadline. When one cannot start (its port taken, a bad
  option, the deadline), every process is stopped and :class:`StartError` names that one
  (index, where it should have served) and why.
- **Ports.** Member ``i`` binds ``port + i`` (``port`` 0: a free one); once it is ready it
  keeps the port it bound, and every restart binds that port again.
- **The secret** reaches a process one way: the first line of its standard input
  (``--secret-on-stdin``, added to its command by the group). ``TORCHFEED_SECRET`` is never in
  a member's environment (taken out of the one given). With no secret given, a process finds
  its own (``TORCHFEED_SECRET_FILE`` in its environment, the default file).
- **Shutdown.** :meth:`WorkerGroup.stop` sends SIGTERM to every running process, gives them
  all one deadline, SIGKILLs those still running at it, and reaps every one.
- **Restarts** follow a :class:`RestartPolicy`: a backoff between the ends of one process and a
  crash loop (too many ends within a window) after which that process is given up.

No torch here: the command line imports it.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..protocol.auth import ENV_SECRET
from ..util import double_delay
from .forked import Parent
from .options import WorkerOptions
from .process import WorkerExited, WorkerProcess, exit_reason, worker_command


class StartError(RuntimeError):
    """A process of a group could not start; the group stopped all of them.

    ``index`` is the process's index, ``where`` the ``host:port`` it was to serve on,
    ``reason`` why in a few words (its last stderr line, when it printed one), and the
    message says it in full (with the end of its stderr). Pickles (a Dask worker sends it
    to the client): the attributes travel as its state.
    """

    def __init__(self, message: str, *, index: int = -1, where: str = "", reason: str = ""):
        super().__init__(message)
        self.index = index
        self.where = where
        self.reason = reason


class StartTimeout(StartError, TimeoutError):
    """A process of a group did not get ready in time (still a TimeoutError, as it always was)."""


@dataclass
class RestartPolicy:
    """When a process that ended starts again, and when it is given up (a crash loop).

    :meth:`ended` counts an end of process ``index`` at ``clock()``: ``crash_loop_ends`` ends
    within ``crash_loop_window`` seconds (failed starts included) are a crash loop; otherwise
    the process waits ``first_delay`` seconds after its first end, twice as long after each
    further end within the window, at most ``most_delay``. Pure: the clock is an argument.
    """

    first_delay: float = 0.5
    most_delay: float = 30.0
    crash_loop_ends: int = 5
    crash_loop_window: float = 120.0
    clock: Callable[[], float] = time.monotonic
    ends_seen: dict[int, collections.deque[float]] = field(default_factory=dict, repr=False)
    delays: dict[int, float] = field(default_factory=dict, repr=False)

    def ended(self, index: int) -> float | None:
        """Count an end of process ``index`` now: seconds before it starts again, or None when
        it is in a crash loop (give it up)."""
        now = self.clock()
        ends = self.ends_seen.setdefault(index, collections.deque())
        ends.append(now)
        while ends and ends[0] < now - self.crash_loop_window:
            ends.popleft()
        if len(ends) >= self.crash_loop_ends:
            return None
        previous = self.delays.get(index, 0.0) if len(ends) > 1 else 0.0
        self.delays[index] = double_delay(previous, self.first_delay, self.most_delay)
        return self.delays[index]

    def ends(self, index: int) -> int:
        """How many ends of process ``index`` lie within the window (as of its last end)."""
        return len(self.ends_seen.get(index, ()))


@dataclass(frozen=True)
class Change:
    """What :meth:`WorkerGroup.supervise` saw happen to process ``index``.

    ``kind``: ``"ended"`` (it ended; it starts again in ``delay`` seconds), ``"given up"`` (it
    ended in a crash loop: it is not started again) or ``"back"`` (a restarted process is
    ready at ``address``). ``where``: the address it had (or ``host:port``); ``address``: the
    address it was ready at (empty: it ended before it was ready) or, ``"back"``, its new one;
    ``how``: how it ended, in words (``"was killed by signal SIGKILL"``).
    """

    kind: str
    index: int
    where: str
    how: str = ""
    delay: float = 0.0
    address: str = ""


@dataclass
class Member:
    """Process ``index`` of a group: the one running now (or starting) and its state."""

    index: int
    port: int  # the port it binds (0: a free one, until its first start bound one)
    process: WorkerProcess | None = None
    address: str | None = None  # while it runs and is ready
    started: float = 0.0  # time.monotonic() of its last start
    restart_at: float | None = None  # ended: when it starts again
    given_up: bool = False  # it crash-looped: not started again


def _short(exc: BaseException, timeout: float) -> str:
    """Why a start failed, in a few words (its last stderr line, when it printed one)."""
    if isinstance(exc, WorkerExited):
        last = exc.tail[-1].strip().removeprefix("torchfeed worker: ") if exc.tail else ""
        return last or f"it {exit_reason(exc.returncode)}"
    if isinstance(exc, InterruptedError):
        return "interrupted"
    if isinstance(exc, TimeoutError):
        return f"not ready within {timeout:g} s"
    return f"{type(exc).__name__}: {exc}"


class WorkerGroup:
    """``n`` worker processes on this machine (see the module's docstring for its invariants).

    Parameters
    ----------
    n : int
        Number of processes.
    host : str
        Interface they bind.
    options : WorkerOptions
        How each serves; with ``per_process``, process ``i`` gets ``options.for_process(i)``
        (its own metrics port).
    extra_args : sequence of str
        More ``torchfeed worker`` arguments.
    port : int
        Process ``i`` binds ``port + i``; 0: each a free port.
    secret : bytes
        Handed to each process on its standard input; empty: each finds its own.
    env : mapping, optional
        Their environment (default: this process's), ``TORCHFEED_SECRET`` taken out.
    new_session, fork, fork_parent, hold_errors
        As for :class:`~torchfeed.worker.process.WorkerProcess`; ``fork_parent`` may be
        replaced between starts (a fork server that died).
    name, label : str
        Formats of a process's name (``{index}``; its output's prefix until it is ready) and
        of its output's prefix once it is ready (``{index}``, ``{address}``).
    """

    def __init__(
        self,
        n: int,
        *,
        host: str,
        options: WorkerOptions | None = None,
        extra_args: Sequence[str] = (),
        port: int = 0,
        per_process: bool = False,
        secret: bytes = b"",
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
        fork: bool = False,
        fork_parent: Parent | None = None,
        hold_errors: bool = False,
        name: str = "worker {index}",
        label: str = "[worker {index} {address}] ",
    ):
        if n < 1:
            raise ValueError(f"a group needs at least one process, got {n}")
        self.host = host
        self.options = options or WorkerOptions()
        self.per_process = per_process
        self.extra_args = [*extra_args, *(["--secret-on-stdin"] if secret else [])]
        self.secret = secret
        self.env = {k: v for k, v in (os.environ if env is None else env).items() if k != ENV_SECRET}
        self.new_session, self.fork, self.fork_parent = new_session, fork, fork_parent
        self.hold_errors = hold_errors
        self.name, self.label = name, label
        self.members = [Member(i, port + i if port else 0) for i in range(n)]

    # -- what the owner reads ---------------------------------------------------------------
    @property
    def processes(self) -> list[WorkerProcess]:
        """The processes started last, in order (ended ones included until they start again)."""
        return [m.process for m in self.members if m.process is not None]

    @property
    def addresses(self) -> list[str]:
        """The addresses of the processes that are ready, in order."""
        return [m.address for m in self.members if m.address is not None]

    def where(self, index: int) -> str:
        """Where process ``index`` serves: its address, or ``host:port`` (port 0: any)."""
        m = self.members[index]
        return m.address or f"{self.host}:{m.port}"

    # -- one process ------------------------------------------------------------------------
    def spawn(self, index: int, *, hold_errors: bool = False) -> WorkerProcess:
        """Start process ``index`` on its port (a previous one is reaped first, SIGKILLed if it
        still runs); its address comes later (:meth:`wait_ready`, :meth:`supervise`)."""
        m = self.members[index]
        if m.process is not None:
            m.process.reap(0.0)
        m.process, m.address, m.restart_at = None, None, None
        options = self.options.for_process(index) if self.per_process else self.options
        argv = worker_command(self.host, m.port, options, *self.extra_args)
        m.process = WorkerProcess(
            argv,
            name=self.name.format(index=index),
            secret=self.secret,
            env=self.env,
            new_session=self.new_session,
            hold_errors=hold_errors,
            fork=self.fork,
            fork_parent=self.fork_parent,
        )
        m.started = time.monotonic()
        return m.process

    def ready(self, index: int, address: str) -> None:
        """Process ``index`` printed ``address``: keep it and its port, prefix its output with it."""
        m = self.members[index]
        assert m.process is not None
        m.address = address
        m.port = int(address.rsplit(":", 1)[1])
        m.process.label(self.label.format(index=index, address=address))

    def wait_ready(self, index: int, timeout: float, stop_timeout: float = 10.0) -> str:
        """Wait up to ``timeout`` seconds for process ``index`` to be ready; its address. Raises
        :class:`StartError` when it is not (the process stopped, ``stop_timeout``)."""
        m = self.members[index]
        assert m.process is not None
        try:
            address = m.process.wait_address(timeout)
        except (WorkerExited, TimeoutError) as exc:
            m.process.stop(stop_timeout)
            raise self._start_error(index, exc, timeout, "") from exc
        self.ready(index, address)
        return address

    def restart(self, index: int, timeout: float, stop_timeout: float = 10.0) -> str:
        """Start process ``index`` again on its port (SIGKILL first if it still runs) and wait up
        to ``timeout`` seconds for it; its address. Raises :class:`StartError`."""
        self.spawn(index)
        return self.wait_ready(index, timeout, stop_timeout)

    def send_signal(self, index: int, sig: int) -> None:
        """Send ``sig`` to process ``index`` if it runs."""
        p = self.members[index].process
        if p is not None:
            p.send_signal(sig)

    # -- all of them ------------------------------------------------------------------------
    def start(
        self, timeout: float, interrupted: Callable[[], bool] | None = None, *, stop_timeout: float = 10.0
    ) -> list[str]:
        """Start every process and wait for all of them, ``timeout`` seconds in all; their
        addresses. When one cannot start (or ``interrupted()``), all are stopped (``stop_timeout``)
        and :class:`StartError` says which and why. Errors held (``hold_errors``) are released
        once all are ready."""
        deadline = time.monotonic() + timeout
        index = 0
        try:
            for index in range(len(self.members)):
                self.spawn(index, hold_errors=self.hold_errors)
            addresses = []
            for m in self.members:
                index = m.index  # the one an error names
                assert m.process is not None
                left = max(0.0, deadline - time.monotonic())
                addresses.append(m.process.wait_address(left, interrupted))
        except (WorkerExited, TimeoutError, InterruptedError, OSError, RuntimeError) as exc:
            self.stop(stop_timeout)
            raise self._start_error(index, exc, timeout, f" (all {len(self.members)} were stopped)") from exc
        except BaseException:
            self.stop(stop_timeout)
            raise
        for index, address in enumerate(addresses):
            self.ready(index, address)
            process = self.members[index].process
            assert process is not None
            process.release_errors()
        return addresses

    def stop(self, timeout: float) -> list[int]:
        """SIGTERM every running process, SIGKILL those still running ``timeout`` seconds later,
        reap all; the exit statuses of the processes there were, in order."""
        running = self.processes
        for p in running:
            p.terminate()
        deadline = time.monotonic() + timeout
        codes = [p.reap(max(0.0, deadline - time.monotonic())) for p in running]
        for m in self.members:
            m.address = None
        return codes

    def supervise(self, policy: RestartPolicy, start_timeout: float, stop_timeout: float) -> list[Change]:
        """One look at every process not given up: reap one that ended (its restart scheduled by
        ``policy``, or given up), start one whose backoff is over, take the address of a
        restarted one that got ready (one not ready within ``start_timeout`` seconds is
        stopped, ``stop_timeout``, and counts as an end). What changed, in order."""
        changes: list[Change] = []
        for m in self.members:
            if m.given_up:
                continue
            p, now = m.process, time.monotonic()
            if p is None:
                if m.restart_at is not None and now >= m.restart_at:
                    self.spawn(m.index)
                continue
            if m.address is None:  # restarted, not ready yet
                try:
                    address = p.wait_address(0.0)
                except TimeoutError:
                    if now - m.started >= start_timeout:
                        p.stop(stop_timeout)
                        changes.append(self._ended(m, policy, f"was not ready within {start_timeout:g} s"))
                    continue
                except WorkerExited as exc:
                    p.close()
                    last = exc.tail[-1].strip().removeprefix("torchfeed worker: ") if exc.tail else ""
                    changes.append(
                        self._ended(m, policy, exit_reason(exc.returncode) + (f" ({last})" if last else ""))
                    )
                    continue
                self.ready(m.index, address)
                changes.append(Change("back", m.index, address, address=address))
                continue
            if p.poll() is None:
                continue
            p.close()  # reaped by poll(); its pipes read to their end
            changes.append(self._ended(m, policy, exit_reason(p.returncode or 0)))
        return changes

    def _ended(self, m: Member, policy: RestartPolicy, how: str) -> Change:
        where, address = self.where(m.index), m.address or ""
        m.process, m.address = None, None
        delay = policy.ended(m.index)
        if delay is None:
            m.given_up = True
            return Change("given up", m.index, where, how, address=address)
        m.restart_at = time.monotonic() + delay
        return Change("ended", m.index, where, how, delay, address)

    def _start_error(self, index: int, exc: BaseException, timeout: float, tail: str) -> StartError:
        name = self.name.format(index=index)
        where = self.where(index)
        if isinstance(exc, WorkerExited):
            shown = "\n".join(exc.tail)
            detail = f"it {exit_reason(exc.returncode)} before it was ready" + (
                f"; its stderr ends with:\n{shown}" if shown else ""
            )
        elif isinstance(exc, TimeoutError):
            detail = f"it did not print its address in time ({timeout:g} s)"
        else:
            detail = _short(exc, timeout)
        kind = StartTimeout if isinstance(exc, TimeoutError) else StartError
        return kind(
            f"{name} ({where}) could not start{tail}: {detail}",
            index=index,
            where=where,
            reason=_short(exc, timeout),
        )
