"""The loaders :mod:`torchfeed.tools.bench_peers` compares, one adapter per system.

Every adapter has the same shape: ``open_<system>(case)`` is a context manager that sets the
system up with :data:`WORKERS` loading processes (outside the clock), yields ``epoch(seed)``,
which returns one pass over the case's samples as an iterable of batches (torch tensors, or
tuples/dicts of them), and tears everything down on exit. Each system gets the same case:
the same samples (:class:`Case`), the same per-sample work, the same batch size, shuffled
per pass from ``seed`` where order matters.

The torch-family systems (torch's DataLoader, torchfeed, torchdata.nodes, SPDL, Ray Data)
run the case's own dataset class; the tf.data service runs TF ops doing the same work
(:func:`tf_dataset`; where it differs is said in benchmarks/README.md). A system whose
package is missing is named by :func:`missing`; nothing here imports it before it is used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from .bench_jpeg import DRAFT, SIDE, JpegPipeline
from .measure import ReadyTensorDataset, TinyDataset

WORKERS = 2  # loading processes of every system
PREFETCH = 2  # batches in flight per loading process, where a system takes the setting
START_TIMEOUT = 120.0  # seconds a tf.data server may take to listen

Epoch = Callable[[int], Iterable[Any]]


@dataclass(frozen=True)
class Case:
    """One workload: ``samples`` samples of the dataset ``name`` in batches of ``batch``."""

    name: str  # jpeg | big | tiny
    batch: int
    samples: int
    root: str = ""  # the folder of JPEGs (jpeg)

    def factory(self) -> tuple[type[Dataset], tuple[Any, ...]]:
        """The dataset class and its arguments (loading processes build it by reference)."""
        if self.name == "jpeg":
            return JpegPipeline, (self.root,)
        if self.name == "big":
            return ReadyTensorDataset, (self.samples,)
        if self.name == "tiny":
            return TinyDataset, (self.samples,)
        raise ValueError(f"unknown case {self.name!r}: use jpeg, big or tiny")

    def dataset(self) -> Dataset:
        cls, args = self.factory()
        return cls(*args)

    def order(self, seed: int) -> list[int]:
        """The pass's sample order: a permutation drawn from ``seed``."""
        return torch.randperm(self.samples, generator=torch.Generator().manual_seed(seed)).tolist()


_DATASETS: dict[Case, Dataset] = {}  # one dataset per case and loading process


def fetch(case: Case, indices: Iterable[int]) -> Any:
    """One collated batch, in a loading process (torchdata.nodes, SPDL and Ray call this)."""
    ds = _DATASETS.get(case)
    if ds is None:
        ds = _DATASETS[case] = case.dataset()
    return default_collate([ds[int(i)] for i in indices])


def _columns(batch: Any) -> dict[str, np.ndarray]:
    """A collated batch as Ray Data's numpy columns (a tensor, or a list of tensors)."""
    parts = batch if isinstance(batch, (list, tuple)) else [batch]
    return {f"c{k}": t.numpy() for k, t in enumerate(parts)}


def ray_fetch(case: Case, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return _columns(fetch(case, rows["i"]))


def missing(system: str) -> str | None:
    """The package ``system`` needs when it is not installed, else None."""
    needs = {
        "torchdata": "torchdata.nodes",
        "spdl": "spdl.pipeline",
        "ray": "ray.data",
        "tfdata": "tensorflow",
    }
    module = needs.get(system)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else module.split(".")[0]


# -- torch's DataLoader and torchfeed ----------------------------------------------------


@contextlib.contextmanager
def open_torch(case: Case) -> Iterator[Epoch]:
    """``DataLoader(num_workers=2, persistent_workers=True)``: workers fork in the first pass."""
    loader = DataLoader(
        case.dataset(),
        batch_size=case.batch,
        shuffle=True,
        num_workers=WORKERS,
        persistent_workers=True,
        prefetch_factor=PREFETCH,
    )
    yield lambda seed: loader  # its persistent workers end with the measuring process


@contextlib.contextmanager
def open_torchfeed(case: Case) -> Iterator[Epoch]:
    """``LocalWorkers(2)`` started in set-up; the dataset is built on them in the first pass."""
    from .. import LocalWorkers, RemoteDataLoader, RemoteDataset

    with LocalWorkers(WORKERS) as workers:
        loader: Any = None

        def epoch(seed: int) -> Any:
            nonlocal loader
            if loader is None:
                cls, args = case.factory()
                loader = RemoteDataLoader(
                    RemoteDataset(workers.addresses, cls, *args),
                    batch_size=case.batch,
                    shuffle=True,
                    prefetch_factor=PREFETCH,
                )
            return loader

        yield epoch


# -- torchdata.nodes and SPDL: the same batch function in 2 processes ----------------------


@contextlib.contextmanager
def open_torchdata(case: Case) -> Iterator[Epoch]:
    """torchdata.nodes as its DataLoader migration guide builds it: sampler, batcher,
    ``ParallelMapper(method="process", num_workers=2)`` fetching and collating, prefetcher."""
    import torchdata.nodes as tn
    from torch.utils.data import RandomSampler

    node: Any = tn.SamplerWrapper(RandomSampler(range(case.samples)))
    node = tn.Batcher(node, batch_size=case.batch, drop_last=False)
    node = tn.ParallelMapper(node, partial(fetch, case), num_workers=WORKERS, method="process")
    node = tn.Prefetcher(node, prefetch_factor=PREFETCH)
    loader = tn.Loader(node)
    yield lambda seed: loader  # its processes end with the mapper's iterator


@contextlib.contextmanager
def open_spdl(case: Case) -> Iterator[Epoch]:
    """An SPDL pipeline per pass: batches of indices, the batch function on a pool of 2
    processes (concurrency 2, in order), a sink of :data:`PREFETCH` batches."""
    from concurrent.futures import ProcessPoolExecutor

    from spdl.pipeline import PipelineBuilder

    with ProcessPoolExecutor(WORKERS) as pool:

        def epoch(seed: int) -> Iterator[Any]:
            order = case.order(seed)
            batches = [order[i : i + case.batch] for i in range(0, case.samples, case.batch)]
            pipeline = (
                PipelineBuilder()
                .add_source(batches)
                .pipe(partial(fetch, case), concurrency=WORKERS, executor=pool, output_order="input")
                .add_sink(PREFETCH)
                .build(num_threads=WORKERS)
            )
            with pipeline.auto_stop():
                yield from pipeline.get_iterator(timeout=START_TIMEOUT)

        yield epoch


# -- Ray Data -----------------------------------------------------------------------------


@contextlib.contextmanager
def open_ray(case: Case) -> Iterator[Epoch]:
    """A local Ray with 2 CPUs on loopback; per pass a dataset of the shuffled indices (one
    block per batch), ``map_batches`` with the batch function, ``iter_torch_batches``."""
    import logging

    import ray

    ray.init(
        num_cpus=WORKERS,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    try:

        def epoch(seed: int) -> Iterable[Any]:
            ds = ray.data.from_items(
                [{"i": i} for i in case.order(seed)],
                override_num_blocks=math.ceil(case.samples / case.batch),
            ).map_batches(partial(ray_fetch, case), batch_size=case.batch, batch_format="numpy")
            return ds.iter_torch_batches(batch_size=case.batch)

        yield epoch
    finally:
        ray.shutdown()


# -- the tf.data service -------------------------------------------------------------------

_TF_SERVER = """
import sys
import tensorflow as tf
svc = tf.data.experimental.service
kind, port = sys.argv[1], int(sys.argv[2])
if kind == "dispatcher":
    server = svc.DispatchServer(svc.DispatcherConfig(port=port))
else:
    server = svc.WorkerServer(svc.WorkerConfig(
        dispatcher_address=sys.argv[3], worker_address=f"localhost:{port}", port=port))
server.join()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"tf.data server on port {port} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"tf.data server not listening on port {port} within {timeout:g} s")
        time.sleep(0.1)


def tf_dataset(case: Case, seed: int) -> Any:
    """The case in TF ops (decoded natively, ``tf.io.decode_jpeg`` DCT-scaled by 2 like
    Pillow's draft; ``sample_distorted_bounding_box`` for the random resized crop)."""
    import tensorflow as tf

    if case.name == "jpeg":
        files = sorted(f for f in os.listdir(case.root) if f.endswith(".jpg"))
        paths = [os.path.join(case.root, files[i]) for i in case.order(seed)]
        scale = 800 // DRAFT[0]

        def load(path: Any) -> Any:
            img = tf.io.decode_jpeg(tf.io.read_file(path), channels=3, ratio=scale)
            begin, size, _ = tf.image.sample_distorted_bounding_box(
                tf.shape(img),
                bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
                min_object_covered=0.0,
                aspect_ratio_range=(3 / 4, 4 / 3),
                area_range=(0.08, 1.0),
                max_attempts=10,
                use_image_if_no_bounding_boxes=True,
            )
            crop = tf.image.resize(tf.slice(img, begin, size), (SIDE, SIDE), method="bilinear")
            crop = tf.image.random_flip_left_right(tf.cast(tf.round(crop), tf.uint8))
            return tf.transpose(crop, (2, 0, 1))

        ds = tf.data.Dataset.from_tensor_slices(paths).map(load, num_parallel_calls=tf.data.AUTOTUNE)
    elif case.name == "big":
        ready = ReadyTensorDataset(4)
        tensors = tf.constant(np.stack([ready[i].numpy() for i in range(4)]))
        ds = tf.data.Dataset.range(case.samples).map(lambda i: tf.gather(tensors, i % 4))
    else:
        ds = tf.data.Dataset.range(case.samples).map(lambda i: (tf.cast(i, tf.float32), i))
    return ds.batch(case.batch).prefetch(PREFETCH)


def _to_torch(batch: Any) -> Any:
    if isinstance(batch, tuple):
        return [torch.from_numpy(b.numpy()) for b in batch]
    return torch.from_numpy(batch.numpy())


@contextlib.contextmanager
def open_tfdata(case: Case) -> Iterator[Epoch]:
    """A ``DispatchServer`` and 2 ``WorkerServer`` processes on loopback; per pass a
    dataset distributed with ``processing_mode="distributed_epoch"`` (every sample once)."""
    import tensorflow as tf

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    ports = [_free_port() for _ in range(WORKERS + 1)]
    dispatcher = f"localhost:{ports[0]}"
    procs: list[subprocess.Popen] = []
    try:
        for k, port in enumerate(ports):
            kind = "dispatcher" if k == 0 else "worker"
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _TF_SERVER, kind, str(port), dispatcher],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            _wait_listening(port, procs[-1])

        def epoch(seed: int) -> Iterator[Any]:
            ds = tf_dataset(case, seed).apply(
                tf.data.experimental.service.distribute(
                    processing_mode="distributed_epoch", service=f"grpc://{dispatcher}"
                )
            )
            for batch in ds:
                yield _to_torch(batch)

        yield epoch
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10.0)


SYSTEMS: dict[str, Callable[[Case], contextlib.AbstractContextManager[Epoch]]] = {
    "torch": open_torch,
    "torchfeed": open_torchfeed,
    "torchdata": open_torchdata,
    "spdl": open_spdl,
    "ray": open_ray,
    "tfdata": open_tfdata,
}
