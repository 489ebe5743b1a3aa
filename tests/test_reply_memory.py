"""A worker's reply cannot make the trainer allocate memory its bytes do not pay for.

Each test runs a real worker that sends a crafted frame and checks the trainer's peak
resident memory (VmHWM, reset before the call through /proc/self/clear_refs) stays flat.
"""

from __future__ import annotations

import os
import pickle

import pytest

import torchfeed

pytestmark = pytest.mark.timeout(120)

# None, then LONG_BINPUT into memo slot 2**26: CPython's unpickler sizes its memo to 2**27
# slots (1 GiB, zeroed) before it stores anything
MEMO_BOMB = b"\x80\x05N" + b"r" + (1 << 26).to_bytes(4, "little") + b"."
FLAT = 64 << 20  # bytes the peak may grow by during one refused call


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc/self/status")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak()


def _send_memo_bombs() -> None:
    """On a worker: replies to "bomb" and every error description become MEMO_BOMB."""
    import torchfeed.worker.serverconn as conn

    plain = conn.serialize.dumps_reply
    conn.serialize.dumps_reply = lambda obj: (MEMO_BOMB, []) if obj == "bomb" else plain(obj)
    conn._describe_exception = lambda exc: MEMO_BOMB


def _raise() -> None:
    raise ValueError("x")


def test_the_memo_bomb_is_real():
    # what the worker sends is a pickle plain pickle loads (allocating the memo)
    assert pickle.loads(b"\x80\x05N" + b"r" + (5).to_bytes(4, "little") + b".") is None


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's clear_refs")
def test_a_far_memo_slot_is_refused_before_the_memo_grows(fresh_workers):
    address = fresh_workers(1).addresses[0]
    torchfeed.rpc_async(address, _send_memo_bombs).wait()
    for fn, args in ((str, ("bomb",)), (_raise, ())):  # a REPLY frame, then an ERROR frame
        before = _reset_peak()
        with pytest.raises(torchfeed.UnsafeReplyError, match="memo slot 67108864"):
            torchfeed.rpc_async(address, fn, args=args, timeout=60).wait()
        grown = _peak() - before
        assert grown < FLAT, f"the trainer's peak memory grew by {grown >> 20} MiB"
    assert torchfeed.rpc_async(address, sum, args=([1, 2],)).wait() == 3  # the worker goes on serving
