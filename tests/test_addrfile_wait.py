"""RemoteDataset.from_file on a workers file that is not there yet.

Slurm and torchrun start trainers and workers together: the workers file may appear, or
fill, after the trainer first reads it. A folder that does not exist is a wrong path (no
worker creates folders) and is said at once; a missing or empty file is waited for, and
the wait is said under ``torchfeed.workers`` as the wait for a direct address is.
"""

from __future__ import annotations

import logging
import threading

import pytest

import torchfeed
from helpers import RangeDataset
from torchfeed.client import reach
from torchfeed.protocol.addrfile import announce

pytestmark = pytest.mark.timeout(120)


def waiting_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "torchfeed.workers" and r.levelno == logging.WARNING and "workers file" in r.getMessage()
    ]


def test_a_workers_file_in_a_folder_that_does_not_exist_is_refused_at_once(tmp_path, caplog):
    path = tmp_path / "no-such-job" / "workers"
    with pytest.raises(FileNotFoundError, match=r"its folder \S*no-such-job does not exist.*--address-file"):
        torchfeed.RemoteDataset.from_file(str(path), RangeDataset, 4, wait_timeout=2)
    assert waiting_lines(caplog) == []  # not waited for


@pytest.mark.parametrize(
    ("content", "state"), [(None, "does not exist"), ("", "is empty")], ids=["missing", "empty"]
)
def test_a_missing_or_empty_workers_file_is_waited_for_and_said(
    tmp_path, caplog, monkeypatch, content, state
):
    monkeypatch.setattr(reach, "REFUSED_LOG_EVERY", 0.5)  # progress lines within the short wait
    path = tmp_path / "workers"
    if content is not None:
        path.write_text(content)
    caplog.set_level(logging.WARNING, logger="torchfeed.workers")
    with pytest.raises(torchfeed.Timeout) as info:
        torchfeed.RemoteDataset.from_file(str(path), RangeDataset, 4, wait_timeout=2)
    message = str(info.value)
    assert f"{path} {state} after waiting 2 s" in message and "--address-file" in message
    assert "lists 0" not in message
    first, *progress = waiting_lines(caplog)
    assert f"workers file {path} {state}; waiting up to" in first and f"--address-file {path}" in first
    assert progress and all(f"workers file {path} {state} after" in line for line in progress)


def test_a_workers_file_written_after_the_call_started_builds_the_dataset(workers2, tmp_path, caplog):
    path = tmp_path / "workers"
    caplog.set_level(logging.WARNING, logger="torchfeed.workers")
    late = threading.Timer(1.0, announce, (workers2[0], str(path)))  # what `--address-file` does
    late.start()
    try:
        ds = torchfeed.RemoteDataset.from_file(str(path), RangeDataset, 4, wait_timeout=60)
    finally:
        late.cancel()
    try:
        assert ds.workers == [workers2[0]] and len(ds) == 4
        assert ds[3][1] == 3
    finally:
        ds.close()
    assert any(f"workers file {path} does not exist" in line for line in waiting_lines(caplog))
