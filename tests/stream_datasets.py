"""Iterable-style datasets for the streaming tests (imported by the workers too)."""

from __future__ import annotations

import os
import time

import torch
from torch.utils.data import IterableDataset, get_worker_info


def _split():
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class Counting(IterableDataset):
    """Numbers split among streams, with a random draw per item (seeded as torch seeds workers)."""

    def __init__(self, n: int = 40, delay: float = 0.0):
        self.n = n
        self.delay = delay

    def __iter__(self):
        wid, count = _split()
        for i in range(wid, self.n, count):
            if self.delay:
                time.sleep(self.delay)
            yield torch.tensor([i, wid]), float(torch.rand(()))


class _Position:
    """An iterator that can say where it is (torchdata's Stateful protocol)."""

    def __init__(self, dataset, wid: int, count: int):
        self.dataset = dataset
        self.wid, self.count = wid, count
        self.next_value = wid

    def __iter__(self):
        return self

    def __next__(self):
        if self.next_value >= self.dataset.n:
            raise StopIteration
        i = self.next_value
        self.next_value += self.count
        if self.dataset.delay:
            time.sleep(self.dataset.delay)
        return torch.tensor([i, self.wid]), float(torch.rand(()))

    def state_dict(self):
        return {"next_value": self.next_value}

    def load_state_dict(self, state):
        self.next_value = state["next_value"]


class StatefulCounting(Counting):
    """The same items as Counting; the iterator is Stateful."""

    def __iter__(self):
        wid, count = _split()
        return _Position(self, wid, count)


class DatasetStateful(IterableDataset):
    """State kept by the dataset itself (state_dict/load_state_dict on the dataset)."""

    def __init__(self, n: int = 30, delay: float = 0.0):
        self.n = n
        self.delay = delay
        self.resume_at = None
        self.at = None

    def __iter__(self):
        wid, count = _split()
        start = self.resume_at if self.resume_at is not None else wid
        self.resume_at = None
        for i in range(start, self.n, count):
            if self.delay:
                time.sleep(self.delay)
            self.at = i + count
            yield i

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.resume_at = state["at"]


class CrashesAt(IterableDataset):
    """Numbers split among streams, but the process that reaches item ``fatal`` exits (a decoder
    that takes the interpreter down), after a pause that lets its earlier replies leave."""

    def __init__(self, n: int, fatal: int):
        self.n = n
        self.fatal = fatal

    def __iter__(self):
        wid, count = _split()
        for i in range(wid, self.n, count):
            if i == self.fatal:
                time.sleep(0.5)
                os._exit(3)
            yield torch.tensor([i, wid])


def sum_collate(batch):
    return {"n": len(batch), "first": batch[0], "sum": sum(int(x[0][0]) for x in batch)}


# --------------------------------------------------------------------------- shard readers
def text_lines(url, storage_options=None):
    from torchfeed.datasets import lines

    return lines(url, storage_options)


class SlowLines:
    """Lines of a text shard as (pid, line); slow on the worker process ``slow_pid``."""

    def __init__(self, slow_pid: int = -1, delay: float = 0.0, every: float = 0.0):
        self.slow_pid = slow_pid
        self.delay = delay
        self.every = every  # a delay on every worker

    def __call__(self, url):
        import os

        from torchfeed.datasets import lines

        pid = os.getpid()
        for line in lines(url):
            if pid == self.slow_pid and self.delay:
                time.sleep(self.delay)
            if self.every:
                time.sleep(self.every)
            yield pid, line


def wds_samples(url):
    """The samples of a webdataset tar shard as (key, text)."""
    import webdataset as wds

    for sample in wds.DataPipeline(wds.SimpleShardList([url]), wds.tarfile_to_samples()):
        yield sample["__key__"], sample["txt"].decode()
