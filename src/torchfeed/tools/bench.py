"""Benchmarks: torchfeed's RemoteDataLoader against torch's DataLoader on the same data.

Every case builds one dataset, feeds it once through ``torch.utils.data.DataLoader``
with ``num_workers=N`` worker processes and once through :class:`RemoteDataLoader` with N
local worker processes (:class:`LocalWorkers`), warms both up, then measures them
alternately (torch, torchfeed, torch, torchfeed, ...) and keeps the best rate of each.
The consumer touches every batch the same cheap way on both sides (:func:`touch`).

The datasets are defined here, in an importable module, so that the workers load them
by reference. Run with ``torchfeed bench [CASE ...]`` or ``benchmarks/compare.py``.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import warnings
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from ..util import cpu_count
from . import BENCH_CASES, bench_cache, bench_epochs, scripts
from . import measure as measure_module
from .measure import (
    BIG,
    STRAGGLER_BATCH,
    STRAGGLER_SLEEP,
    STRAGGLER_SLOWDOWN,
    STRAGGLER_WORKERS,
    Context,
    JpegDecodeDataset,
    ReadyTensorDataset,
    Result,
    SleepyDataset,
    TinyDataset,
    batch_megabytes,
    cpu_per_batch,
    fraction_result,
    make_pair,
    run_pair,
    single_rate,
)


def _ratio_case(
    ctx: Context,
    case: str,
    metric: str,
    ds: Dataset,
    batch: int,
    per_batch: float,
    target: float,
    notes: Sequence[str],
) -> Result:
    """Both loaders on ``ctx.n`` workers, torch's over ``ds`` and torchfeed's over ``type(ds)(BIG)``
    built on its workers; best rates in ``metric``, of which a batch holds ``per_batch``."""
    runs = run_pair(ctx, make_pair(ctx, ctx.n, ds, type(ds), (BIG,), {}, batch))
    if runs.paths:
        notes = [*notes, f"torchfeed reached its workers by: {runs.paths}"]
    best = {k: max(v) * per_batch for k, v in runs.rates.items()}
    ratio = best["torchfeed"] / best["torch"]
    return Result(
        case,
        metric,
        best["torch"],
        best["torchfeed"],
        target,
        f">= {target:g}x",
        ratio >= target,
        notes=list(notes),
        runs={k: [x * per_batch for x in v] for k, v in runs.rates.items()},
        cpu_ms=cpu_per_batch(runs),
    )


def case_cpu(ctx: Context) -> Result:
    batch = 32
    ds = JpegDecodeDataset(BIG)
    sizes = [len(j) for j in ds.jpegs]
    note = (
        f"{len(sizes)} JPEGs 256x256, {sum(sizes) / len(sizes) / 1e3:.1f} kB on average; "
        f"crop 224, uint8 CHW, batch {batch}, {ctx.n} workers"
    )
    return _ratio_case(ctx, "cpu", "samples/s", ds, batch, per_batch=batch, target=1.0, notes=[note])


def case_transfer(ctx: Context) -> Result:
    batch = 64
    ds = ReadyTensorDataset(BIG)
    mb = batch_megabytes(default_collate([ds[i] for i in range(batch)]))
    note = f"float32 3x224x224 per sample, batch {batch} = {mb:.1f} MB, {ctx.n} workers"
    return _ratio_case(ctx, "transfer", "MB/s", ds, batch, per_batch=mb, target=1.0, notes=[note])


def case_overhead(ctx: Context) -> Result:
    note = f"scalar tensor + int, batch_size=1, {ctx.n} workers"
    return _ratio_case(ctx, "overhead", "items/s", TinyDataset(BIG), 1, per_batch=1, target=3.0, notes=[note])


STALL_EVERY_BATCHES = 50
STALL_SECONDS = 5.0


def _fraction_of_ideal(
    name: str, ctx: Context, ideal: float, torch_ds: Dataset, remote_kwargs: dict, notes: list[str]
) -> Result:
    """Run both loaders on sleep-bound workers; report each rate as a fraction of ``ideal``."""
    sides = make_pair(
        ctx,
        STRAGGLER_WORKERS,
        torch_ds,
        SleepyDataset,
        (BIG, STRAGGLER_SLEEP),
        remote_kwargs,
        STRAGGLER_BATCH,
    )
    runs = run_pair(ctx, sides)
    best = {k: max(v) * STRAGGLER_BATCH for k, v in runs.rates.items()}
    notes = notes + [f"torch {best['torch']:.0f} samples/s, torchfeed {best['torchfeed']:.0f} samples/s"]
    return fraction_result(
        name,
        {k: v / ideal for k, v in best.items()},
        0.9,
        notes,
        runs={k: [x * STRAGGLER_BATCH / ideal for x in v] for k, v in runs.rates.items()},
        cpu_ms=cpu_per_batch(runs),
    )


def case_straggler(ctx: Context) -> Result:
    nw, slow = STRAGGLER_WORKERS, STRAGGLER_SLOWDOWN
    single = single_rate(min(1.5, max(0.3, ctx.seconds / 4)))
    ideal = single * (nw - 1 + 1 / slow)
    slow_pid = ctx.workers.processes[0].pid
    torch_ds = SleepyDataset(BIG, STRAGGLER_SLEEP, slow_worker_ids={0: slow})
    notes = [
        f"{nw} workers, {STRAGGLER_SLEEP * 1e3:g} ms sleep per sample, batch {STRAGGLER_BATCH}, "
        f"one worker {slow:g}x slower",
        f"single fast worker {single:.0f} samples/s (measured in-process), ideal = {nw - 1} + 1/{slow:g} "
        f"of it = {ideal:.0f} samples/s",
    ]
    return _fraction_of_ideal("straggler", ctx, ideal, torch_ds, {"slow_pids": {slow_pid: slow}}, notes)


def case_stall(ctx: Context) -> Result:
    """Issue scenario: 4 workers, one 4x slower, one stalling 5 s every 50 of its batches."""
    nw, slow = STRAGGLER_WORKERS, STRAGGLER_SLOWDOWN
    single = single_rate(min(1.5, max(0.3, ctx.seconds / 4)))
    batch_seconds = STRAGGLER_BATCH / single
    stall_share = STALL_EVERY_BATCHES * batch_seconds / (STALL_EVERY_BATCHES * batch_seconds + STALL_SECONDS)
    ideal = single * (nw - 2 + 1 / slow + stall_share)  # each worker's own average rate, summed
    pids = [p.pid for p in ctx.workers.processes[:nw]]
    every = (STALL_EVERY_BATCHES * STRAGGLER_BATCH, STALL_SECONDS)
    torch_ds = SleepyDataset(BIG, STRAGGLER_SLEEP, slow_worker_ids={0: slow}, stall_worker_ids={1: every})
    notes = [
        f"{nw} workers, {STRAGGLER_SLEEP * 1e3:g} ms sleep per sample, batch {STRAGGLER_BATCH}: one worker "
        f"{slow:g}x slower, one stalling {STALL_SECONDS:g} s every {STALL_EVERY_BATCHES} of its batches",
        f"ideal = sum of each worker's average rate = {ideal:.0f} samples/s "
        f"(single fast worker {single:.0f} samples/s)",
    ]
    long_ctx = Context(ctx.workers, ctx.n, max(ctx.seconds, 3 * STALL_SECONDS), ctx.repeats, ctx.log)
    return _fraction_of_ideal(
        "stall",
        long_ctx,
        ideal,
        torch_ds,
        {"slow_pids": {pids[0]: slow}, "stall_pids": {pids[1]: every}},
        notes,
    )


# each case of BENCH_CASES (tools/__init__.py: names and what they measure) -> its function
RUNNERS: dict[str, Callable[[Context], Result]] = {
    "cpu": case_cpu,
    "transfer": case_transfer,
    "overhead": case_overhead,
    "straggler": case_straggler,
    "stall": case_stall,
    # epoch boundaries, the trainer's cost per batch, shared workers: bench_epochs.py
    "epochs": bench_epochs.case_epochs,
    "tiny": bench_epochs.case_tiny,
    "shared": bench_epochs.case_shared,
    # torchfeed.cached (decode once): bench_cache.py
    "cache": bench_cache.case_cache,
}
CASES = list(BENCH_CASES)  # the case names, in their listed order
assert sorted(RUNNERS) == sorted(BENCH_CASES), "every listed benchmark case has its function"


# -- running and reporting -----------------------------------------------------------------


def machine_info() -> dict[str, str]:
    from .. import __version__

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    usable = cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return {
        "cpu": f"{model or platform.processor() or '?'}, {os.cpu_count()} cores ({usable} usable)",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchfeed": __version__,
        "load average (1/5/15 min)": load,
    }


def run_cases(
    names: Sequence[str] = (),
    workers: int = 2,
    seconds: float = 6.0,
    repeats: int = 2,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> list[Result]:
    """Run the named cases (all when empty) and return their results."""
    from ..local import LocalWorkers

    names = list(names) or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown benchmark case(s) {unknown}; choose from {list(CASES)}")
    if workers < 1 or seconds <= 0 or repeats < 1:
        raise ValueError("workers and repeats must be >= 1 and seconds > 0")
    scripts.throwaway_secret()
    pool = max(workers, STRAGGLER_WORKERS if {"straggler", "stall", "epochs"} & set(names) else 1)
    results = []
    log(f"starting {pool} local torchfeed worker processes")
    with LocalWorkers(pool) as lw, warnings.catch_warnings():
        # more workers than cores is the point of the sleep-bound straggler case
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        ctx = Context(lw, workers, seconds, repeats, log)
        for name in names:
            log(f"case {name}: {BENCH_CASES[name]}")
            results.append(RUNNERS[name](ctx))
    return results


def _fmt(value: float, fraction: bool) -> str:
    if fraction:
        return f"{value:.1%}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def table_rows(results: Sequence[Result]) -> list[list[str]]:
    rows = [["case", "metric", "torch", "torchfeed", "ratio", "target", "result", "trainer CPU ms/batch"]]
    for r in results:
        cpu = " / ".join(f"{r.cpu_ms[k][0]:.2f}" for k in ("torch", "torchfeed") if k in r.cpu_ms)
        rows.append(
            [
                r.case,
                r.metric,
                _fmt(r.torch, r.fraction),
                _fmt(r.torchfeed, r.fraction),
                f"{r.ratio:.2f}x",
                r.target_text,
                "PASS" if r.passed else "FAIL",
                cpu,
            ]
        )
    return rows


def format_table(results: Sequence[Result]) -> str:
    rows = table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = {2, 3, 4}

    def line(row):
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]])


def format_markdown(results: Sequence[Result]) -> str:
    rows = table_rows(results)
    out = [
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join(["---", "---", "---:", "---:", "---:", "---", "---", "---:"]) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def format_notes(results: Sequence[Result]) -> list[str]:
    lines = []
    for r in results:
        runs = "; ".join(f"{k} " + ", ".join(_fmt(x, r.fraction) for x in v) for k, v in r.runs.items())
        cpu = "; ".join(
            f"{k} {t:.2f} ms in the trainer" + ("" if math.isnan(w) else f" + {w:.2f} ms in the workers")
            for k, (t, w) in r.cpu_ms.items()
        )
        lines.append(f"{r.case}: " + "; ".join(r.notes) + f". Runs: {runs}. CPU per batch: {cpu}.")
    return lines


def run_bench(args) -> int:
    """Entry point of ``torchfeed bench``."""
    plot: str | None = getattr(args, "plot", None)
    timeline = None
    if plot:
        from .. import plots

        if not plots.available():
            print("torchfeed bench: --plot needs matplotlib: pip install 'torchfeed[plot]'", file=sys.stderr)
            return 2
        timeline = measure_module.TIMELINE = plots.Timeline()
    info = machine_info()
    for k, v in info.items():
        print(f"{k}: {v}")
    try:
        results = run_cases(args.cases, args.workers, args.seconds, getattr(args, "repeats", 2))
    except ValueError as exc:
        print(f"torchfeed bench: {exc}", file=sys.stderr)
        return 2
    print(
        f"best of {getattr(args, 'repeats', 2)} alternating runs per side, ~{args.seconds:g} s each; "
        f"{args.workers} workers (straggler: {STRAGGLER_WORKERS})"
    )
    print()
    print(format_table(results))
    print()
    for line in format_notes(results):
        print(line)
    print(f"load average at the end: {machine_info()['load average (1/5/15 min)']}")
    if timeline is not None and plot:
        measure_module.TIMELINE = None
        timeline.plot(plot, title="torchfeed bench: " + ", ".join(r.case for r in results))
        print(f"plot of the torchfeed runs (per-worker samples/s, the trainer's wait): {plot}")
    return 0
