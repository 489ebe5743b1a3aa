"""Run as one rank of a 2-process job (launcher variables in the environment).

Initialises torch.distributed with ``torchfeed.cluster.init_distributed``, trains a model
split across ``device_group(2)`` (two "devices": CPU here) with DDP over gloo, checks that
``Preemption.should_stop`` is agreed by all ranks when only rank 1 got the signal, and
writes what it saw to ``argv[1]`` as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torchfeed.checkpoint import Preemption
from torchfeed.cluster import device_group, init_distributed


class SplitModel(torch.nn.Module):
    """Head on the first device of the replica, tail on the second (the seed's ToyModel)."""

    def __init__(self, devices):
        super().__init__()
        self.devices = devices
        self.head = torch.nn.Linear(4, 8).to(devices[0])
        self.tail = torch.nn.Linear(8, 1).to(devices[1])

    def forward(self, x):
        h = torch.relu(self.head(x.to(self.devices[0])))
        return self.tail(h.to(self.devices[1]))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(6, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def main() -> int:
    out = sys.argv[1]
    env = init_distributed(timeout=60)
    devices = device_group(2)
    torch.manual_seed(0)
    model = DDP(SplitModel(devices))  # a multi-device module: no device_ids
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(env.rank, step)
        loss = ((model(x) - y.to(devices[1])) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    pre = Preemption(["USR2"])
    if env.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR2)
    local_flag = pre.requested
    agreed = pre.should_stop()
    pre.close()
    result = {
        "rank": env.rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "source": env.source,
        "master_port": env.master_port,
        "devices": [str(d) for d in devices],
        "params": [p.detach().flatten().tolist() for p in model.module.parameters()],
        "local_flag": local_flag,
        "agreed": agreed,
        "backend": dist.get_backend(),
    }
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
