"""Smoke test of the benchmark runner: one tiny case end to end (numbers are not checked)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(150)  # about 9 s on a quiet machine; a busy one stretches it several times
def test_bench_overhead_prints_a_table_row(tmp_path):
    png = tmp_path / "bench.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    proc = subprocess.run(
        [sys.executable, "-m", "torchfeed", "bench", "overhead", "--seconds", "0.3", *plot],
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"^case\s+metric\s+torch\s+torchfeed\s+ratio\s+target\s+result\s+trainer CPU ms/batch",
        proc.stdout,
        re.M,
    ), proc.stdout
    row = re.search(
        r"^overhead\s+items/s\s+[\d,.]+\s+[\d,.]+\s+[\d.]+x\s+>= 3x\s+(PASS|FAIL)\s+[\d.]+ / [\d.]+\s*$",
        proc.stdout,
        re.M,
    )
    assert row, proc.stdout
    if plot:  # issue 13: the torchfeed runs drawn
        assert png.read_bytes()[:4] == b"\x89PNG" and "plot of the torchfeed runs" in proc.stdout


def test_bench_rejects_unknown_case():
    proc = subprocess.run(
        [sys.executable, "-m", "torchfeed", "bench", "nosuchcase", "--seconds", "0.1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "unknown benchmark case" in proc.stderr
