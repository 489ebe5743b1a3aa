"""LocalWorkers(start="fork"): workers forked from the trainer, as torch forks its DataLoader workers."""

from __future__ import annotations

import os
import socket

import pytest

import torchfeed
from helpers import PROMPT, RangeDataset, wait_for
from torchfeed.util import pid_alive

pytestmark = pytest.mark.timeout(180)


def _parent_pid() -> int:
    return os.getppid()


def test_forked_workers_load_like_spawned_ones_and_are_reaped():
    with torchfeed.LocalWorkers(2, start="fork") as w:
        ds = torchfeed.RemoteDataset(w.addresses, RangeDataset, 40)
        pids = ds.run_on_workers(os.getpid)
        assert set(pids.values()) == {p.pid for p in w.processes}
        assert set(ds.run_on_workers(_parent_pid).values()) == {os.getpid()}  # forked from here
        got = [
            int(i) for _, y in torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True, seed=1) for i in y
        ]
        assert sorted(got) == list(range(40))
        procs = w.processes
    assert all(p.returncode is not None for p in procs)  # reaped: no zombie left
    assert not any(pid_alive(p.pid) for p in procs)


def test_a_forked_worker_does_not_hold_this_process_sockets_open():
    """The parent's end of a connection closes for its peer when the parent closes it."""
    ours, peer = socket.socketpair()
    peer.settimeout(PROMPT)
    with torchfeed.LocalWorkers(1, start="fork") as w:
        ours.close()
        assert peer.recv(1) == b""  # end of stream: no forked worker keeps `ours` open
        ds = torchfeed.RemoteDataset(w.addresses, RangeDataset, 8)
        assert len(list(torchfeed.RemoteDataLoader(ds, batch_size=4))) == 2
    peer.close()


def test_a_killed_forked_worker_is_restarted_and_serves_again():
    with torchfeed.LocalWorkers(1, start="fork") as w:
        old = w.processes[0]
        w.kill(0)
        assert wait_for(lambda: old.poll() is not None, timeout=PROMPT)
        assert old.returncode == -9
        address = w.restart(0)
        ds = torchfeed.RemoteDataset([address], RangeDataset, 8)
        assert [int(i) for _, y in torchfeed.RemoteDataLoader(ds, batch_size=8) for i in y] == list(range(8))


def test_a_bad_start_method_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'auto', 'forkserver', 'spawn' or 'fork'"):
        torchfeed.LocalWorkers(1, start="thread")


def test_auto_forks_by_default_and_spawns_for_interpreter_variables(tmp_path):
    with torchfeed.LocalWorkers(1) as w:  # start="auto"
        assert w.fork and w.start == "forkserver" and w.fork_server is not None
        ds = torchfeed.RemoteDataset(w.addresses, RangeDataset, 4)
        assert set(ds.run_on_workers(_parent_pid).values()) == {w.fork_server.pid}  # not this process
    # PYTHONPATH is read by a new interpreter only: auto spawns one, fork refuses to ignore it
    (tmp_path / "only_there.py").write_text("WHERE = 'there'\n")
    env = {"PYTHONPATH": str(tmp_path)}
    for start in ("fork", "forkserver"):
        with pytest.raises(ValueError, match="PYTHONPATH.*start='spawn'"):
            torchfeed.LocalWorkers(1, start=start, env=env)
    with torchfeed.LocalWorkers(1, env=env) as w:
        assert not w.fork and w.start == "spawn"

        def where():
            import only_there  # type: ignore[import-not-found]  # written by this test, for the workers

            return only_there.WHERE

        assert torchfeed.rpc_async(w.addresses[0], where).wait() == "there"
