#!/usr/bin/env python
"""One same-host worker and two behind a shaped link, in one dataset: is nothing lost?

    sudo python benchmarks/mixed.py [--rate 1gbit] [--seconds 6] [--rounds 3]

Two workers run in a network namespace of their own (``ip netns``), reached through a veth
pair whose far end is shaped by tc's token bucket (``tbf``, the worker-to-trainer direction);
one worker runs beside the trainer (the same-host path: Unix socket, shared memory). Each
sample sleeps ``--sleep`` seconds (I/O-bound loading, so the 2 cores are not what bounds the
rates) and is a float32 3x224x224 tensor (602 KB). Measured, in interleaved rounds:

* the near worker alone, the two far ones alone (the link bounds them), then all three;
* the share: what all three deliver over the sum of what each group delivered alone (target
  >= 0.9), and the path each connection took.

Needs root, iproute2 and tc. The namespace and the veth pair are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
try:
    import torchfeed
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent / "src"))
    import torchfeed

NS = "tf-bench-far"
NEAR_IP, FAR_IP = "10.231.77.1", "10.231.77.2"  # on the veth pair only: nothing leaves the machine


class Sleepy(torch.utils.data.Dataset):
    """``seconds`` of waiting, then a 602 KB float32 image: loading bound by I/O, not CPU."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.image = torch.rand(3, 224, 224)

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.image


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def make_namespace(rate: str) -> None:
    remove_namespace()
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", "tf-near0", "type", "veth", "peer", "name", "tf-far0")
    sh("ip", "link", "set", "tf-far0", "netns", NS)
    sh("ip", "addr", "add", f"{NEAR_IP}/30", "dev", "tf-near0")
    sh("ip", "link", "set", "tf-near0", "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{FAR_IP}/30", "dev", "tf-far0")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "tf-far0", "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
    shape = [
        "tc",
        "qdisc",
        "add",
        "dev",
        "tf-far0",
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        "1mb",
        "latency",
        "200ms",
    ]
    sh("ip", "netns", "exec", NS, *shape)


def remove_namespace() -> None:
    subprocess.run(["ip", "link", "del", "tf-near0"], capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def far_workers(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                NS,
                sys.executable,
                "-m",
                "torchfeed",
                "worker",
                "--host",
                FAR_IP,
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(n)
    ]
    return procs, [p.stdout.readline().strip() for p in procs if p.stdout is not None]


def rate(addresses: list[str], seconds: float, sleep: float) -> tuple[float, dict[str, str]]:
    """MB/s a loader over ``addresses`` delivers (after a warm-up), and its paths."""
    loader = torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(addresses, Sleepy, sleep), batch_size=16)
    it = iter(loader)
    for _ in range(3 * len(addresses)):
        next(it)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += next(it).nbytes
    elapsed = time.perf_counter() - start
    paths = torchfeed.client.paths()
    del it, loader
    torchfeed.client.close_all()
    return done / elapsed / 1e6, {a: paths.get(a, "?") for a in addresses}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit", help="the far workers' link, in tc's units (default 1gbit)")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.004, help="seconds each sample waits (default 0.004)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("benchmarks/mixed.py needs root (ip netns, tc)", file=sys.stderr)
        return 2
    os.environ.setdefault("TORCHFEED_SECRET", secrets.token_hex(32))
    make_namespace(args.rate)
    procs: list[subprocess.Popen] = []
    try:
        procs, far = far_workers(2)
        with torchfeed.LocalWorkers(1) as near_workers:
            near = near_workers.addresses
            shares, rows = [], []
            for r in range(args.rounds):
                alone_near, _ = rate(near, args.seconds, args.sleep)
                alone_far, _ = rate(far, args.seconds, args.sleep)
                mixed, paths = rate(near + far, args.seconds, args.sleep)
                share = mixed / (alone_near + alone_far)
                shares.append(share)
                rows.append((alone_near, alone_far, mixed, share))
                print(
                    f"round {r + 1}: near alone {alone_near:.0f} MB/s, far pair alone {alone_far:.0f} MB/s "
                    f"({args.rate}), all three {mixed:.0f} MB/s: {share:.2f} of the sum; paths {sorted(paths.values())}",
                    flush=True,
                )
            print(f"median share of the sum: {statistics.median(shares):.2f} (target >= 0.9)")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        remove_namespace()
    return 0


if __name__ == "__main__":
    sys.exit(main())
