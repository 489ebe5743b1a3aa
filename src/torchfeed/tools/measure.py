"""What the benchmarks measure with: datasets loaded by reference on the workers, the
consumer (:func:`touch`), a loader "side" and its timing, CPU accounting, and result records.

The cases themselves are in :mod:`torchfeed.tools.bench` and :mod:`torchfeed.tools.bench_epochs`.
"""

from __future__ import annotations

import gc
import io
import math
import os
import resource
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info
from torch.utils.data._utils.collate import default_collate

if TYPE_CHECKING:
    from ..local import LocalWorkers
    from ..plots import Timeline

PAGE = 4096
# a plots.Timeline that Side.epoch feeds while `torchfeed bench --plot F.png` runs [stats hook]
TIMELINE: Timeline | None = None
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
            smooth = np.asarray(coarse.resize((size, size), Image.Resampling.BICUBIC), dtype=np.int16)
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


class SleepIndexDataset(Dataset):
    """Sample i is i, after ``seconds`` of sleep (I/O-bound loading); with ``pid``, the tensor
    ``[i, pid of the loading process]``, which tells which worker loaded it."""

    def __init__(self, n: int, seconds: float, pid: bool = False):
        self.n, self.seconds, self.pid = n, seconds, pid

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return torch.tensor([i, os.getpid()]) if self.pid else i


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
    The pages are read through numpy (the tensor's own memory): a few microseconds per
    tensor where torch's indexing and reduction cost about 8, which for tiny batches
    would be a large share of the consumer's time on either side.
    """
    total = 0
    for t in _tensors(batch):
        try:
            flat = t.numpy().reshape(-1)  # CPU tensors share their memory with numpy
        except (RuntimeError, TypeError):  # e.g. bfloat16, tensors that require grad
            total += int(t.reshape(-1).view(torch.uint8)[::PAGE].sum())
            continue
        total += int(flat.view(np.uint8)[::PAGE].sum())
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


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def child_pids(pid: int) -> list[int]:
    """The child processes of every thread of a process (Linux /proc; none where unavailable)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def own_cpu_seconds() -> float:
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
    paths: str = ""  # how torchfeed reached its workers: "same-host x2", "tcp x2", ...


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
            own, workers = own_cpu_seconds(), sum(map(process_cpu_seconds, pids))
            elapsed = s.epoch(n)
            own, workers = own_cpu_seconds() - own, sum(map(process_cpu_seconds, pids)) - workers
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


def fraction_result(
    case: str,
    fractions: dict[str, float],
    target: float,
    notes: list[str],
    runs: dict[str, list[float]],
    cpu_ms: dict[str, tuple[float, float]],
) -> Result:
    """A case whose values are each side's fraction of an ideal rate; torchfeed passes at ``target``."""
    return Result(
        case,
        "% of ideal",
        fractions["torch"],
        fractions["torchfeed"],
        target,
        f">= {target:.0%}",
        fractions["torchfeed"] >= target,
        fraction=True,
        notes=notes,
        runs=runs,
        cpu_ms=cpu_ms,
    )


@dataclass
class Context:
    workers: LocalWorkers
    n: int  # workers per comparison (cases cpu, transfer, overhead)
    seconds: float
    repeats: int
    log: Callable[[str], None]


BIG = 1 << 40  # dataset length: the samplers choose how many indices are used


# -- both loaders side by side (the cases in bench.py and bench_epochs.py) --------------
def make_pair(
    ctx: Context, n_workers: int, torch_ds: Dataset, factory, fargs: tuple, fkwargs: dict, batch_size: int
) -> list[Side]:
    from ..loader import RemoteDataLoader, RemoteDataset

    ts, rs = CountSampler(), CountSampler()
    tl = DataLoader(
        torch_ds,
        batch_size=batch_size,
        sampler=ts,
        num_workers=n_workers,
        persistent_workers=True,
        prefetch_factor=PREFETCH,
    )
    rds: RemoteDataset[Any] = RemoteDataset(ctx.workers.addresses[:n_workers], factory, *fargs, **fkwargs)
    rl = RemoteDataLoader(rds, batch_size=batch_size, sampler=rs, prefetch_factor=PREFETCH)
    ours = [p.pid for p in ctx.workers.processes[:n_workers]]

    def torch_pids():
        it = getattr(tl, "_iterator", None)
        return [w.pid for w in getattr(it, "_workers", [])]

    return [
        Side("torch", tl, ts, batch_size, torch_pids),
        Side("torchfeed", rl, rs, batch_size, lambda: ours),
    ]


def paths_used() -> str:
    """How torchfeed's default session reaches its workers now: ``"same-host x2"`` and so on."""
    from ..client import paths

    counts = Counter(paths().values())
    return ", ".join(f"{path} x{n}" for path, n in sorted(counts.items())) or "none"


def run_pair(ctx: Context, sides: list[Side]) -> Runs:
    try:
        runs = measure(sides, ctx.seconds, ctx.repeats, ctx.log)
        runs.paths = paths_used()
        return runs
    finally:
        for s in sides:
            s.close()
        gc.collect()


def cpu_per_batch(runs: Runs) -> dict[str, tuple[float, float]]:
    return {k: (runs.trainer_ms[k], runs.workers_ms[k]) for k in runs.rates}


STRAGGLER_WORKERS = 4
STRAGGLER_SLOWDOWN = 4.0
STRAGGLER_SLEEP = 0.002
STRAGGLER_BATCH = 8


def single_rate(seconds: float, tries: int = 3) -> float:
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
