"""Training script run by the Slurm tests (srun or torchrun): gloo DDP fed by torchfeed workers.

Writes into ``$TORCHFEED_JOB_DIR``: ``seen.<rank>.json`` (the (epoch, sample) pairs each
rank trained on), ``result.json`` (rank 0: final parameters, environment facts) and
``progress`` (steps done, for the preemption test to know when to signal). With
``--preempt`` it checkpoints on the preemption signal, requeues the job and resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchfeed
from helpers import RangeDataset
from torchfeed import checkpoint
from torchfeed.cluster import environment, init_distributed, workers


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--preempt", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    job_dir = os.environ["TORCHFEED_JOB_DIR"]
    env = init_distributed(timeout=120)
    rank, world = env.rank, env.world_size
    my_workers = workers()
    pre = checkpoint.Preemption() if args.preempt else None

    ds = torchfeed.RemoteDataset(my_workers, RangeDataset, args.samples)
    sampler = torchfeed.DistributedSampler(args.samples, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=args.batch_size, sampler=sampler, seed=11)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ckpt = os.path.join(job_dir, "checkpoint.pt")
    seen, start_epoch, step = [], 0, 0
    if args.preempt and checkpoint.exists(ckpt):
        state = checkpoint.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"][rank])
        seen, start_epoch, step = state["seen"][rank], state["epoch"], state["step"]

    stopped = False
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # the loader's own epoch advances by one per pass (and is in its state)
        for x, y in loader:
            loss = ((model(x / args.samples).squeeze(1) - y.float() / args.samples) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += [[epoch, int(i)] for i in y]
            step += 1
            if rank == 0:
                with open(os.path.join(job_dir, "progress"), "w") as f:
                    f.write(str(step))
            time.sleep(args.step_sleep)
            if pre is not None and pre.should_stop():
                states: list = [None] * world
                dist.all_gather_object(states, {"loader": loader.state_dict(), "seen": seen})
                if rank == 0:
                    checkpoint.save(
                        {
                            "model": model.module.state_dict(),
                            "optimizer": opt.state_dict(),
                            "loader": [s["loader"] for s in states],
                            "seen": [s["seen"] for s in states],
                            "epoch": epoch,
                            "step": step,
                        },
                        ckpt,
                    )
                    print(f"rank 0: checkpoint at step {step} (epoch {epoch})", flush=True)
                pre.requeue()
                stopped = True
                break
        if stopped:
            break
    if not stopped:
        with open(os.path.join(job_dir, f"seen.{rank}.json"), "w") as f:
            json.dump(seen, f)
        if rank == 0:
            result = {
                "params": [p.detach().flatten().tolist() for p in model.module.parameters()],
                "steps": step,
                "world_size": world,
                "source": env.source,
                "workers": my_workers,
                "restarts": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
                "environment": environment().__dict__,
            }
            with open(os.path.join(job_dir, "result.json"), "w") as f:
                json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
