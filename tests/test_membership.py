"""A dataset's membership on its own: the books (workers, lost ones, listeners) and the thread
that brings lost workers back, with an owner that builds nothing remote (a real listening
socket stands for the worker the probe connects to)."""

from __future__ import annotations

import gc
import socket
import threading

from helpers import wait_for
from torchfeed.errors import WorkerLost
from torchfeed.loader.membership import Membership


class Owner:
    """Builds by rule: fails ``fail`` times per worker, then succeeds; records drops."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.built: list[str] = []
        self.dropped: list[str] = []

    def build(self, workers, strict=False):
        failed = {}
        for w in workers:
            if self.fail > 0:
                self.fail -= 1
                failed[w] = WorkerLost(f"{w} refused")
            else:
                self.built.append(w)
        return failed

    def drop(self, address):
        self.dropped.append(address)


class Recorder:
    def __init__(self):
        self.seen: list[tuple[str, bool]] = []

    def worker_joined(self, address):
        self.seen.append((address, True))

    def worker_removed(self, address):
        self.seen.append((address, False))


def _membership_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "torchfeed-membership"}


def test_a_lost_worker_is_retried_until_it_builds_and_the_listeners_hear_it_is_back():
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        owner = Owner(fail=1)  # the first retry fails too: backoff, then the next one builds
        members = Membership([address], owner.build, owner.drop)
        heard = Recorder()
        members.listeners.add(heard)
        members.worker_lost(address, WorkerLost("connection reset"))
        members.worker_lost(address, WorkerLost("reported twice"))  # once is enough
        assert owner.dropped == [address]
        assert "connection reset" in members.lost_errors()[address]
        assert wait_for(lambda: heard.seen == [(address, True)], timeout=30)
        assert owner.built == [address] and members.lost_errors() == {}
        members.remove([address])
        assert heard.seen[-1] == (address, False) and members.current() == []


def test_the_membership_keeps_no_dataset_alive_and_its_thread_ends_with_the_owner():
    before = _membership_threads()
    owner = Owner(fail=10**6)
    members = Membership(["127.0.0.1:9"], owner.build, owner.drop)
    members.mark_lost("127.0.0.1:9", WorkerLost("gone"))
    started = _membership_threads() - before
    assert len(started) == 1
    del owner
    gc.collect()
    assert not members.owned()
    assert wait_for(lambda: not any(t.is_alive() for t in started), timeout=30)
