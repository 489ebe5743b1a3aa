"""torchfeed against the loaders a user would pick instead, in the same run.

Systems (adapters in :mod:`torchfeed.tools.bench_systems`): torch's DataLoader, torchfeed,
torchdata.nodes, SPDL, Ray Data and the tf.data service, each with 2 loading processes.
Cases: ``jpeg`` (the JPEG pipeline of :mod:`torchfeed.tools.bench_jpeg`: decode, random
resized crop to 224, flip; batch 32), ``big`` (ready 3x224x224 float32 tensors, batch 64:
38.5 MB) and ``tiny`` (a scalar and an int, batch 1).

Every (round, case, system) runs in a fresh Python process (``python -m
torchfeed.tools.bench_peers``): imports, threads and memory of one system never reach
another, and each starts cold like a user's script. Inside it: set-up (timed apart), then
``epochs`` passes, each timed from asking for the pass to its last batch, the consumer
(:func:`~torchfeed.tools.measure.touch`) reading every page of every batch. Measured per
pass: samples/s and the trainer's CPU per batch (all its threads); over the whole run: the
peak memory: the largest sum of the RSS of every process of the run's tree (the trainer and
all its descendants: loading processes, servers, Ray's daemons) at one reading, read from
/proc every :data:`SAMPLE_EVERY` seconds by a thread. Rounds interleave the systems; the
parent reports medians. ``benchmarks/peers.py`` runs it; numbers in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .bench_systems import SYSTEMS, Case, missing
from .measure import child_pids

CASES = ("jpeg", "big", "tiny")
BATCH = {"jpeg": 32, "big": 64, "tiny": 1}
SAMPLE_EVERY = 0.05  # seconds between two reads of the process tree's RSS
RUN_TIMEOUT = 900.0  # seconds one (round, case, system) may take before it counts as failed
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- in the measuring process ---------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux /proc; only ``pid`` where unavailable)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += child_pids(p)
    return found


def rss_bytes(pid: int) -> int:
    """Resident bytes of a process (``/proc/PID/statm``: counters only, no memory-map walk)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


class PeakMemory:
    """A thread reading the RSS of this process's tree: ``peak`` is the largest sum over the
    processes alive at one reading, ``pids`` every process seen.

    Owned by the ``with`` block: the thread starts on entry and is joined on exit."""

    def __init__(self, every: float = SAMPLE_EVERY):
        self.every = every
        self.peak = 0
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def sample(self) -> None:
        pids = descendants(os.getpid())
        self.pids.update(pids)
        self.peak = max(self.peak, sum(map(rss_bytes, pids)))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        self.sample()


def _size(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return len(batch)


def measure_one(system: str, case: Case, epochs: int) -> dict[str, Any]:
    """Set up ``system``, run ``epochs`` passes of ``case``, tear down: JSON-friendly numbers."""
    from .measure import own_cpu_seconds, touch

    rates: list[float] = []
    cpu_ms: list[float] = []
    with PeakMemory() as memory:
        start = time.perf_counter()
        with SYSTEMS[system](case) as epoch:
            setup = time.perf_counter() - start
            for e in range(epochs):
                cpu, start = own_cpu_seconds(), time.perf_counter()
                n = batches = 0
                for batch in epoch(e):
                    touch(batch)
                    n += _size(batch)
                    batches += 1
                elapsed = time.perf_counter() - start
                if n != case.samples:
                    raise RuntimeError(
                        f"{system} delivered {n} samples in pass {e + 1}, expected {case.samples}"
                    )
                rates.append(n / elapsed)
                cpu_ms.append((own_cpu_seconds() - cpu) * 1e3 / batches)
            processes = len(memory.pids)
    return {
        "setup_s": setup,
        "rates": rates,
        "cpu_ms": cpu_ms,
        "peak_rss_mb": memory.peak / 1e6,
        "processes": processes,
    }


# -- in the parent: rounds, medians, the table ----------------------------------------------


def run_child(system: str, case: Case, epochs: int, timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
    """One measurement in a fresh process; ``{"error": ...}`` when it fails."""
    cmd = [sys.executable, "-m", __name__, system, case.name, str(case.samples), case.root, str(epochs)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:g} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}
    return json.loads(lines[-1])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: epoch 1, later passes, trainer CPU per batch, peak RSS, set-up."""
    med = statistics.median
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"] if runs else "not run"}
    return {
        "epoch1": med(r["rates"][0] for r in good),
        "later": med(x for r in good for x in r["rates"][1:]) if good[0]["rates"][1:] else None,
        "trainer_cpu_ms_per_batch": med(x for r in good for x in (r["cpu_ms"][1:] or r["cpu_ms"])),
        "epoch1_trainer_cpu_ms_per_batch": med(r["cpu_ms"][0] for r in good),
        "peak_rss_mb": med(r["peak_rss_mb"] for r in good),
        "processes": med(r["processes"] for r in good),
        "setup_s": med(r["setup_s"] for r in good),
        "rounds": len(good),
        "errors": [r["error"] for r in runs if "error" in r],
        "runs": good,
    }


def run(
    cases: Sequence[str] = CASES,
    systems: Sequence[str] = tuple(SYSTEMS),
    rounds: int = 3,
    images: int = 600,
    big_batches: int = 40,
    tiny_samples: int = 2000,
    epochs: int = 3,
    log: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Every case and system, ``rounds`` interleaved rounds; JSON-friendly medians."""
    from .bench_cache import make_jpegs

    unknown = [c for c in cases if c not in CASES] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown case or system {unknown}: cases {list(CASES)}, systems {list(SYSTEMS)}")
    absent = {s: missing(s) for s in systems}
    out: dict[str, Any] = {"rounds": rounds, "epochs": epochs, "workers": 2, "cases": {}}
    samples = {"jpeg": images, "big": big_batches * BATCH["big"], "tiny": tiny_samples}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(c, s): [] for c in cases for s in systems}
    with tempfile.TemporaryDirectory(prefix="torchfeed-peers-") as root:
        if "jpeg" in cases:
            make_jpegs(root, images)
        for r in range(rounds):
            for c in cases:
                case = Case(c, BATCH[c], samples[c], root if c == "jpeg" else "")
                for s in systems:
                    if absent[s]:
                        continue
                    result = run_child(s, case, epochs)
                    runs[c, s].append(result)
                    if "error" in result:
                        log(f"round {r + 1} {c} {s}: failed: {result['error']}")
                    else:
                        rates = ", ".join(f"{x:.0f}" for x in result["rates"])
                        log(
                            f"round {r + 1} {c} {s}: samples/s {rates}; set-up {result['setup_s']:.2f} s; "
                            f"peak RSS {result['peak_rss_mb']:.0f} MB"
                        )
    for c in cases:
        out["cases"][c] = {"batch_size": BATCH[c], "samples": samples[c], "systems": {}}
        for s in systems:
            entry = {"not_installed": absent[s]} if absent[s] else summarize(runs[c, s])
            out["cases"][c]["systems"][s] = entry
    return out


def iter_table(result: dict[str, Any]) -> Iterator[str]:
    """A Markdown table: one row per case and system, ratios against torch's DataLoader."""
    yield (
        "| case | system | epoch 1 samples/s | later samples/s | x torch (later) "
        "| trainer CPU ms/batch | peak RSS MB (processes) | set-up s |"
    )
    yield "|---|---|---:|---:|---:|---:|---:|---:|"
    for c, case in result["cases"].items():
        torch_later = case["systems"].get("torch", {}).get("later")
        for s, r in case["systems"].items():
            if "not_installed" in r:
                yield f"| {c} | {s} | not installed ({r['not_installed']}) | | | | | |"
                continue
            if "epoch1" not in r:
                yield f"| {c} | {s} | failed: {r['error'][:80]} | | | | | |"
                continue
            later = r["later"]
            ratio = f"{later / torch_later:.2f}x" if later and torch_later else ""
            yield (
                f"| {c} | {s} | {r['epoch1']:,.0f} | {later or 0:,.0f} | {ratio} "
                f"| {r['trainer_cpu_ms_per_batch']:.2f} | {r['peak_rss_mb']:,.0f} ({r['processes']:.0f}) "
                f"| {r['setup_s']:.2f} |"
            )


def main(argv: Sequence[str] | None = None) -> None:
    """The measuring process: ``SYSTEM CASE SAMPLES ROOT EPOCHS``; one JSON line on stdout."""
    p = argparse.ArgumentParser(description="one measurement of torchfeed.tools.bench_peers")
    p.add_argument("system", choices=sorted(SYSTEMS))
    p.add_argument("case", choices=CASES)
    p.add_argument("samples", type=int)
    p.add_argument("root")
    p.add_argument("epochs", type=int)
    a = p.parse_args(argv)
    result = measure_one(a.system, Case(a.case, BATCH[a.case], a.samples, a.root), a.epochs)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
