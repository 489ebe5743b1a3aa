"""A private Ray cluster on this machine, on loopback: a head node and a second node offering
the resource the torchfeed worker actors need (``torchfeed_worker``) and a label
(``torchfeed-pool=cpu``), as a CPU node would.

Ray takes "127.0.0.1" to mean "this machine" and swaps in its routable address; another loopback
address stays as given, so every Ray connection stays on loopback (``NODE_IP``). The nodes do
not inherit TORCHFEED_SECRET: workers get the secret only through the pool. The cluster's
processes are found by the private temporary folder given to ``ray start`` and stopped by PID
(never ``ray stop``, which would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchfeed.util import free_port

SRC = Path(__file__).resolve().parent.parent / "src"
TESTS = Path(__file__).resolve().parent
NODE_IP = "127.0.0.9"
RESOURCE = "torchfeed_worker"
LABELS = {"torchfeed-pool": "cpu"}  # the second node's labels (Ray's label_selector)
START_TIMEOUT = 120  # seconds for each `ray start`


class Unavailable(Exception):
    """Ray is not installed here."""


def _ray_command() -> str:
    found = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    if not Path(found).exists():
        raise Unavailable("the ray command is not installed (pip install 'torchfeed[ray]')")
    return found


class RayCluster:
    """``ray start`` twice; :attr:`address` for ``ray.init``; :meth:`close` stops both nodes."""

    def __init__(self, head_cpus: int = 2, worker_cpus: int = 3):
        import psutil  # noqa: F401 - needed by close(); fail before starting anything

        ray = _ray_command()
        self.folder = tempfile.mkdtemp(prefix="tfray", dir="/tmp")  # short: Ray's socket paths must fit
        port = free_port()
        self.address = f"{NODE_IP}:{port}"
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TORCHFEED_SECRET", "TORCHFEED_SECRET_FILE", "RAY_ADDRESS")
        }
        env.update(
            PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]),
            RAY_USAGE_STATS_ENABLED="0",
            RAY_memory_monitor_refresh_ms="0",
            RAY_AUTH_MODE="disabled",  # a ~/.ray/auth_token left by another Ray would switch tokens on
        )
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the same for this process's driver
        common = [
            f"--node-ip-address={NODE_IP}",
            "--object-store-memory=80000000",
            "--num-gpus=0",
            "--disable-usage-stats",
        ]

        def agent_ports() -> list[str]:  # Ray's defaults are fixed ports another Ray here may hold
            return [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]

        head = [ray, "start", "--head", f"--port={port}", f"--temp-dir={self.folder}", f"--num-cpus={head_cpus}",
                "--include-dashboard=false"]  # fmt: skip
        second = [ray, "start", f"--address={self.address}", f"--num-cpus={worker_cpus}",
                  "--resources=" + json.dumps({RESOURCE: worker_cpus}), "--labels=" + json.dumps(LABELS)]  # fmt: skip
        try:
            for cmd in (head, second):
                done = subprocess.run(
                    [*cmd, *agent_ports(), *common], env=env, capture_output=True, timeout=START_TIMEOUT
                )
                if done.returncode:
                    raise RuntimeError(f"{' '.join(cmd[:3])} failed: {done.stderr.decode()[-2000:]}")
        except BaseException:
            self.close()
            raise

    def wait_for_resource(self, ray, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while ray.cluster_resources().get(RESOURCE, 0) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the second node did not join: {ray.cluster_resources()}")
            time.sleep(0.2)

    def _processes(self) -> list:
        import psutil

        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid == os.getpid():
                continue
            try:
                if any(self.folder in part for part in (p.info["cmdline"] or [])):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def close(self) -> None:
        """Stop the cluster's processes (by PID) and remove its folder."""
        import psutil

        procs = self._processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)
