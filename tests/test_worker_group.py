"""WorkerGroup: N real worker processes started all or none, restarted on their port,
supervised under a RestartPolicy, stopped with one deadline. No mocks: real processes on
loopback (new interpreters, or forked from the fork server); the policy alone with a fake clock."""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket

import pytest

import torchfeed
from helpers import listen_on_if_free, secret_seen_by_worker_code, wait_for
from torchfeed.protocol.auth import ENV_SECRET
from torchfeed.util import pid_alive
from torchfeed.worker import forkserver
from torchfeed.worker.group import RestartPolicy, StartError, StartTimeout, WorkerGroup

pytestmark = pytest.mark.timeout(240)

START = 120.0  # seconds: generous, the machine is busy; no test asserts a duration
KEY = secrets.token_hex(32)


def _forked() -> dict:
    """Forked from the fork server where there is one (fast), else new interpreters."""
    if forkserver.available():
        return {"fork": True, "fork_parent": forkserver.shared(START)}
    return {}


def _held_port_after_a_free_one() -> tuple[socket.socket, int]:
    """A listening socket on port P, with P - 1 free (as far as one can tell): (socket, P)."""
    for _ in range(50):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", port - 1))
        except OSError:
            holder.close()
            continue
        finally:
            probe.close()
        holder.listen()
        return holder, port
    raise RuntimeError("no two consecutive ports")


def _ignore_sigterm() -> int:
    """On a worker: ignore SIGTERM process-wide (from any thread, through libc); its pid."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(int(signal.SIGTERM), ctypes.c_void_p(1))  # SIG_IGN
    return os.getpid()


def _call(address: str, fn, *args):
    return torchfeed.rpc_async(address, fn, args, secret=KEY, timeout=60).wait()


# -- start ----------------------------------------------------------------------------------


def test_start_is_all_or_none_and_names_the_process_that_could_not_start():
    """Process 1 of 2 finds its port taken: StartError names it, its port and why, and process 0
    (which could start) was stopped and reaped."""
    holder, port = _held_port_after_a_free_one()
    with holder:
        group = WorkerGroup(2, host="127.0.0.1", port=port - 1, secret=KEY.encode(), hold_errors=True)
        with pytest.raises(StartError) as info:
            group.start(START)
    err = info.value
    assert err.index == 1 and err.where == f"127.0.0.1:{port}"
    assert err.reason == f"cannot serve on 127.0.0.1:{port}: Address already in use", err.reason
    assert "worker 1 (127.0.0.1:" in str(err) and "all 2 were stopped" in str(err)
    again = pickle.loads(pickle.dumps(err))  # as a Dask worker sends it
    assert (str(again), again.index, again.where, again.reason) == (str(err), 1, err.where, err.reason)
    assert group.addresses == []
    assert all(p.returncode is not None for p in group.processes), "a process was left unreaped"
    assert not any(pid_alive(p.pid) for p in group.processes)


def test_ready_processes_serve_with_the_secret_on_stdin_only_and_labelled_output(capsys):
    """The secret reaches each process on its stdin: none has TORCHFEED_SECRET in its environment,
    even when the environment given holds it; their output is prefixed [worker i host:port]."""
    env = {**os.environ, ENV_SECRET: KEY}
    group = WorkerGroup(2, host="127.0.0.1", secret=KEY.encode(), env=env)
    try:
        addresses = group.start(START)
        assert addresses == group.addresses and len(set(addresses)) == 2
        assert [p.address for p in group.processes] == addresses
        for address in addresses:
            seen = _call(address, secret_seen_by_worker_code)
            assert seen["os.environ"] is None and seen["subprocess"] == "", seen
            assert not seen["started with it"], seen
        _call(addresses[1], print, "hello from worker 1")
        line = f"[worker 1 {addresses[1]}] hello from worker 1"
        out: list[str] = []

        def printed() -> bool:
            out.append(capsys.readouterr().out)
            return line in "".join(out)

        assert wait_for(printed, 30), out
    finally:
        codes = group.stop(30.0)
    assert codes == [0, 0]


# -- one process ----------------------------------------------------------------------------


def test_restart_binds_the_same_port_again():
    group = WorkerGroup(2, host="127.0.0.1", secret=KEY.encode(), **_forked())
    try:
        first = group.start(START)
        old = _call(first[0], os.getpid)
        group.send_signal(0, signal.SIGKILL)
        assert wait_for(lambda: group.processes[0].poll() is not None, 30)
        again = group.restart(0, START)
        assert again == first[0] and group.addresses == first
        assert _call(again, os.getpid) not in (old, _call(first[1], os.getpid))
    finally:
        group.stop(30.0)


def test_stop_kills_a_process_that_ignores_sigterm_at_the_deadline():
    """Both get SIGTERM; the one that ignores it is SIGKILLed at the deadline; both are reaped."""
    group = WorkerGroup(2, host="127.0.0.1", secret=KEY.encode(), **_forked())
    try:
        addresses = group.start(START)
        stubborn = _call(addresses[0], _ignore_sigterm)
    finally:
        codes = group.stop(2.0)
    assert codes == [-signal.SIGKILL, 0], codes
    assert not pid_alive(stubborn)


# -- supervision ----------------------------------------------------------------------------


def test_supervise_restarts_an_ended_process_on_its_port_and_gives_up_a_crash_loop():
    """A killed process is seen ended and comes back on its port; killed again with its port
    taken meanwhile, every restart fails, and the policy gives it up; the other keeps serving."""
    policy = RestartPolicy(first_delay=0.0, most_delay=0.0, crash_loop_ends=4)
    group = WorkerGroup(2, host="127.0.0.1", secret=KEY.encode(), **_forked())
    changes = []

    def look(kind: str) -> bool:
        changes.extend(group.supervise(policy, START, 30.0))
        return any(c.kind == kind for c in changes)

    try:
        first = group.start(START)
        group.send_signal(0, signal.SIGKILL)
        assert wait_for(lambda: look("back"), 60, interval=0.05), changes
        ended, back = changes
        assert (ended.kind, ended.index, ended.where, ended.address) == ("ended", 0, first[0], first[0])
        assert ended.how == "was killed by signal SIGKILL"
        assert (back.index, back.address) == (0, first[0]) and group.addresses == first
        changes.clear()

        port = int(first[0].rsplit(":", 1)[1])
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        group.send_signal(0, signal.SIGKILL)
        assert wait_for(lambda: group.processes[0].poll() is not None, 30)

        with holder:
            assert wait_for(lambda: listen_on_if_free(holder, port), 30, interval=0.01)
            assert wait_for(lambda: look("given up"), 120, interval=0.05), changes
        # the kill and two failed starts: with the first end, four within the window
        assert [c.kind for c in changes] == ["ended", "ended", "given up"], changes
        assert "Address already in use" in changes[-1].how and changes[-1].address == ""
        assert policy.ends(0) == 4
        assert group.addresses == [first[1]] and _call(first[1], os.getpid) > 0
        assert group.supervise(policy, START, 30.0) == []  # given up: left alone
    finally:
        group.stop(30.0)
    assert not any(pid_alive(p.pid) for p in group.processes)


def test_restart_policy_backs_off_and_detects_a_crash_loop_with_a_fake_clock():
    now = [1000.0]
    policy = RestartPolicy(clock=lambda: now[0])  # 0.5 s doubling to 30 s; 5 ends in 120 s
    assert [policy.ended(0) for _ in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert policy.ended(1) == 0.5  # each process counts its own ends
    assert policy.ended(0) is None and policy.ends(0) == 5  # the fifth within the window
    now[0] += 121.0
    assert policy.ended(0) == 0.5 and policy.ends(0) == 1  # the old ends left the window
    capped = RestartPolicy(first_delay=10.0, most_delay=30.0, crash_loop_ends=100, clock=lambda: now[0])
    assert [capped.ended(2) for _ in range(4)] == [10.0, 20.0, 30.0, 30.0]
    spread = RestartPolicy(crash_loop_window=10.0, clock=lambda: now[0])
    for _ in range(10):  # one end every 11 s never makes a crash loop, nor a long backoff
        assert spread.ended(3) == 0.5
        now[0] += 11.0


def test_a_group_needs_a_process():
    with pytest.raises(ValueError, match="at least one"):
        WorkerGroup(0, host="127.0.0.1")


def test_a_start_that_runs_out_of_time_is_still_a_timeout_error():
    group = WorkerGroup(1, host="127.0.0.1", secret=KEY.encode())
    with pytest.raises(StartTimeout, match="did not print its address in time") as caught:
        group.start(0.0)  # no process prints its address within no time at all
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, StartError)
    assert all(p.poll() is not None for p in group.processes)  # stopped and reaped
