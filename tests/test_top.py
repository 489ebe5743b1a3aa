"""`torchfeed top`: worker statistics over an authenticated connection, on real workers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

import torchfeed
from helpers import SleepDataset, wait_for

pytestmark = pytest.mark.timeout(60)


def top(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchfeed", "top", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def fresh2():
    """Two workers of this test alone: the shared ones carry errors other tests provoked."""
    with torchfeed.LocalWorkers(2) as w:
        yield w.addresses


@pytest.mark.slow
def test_once_json_on_busy_workers(fresh2, tmp_path):
    workers2 = fresh2
    ds = torchfeed.RemoteDataset(workers2, SleepDataset, 200, 0.001)
    assert len(list(torchfeed.RemoteDataLoader(ds, batch_size=4))) == 50
    listing = tmp_path / "workers.txt"
    listing.write_text(workers2[1] + "\n")
    proc = top(workers2[0], "--workers-file", str(listing), "--once", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = {r["address"]: r for r in doc["workers"]}
    assert set(rows) == set(workers2)
    for row in rows.values():
        assert (
            row["pid"] > 0
            and row["rss_bytes"] > 10e6
            and 0 <= row["cpu_percent"] <= 100 * (os.cpu_count() or 1) * 1.1
        )
        assert row["clients"] >= 2  # this process and `top` itself
        assert row["queued"] == 0 and row["errors"] == 0
        assert {"requests_per_s", "mb_per_s_sent", "bytes_sent"} <= set(row)
    assert sum(r["requests"] for r in rows.values()) >= 50
    assert sum(r["bytes_sent"] for r in rows.values()) > 0


@pytest.mark.slow
def test_unreachable_worker_is_a_row_not_a_crash(workers2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    proc = top(workers2[0], dead, "--once", "--json", "--timeout", "2")
    assert proc.returncode == 0, proc.stderr
    rows = {r["address"]: r for r in json.loads(proc.stdout)["workers"]}
    assert "error" in rows[dead] and "pid" in rows[workers2[0]]
    proc = top(workers2[0], "--once")  # the table
    assert proc.returncode == 0 and "cpu_percent" in proc.stdout and workers2[0] in proc.stdout, proc.stdout


@pytest.mark.slow
def test_live_view_refreshes_until_interrupted(workers2):
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchfeed", "top", *workers2, "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    stdout = proc.stdout
    assert stdout is not None and proc.stderr is not None
    reader = threading.Thread(target=lambda: seen.extend(iter(stdout.readline, "")), daemon=True)
    reader.start()
    assert wait_for(lambda: sum("torchfeed top" in line for line in seen) >= 3, timeout=30), seen
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=20) == 0, proc.stderr.read()
    reader.join(5)
    out = "".join(seen)
    assert out.count("\x1b[H\x1b[2J") >= 3, out[-500:]
    assert all(a in out for a in workers2)


def test_wrong_usage_says_what_to_do():
    proc = top("--once")
    assert proc.returncode == 2 and "--workers-file" in proc.stderr
    proc = top("127.0.0.1:1", "--json")
    assert proc.returncode == 2 and "--once" in proc.stderr


def test_table_and_json_use_the_same_names(workers2):
    from torchfeed.cli import top as topcli

    rows = topcli.collect(workers2[:1], timeout=10)
    header, line = topcli.format_rows(rows).splitlines()
    names = header.split()
    assert names[0] == "address" and len(names) == len(line.split())
    for name, cell in zip(names, line.split()):
        assert name in rows[0], f"the table's column {name!r} is not a key of the JSON rows"
        value = rows[0][name]
        assert cell == (value if isinstance(value, str) else cell) and (
            isinstance(value, str)
            or (cell == "-" and value is None)  # no figure yet (a cache nobody looked in)
            or float(cell) == pytest.approx(value, abs=0.5)
        ), (name, cell, value)
