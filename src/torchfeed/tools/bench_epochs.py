"""Benchmark cases: what the loader costs the trainer, across epoch boundaries,
and with many trainers sharing many workers (see :mod:`torchfeed.tools.bench` for the others).

* ``epochs``: 4 sleep-bound workers, one 4x slower, epochs of 64 batches of 8, timed over
  5 consecutive passes including the gaps between them (start and tail of every pass).
* ``tiny``: batch_size=1 tiny samples: items/s and the trainer's CPU per batch.
* ``shared``: 48 sleep-bound worker processes (20 ms per sample, batch 4) shared by 4
  trainer processes; torch's side is 4 trainers with 12 DataLoader workers each. Counted
  over a common window of wall-clock time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from ..local import LocalWorkers
from . import measure as bench
from .measure import (
    BIG,
    PREFETCH,
    STRAGGLER_BATCH,
    STRAGGLER_SLEEP,
    STRAGGLER_SLOWDOWN,
    STRAGGLER_WORKERS,
    Context,
    CountSampler,
    Result,
    SleepyDataset,
    TinyDataset,
    fraction_result,
    own_cpu_seconds,
    process_cpu_seconds,
    touch,
)

EPOCH_BATCHES = 64
EPOCH_PASSES = 5
EPOCH_TARGET = 0.95
SHARED_WORKERS = 48
SHARED_TRAINERS = 4
SHARED_SLEEP = 0.020
SHARED_BATCH = 4
SHARED_SECONDS = 10.0
SHARED_START_TIMEOUT = 120.0  # seconds for the shared case's workers to be ready


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


# -- epochs ------------------------------------------------------------------------------


def _passes(loader, passes: int) -> float:
    start = time.perf_counter()
    for _ in range(passes):
        n = 0
        for batch in loader:
            touch(batch)
            n += 1
        if n != EPOCH_BATCHES:
            raise RuntimeError(f"a pass yielded {n} batches, expected {EPOCH_BATCHES}")
    return time.perf_counter() - start


def case_epochs(ctx: Context) -> Result:
    from ..loader import RemoteDataLoader, RemoteDataset

    nw, slow = STRAGGLER_WORKERS, STRAGGLER_SLOWDOWN
    share = nw - 1 + 1 / slow  # the ideal in fast workers: the slow one counts for 1/slow
    length = EPOCH_BATCHES * STRAGGLER_BATCH
    # The in-process rate of one fast worker moves by several percent with the machine's
    # load, so it is measured again right before every repeat, and each repeat is compared
    # with the ideal of its own moment.
    ideal_seconds = min(1.5, max(0.6, ctx.seconds / 4))
    singles: list[float] = []
    slow_pid = ctx.workers.processes[0].pid
    torch_loader = DataLoader(
        SleepyDataset(length, STRAGGLER_SLEEP, slow_worker_ids={0: slow}),
        batch_size=STRAGGLER_BATCH,
        num_workers=nw,
        persistent_workers=True,
        prefetch_factor=PREFETCH,
    )
    rds: RemoteDataset[Any] = RemoteDataset(
        ctx.workers.addresses[:nw], SleepyDataset, length, STRAGGLER_SLEEP, slow_pids={slow_pid: slow}
    )
    ours = RemoteDataLoader(rds, batch_size=STRAGGLER_BATCH, prefetch_factor=PREFETCH, seed=0)
    ours_pids = [p.pid for p in ctx.workers.processes[:nw]]
    sides: dict[str, Any] = {"torch": torch_loader, "torchfeed": ours}
    fractions: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    workers_cpu: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for loader in sides.values():
            _passes(loader, 2)  # start-up and a measured pass (torchfeed keeps its estimates)
        for r in range(max(ctx.repeats, 3)):
            singles.append(bench.single_rate(ideal_seconds))
            ideal = singles[-1] * share
            for name, loader in sides.items():
                pids = ours_pids if name == "torchfeed" else [w.pid for w in loader._iterator._workers]
                own, wk = own_cpu_seconds(), sum(map(process_cpu_seconds, pids))
                elapsed = _passes(loader, EPOCH_PASSES)
                own, wk = own_cpu_seconds() - own, sum(map(process_cpu_seconds, pids)) - wk
                batches = EPOCH_PASSES * EPOCH_BATCHES
                fractions[name].append(batches * STRAGGLER_BATCH / elapsed / ideal)
                cpu[name].append(own * 1e3 / batches)
                workers_cpu[name].append(wk * 1e3 / batches)
                ctx.log(
                    f"    run {r + 1} {name}: {EPOCH_PASSES} passes of {EPOCH_BATCHES} batches in "
                    f"{elapsed:.2f} s = {fractions[name][-1]:.1%} of ideal ({ideal:.0f}/s); CPU per batch: trainer "
                    f"{cpu[name][-1]:.2f} ms, workers {workers_cpu[name][-1]:.2f} ms"
                )
    finally:
        it = getattr(torch_loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()
    med = {k: _median(v) for k, v in fractions.items()}
    notes = [
        f"{nw} workers, {STRAGGLER_SLEEP * 1e3:g} ms sleep per sample, batch {STRAGGLER_BATCH}, one worker "
        f"{slow:g}x slower; {EPOCH_PASSES} consecutive passes of {EPOCH_BATCHES} batches timed together "
        f"(gaps between passes included); median of {len(fractions['torch'])} repeats; torchfeed with seed=0 "
        f"(its next pass is prefetched)",
        f"ideal = {nw - 1} + 1/{slow:g} of a single fast worker, measured in this process right before "
        f"each repeat (best of three {ideal_seconds / 3:.2g} s stretches: {min(singles):.0f}-{max(singles):.0f} "
        f"samples/s, so {min(singles) * share:.0f}-{max(singles) * share:.0f})",
    ]
    return fraction_result(
        "epochs",
        med,
        EPOCH_TARGET,
        notes,
        runs=fractions,
        cpu_ms={k: (_median(cpu[k]), _median(workers_cpu[k])) for k in sides},
    )


# -- tiny ------------------------------------------------------------------------------------


def case_tiny(ctx: Context) -> Result:
    runs = bench.run_pair(ctx, bench.make_pair(ctx, ctx.n, TinyDataset(BIG), TinyDataset, (BIG,), {}, 1))
    rate = {k: _median(v) for k, v in runs.rates.items()}
    ratio = rate["torchfeed"] / rate["torch"]
    cpu_ratio = runs.trainer_ms["torchfeed"] / max(runs.trainer_ms["torch"], 1e-9)
    notes = [
        f"scalar tensor + int, batch_size=1, {ctx.n} workers; medians of the runs",
        f"trainer CPU per batch torchfeed / torch = {cpu_ratio:.2f} (target <= 0.33)",
    ]
    return Result(
        "tiny",
        "items/s",
        rate["torch"],
        rate["torchfeed"],
        5.0,
        ">= 5x, CPU <= 1/3",
        ratio >= 5.0 and cpu_ratio <= 1 / 3,
        notes=notes,
        runs=runs.rates,
        cpu_ms=bench.cpu_per_batch(runs),
    )


# -- shared ----------------------------------------------------------------------------------


def shared_trainer(kind: str, addresses: list[str], start_at: float, seconds: float) -> None:
    """One trainer process of ``shared``: prints one JSON line (batches in the window, CPU)."""
    import warnings

    warnings.filterwarnings("ignore", message="This DataLoader will create")  # the point of the case
    loader: Any  # either kind of loader
    if kind == "torch":
        loader = DataLoader(
            SleepyDataset(BIG, SHARED_SLEEP),
            batch_size=SHARED_BATCH,
            sampler=CountSampler(10**7),
            num_workers=SHARED_WORKERS // SHARED_TRAINERS,
            prefetch_factor=PREFETCH,
        )
    else:
        from ..loader import RemoteDataLoader, RemoteDataset

        rds: RemoteDataset[Any] = RemoteDataset(addresses, SleepyDataset, BIG, SHARED_SLEEP)
        loader = RemoteDataLoader(
            rds, batch_size=SHARED_BATCH, sampler=CountSampler(10**7), prefetch_factor=PREFETCH
        )
    end = start_at + seconds
    count, cpu0, first = 0, None, None
    for batch in loader:
        touch(batch)
        now = time.time()
        if now < start_at:
            continue
        if cpu0 is None:
            cpu0, first = own_cpu_seconds(), now
        if now > end:
            break
        count += 1
    cpu = own_cpu_seconds() - cpu0 if cpu0 is not None else 0.0
    print(
        json.dumps(
            {"batches": count, "cpu_ms": cpu * 1e3 / max(count, 1), "late": (first or end) - start_at}
        ),
        flush=True,
    )
    os._exit(0)  # no teardown of 12 workers or 48 connections inside the measurement of others


def _run_trainers(kind: str, addresses: list[str], warmup: float, seconds: float, log) -> list[dict]:
    start_at = time.time() + warmup
    code = (
        "import sys, json; from torchfeed.tools.bench_epochs import shared_trainer; "
        "shared_trainer(sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, kind, json.dumps(addresses), repr(start_at), repr(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(SHARED_TRAINERS)
    ]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=warmup + seconds + 120)
        lines = [ln for ln in text.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"a {kind} trainer of case shared printed no result (exit {p.returncode})")
        out.append(json.loads(lines[-1]))
    log(
        f"    {kind}: batches per trainer {[o['batches'] for o in out]}; trainer CPU per batch "
        f"{[round(o['cpu_ms'], 2) for o in out]} ms; started late by {[round(o['late'], 2) for o in out]} s"
    )
    return out


def _single_sleepy_rate() -> float:
    ds = SleepyDataset(BIG, SHARED_SLEEP)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        touch(default_collate([ds[i] for i in range(n, n + SHARED_BATCH)]))
        n += SHARED_BATCH
    return n / (time.perf_counter() - start)


def case_shared(ctx: Context) -> Result:
    single = _single_sleepy_rate()
    ideal = single * SHARED_WORKERS  # samples/s
    seconds = max(SHARED_SECONDS, ctx.seconds)
    fractions: dict[str, list[float]] = {"torch": [], "torchfeed": []}
    spread: dict[str, float] = {}
    cpu: dict[str, list[float]] = {"torch": [], "torchfeed": []}
    ctx.log(f"    starting {SHARED_WORKERS} forked torchfeed workers")
    # forked from the fork server (one interpreter that imported torch: cheap starts, shared memory)
    workers = LocalWorkers(SHARED_WORKERS, start_timeout=SHARED_START_TIMEOUT, stop_timeout=15.0)
    try:
        for kind in ("torch", "torchfeed"):
            outs = _run_trainers(
                kind, workers.addresses if kind == "torchfeed" else [], 15.0, seconds, ctx.log
            )
            counts = [o["batches"] for o in outs]
            mean = sum(counts) / len(counts)
            fractions[kind].append(sum(counts) * SHARED_BATCH / seconds / ideal)
            spread[kind] = max(abs(c - mean) / mean for c in counts) if mean else 1.0
            cpu[kind] = [o["cpu_ms"] for o in outs]
    finally:
        workers.close()
    med = {k: _median(v) for k, v in fractions.items()}
    passed = med["torchfeed"] >= 0.9 and spread["torchfeed"] <= 0.2
    notes = [
        f"{SHARED_WORKERS} workers shared by {SHARED_TRAINERS} trainer processes (torch: {SHARED_TRAINERS} "
        f"trainers x {SHARED_WORKERS // SHARED_TRAINERS} DataLoader workers), {SHARED_SLEEP * 1e3:g} ms sleep "
        f"per sample, batch {SHARED_BATCH}; counted over a common {seconds:g} s window after a 15 s start",
        f"ideal = {SHARED_WORKERS} x one worker ({single:.0f} samples/s) = {ideal:.0f} samples/s",
        f"largest deviation of a trainer from the mean share: torch {spread['torch']:.1%}, torchfeed "
        f"{spread['torchfeed']:.1%} (target <= 20%)",
    ]
    return Result(
        "shared",
        "% of ideal",
        med["torch"],
        med["torchfeed"],
        0.9,
        ">= 90%, share +-20%",
        passed,
        fraction=True,
        notes=notes,
        runs=fractions,
        cpu_ms={k: (_median(v), float("nan")) for k, v in cpu.items()},
    )
