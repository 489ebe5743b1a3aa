"""A worker's cache lane applies the worker's hardening options (real worker process)."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

import torchfeed
from helpers import WORKER_COMMAND
from torchfeed.errors import FrameTooLarge
from torchfeed.worker import lanes

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def worker():
    proc = subprocess.Popen(
        [
            *WORKER_COMMAND,
            "--port",
            "0",
            "--max-call-bytes",
            "4096",
            "--handshake-timeout",
            "1",
            "--max-handshakes",
            "2",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    assert address, f"worker did not start (exit code {proc.poll()})"
    yield address
    proc.terminate()
    proc.wait(10)


def test_the_lane_takes_the_workers_call_size_and_handshake_bounds(worker):
    assert torchfeed.rpc_async(worker, len, args=(b"x" * 1000,)).wait() == 1000
    lane = torchfeed.rpc_async(worker, lanes.lane_address, args=(None,)).wait()
    assert lane and lane != worker
    with pytest.raises(
        FrameTooLarge, match="limit of 4,096"
    ):  # --max-call-bytes 4096, as on the worker itself
        torchfeed.rpc_async(lane, len, args=(b"x" * 10_000,)).wait()
    assert torchfeed.rpc_async(lane, len, args=(b"x" * 1000,)).wait() == 1000
    host, port = lane.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as idle:  # never authenticates
        idle.settimeout(8)  # --handshake-timeout 1; the default would keep it 10 s
        try:
            while idle.recv(4096):  # the lane's HELLO, then its close
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail("the lane kept an unauthenticated connection past the worker's --handshake-timeout")
