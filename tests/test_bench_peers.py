"""Smoke test of benchmarks/peers.py on torch and torchfeed (tiny sizes; numbers not checked).

The peers (Ray Data, the tf.data service, SPDL, torchdata.nodes) come with the `bench` extra,
which CI does not install: the runner must work, and report them, without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchfeed.tools import bench_peers, bench_systems

RUNNER = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


@pytest.mark.slow
@pytest.mark.timeout(240)  # about 10 s on a quiet machine; a busy one stretches it several times
def test_peers_runner_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(RUNNER), "--cases", "jpeg", "--systems", "torch,torchfeed"]
    cmd += ["--rounds", "1", "--epochs", "2", "--images", "16", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| case | system | epoch 1 samples/s | later samples/s |" in proc.stdout
    for system in ("torch", "torchfeed"):
        assert f"| jpeg | {system} | " in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert set(result["cases"]) == {"jpeg"}
    entry = result["cases"]["jpeg"]
    assert entry["samples"] == 16 and entry["batch_size"] == 32
    assert set(entry["systems"]) == {"torch", "torchfeed"}
    for s in entry["systems"].values():
        assert s["rounds"] == 1 and not s["errors"], s
        assert s["epoch1"] > 0 and s["later"] > 0 and s["trainer_cpu_ms_per_batch"] > 0
        assert s["peak_rss_mb"] > 0 and s["processes"] >= 3  # the trainer and 2 loading processes


def test_a_missing_peer_is_reported_not_run(monkeypatch):
    monkeypatch.setattr(bench_peers, "missing", lambda system: "nosuchpackage" if system == "ray" else None)
    monkeypatch.setattr(bench_peers, "run_child", lambda *a, **k: pytest.fail("a missing peer was run"))
    result = bench_peers.run(["tiny"], ["ray"], rounds=1, log=lambda line: None)
    assert result["cases"]["tiny"]["systems"]["ray"] == {"not_installed": "nosuchpackage"}
    assert "| tiny | ray | not installed (nosuchpackage) |" in "\n".join(bench_peers.iter_table(result))


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown case or system"):
        bench_peers.run(["jpeg"], ["nosuchloader"], rounds=1)
    assert bench_systems.missing("torch") is None
