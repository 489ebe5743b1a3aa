"""Random seeding helpers for code that runs on workers."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seeds(base_seed: int, worker_id: int) -> None:
    """Seed Python's, numpy's and torch's default generators on a worker.

    Meant to be run once on each worker (for example with
    ``RemoteDataset.run_on_workers``), giving each worker a distinct stream derived from
    ``base_seed`` and its ``worker_id``, as torch's DataLoader does for its worker processes.
    """
    seed = (int(base_seed) + int(worker_id)) % 2**64
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
