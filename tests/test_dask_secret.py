"""torchfeed.dask.Pool decides per Dask worker, when it joins, whether the secret may go there.

Real: a LocalCluster on loopback, its workers joining as it scales, the plugin the scheduler
hands them, the secret sent to each one separately, what each worker holds (read on it).
Simulated: that a worker joined over a network in clear. Every connection here is loopback,
so the test makes the check (dask/transport.in_clear, the function the pool asks) regard
the late worker's address as a network address; the pool's decision follows from it.
"""

from __future__ import annotations

import logging

import pytest

import torchfeed.dask as tfd
import torchfeed.dask.pool as pool_module
from helpers import dask_cluster, wait_for

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]


def _held(dask_worker=None):
    """On a Dask worker: what its torchfeed pool plugin holds (state, whether it has a secret)."""
    plugin = dask_worker.plugins.get(pool_module.POOL_PLUGIN)
    return plugin.state, plugin.sent is not None


def test_late_joiners_get_the_secret_only_when_their_connection_is_checked(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="torchfeed.dask")
    with dask_cluster() as cluster:
        with tfd.Pool(cluster, poll=0.25) as pool:
            assert len(pool.wait(1, 120)) == 1
            first = set(cluster.scheduler_info["workers"])
            held = pool.client.run(_held)
            assert all(state == "ready" for state, _ in held.values())
            kept = pool.client.run_on_scheduler(
                lambda dask_scheduler=None: dask_scheduler.worker_plugins[pool_module.POOL_PLUGIN]
            )
            assert (
                isinstance(kept, bytes) and pool.secret.value not in kept
            )  # what late joiners get: no secret
            real_check = pool_module.in_clear
            clear_all = [
                True
            ]  # a worker joining "over a network in clear": every later one, as the check sees it
            monkeypatch.setattr(
                pool_module, "in_clear", lambda a: (clear_all[0] and a not in first) or real_check(a)
            )
            pool.scale(2)
            assert wait_for(lambda: len(cluster.scheduler_info["workers"]) == 2, 120)
            late = (set(cluster.scheduler_info["workers"]) - first).pop()
            assert wait_for(lambda: any(late in r.getMessage() for r in caplog.records), 60)
            assert pool.client.run(_held, workers=[late])[late] == ("waiting", False)  # no secret there
            message = next(r.getMessage() for r in caplog.records if late in r.getMessage())
            assert "not encrypted and leaves this machine" in message and "secret_file=PATH" in message
            assert len(pool.addresses()) == 1
            # a loopback joiner, as the check really sees it: gets the secret and its worker starts
            clear_all[0] = False
            pool.scale(3)
            assert len(pool.wait(2, 120)) == 2
            states = pool.client.run(_held)
            assert states[late] == ("waiting", False)
            assert sorted(states.values()).count(("ready", True)) == 2


def _listen_as(uid: int, gid: int) -> tuple[int, int]:
    """A child process that listens on a loopback port as user ``uid``: (its pid, the port)."""
    import os
    import signal
    import socket

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the other user, listen, wait to be killed
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            os.close(r)
            os.write(w, str(s.getsockname()[1]).encode())
            signal.pause()  # until the test kills it
        finally:
            os._exit(0)
    os.close(w)
    port = int(os.read(r, 16))
    os.close(r)
    return pid, port


def test_a_dask_address_on_loopback_held_by_another_user_is_not_trusted_with_the_secret(other_user):
    """A Dask worker another local user runs on 127.0.0.1 would get the secret through Dask's
    clear connections: the kernel says whose the listening socket is, and only this user's
    (or root's) count as safe."""
    import os
    import signal
    import socket

    from torchfeed.dask.comms import in_clear, listener_uids

    pid, port = _listen_as(*other_user)
    try:
        assert listener_uids("127.0.0.1", port) == {other_user[0]}
        assert in_clear(f"tcp://127.0.0.1:{port}")
        with socket.socket() as mine:
            mine.bind(("127.0.0.1", 0))
            mine.listen()
            own = mine.getsockname()[1]
            assert listener_uids("127.0.0.1", own) == {os.geteuid()}
            assert not in_clear(f"tcp://127.0.0.1:{own}")
            # nothing of ours listens on ::1 or 127.0.0.2 at that port: another user could
            assert in_clear(f"tcp://[::1]:{own}") and in_clear(f"tcp://127.0.0.2:{own}")
            # localhost reaches 127.0.0.1 and ::1: safe while every socket there is ours
            assert not in_clear(f"tcp://localhost:{own}")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert in_clear(f"tcp://127.0.0.1:{port}")  # nobody listens there now: not provably safe
