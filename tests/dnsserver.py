"""A DNS server on loopback for the tests: dnsmasq (Debian's) on 127.0.0.1 at a free port,
answering one name from a hosts file it reads again on SIGHUP (records with TTL 0)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

from helpers import stop_process
from torchfeed.loader.dnsnames import DNSName
from torchfeed.util import free_port

NAME = "torchfeed-workers.test"  # the name the tests' workers are found under


class Unavailable(Exception):
    """dnsmasq is not installed here."""


class Dnsmasq:
    """dnsmasq on 127.0.0.1:port answering ``name`` from a hosts file (TTL 0); :meth:`set` changes its records."""

    def __init__(self, folder: Path, name: str):
        binary = shutil.which("dnsmasq")
        if binary is None:
            raise Unavailable("dnsmasq is not installed (Debian: apt-get install dnsmasq)")
        self.record = name
        self.hosts = folder / "hosts"
        self.port = free_port()
        self.log = open(folder / "dnsmasq.log", "w")  # noqa: SIM115 - closed in close()
        self.set([])
        self.proc = subprocess.Popen(
            [
                binary,
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                f"--port={self.port}",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                f"--addn-hosts={self.hosts}",
                f"--local=/{name.rsplit('.', 1)[-1]}/",  # answer AAAA queries (no records) instead of refusing them
                "--user=root",  # reads the hosts file again after SIGHUP (the test's folder is private)
                "--pid-file=",
                "--log-facility=-",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.name = DNSName(name, 1, server="127.0.0.1", server_port=self.port, timeout=1.0)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.name.resolve()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(
                        f"dnsmasq did not start: {(folder / 'dnsmasq.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.1)

    def set(self, ips) -> None:
        """Serve these records from now on (once dnsmasq has read the file again: callers poll)."""
        fresh = self.hosts.with_suffix(".new")
        fresh.write_text("".join(f"{ip} {self.record}\n" for ip in ips))
        fresh.replace(self.hosts)  # whole: dnsmasq never reads half a file
        if hasattr(self, "proc"):
            self.proc.send_signal(signal.SIGHUP)

    def close(self) -> None:
        stop_process(self.proc)
        self.log.close()
