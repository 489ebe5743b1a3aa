"""torchfeed.checkpoint: atomic save/load (local and fsspec URLs) and Preemption."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import wait_for
from torchfeed import checkpoint
from torchfeed.checkpoint import Preemption


def _state(v: float) -> dict:
    return {
        "model": {"w": torch.full((3, 4), v), "b": torch.arange(3)},
        "step": int(v),
        "tags": ["a", {"x": v}],
    }


def _same(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["model"]["w"], b["model"]["w"])
        and torch.equal(a["model"]["b"], b["model"]["b"])
        and a["step"] == b["step"]
        and a["tags"] == b["tags"]
    )


def test_local_roundtrip_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "deep" / "dir" / "ckpt.pt"
    assert not checkpoint.exists(path)
    checkpoint.save(_state(1.0), path)
    checkpoint.save(_state(2.0), str(path))  # replaces the first one
    assert checkpoint.exists(path) and _same(checkpoint.load(path), _state(2.0))
    assert os.listdir(path.parent) == ["ckpt.pt"]
    assert _same(checkpoint.load(f"file://{path}"), _state(2.0))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "missing.pt")


def test_fsspec_url_roundtrip():
    pytest.importorskip("fsspec")
    url = f"memory://torchfeed-test-{os.getpid()}/ckpt.pt"
    checkpoint.save(_state(1.0), url)
    checkpoint.save(_state(3.0), url)
    assert checkpoint.exists(url) and _same(checkpoint.load(url), _state(3.0))
    import fsspec

    fs = fsspec.filesystem("memory")
    assert fs.ls(f"/torchfeed-test-{os.getpid()}", detail=False) == [f"/torchfeed-test-{os.getpid()}/ckpt.pt"]
    with pytest.raises(FileNotFoundError):
        checkpoint.load(f"memory://torchfeed-test-{os.getpid()}/none.pt")


SLOW_SAVER = textwrap.dedent("""
    import sys, time, torch
    from torchfeed import checkpoint

    class Slow:
        # pickled by torch.save: announces it is being written, then blocks
        def __reduce__(self):
            open(sys.argv[2], "w").close()
            time.sleep(60)
            return (int, (0,))

    checkpoint.save({"model": {"w": torch.zeros(1000, 1000)}, "slow": Slow()}, sys.argv[1])
""")


def test_killed_during_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    started = tmp_path / "started"
    checkpoint.save(_state(1.0), path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVER, str(path), str(started)])
    try:

        def writing() -> bool:
            assert proc.poll() is None, "the saving process ended early"
            return started.exists()

        assert wait_for(writing, 60), "the saving process never started writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _same(checkpoint.load(path), _state(1.0))
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".ckpt.pt.tmp-")]
    assert len(leftovers) == 1  # the killed writer's partial file, never read
    checkpoint.save(_state(2.0), path)  # the next save removes it (its process is gone)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "started"]
    assert _same(checkpoint.load(path), _state(2.0))


def test_preemption_flag_and_handler_restore(monkeypatch):
    monkeypatch.delenv("TORCHFEED_PREEMPT_SIGNAL", raising=False)
    before = signal.getsignal(signal.SIGUSR2)
    with Preemption() as pre:
        assert not pre.requested and not pre.should_stop()
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for(lambda: pre.requested, 5)
        assert pre.requested and pre.should_stop() and pre.received == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) == before
    monkeypatch.setenv("TORCHFEED_PREEMPT_SIGNAL", "USR1")  # as scripts from `torchfeed slurm --signal USR1`
    with Preemption() as pre:
        assert pre.signals == [signal.SIGUSR1]
    with pytest.raises(ValueError, match="unknown signal"):
        Preemption(["NOPE"])


def test_requeue(monkeypatch, tmp_path, caplog):
    for name in ("SLURM_JOB_ID", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    with Preemption(["USR2"]) as pre, caplog.at_level(logging.WARNING, "torchfeed.checkpoint"):
        assert pre.requeue() is False
        assert "not running under Slurm" in caplog.text
    # a stand-in `scontrol` records its arguments (the real one is used by tests/test_slurm.py)
    record = tmp_path / "args"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with Preemption(["USR2"]) as pre:
        assert pre.requeue() is True
    assert record.read_text().split() == ["requeue", "4242"]
    with Preemption(["USR2"], requeue=False) as pre:
        assert pre.requeue() is False


class _RunsCode:
    """A crafted checkpoint: unpickling it calls os.system (here a harmless file touch)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_runs_no_code_by_default(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "crafted.pt"
    torch.save({"model": {}, "payload": _RunsCode(marker)}, path)
    with pytest.raises(Exception, match="weights_only"):
        checkpoint.load(path)
    assert not marker.exists()
    # a training checkpoint of model, optimizer and loader states loads as it is
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "loader": {"generators": {"x": b"\x01"}}}
    checkpoint.save(state, tmp_path / "ok.pt")
    assert checkpoint.load(tmp_path / "ok.pt")["loader"] == state["loader"]
