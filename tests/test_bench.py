"""The benchmark runner end to end on one tiny case (numbers are not checked), and the bare
processes that measure ceilings."""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import subprocess
import sys
from functools import partial

import pytest
import torch

from torchfeed.tools.bench_ceiling import Bare


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
    if plot:  # the torchfeed runs drawn
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


class _Logged(torch.utils.data.Dataset):
    """Each sample loaded appends ``pid key`` to a file (what a bare process built)."""

    def __init__(self, path):
        self.path = path

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if i == 63:
            raise ValueError("sample 63 is broken")
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return torch.tensor([i])


def test_bare_processes_share_the_work_equally_and_report_failures(tmp_path):
    log = tmp_path / "built"
    split = lambda ds: (ds.__getitem__, lambda x: x + 1)  # noqa: E731 - decode, then
    with Bare(2, partial(_Logged, log), split) as bare:
        batches = [list(range(i, i + 8)) for i in range(0, 40, 8)]
        for mode in ("epoch", "cached"):
            log.write_text("")
            assert bare.run(mode, batches) > 0
            rows = [line.split() for line in log.read_text().splitlines()]
            by_pid = collections.Counter(pid for pid, _ in rows)
            assert sorted(int(k) for _, k in rows) == list(range(40))  # each sample once
            assert sorted(by_pid.values()) == [20, 20] and str(os.getpid()) not in by_pid
        log.write_text("")
        bare.run("parts", [list(range(10))])
        assert sorted(
            collections.Counter(line.split()[0] for line in log.read_text().splitlines()).values()
        ) == [5, 5]
        with pytest.raises(RuntimeError, match="sample 63 is broken"):
            bare.run("epoch", [[60, 61, 62, 63]])
        with pytest.raises(ValueError, match="parts of one"):
            bare.run("parts", batches)
        assert bare.run("epoch", [[1, 2]]) > 0  # still serving after a failure
        procs = bare.processes
    assert not any(p.is_alive() for p in procs)
