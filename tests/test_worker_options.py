"""WorkerOptions flows whole: every field has a command-line form that reads back the same, every
starter writes it, the server and its cache lane serve under it, and the docs' table is made
from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from torchfeed.worker import samplestore
from torchfeed.worker.objects import ConnectionLimits
from torchfeed.worker.options import WorkerOptions, options_table
from torchfeed.worker.process import worker_command
from torchfeed.worker.server import WorkerServer

DOCS = Path(__file__).resolve().parent.parent / "docs"

# a value other than the default for every field (a new field without one fails the test below)
CHANGED: dict[str, Any] = {
    "timeout": 30.0,
    "parallel": 3,
    "threads": 2,
    "handshake_timeout": 4.0,
    "cache_size": 8 << 30,
    "shm_bytes": 256 << 20,
    "metrics_port": 9400,
    "metrics_host": "0.0.0.0",
    "max_call_bytes": 12345,
    "max_queued_requests": 17,
    "max_queued_bytes": 99999,
    "max_unsent_bytes": 77777,
    "max_worker_queued_requests": 33,
    "max_worker_queued_bytes": 888888,
    "max_refs": 9,
    "max_handshakes": 5,
    "trusted_network_no_encryption": True,
    "reachable_at": ("gw.example:9000", "*:7000"),
}


def _parsed(argv: list[str]) -> WorkerOptions:
    parser = argparse.ArgumentParser()
    WorkerOptions.add_arguments(parser)
    return WorkerOptions.from_args(parser.parse_args(argv))


def test_every_field_reads_back_from_its_command_line():
    names = {f.name for f in dataclasses.fields(WorkerOptions)}
    assert names == set(CHANGED), "give the new field a changed value in CHANGED"
    options = WorkerOptions(**CHANGED)
    assert options != WorkerOptions()
    assert _parsed(options.to_args()) == options
    assert _parsed([]) == WorkerOptions()
    assert WorkerOptions().to_args() == []  # only what differs from the defaults is written


def test_every_bound_of_a_connection_is_an_option():
    """The server's ConnectionLimits come whole from the options (no bound without a flag)."""
    options = WorkerOptions(**CHANGED)
    limits = options.limits()
    for f in dataclasses.fields(ConnectionLimits):
        assert getattr(limits, f.name) == CHANGED[f.name]


def test_the_docs_table_is_made_from_the_fields():
    page = (DOCS / "workers.md").read_text()
    start, end = "<!-- worker options: start -->\n", "<!-- worker options: end -->"
    table = page[page.index(start) + len(start) : page.index(end)]
    assert table == options_table(), (
        "docs/workers.md's option table differs from the fields: paste "
        "torchfeed.worker.options.options_table() between its markers"
    )
    for f in dataclasses.fields(WorkerOptions):
        assert f"`--{f.name.replace('_', '-')}" in table


def test_the_server_and_its_lane_serve_under_the_options_given():
    options = WorkerOptions(
        timeout=30, parallel=2, max_handshakes=5, max_unsent_bytes=4096, shm_bytes=1 << 20
    )
    server = WorkerServer("127.0.0.1", 0, options=options)
    try:
        assert server.options is options
        assert (server.timeout, server.parallel, server.shm_bytes) == (30.0, 2, 1 << 20)
        assert server.limits == options.limits()
        assert server.doorman.max_pending == 5
    finally:
        server.stop()
    lane = samplestore.Lane("127.0.0.1", server.secret, options)
    assert lane.options is options  # the lane's server is made from the same object (worker/lanes.py)


def test_server_shortcuts_replace_the_options_and_old_names_warn():
    server = WorkerServer(port=0, timeout=7, limits=ConnectionLimits(max_unsent_bytes=4096))
    try:
        assert server.options.timeout == 7 and server.limits.max_unsent_bytes == 4096
    finally:
        server.stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        server = WorkerServer(port=0, max_pending_handshakes=3)
    server.stop()
    assert server.options.max_handshakes == 3
    assert any("max_handshakes" in str(w.message) and w.category is FutureWarning for w in caught)


def test_bad_options_are_refused_once_with_what_to_fix():
    with pytest.raises(ValueError, match="parallel must be >= 1"):
        WorkerServer(port=0, parallel=0)
    with pytest.raises(TypeError, match="unknown worker option 'max_ref'.*max_refs"):
        WorkerServer(port=0, max_ref=3)
    with pytest.raises(ValueError, match="cache size '8 gigs' not understood"):
        WorkerOptions(cache_size="8 gigs")  # type: ignore[arg-type]  # text is parsed; the field types what it keeps


def test_starters_write_the_options_whole(tmp_path):
    options = WorkerOptions(max_refs=9, cache_size="1GiB", reachable_at=("*:7000",))  # type: ignore[arg-type]  # text is parsed
    command = worker_command("127.0.0.1", 0, options)
    assert command[command.index("--max-refs") + 1] == "9"
    assert command[command.index("--reachable-at") + 1] == "*:7000"
    # torchfeed slurm takes every option for its workers and writes them into the batch script
    script = subprocess.run(
        [sys.executable, "-m", "torchfeed", "slurm", "--dry-run", "--max-refs", "9", "--cache-size", "8GiB"]
        + ["--job-dir", str(tmp_path), "--", "python", "train.py"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    worker_line = next(line for line in script.splitlines() if "-m torchfeed worker" in line)
    assert "--max-refs 9" in worker_line and f"--cache-size {8 << 30}" in worker_line
