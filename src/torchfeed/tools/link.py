"""A real link on one machine: workers and trainer in a network namespace whose loopback is
shaped by tc's token bucket (tbf), and what reaches the trainer through it.

Every figure torchfeed published before was measured over unshaped loopback, where the
CPU, not the link, bounds what reaches the trainer. Here ``unshare --net`` (root) gives
the measurement a loopback of its own and ``tc qdisc add dev lo root tbf rate R burst 1mb
latency 200ms`` caps it at R (netem is not available on these kernels; tbf is). Workers
started inside the namespace (:class:`torchfeed.LocalWorkers`) reach the trainer only
through that shaped loopback; no traffic leaves the machine.

:func:`run` measures, for each batch kind, the logical bytes per second a
:class:`~torchfeed.RemoteDataLoader` delivers over 2 workers, against the link's rate:

* ``tokens``: int64 token ids below 32,000 (compressible: most bytes are zero);
* ``photos``: uint8 images of random bytes (incompressible);
* ``floats``: float32 batches of random values (incompressible).

``python benchmarks/link.py`` (or :func:`main`) re-runs itself inside a shaped namespace
per rate; the table compares with the same kinds over unshaped loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..protocol import localpath
from . import measure as measure_tools

BATCH = 32
KINDS = ("tokens", "photos", "floats")


class LinkDataset(Dataset):
    """Samples of one kind (see the module's docstring), made once and served round robin."""

    def __init__(self, kind: str, length: int = 1 << 30, distinct: int = 16, seed: int = 0):
        rng = np.random.default_rng(seed)
        if kind == "tokens":  # a 2048-token sequence of ids below 32,000
            items = [torch.from_numpy(rng.integers(0, 32_000, 2048, dtype=np.int64)) for _ in range(distinct)]
        elif kind == "photos":  # a 3x224x224 uint8 image of random bytes
            items = [
                torch.from_numpy(rng.integers(0, 256, (3, 224, 224), dtype=np.uint8)) for _ in range(distinct)
            ]
        elif kind == "floats":  # 3x64x64 float32 values
            items = [
                torch.from_numpy(rng.standard_normal((3, 64, 64), dtype=np.float32)) for _ in range(distinct)
            ]
        else:
            raise ValueError(f"unknown kind {kind!r}: choose from {KINDS}")
        self.items, self.length = items, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i % len(self.items)]


def shaping_available() -> str | None:
    """None when shaped namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (unshare --net and tc)"
    missing = [p for p in ("unshare", "ip", "tc") if shutil.which(p) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux, iproute2)"
    return None


def shaped_command(argv: list[str], rate: str | None) -> list[str]:
    """``argv`` run in a new network namespace whose loopback is up and, with ``rate``
    (tc's units: 1gbit, 400mbit), shaped by a token bucket."""
    setup = "ip link set lo up"
    if rate:
        setup += f" && tc qdisc add dev lo root tbf rate {rate} burst 1mb latency 200ms"
    quoted = " ".join(shlex.quote(a) for a in argv)
    return ["unshare", "--net", "--", "sh", "-c", f"{setup} && exec {quoted}"]


def measure(kind: str, seconds: float, workers: int = 2, compression: str | None = "auto") -> dict[str, Any]:
    """In this process's network: logical MB/s a RemoteDataLoader delivers for ``kind``
    with ``compression`` (``"none"``: None)."""
    import torchfeed

    with torchfeed.LocalWorkers(workers) as w:
        ds: torchfeed.RemoteDataset = torchfeed.RemoteDataset(w.addresses, LinkDataset, kind)
        loader: torchfeed.RemoteDataLoader = torchfeed.RemoteDataLoader(
            ds,
            batch_size=BATCH,
            prefetch_factor=4,
            compression=None if compression == "none" else compression,
        )
        it = iter(loader)
        for _ in range(4):  # warm up: connections, first batches
            next(it)
        # bytes as they arrive (the loader's statistics), not as this loop takes batches: with
        # two connections, a batch often arrives whole before the one ahead of it is taken
        received, start = loader.stats().bytes_received, time.perf_counter()
        while time.perf_counter() - start < seconds:
            next(it)
        elapsed = time.perf_counter() - start
        stats = loader.stats()
        paths = measure_tools.paths_used()
    return {
        "paths": paths,
        "kind": kind,
        "compression": compression,
        "mb_per_s": (stats.bytes_received - received) / elapsed / 1e6,
        "wire_share": stats.wire_bytes_received / max(stats.bytes_received, 1),
        "wait": stats.wait_fraction,
        "advice": stats.advice,
    }


def _inside(args) -> int:
    # the workers share this namespace with the trainer: without this they would be reached over
    # the same-host socket, which no link shapes
    os.environ[localpath.ENV] = "tcp"
    out = [
        measure(kind, args.seconds, compression=c) for kind in args.kinds for c in args.compression.split(",")
    ]
    print(json.dumps(out))
    return 0


def rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"a rate in tc's units (400mbit, 1gbit), not {rate!r}")


def run(
    rates: list[str | None], kinds: list[str], seconds: float, compression: str = "auto"
) -> list[dict[str, Any]]:
    """Each kind at each rate (None: unshaped) with each of ``compression`` (comma
    separated: auto, none, lz4, zstd), each rate in a namespace of its own."""
    rows = []
    for rate in rates:
        argv = [sys.executable, "-m", "torchfeed.tools.link", "--inside", "--seconds", str(seconds)]
        argv += ["--compression", compression, *kinds]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(
            shaped_command(argv, rate),
            capture_output=True,
            text=True,
            env=env,
            timeout=120 + (30 + 2 * seconds) * len(kinds) * len(compression.split(",")),
        )
        if done.returncode != 0:
            raise RuntimeError(f"the measurement at {rate or 'loopback'} failed:\n{done.stderr[-3000:]}")
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            row["rate"] = rate or "loopback"
            row["link_share"] = row["mb_per_s"] * 8e6 / rate_bits(rate) if rate else None
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| link | batches | compression | delivered MB/s | x the link's bytes | wire/logical | trainer waiting |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = "-" if r["link_share"] is None else f"{r['link_share']:.2f}"
        lines.append(
            f"| {r['rate']} | {r['kind']} | {r['compression']} | {r['mb_per_s']:,.0f} | {share} | "
            f"{r['wire_share']:.2f} | {r['wait']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/link.py", description=__doc__.split("\n\n")[0])
    p.add_argument("kinds", nargs="*", default=list(KINDS), help=f"batch kinds (default: {' '.join(KINDS)})")
    p.add_argument("--rates", default="1gbit,4gbit", help="tc rates, comma separated (default 1gbit,4gbit)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds measured per kind and rate")
    p.add_argument(
        "--compression", default="auto,none", help="compression settings, comma separated (default auto,none)"
    )
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inside:
        return _inside(args)
    why = shaping_available()
    if why:
        print(f"benchmarks/link.py: {why}", file=sys.stderr)
        return 2
    rates: list[str | None] = [None, *[r for r in args.rates.split(",") if r]]
    print(table(run(rates, args.kinds, args.seconds, args.compression)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
