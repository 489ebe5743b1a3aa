"""The small operating-system helpers of torchfeed.util."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers import wait_for
from torchfeed import util


def test_free_port_can_be_bound():
    port = util.free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_pid_alive_for_running_zombie_and_reaped_processes():
    assert util.pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    # exited but not reaped: a zombie counts as dead
    assert wait_for(lambda: not util.pid_alive(proc.pid), 10)
    proc.wait(timeout=10)
    assert not util.pid_alive(proc.pid)


def test_cpu_count_is_positive():
    assert util.cpu_count() >= 1


def test_double_delay_doubles_from_first_up_to_most():
    delays = [0.0]
    for _ in range(6):
        delays.append(util.double_delay(delays[-1], 0.1, 1.0))
    assert delays[1:] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_atomic_write_bytes_and_writer(tmp_path):
    path = tmp_path / "sub" / "file"
    util.atomic_write(path, b"one")
    assert path.read_bytes() == b"one"
    util.atomic_write(path, lambda f: f.write(b"two"))
    assert path.read_bytes() == b"two"
    assert os.listdir(path.parent) == ["file"]  # no temporary file left
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~util.umask())


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"old")

    def broken(f):
        f.write(b"partial")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        util.atomic_write(path, broken)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file"]


def test_saved_env_restores_set_and_unset_variables(monkeypatch):
    monkeypatch.setenv("TORCHFEED_TEST_A", "a")
    monkeypatch.delenv("TORCHFEED_TEST_B", raising=False)
    with util.saved_env(["TORCHFEED_TEST_A", "TORCHFEED_TEST_B"]) as saved:
        assert saved == {"TORCHFEED_TEST_A": "a", "TORCHFEED_TEST_B": None}
        os.environ["TORCHFEED_TEST_A"] = "changed"
        os.environ["TORCHFEED_TEST_B"] = "new"
    assert os.environ["TORCHFEED_TEST_A"] == "a"
    assert "TORCHFEED_TEST_B" not in os.environ
