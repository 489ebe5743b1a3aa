"""``torchfeed demo``: train a small CNN on scikit-learn's 8x8 digits, fed by remote workers.

The training set lives on the workers (``RemoteDataset``); each worker augments its
samples (a random affine warp: shift up to 1 pixel, small rotation and scale, then
gaussian noise) with numpy's global generator and collates them into batches that
``RemoteDataLoader`` streams to the trainer. The loader's ``seed=`` seeds every sample
from ``(seed, epoch, index)``, so a run is reproducible whichever worker happens to
load which batch. After training, the demo
measures how fast the same augmented dataset loads through ``RemoteDataLoader`` and
through torch's own ``DataLoader``.

Needs scikit-learn (``pip install 'torchfeed[demo]'``); the digits ship with it, nothing
is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import sys
import time
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..client import parse_address
from ..loader import RemoteDataLoader, RemoteDataset
from ..local import LocalWorkers
from ..plots import Timeline
from ..util import cpu_count

N_TEST = 300
PIXEL_MEAN = 0.305  # of the digits scaled to [0, 1]
PIXEL_STD = 0.376
THROUGHPUT_SECONDS = 3.0  # loading time measured per loader, in ROUNDS interleaved slices
ROUNDS = 3

# Pixel centres of an 8x8 image as (row, column) offsets from the image centre.
_GRID = np.stack(np.meshgrid(np.arange(8.0), np.arange(8.0), indexing="ij"), -1).reshape(-1, 2) - 3.5


# -- data (this code also runs on the workers) ------------------------------------


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits split into 1,497 training and 300 test images.

    Returns ``(train_images, train_labels, test_images, test_labels)``; images are uint8
    arrays of shape (n, 8, 8) with values 0..16, labels int64.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("the demo needs scikit-learn: pip install 'torchfeed[demo]'") from None
    digits = load_digits()
    images = digits.images.astype(np.uint8)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    train, test = order[N_TEST:], order[:N_TEST]
    return images[train], labels[train], images[test], labels[test]


def normalize(images: np.ndarray) -> np.ndarray:
    """Images with values in [0, 1] -> zero mean, unit variance (float32)."""
    return ((images - PIXEL_MEAN) / PIXEL_STD).astype(np.float32)


def random_affine(
    image: np.ndarray, rng, max_shift: float = 1.0, max_degrees: float = 12.0, max_zoom: float = 0.1
) -> np.ndarray:
    """Warp an 8x8 image by a random shift, rotation and scale (bilinear, zero outside).

    The shift is up to ``max_shift`` pixels along each axis, the rotation up to
    ``max_degrees`` either way and the scale within ``1 +- max_zoom``.
    """
    u = rng.random(4) * 2 - 1  # four draws in [-1, 1)
    angle = np.deg2rad(max_degrees) * u[0]
    zoom = 1 + max_zoom * u[1]
    cos, sin = np.cos(angle) / zoom, np.sin(angle) / zoom
    inverse = np.array([[cos, -sin], [sin, cos]])  # output pixel -> where it reads from
    source = (_GRID - max_shift * u[2:]) @ inverse + 4.5  # in the coordinates of the padded image
    np.clip(source, 0.0, 9.0, out=source)  # beyond the 1-pixel zero border reads zeros too
    row, col = source[:, 0], source[:, 1]
    r0, c0 = row.astype(np.intp), col.astype(np.intp)
    wr, wc = row - r0, col - c0
    flat = r0 * 11 + c0
    padded = np.zeros(121)
    padded.reshape(11, 11)[1:9, 1:9] = image
    top = padded[flat] * (1 - wc) + padded[flat + 1] * wc
    bottom = padded[flat + 11] * (1 - wc) + padded[flat + 12] * wc
    return (top * (1 - wr) + bottom * wr).reshape(8, 8)


class AugmentedDigits(Dataset):
    """8x8 digits with on-the-fly augmentation; sample i is (float tensor 1x8x8, label).

    Parameters
    ----------
    images : array of shape (n, 8, 8)
        Pixel values 0..16.
    labels : array of shape (n,)
    augment : bool
        Warp and add noise (training) or return the images as they are (testing).
    noise : float
        Standard deviation of the gaussian noise, in units of full brightness.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, augment: bool = True, noise: float = 0.05):
        self.images = np.asarray(images, dtype=np.float64) / 16.0
        self.labels = np.asarray(labels, dtype=np.int64)
        self.augment = augment
        self.noise = noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.augment:
            # numpy's global generator: RemoteDataLoader(seed=...) seeds it for each sample
            image = random_affine(image, np.random) + np.random.normal(0.0, self.noise, size=(8, 8))
        return torch.from_numpy(normalize(image)).unsqueeze(0), int(self.labels[index])


# -- model -------------------------------------------------------------------------


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and a two-layer classifier (~150k parameters)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    return (model(images).argmax(1) == labels).float().mean().item()


# -- output ------------------------------------------------------------------------


class ProgressBar:
    """A one-line bar redrawn in place with ``\\r`` (only when the stream is a terminal)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 24):
        self.total = total
        self.label = label
        self.stream = stream = stream if stream is not None else sys.stdout
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._live = bool(getattr(stream, "isatty", lambda: False)())
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "█░".encode(encoding)
            self._fill, self._empty = "█", "░"
        except (UnicodeEncodeError, LookupError):
            self._fill, self._empty = "#", "."

    def rate(self) -> float:
        return self.done / max(time.perf_counter() - self.start, 1e-9)

    def line(self, extra: str = "") -> str:
        filled = round(self.width * self.done / max(self.total, 1))
        bar = self._fill * filled + self._empty * (self.width - filled)
        digits = len(str(self.total))
        text = f"{self.label} {bar} {self.done:>{digits}}/{self.total}  {self.rate():>7,.0f} samples/s"
        return f"{text}  {extra}" if extra else text

    def update(self, n: int, extra: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        if self._live and (now - self._last_draw > 0.05 or self.done >= self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line(extra) + "\033[K")
            self.stream.flush()

    def finish(self, extra: str = "") -> None:
        self.stream.write(
            ("\r" if self._live else "") + self.line(extra) + ("\033[K" if self._live else "") + "\n"
        )
        self.stream.flush()


def _say(text: str = "") -> None:
    print(text, flush=True)


# -- the demo ------------------------------------------------------------------------


def _train(
    model: nn.Module,
    loader: RemoteDataLoader,
    epochs: int,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    timeline: Timeline | None = None,
) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=epochs * len(loader), pct_start=0.15
    )
    loss_fn = nn.CrossEntropyLoss()
    test_acc = 0.0
    width = len(str(epochs))
    for epoch in range(epochs):  # the loader's epoch advances with each pass
        model.train()
        bar = ProgressBar(
            len(loader.dataset),  # type: ignore[arg-type]
            f"epoch {epoch + 1:>{width}}/{epochs}",
        )
        loss_sum, correct, seen = 0.0, 0, 0
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            logits = model(images)
            loss = loss_fn(logits, labels)
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += loss.item() * len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            seen += len(labels)
            bar.update(len(labels), f"loss {loss_sum / seen:.3f}")
            if timeline is not None:  # [stats hook] every 0.25 s: loader.stats()
                timeline.sample(loader)
        test_acc = accuracy(model, test_x, test_y)
        bar.finish(
            f"loss {loss_sum / seen:.3f}  train {100 * correct / seen:5.1f}%  test {100 * test_acc:5.1f}%"
        )
    return test_acc


def measure_loading(loader, seconds: float) -> tuple[float, int]:
    """Iterate whole passes of ``loader`` for about ``seconds`` (at least one pass).

    Returns (samples per second, samples counted).
    """
    samples = 0
    start = time.perf_counter()
    while True:
        for _, labels in loader:
            samples += len(labels)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return samples / elapsed, samples


def compare_rates(loaders: dict[str, Any], seconds: float, rounds: int = ROUNDS) -> dict[str, float]:
    """Each loader's median rate over ``rounds`` interleaved slices of ``seconds / rounds``
    (after one untimed pass each), as the benchmarks measure: a load that comes and goes on
    the machine then reaches every loader alike."""
    for loader in loaders.values():  # warm up: worker start, first connections, caches
        for _ in loader:
            pass
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(rounds):
        for name, loader in loaders.items():
            rates[name].append(measure_loading(loader, seconds / rounds)[0])
    return {name: statistics.median(values) for name, values in rates.items()}


def busy_note(load: float | None = None, cores: int | None = None) -> str | None:
    """A sentence when the machine is busy (the 1-minute load average, this demo's own
    processes included, above the number of cores), else None. Defaults: this machine's."""
    cores = cores or cpu_count()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform
            return None
    if load <= cores:
        return None
    return (
        f"this machine is busy (load average {load:.1f} on {cores} cores): both loaders compete for "
        "the same cores, so the ratio says more about the machine than about the loaders"
    )


def _compare_loading(
    remote: RemoteDataset, local: AugmentedDigits, args, seconds: float
) -> tuple[float, float]:
    n_remote = len(remote.workers)
    _say(
        f"\nloading throughput of the augmented training set (loading only, no model, batch {args.batch_size}, "
        f"median of {ROUNDS} interleaved rounds, ~{seconds:g} s each):"
    )
    remote_label = f"torchfeed.RemoteDataLoader  ({n_remote} remote worker{'s' if n_remote != 1 else ''})"
    torch_label = f"torch DataLoader(num_workers={args.workers})"
    loaders = {
        remote_label: RemoteDataLoader(remote, batch_size=args.batch_size, shuffle=True),
        torch_label: DataLoader(
            local,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
        ),
    }
    rates = compare_rates(loaders, seconds)
    del loaders  # stops torch's worker processes
    remote_rate, torch_rate = rates[remote_label], rates[torch_label]
    pad = max(len(remote_label), len(torch_label)) + 2
    _say(f"  {remote_label:<{pad}}{remote_rate:>9,.0f} samples/s")
    _say(f"  {torch_label:<{pad}}{torch_rate:>9,.0f} samples/s")
    _say(f"  {'ratio torchfeed / torch':<{pad}}{remote_rate / torch_rate:>9.2f}x")
    note = busy_note()
    if note is not None:
        _say(f"  note: {note}")
    return remote_rate, torch_rate


def _is_this_machine(address: str) -> bool:
    host, _ = parse_address(address)
    return host in ("localhost", "::1", "0.0.0.0", socket.gethostname()) or host.startswith("127.")


def _plot(timeline: Timeline, path: str | None) -> None:
    if not path:
        return
    try:
        timeline.plot(path, title="torchfeed demo: per-worker samples/s and the trainer's wait")
        _say(f"plot: {path}")
    except ImportError:
        _say("(no plot: matplotlib is not installed; pip install 'torchfeed[plot]')")


def run_demo(args) -> int:
    """Run the demo described in this module's docstring; return the exit code."""
    t_start = time.perf_counter()
    seed = int(getattr(args, "seed", 0))
    epochs = int(args.epochs)
    connect: list | None = getattr(args, "connect", None)
    if epochs < 1 or args.batch_size < 1 or (not connect and args.workers < 1):
        print("torchfeed demo: --epochs, --batch-size and --workers must be at least 1", file=sys.stderr)
        return 2
    torch.manual_seed(seed)
    train_x, train_y, test_x, test_y = load_digits_split(seed)
    test_images = torch.from_numpy(normalize(test_x / 16.0)).unsqueeze(1)
    test_labels = torch.from_numpy(test_y)

    _say(
        f"torchfeed demo: a small CNN learns scikit-learn's 8x8 digits ({len(train_y):,} train / "
        f"{len(test_y)} test images), {epochs} epoch{'s' if epochs != 1 else ''}, batch {args.batch_size}, "
        f"seed {seed}"
    )
    with contextlib.ExitStack() as stack:
        try:
            if connect:
                addresses = list(connect)
                how = f"{len(addresses)} running worker{'s' if len(addresses) != 1 else ''}"
            else:
                t0 = time.perf_counter()
                workers = stack.enter_context(LocalWorkers(args.workers))
                addresses = workers.addresses
                how = (
                    f"{len(addresses)} local worker process{'es' if len(addresses) != 1 else ''}, "
                    f"started in {time.perf_counter() - t0:.1f} s"
                )
            _say(f"workers: {', '.join(addresses)} ({how})")
            on_this_machine = sum(_is_this_machine(a) for a in addresses)
            if on_this_machine:
                # Workers here use cores too: more trainer threads than cores left makes every
                # small step wait on oversubscribed threads (about 10x slower on 2 cores).
                threads_before = torch.get_num_threads()
                torch.set_num_threads(max(1, cpu_count() - on_this_machine))
                stack.callback(torch.set_num_threads, threads_before)
            remote: RemoteDataset[Any] = RemoteDataset(addresses, AugmentedDigits, train_x, train_y)
            _say(
                "each worker holds the training set and augments it (shift <= 1 px, rotation <= 12 deg, "
                "scale 0.9-1.1, noise)\n"
            )

            model = SmallCNN()
            loader = RemoteDataLoader(remote, batch_size=args.batch_size, shuffle=True, seed=seed)
            t0 = time.perf_counter()
            timeline = Timeline(every=0.1)
            test_acc = _train(model, loader, epochs, test_images, test_labels, timeline)
            train_seconds = time.perf_counter() - t0
            _say(
                f"\ntest accuracy: {100 * test_acc:.1f}% on {len(test_labels)} held-out digits "
                f"(training took {train_seconds:.1f} s)"
            )
            _say("\nis the trainer waiting for data? loader.stats() at the end of training:")
            _say(loader.stats().table())
            _plot(timeline, getattr(args, "plot", None))

            local = AugmentedDigits(train_x, train_y)
            remote_rate, torch_rate = _compare_loading(remote, local, args, THROUGHPUT_SECONDS)
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the workers", file=sys.stderr)
            return 130
    _say(
        f"\ndone in {time.perf_counter() - t_start:.1f} s: test accuracy {100 * test_acc:.1f}%, "
        f"torchfeed loads {remote_rate:,.0f} samples/s vs torch's {torch_rate:,.0f} samples/s "
        f"({remote_rate / torch_rate:.2f}x)"
    )
    return 0
