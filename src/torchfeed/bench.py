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

import gc
import io
import math
import os
import platform
import resource
import secrets
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info
from torch.utils.data._utils.collate import default_collate

if TYPE_CHECKING:
    from .local import LocalWorkers

PAGE = 4096
PREFETCH = 2  # prefetch_factor of both loaders (torch's default)


# -- datasets (loaded by reference on the workers) ----------------------------------


class JpegDecodeDataset(Dataset):
    """Decode a 256x256 JPEG with Pillow, crop 224x224, return a uint8 CHW tensor and a label.

    ``images`` distinct JPEGs (smooth random colour fields with fine noise, so they compress
    like photos: ~13 kB each) are made deterministically from ``seed`` at construction.
    The crop offset is derived from the index, so every process crops sample i alike.
    """

    def __init__(
        self,
        length: int,
        images: int = 64,
        size: int = 256,
        crop: int = 224,
        quality: int = 90,
        seed: int = 0,
    ):
        from PIL import Image

        self.length, self.size, self.crop = length, size, crop
        rng = np.random.default_rng(seed)
        self.jpegs: list[bytes] = []
        for _ in range(images):
            coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
            smooth = np.asarray(coarse.resize((size, size), Image.BICUBIC), dtype=np.int16)
            noisy = smooth + rng.integers(-6, 7, smooth.shape, dtype=np.int16)
            buf = io.BytesIO()
            Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
            self.jpegs.append(buf.getvalue())

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        from PIL import Image

        img = Image.open(io.BytesIO(self.jpegs[i % len(self.jpegs)])).convert("RGB")
        span = self.size - self.crop + 1
        h = (i * 2654435761) & 0xFFFFFFFF
        top, left = h % span, (h // span) % span
        img = img.crop((left, top, left + self.crop, top + self.crop))
        return torch.from_numpy(np.array(img)).permute(2, 0, 1), i % 1000


class ReadyTensorDataset(Dataset):
    """Return one of a few precomputed float32 tensors (3x224x224 by default): pure transfer."""

    def __init__(self, length: int, shape: Sequence[int] = (3, 224, 224), distinct: int = 4, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.length = length
        self.tensors = [torch.rand(tuple(shape), generator=gen) for _ in range(distinct)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.tensors[i % len(self.tensors)]


class TinyDataset(Dataset):
    """A scalar tensor and an int per sample: measures per-batch overhead."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return torch.tensor(float(i)), i


class SleepyDataset(Dataset):
    """I/O-bound samples: each sleeps ``seconds`` times the slowness factor of this process.

    The factor comes from ``slow_pids`` (process id -> factor; torchfeed worker processes)
    or from ``slow_worker_ids`` (torch DataLoader worker id -> factor).
    """

    def __init__(
        self,
        length: int,
        seconds: float = 0.002,
        slow_pids: dict[int, float] | None = None,
        slow_worker_ids: dict[int, float] | None = None,
        stall_pids: dict[int, tuple] | None = None,
        stall_worker_ids: dict[int, tuple] | None = None,
    ):
        self.length = length
        self.seconds = seconds
        self.slow_pids = dict(slow_pids or {})
        self.slow_worker_ids = dict(slow_worker_ids or {})
        # (every this many samples, stall this many seconds), by pid or torch worker id
        self.stall_pids = dict(stall_pids or {})
        self.stall_worker_ids = dict(stall_worker_ids or {})
        self.loaded = 0  # samples loaded by this process's copy

    def __len__(self) -> int:
        return self.length

    def factor(self) -> float:
        f = self.slow_pids.get(os.getpid())
        if f is None and self.slow_worker_ids:
            info = get_worker_info()
            if info is not None:
                f = self.slow_worker_ids.get(info.id)
        return f or 1.0

    def stall(self) -> tuple | None:
        st = self.stall_pids.get(os.getpid())
        if st is None and self.stall_worker_ids:
            info = get_worker_info()
            if info is not None:
                st = self.stall_worker_ids.get(info.id)
        return st

    def __getitem__(self, i: int):
        time.sleep(self.seconds * self.factor())
        self.loaded += 1
        st = self.stall()
        if st is not None and self.loaded % st[0] == 0:
            time.sleep(st[1])
        return torch.tensor(float(i)), i


# -- measuring ------------------------------------------------------------------------


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def touch(batch) -> int:
    """The consumer: read one byte of every 4 KiB page of every tensor of the batch.

    Cheap, identical on both sides, and it makes every page of the data resident (lazily
    mapped shared memory included), so no loader gets away without delivering the bytes.
    """
    total = 0
    for t in _tensors(batch):
        total += int(t.reshape(-1).view(torch.uint8)[::PAGE].sum())
    return total


def batch_megabytes(batch) -> float:
    return sum(t.numel() * t.element_size() for t in _tensors(batch)) / 1e6


class CountSampler(Sampler):
    """Indices 0..n-1; ``n`` is changed between epochs to size each measurement."""

    def __init__(self, n: int = 0):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, no children
    return usage.ru_utime + usage.ru_stime


class Side:
    """One loader plus its sampler; ``epoch(batches)`` returns the seconds one pass took.

    ``worker_pids()`` lists the processes doing the loading, for CPU accounting.
    """

    def __init__(
        self, name: str, loader, sampler: CountSampler, batch_size: int, worker_pids: Callable[[], list[int]]
    ):
        self.name, self.loader, self.sampler, self.batch_size = name, loader, sampler, batch_size
        self.worker_pids = worker_pids

    def epoch(self, batches: int) -> float:
        self.sampler.n = batches * self.batch_size
        count = 0
        timeline = TIMELINE if hasattr(self.loader, "stats") else None  # [stats hook] --plot
        start = time.perf_counter()
        for batch in self.loader:
            touch(batch)
            count += 1
            if timeline is not None:
                timeline.sample(self.loader)
        elapsed = time.perf_counter() - start
        if count != batches:
            raise RuntimeError(f"{self.name} yielded {count} batches, expected {batches}")
        return elapsed

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)  # torch's persistent workers
        if it is not None:
            it._shutdown_workers()
            self.loader._iterator = None
        self.loader = None


def _calibrate(side: Side, warm_seconds: float, first: int) -> float:
    """Warm up (start-up pass, then passes until one lasts ``warm_seconds``); batches/s."""
    side.epoch(first)  # starts processes / builds the worker-side fetchers
    n = first
    for _ in range(8):
        elapsed = side.epoch(n)
        if elapsed >= warm_seconds:
            break
        n = min(8 * n, max(2 * n, math.ceil(n * 1.2 * warm_seconds / max(elapsed, 1e-4))))
    return n / elapsed


@dataclass
class Runs:
    """Batches/s of every timed run, and CPU milliseconds per batch over all of them."""

    rates: dict[str, list[float]]
    trainer_ms: dict[str, float]  # CPU of the consuming process (all its threads)
    workers_ms: dict[str, float]  # CPU of the loading processes together


def measure(sides: Sequence[Side], seconds: float, repeats: int, log: Callable[[str], None]) -> Runs:
    """Warm up every side, then time ``repeats`` rounds, alternating."""
    warm = min(2.0, max(0.15, seconds / 4))
    sizes = {}
    for s in sides:
        rate = _calibrate(s, warm, first=2 * PREFETCH * 4)
        sizes[s.name] = max(8, round(rate * seconds))
        log(f"    warm-up {s.name}: ~{rate:.1f} batches/s -> {sizes[s.name]} batches per run")
    runs = Runs({s.name: [] for s in sides}, {s.name: 0.0 for s in sides}, {s.name: 0.0 for s in sides})
    for r in range(repeats):
        for s in sides:
            n = sizes[s.name]
            pids = s.worker_pids()
            own, workers = _own_cpu_seconds(), sum(map(_process_cpu_seconds, pids))
            elapsed = s.epoch(n)
            own, workers = _own_cpu_seconds() - own, sum(map(_process_cpu_seconds, pids)) - workers
            runs.rates[s.name].append(n / elapsed)
            runs.trainer_ms[s.name] += own * 1e3 / (n * repeats)
            runs.workers_ms[s.name] += workers * 1e3 / (n * repeats)
            log(
                f"    run {r + 1} {s.name}: {n} batches in {elapsed:.2f} s = {n / elapsed:.1f} batches/s; "
                f"CPU per batch: trainer {own * 1e3 / n:.2f} ms, workers {workers * 1e3 / n:.2f} ms"
            )
    return runs


# -- cases ---------------------------------------------------------------------------


@dataclass
class Result:
    case: str
    metric: str
    torch: float  # value shown in the torch column (rate, or fraction of ideal)
    torchfeed: float
    target: float  # ratio target (or fraction target for "straggler")
    target_text: str
    passed: bool
    fraction: bool = False  # values are fractions of an ideal rate
    notes: list[str] = field(default_factory=list)
    runs: dict[str, list[float]] = field(default_factory=dict)
    cpu_ms: dict[str, tuple[float, float]] = field(
        default_factory=dict
    )  # side -> (trainer, workers) per batch

    @property
    def ratio(self) -> float:
        return self.torchfeed / self.torch if self.torch else float("inf")


@dataclass
class Context:
    workers: LocalWorkers
    n: int  # workers per comparison (cases cpu, transfer, overhead)
    seconds: float
    repeats: int
    log: Callable[[str], None]


BIG = 1 << 40  # dataset length: the samplers choose how many indices are used


def _pair(
    ctx: Context, n_workers: int, torch_ds: Dataset, factory, fargs: tuple, fkwargs: dict, batch_size: int
) -> list[Side]:
    from .loader import RemoteDataLoader, RemoteDataset

    ts, rs = CountSampler(), CountSampler()
    tl = DataLoader(
        torch_ds,
        batch_size=batch_size,
        sampler=ts,
        num_workers=n_workers,
        persistent_workers=True,
        prefetch_factor=PREFETCH,
    )
    rds = RemoteDataset(ctx.workers.addresses[:n_workers], factory, *fargs, **fkwargs)
    rl = RemoteDataLoader(rds, batch_size=batch_size, sampler=rs, prefetch_factor=PREFETCH)
    ours = [p.pid for p in ctx.workers.processes[:n_workers]]

    def torch_pids():
        it = getattr(tl, "_iterator", None)
        return [w.pid for w in getattr(it, "_workers", [])]

    return [
        Side("torch", tl, ts, batch_size, torch_pids),
        Side("torchfeed", rl, rs, batch_size, lambda: ours),
    ]


def _run_pair(ctx: Context, sides: list[Side]) -> Runs:
    try:
        return measure(sides, ctx.seconds, ctx.repeats, ctx.log)
    finally:
        for s in sides:
            s.close()
        gc.collect()


def _cpu(runs: Runs) -> dict[str, tuple[float, float]]:
    return {k: (runs.trainer_ms[k], runs.workers_ms[k]) for k in runs.rates}


def _ratio_result(case, metric, runs: Runs, per_batch, target, notes=()) -> Result:
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
        cpu_ms=_cpu(runs),
    )


def case_cpu(ctx: Context) -> Result:
    batch = 32
    ds = JpegDecodeDataset(BIG)
    sizes = [len(j) for j in ds.jpegs]
    runs = _run_pair(ctx, _pair(ctx, ctx.n, ds, JpegDecodeDataset, (BIG,), {}, batch))
    return _ratio_result(
        "cpu",
        "samples/s",
        runs,
        batch,
        1.0,
        [
            f"{len(sizes)} JPEGs 256x256, {sum(sizes) / len(sizes) / 1e3:.1f} kB on average; "
            f"crop 224, uint8 CHW, batch {batch}, {ctx.n} workers"
        ],
    )


def case_transfer(ctx: Context) -> Result:
    batch = 64
    ds = ReadyTensorDataset(BIG)
    mb = batch_megabytes(default_collate([ds[i] for i in range(batch)]))
    runs = _run_pair(ctx, _pair(ctx, ctx.n, ds, ReadyTensorDataset, (BIG,), {}, batch))
    return _ratio_result(
        "transfer",
        "MB/s",
        runs,
        mb,
        1.0,
        [f"float32 3x224x224 per sample, batch {batch} = {mb:.1f} MB, {ctx.n} workers"],
    )


def case_overhead(ctx: Context) -> Result:
    runs = _run_pair(ctx, _pair(ctx, ctx.n, TinyDataset(BIG), TinyDataset, (BIG,), {}, 1))
    return _ratio_result(
        "overhead", "items/s", runs, 1, 3.0, [f"scalar tensor + int, batch_size=1, {ctx.n} workers"]
    )


STRAGGLER_WORKERS = 4
STRAGGLER_SLOWDOWN = 4.0
STRAGGLER_SLEEP = 0.002
STRAGGLER_BATCH = 8


def _single_rate(seconds: float, tries: int = 3) -> float:
    """Samples/s of one fast worker: the dataset and collation in this process, no loader.

    Best of ``tries`` stretches of ``seconds / tries`` (like the loaders' best run).
    """
    ds = SleepyDataset(BIG, STRAGGLER_SLEEP)
    rates = []
    for _ in range(tries):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / tries:
            touch(default_collate([ds[i] for i in range(n, n + STRAGGLER_BATCH)]))
            n += STRAGGLER_BATCH
        rates.append(n / (time.perf_counter() - start))
    return max(rates)


STALL_EVERY_BATCHES = 50
STALL_SECONDS = 5.0


def _fraction_of_ideal(
    name: str, ctx: Context, ideal: float, torch_ds: Dataset, remote_kwargs: dict, notes: list[str]
) -> Result:
    """Run both loaders on sleep-bound workers; report each rate as a fraction of ``ideal``."""
    sides = _pair(
        ctx,
        STRAGGLER_WORKERS,
        torch_ds,
        SleepyDataset,
        (BIG, STRAGGLER_SLEEP),
        remote_kwargs,
        STRAGGLER_BATCH,
    )
    runs = _run_pair(ctx, sides)
    best = {k: max(v) * STRAGGLER_BATCH for k, v in runs.rates.items()}
    frac = {k: v / ideal for k, v in best.items()}
    target = 0.9
    notes = notes + [f"torch {best['torch']:.0f} samples/s, torchfeed {best['torchfeed']:.0f} samples/s"]
    return Result(
        name,
        "% of ideal",
        frac["torch"],
        frac["torchfeed"],
        target,
        f">= {target:.0%}",
        frac["torchfeed"] >= target,
        fraction=True,
        notes=notes,
        runs={k: [x * STRAGGLER_BATCH / ideal for x in v] for k, v in runs.rates.items()},
        cpu_ms=_cpu(runs),
    )


def case_straggler(ctx: Context) -> Result:
    nw, slow = STRAGGLER_WORKERS, STRAGGLER_SLOWDOWN
    single = _single_rate(min(1.5, max(0.3, ctx.seconds / 4)))
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
    single = _single_rate(min(1.5, max(0.3, ctx.seconds / 4)))
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


CASES: dict[str, tuple[Callable[[Context], Result], str]] = {
    "cpu": (case_cpu, "Pillow JPEG decode + random crop, batch 32: samples/s"),
    "transfer": (case_transfer, "ready 3x224x224 float32 tensors, batch 64 (38.5 MB): MB/s"),
    "overhead": (case_overhead, "tiny samples, batch_size=1: items/s"),
    "straggler": (case_straggler, "4 sleep-bound workers, one 4x slower: % of ideal rate"),
    "stall": (case_stall, "4 sleep-bound workers, one 4x slower, one stalling 5 s every 50 batches"),
}


# -- running and reporting -----------------------------------------------------------------


def machine_info() -> dict[str, str]:
    from . import __version__

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
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
    from .local import LocalWorkers

    names = list(names) or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown benchmark case(s) {unknown}; choose from {list(CASES)}")
    if workers < 1 or seconds <= 0 or repeats < 1:
        raise ValueError("workers and repeats must be >= 1 and seconds > 0")
    # Trainer and workers share a secret; a throw-away one unless the user set their own.
    os.environ.setdefault("TORCHFEED_SECRET", secrets.token_hex(32))
    pool = max(workers, STRAGGLER_WORKERS if {"straggler", "stall", "epochs"} & set(names) else 1)
    results = []
    log(f"starting {pool} local torchfeed worker processes")
    with LocalWorkers(pool) as lw, warnings.catch_warnings():
        # more workers than cores is the point of the sleep-bound straggler case
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        ctx = Context(lw, workers, seconds, repeats, log)
        for name in names:
            log(f"case {name}: {CASES[name][1]}")
            results.append(CASES[name][0](ctx))
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


TIMELINE = None  # a plots.Timeline while `torchfeed bench --plot F.png` runs [stats hook]


def run_bench(args) -> int:
    """Entry point of ``torchfeed bench``."""
    global TIMELINE
    plot = getattr(args, "plot", None)
    if plot:
        from . import plots

        if not plots.available():
            print("torchfeed bench: --plot needs matplotlib: pip install 'torchfeed[plot]'", file=sys.stderr)
            return 2
        TIMELINE = plots.Timeline()
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
    if plot:
        TIMELINE.plot(plot, title="torchfeed bench: " + ", ".join(r.case for r in results))
        TIMELINE = None
        print(f"plot of the torchfeed runs (per-worker samples/s, the trainer's wait): {plot}")
    return 0


# issue 12's cases (epoch boundaries, the trainer's cost per batch, shared workers) live in
# bench_epochs.py, which imports this module: looked up when run


def _later(name: str) -> Callable[[Context], Result]:
    def run(ctx: Context) -> Result:
        from . import bench_epochs

        return getattr(bench_epochs, name)(ctx)

    return run


CASES.update(
    {
        "epochs": (
            _later("case_epochs"),
            "4 sleep-bound workers, one 4x slower, 5 passes of 64 batches with the gaps between them",
        ),
        "tiny": (_later("case_tiny"), "tiny samples, batch_size=1: items/s and the trainer's CPU per batch"),
        "shared": (_later("case_shared"), "48 sleep-bound workers shared by 4 trainer processes: % of ideal"),
    }
)
