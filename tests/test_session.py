"""Session: one owner for client state; independent sessions; forked children connect afresh."""

from __future__ import annotations

import functools
import os
import secrets
import threading
import time

import pytest

import torchfeed
from torchfeed import client
from torchfeed.protocol import auth

pytestmark = pytest.mark.timeout(60)

OTHER_SECRET = secrets.token_hex(32)


def _square(x):
    return x * x


def _wait_child(pid: int, timeout: float) -> int:
    """The exit status of child ``pid``; kills it after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child did not finish within {timeout:g} s")


def test_forked_child_gets_fresh_connections_and_the_parent_keeps_its_own(workers2):
    address = workers2[0]
    conn = client.connect(address)
    worker_pid = torchfeed.rpc_async(address, os.getpid, timeout=10).wait()
    pid = os.fork()
    if pid == 0:  # the child: only os._exit leaves it (no pytest teardown here)
        code = 1
        try:
            inherited_closed = conn.closed  # marked closed by the at-fork handler
            fresh = client.connect(address, timeout=10)
            served = torchfeed.rpc_async(address, _square, args=(7,), timeout=10).wait()
            code = 0 if inherited_closed and fresh is not conn and served == 49 else 2
        except BaseException:  # noqa: BLE001 - reported through the exit code
            code = 3
        finally:
            os._exit(code)
    assert _wait_child(pid, 30) == 0, "the child did not get a working connection of its own"
    # the parent's connection was not shut down by the child
    assert not conn.closed
    assert client.connect(address) is conn
    assert torchfeed.rpc_async(address, os.getpid, timeout=10).wait() == worker_pid
    assert torchfeed.rpc_async(address, _square, args=(5,), timeout=10).wait() == 25


def test_a_second_session_has_its_own_heartbeat_secret_and_connections(fresh_workers, workers2):
    default = client.default_session()
    before = (default.heartbeat_interval, default.heartbeat_timeout)
    other_workers = fresh_workers(1, env={auth.ENV_SECRET: OTHER_SECRET})
    other = other_workers.addresses[0]
    with torchfeed.Session(
        heartbeat_interval=0.3, heartbeat_timeout=3.0, secret=OTHER_SECRET, timeout=20
    ) as s:
        assert (s.heartbeat_interval, s.heartbeat_timeout, s.timeout) == (0.3, 3.0, 20.0)
        assert (default.heartbeat_interval, default.heartbeat_timeout) == before
        # its secret is its own: the default session (the tests' secret) is refused there
        assert s.rpc_async(other, _square, args=(3,)).wait() == 9
        with pytest.raises(torchfeed.AuthenticationError):
            torchfeed.rpc_async(other, _square, args=(3,), timeout=10).wait()
        # the same worker reached by both sessions: two connections, one each
        shared = workers2[0]
        mine = s.connect(shared, secret=os.environ[auth.ENV_SECRET])
        assert mine is not client.connect(shared)
        assert mine.session is s and client.connect(shared).session is default
        assert [c.address for c in s.connections()] == [other, shared]
    # closing the session closed only its own connections
    assert mine.closed and s.connections() == []
    assert not client.connect(shared).closed
    assert torchfeed.rpc_async(shared, _square, args=(4,), timeout=10).wait() == 16


def test_a_dataset_and_its_loaders_use_the_session_they_were_built_with(fresh_workers):
    other_workers = fresh_workers(1, env={auth.ENV_SECRET: OTHER_SECRET})
    with torchfeed.Session(secret=OTHER_SECRET, timeout=30) as s:
        ds = torchfeed.RemoteDataset(other_workers.addresses, list, range(6), session=s)
        assert ds.session is s and ds.timeout == 30.0 and ds.secret == OTHER_SECRET
        batches = [b.tolist() for b in torchfeed.RemoteDataLoader(ds, batch_size=4)]
        assert batches == [[0, 1, 2, 3], [4, 5]]
        assert {c.address for c in s.connections()} == set(other_workers.addresses)


def test_heartbeat_settings_are_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="interval < timeout"):
        torchfeed.Session(heartbeat_interval=5, heartbeat_timeout=1)
    monkeypatch.setenv("TORCHFEED_HEARTBEAT_INTERVAL", "0.5")
    monkeypatch.setenv("TORCHFEED_HEARTBEAT_TIMEOUT", "4")
    s = torchfeed.Session()
    assert (s.heartbeat_interval, s.heartbeat_timeout) == (0.5, 4.0)
    monkeypatch.setenv("TORCHFEED_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TORCHFEED_HEARTBEAT_TIMEOUT='soon'"):
        torchfeed.Session()


def test_remote_ref_call_returns_a_cancellable_handle(workers2):
    address = workers2[0]
    sleeper = torchfeed.rpc_async(
        address, functools.partial, args=(time.sleep,), rref=True, timeout=10
    ).wait()
    assert sleeper.alive
    got = []
    call = sleeper.call((0.0,), callback=lambda ok, value: got.append((ok, value)))
    assert isinstance(call, client.Call) and call.conn.address == sleeper.address
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [(True, None)]
    cancelled = []
    sleeper.call((0.5,), callback=lambda ok, value: cancelled.append(ok)).cancel()
    time.sleep(1.0)  # the call would have answered by now: a cancelled call's callback never runs
    assert cancelled == []
    sleeper.release()


def _slow_object():
    time.sleep(0.4)
    return bytearray(10)


@pytest.mark.slow
def test_a_cancelled_rref_call_frees_its_object():
    """The reply of a cancelled rref call (a fresh reference id) is dropped unread: the object
    it names must be released, or cancelled calls would use up the worker's --max-refs."""
    with torchfeed.LocalWorkers(1, extra_args=["--max-refs", "2"]) as w, torchfeed.Session(timeout=20) as s:
        address = w.addresses[0]
        for _ in range(2):
            call = s.call(address, _slow_object, rref=True, callback=lambda ok, value: None)
            time.sleep(0.2)  # the worker has started it
            call.cancel()
            time.sleep(0.5)  # its reply arrives and is dropped
        ref = s.rpc_async(address, bytearray, args=(1,), rref=True).wait()  # room again
        assert ref.alive


def _blob(n: int):
    import numpy as np

    return np.zeros(n, dtype=np.uint8)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_holds_the_buffer_pool(workers2):
    """A fork while a parent thread is inside the receive-block pool must not leave the
    child's copy of its lock held (the child's first large reply would wait forever)."""
    from torchfeed.protocol import buffers

    address = workers2[0]
    torchfeed.rpc_async(address, _blob, args=(1 << 20,), timeout=10).wait()  # imports warm
    held, release = threading.Event(), threading.Event()

    def inside_the_pool():
        with buffers.pool._lock:  # what a reader thread does while leasing a block
            held.set()
            release.wait()

    threading.Thread(target=inside_the_pool, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # child: one large reply, within a deadline
        out = []

        def go():
            try:
                torchfeed.rpc_async(address, _blob, args=(1 << 20,), timeout=5).wait()
                out.append(0)
            except BaseException:  # noqa: BLE001 - any failure is reported by the exit status
                out.append(1)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(12)
        os._exit(0 if out == [0] else 9 if not out else 8)
    release.set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # 9: the child deadlocked on the pool's lock


def test_a_connect_that_straddles_close_is_undone(workers2, monkeypatch):
    """close() while another thread is in its handshake: that connection must not survive
    in the closed session (it did: close() had emptied the cache before it was stored)."""
    in_handshake, real = threading.Event(), auth.client_session  # both paths' handshake

    def slow_handshake(*args, **kwargs):
        in_handshake.set()
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(auth, "client_session", slow_handshake)
    session = torchfeed.Session(timeout=10)
    outcome: list = []

    def connect():
        try:
            outcome.append(session.connect(workers2[0]))
        except BaseException as exc:  # noqa: BLE001 - the outcome is the point
            outcome.append(exc)

    t = threading.Thread(target=connect)
    t.start()
    assert in_handshake.wait(10)
    session.close()
    t.join(10)
    assert isinstance(outcome[0], torchfeed.ConnectionClosed), outcome
    assert "closed while connecting" in str(outcome[0])
    assert [c for c in session.connections() if not c.closed] == []
    monkeypatch.setattr(auth, "client_session", real)
    assert session.rpc_async(workers2[0], _square, args=(3,)).wait() == 9  # a later call reconnects
    session.close()


def test_stopping_local_workers_closes_every_sessions_connections_quietly():
    session = torchfeed.Session(timeout=20)
    w = torchfeed.LocalWorkers(1)
    try:
        torchfeed.RemoteDataset(w.addresses, list, range(4), session=session)
        conn = session.connections()[0]
    finally:
        w.close()
    assert conn.closed and isinstance(conn.error, torchfeed.ConnectionClosed), conn.error
    session.close()


def test_the_old_heartbeat_globals_warn_then_read_and_set_the_default_session(monkeypatch):
    from torchfeed import deprecation

    monkeypatch.setattr(deprecation, "_warned", set())
    session = client.default_session()
    old = session.heartbeat_interval, session.heartbeat_timeout
    with pytest.warns(FutureWarning, match=r"HEARTBEAT_INTERVAL is deprecated .* torchfeed.set_heartbeat"):
        assert client.HEARTBEAT_INTERVAL == old[0]
    with pytest.warns(FutureWarning, match="HEARTBEAT_TIMEOUT is deprecated"):
        assert client.HEARTBEAT_TIMEOUT == old[1]
    try:
        client.HEARTBEAT_TIMEOUT = 9.0  # what code written for the old globals does (warned once)
        assert client.default_session().heartbeat_timeout == 9.0
        client.HEARTBEAT_INTERVAL = 0.5
        assert client.default_session().heartbeat_interval == 0.5
        torchfeed.set_heartbeat(1.0, 7.0)
        assert (client.HEARTBEAT_INTERVAL, client.HEARTBEAT_TIMEOUT) == (1.0, 7.0)  # no stale copy
        with pytest.raises(ValueError, match="interval < timeout"):
            client.HEARTBEAT_TIMEOUT = 0.5
    finally:
        torchfeed.set_heartbeat(*old)


def test_remote_dataset_timeout_read_on_the_class_is_the_default_sessions():
    assert torchfeed.RemoteDataset.timeout == client.default_session().timeout
    assert isinstance(torchfeed.RemoteDataset.timeout * 2, float)


def _after(seconds: float, value):
    time.sleep(seconds)
    return value


def test_sessions_dropped_without_close_leave_nothing_behind(workers2):
    import gc

    from helpers import wait_for

    def own_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def use_and_drop():
        session = torchfeed.Session(timeout=10)
        assert session.rpc_async(workers2[0], _square, args=(4,)).wait() == 16

    use_and_drop()  # imports and pools warmed up
    gc.collect()
    threads, fds = threading.active_count(), own_fds()
    for _ in range(10):
        use_and_drop()
    gc.collect()
    # each dropped session's connection, reader thread and keeper are gone (they lived until exit)
    assert wait_for(lambda: threading.active_count() <= threads and own_fds() <= fds, timeout=10), (
        threading.active_count() - threads,
        own_fds() - fds,
    )


def test_a_dropped_session_finishes_its_calls_and_keeps_its_references(workers2):
    import gc

    future = torchfeed.Session(timeout=10).rpc_async(workers2[0], _after, args=(0.3, "done"))
    gc.collect()  # the session is unreachable but for the call in flight
    assert future.wait() == "done"
    ref = (
        torchfeed.Session(timeout=10)
        .rpc_async(workers2[0], functools.partial, args=(_square,), rref=True)
        .wait()
    )
    gc.collect()  # the session is unreachable but for the reference
    got: list = []
    done = threading.Event()

    def callback(ok, value):
        got.append((ok, value))
        done.set()

    ref.call((5,), callback=callback)
    assert done.wait(10) and got == [(True, 25)]
    assert ref.alive


def _stall_replies_after(nbytes: int, stalled: threading.Event, gate: threading.Event):
    """A relay hook: the worker's bytes stop after ``nbytes`` (mid-reply) until ``gate``."""
    from relay import W2C_SEALED

    def hook(conn, direction, offset, data):
        if direction == "w2c" and offset > W2C_SEALED + nbytes:
            stalled.set()
            gate.wait(30)
        return data

    return hook


def test_a_worker_stalling_in_the_middle_of_a_reply_is_lost_by_heartbeat(workers2):
    """The request leaves the pending table when its reply's header arrives; a worker that
    then stops in the middle of the body must still be declared lost (it hung forever)."""
    from relay import Relay

    stalled, gate = threading.Event(), threading.Event()
    relay = Relay(workers2[0], _stall_replies_after(1 << 20, stalled, gate))
    session = torchfeed.Session(timeout=30, heartbeat_interval=0.2, heartbeat_timeout=1.5)
    try:
        future = session.rpc_async(relay.address, bytes, args=(8 << 20,))
        assert stalled.wait(10)
        # the heartbeat's verdict, not the call's 30 s timeout (that one raises Timeout)
        with pytest.raises(torchfeed.WorkerLost, match="sent nothing"):
            future.wait()
    finally:
        gate.set()
        relay.close()
        session.close()


def test_a_call_cancelled_while_its_reply_arrives_is_not_called_back(workers2):
    from helpers import wait_for
    from relay import Relay

    stalled, gate = threading.Event(), threading.Event()
    relay = Relay(workers2[0], _stall_replies_after(1 << 20, stalled, gate))
    session = torchfeed.Session(timeout=30)
    try:
        make = session.rpc_async(relay.address, functools.partial, args=(bytes,), rref=True).wait()
        got: list = []
        call = make.call((8 << 20,), callback=lambda ok, value: got.append(ok))
        assert stalled.wait(10)
        assert wait_for(lambda: call.conn.num_pending() == 0)  # its header is in: the body arrives
        call.cancel()
        gate.set()
        # replies come in order: once a later call is answered, the cancelled one was received
        assert session.rpc_async(relay.address, _square, args=(3,)).wait() == 9
        assert got == []
    finally:
        gate.set()
        relay.close()
        session.close()


def test_cancelling_the_last_call_of_a_dropped_session_does_not_hang(workers2):
    """The call in flight held the last reference to its session: cancel() dropped it inside
    the connection's lock, and the session's finalizer, closing that connection, took the
    same lock (the thread hung for good)."""
    call = torchfeed.Session(timeout=10).call(workers2[0], time.sleep, (3,), callback=lambda ok, value: None)
    t = threading.Thread(target=call.cancel, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "Call.cancel() hung"
