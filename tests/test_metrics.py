"""Prometheus metrics: workers' (--metrics-port) and loaders' (torchfeed.metrics.serve).

The figures are scraped by a real Prometheus server on loopback (Debian's ``prometheus``,
started here with its own configuration and data folder) and read back through its HTTP
API; without the program those tests skip and say so. The Grafana dashboard's queries may
name only series the workers and loaders export.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers import WORKER_COMMAND, RangeDataset, SleepDataset, stop_process
from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset
from torchfeed.scaling import Policy
from torchfeed.stats import LoaderStats, WorkerStats
from torchfeed.util import free_port

pytestmark = pytest.mark.slow
prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import torchfeed.metrics as metrics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "torchfeed.json"
N = 120  # samples per pass


def _get(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def _families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(_get(url)[1])}


def _series_names(text: str) -> set[str]:
    """Names of the samples in a text exposition."""
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _dashboard_series() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    assert exprs, "the dashboard has no queries"
    return {name for e in exprs for name in re.findall(r"\btorchfeed_[a-z_]+", e)}


def _worker(port: int, **kw) -> LocalWorkers:
    return LocalWorkers(1, extra_args=["--metrics-port", str(port)], **kw)


@pytest.fixture(scope="module")
def scraped_pool():
    """Two workers with metrics ports, a loader over them after one full pass, its metrics served."""
    ports = [free_port(), free_port()]
    pools = [_worker(p) for p in ports]
    try:
        ds = RemoteDataset([w.addresses[0] for w in pools], RangeDataset, N)
        loader = RemoteDataLoader(ds, batch_size=10)
        assert sum(len(b[1]) for b in loader) == N
        with metrics.serve(loader, port=0) as served:
            yield ports, loader, served
    finally:
        for w in pools:
            w.close()


def test_worker_metrics_follow_prometheus_conventions(scraped_pool):
    ports, _, _ = scraped_pool
    families = [_families(f"http://127.0.0.1:{p}/metrics") for p in ports]
    for fams in families:
        for name, f in fams.items():
            assert name.startswith("torchfeed_worker_"), name
            if f.type == "counter":
                assert all(s.name == name + "_total" for s in f.samples if not s.name.endswith("_created"))
            if "bytes" in name or "seconds" in name:
                assert name.endswith(("_bytes", "_seconds")), f"unit not last in {name}"
    samples = [fams["torchfeed_worker_samples"].samples[0].value for fams in families]
    batches = [fams["torchfeed_worker_batches"].samples[0].value for fams in families]
    assert sum(samples) >= N and sum(batches) >= N // 10  # hedged batches load twice: never fewer
    for fams in families:
        assert fams["torchfeed_worker_sent_bytes"].samples[0].value > 0
        assert fams["torchfeed_worker_wire_sent_bytes"].samples[0].value > 0
        assert fams["torchfeed_worker_busy_seconds"].samples[0].value > 0
        assert fams["torchfeed_worker_executors"].samples[0].value == 1
        assert {"torchfeed_worker_cache_bytes", "torchfeed_worker_cache_hit_ratio"} <= set(fams)


def test_loader_metrics(scraped_pool):
    _, loader, served = scraped_pool
    fams = _families(served.url)
    assert all(name.startswith("torchfeed_loader_") for name in fams)
    per_worker = {s.labels["worker"]: s.value for s in fams["torchfeed_loader_worker_samples"].samples}
    assert set(per_worker) == set(loader.dataset.workers)
    assert sum(per_worker.values()) == N  # delivered exactly once each
    serving = {s.labels["state"]: s.value for s in fams["torchfeed_loader_workers"].samples}
    assert serving["serving"] == 2
    assert fams["torchfeed_loader_advised_workers"].samples[0].value >= 1
    assert fams["torchfeed_loader_received_bytes"].samples[0].value > 0
    # OpenMetrics when the scraper asks for it
    kind, text = _get(served.url, accept="application/openmetrics-text; version=1.0.0")
    assert kind.startswith("application/openmetrics-text") and text.rstrip().endswith("# EOF")


def test_dashboard_names_only_exported_series(scraped_pool):
    ports, _, served = scraped_pool
    exported = _series_names(_get(served.url)[1])
    for p in ports:
        exported |= _series_names(_get(f"http://127.0.0.1:{p}/metrics")[1])
    missing = _dashboard_series() - exported
    assert not missing, f"{DASHBOARD.name} queries series nobody exports: {sorted(missing)}"


def _stats(wait: float, rate: float, workers: int, per_worker_spb: float, batch: int = 10) -> LoaderStats:
    rows = {
        f"h:{i}": WorkerStats(f"h:{i}", "serving", rate / workers, 100, 100 * batch, 1, per_worker_spb, 0, 0)
        for i in range(workers)
    }
    return LoaderStats(wait, wait, rate, 10, 100, 0, 1.0, 0.0, workers=rows)


def test_advised_workers_is_the_policys_need():
    # the trainer waits 75% while 2 workers deliver 100 samples/s: it would take 400/s; one
    # worker does 10 samples / 0.1 s = 100/s, so 4 with no headroom, 5 with 10% headroom
    s = _stats(wait=0.75, rate=100.0, workers=2, per_worker_spb=0.1)
    assert metrics.demand(s) == pytest.approx(400.0)
    assert metrics.advised_workers(s, Policy(headroom=1.0)) == 4
    assert metrics.advised_workers(s) == 5
    assert metrics.advised_workers(s, Policy(max_workers=3)) == 3
    # nothing measured: keep what serves
    idle = _stats(wait=0.0, rate=0.0, workers=3, per_worker_spb=0.1)
    assert metrics.advised_workers(idle, Policy(min_workers=1)) == 1  # no batch taken: min_workers
    fresh = LoaderStats(0.0, 0.0, 5.0, 1, 5, 0, 1.0, 0.0)
    assert metrics.advised_workers(fresh) == 1


def test_worker_procs_get_consecutive_metrics_ports(tmp_path):
    port = free_port()
    while True:  # PORT and PORT+1 both free
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    proc = subprocess.Popen(
        [*WORKER_COMMAND, "--procs", "2", "--metrics-port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(2)]  # ready: both metrics ports serve
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", line) for line in lines), lines
        for i in range(2):
            fams = _families(f"http://127.0.0.1:{port + i}/metrics")
            assert fams["torchfeed_worker_executors"].samples[0].labels["worker"] == lines[i]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_metrics_without_prometheus_client_say_how_to_install(tmp_path):
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from torchfeed.worker.prometheus import require_client\n"
        "try:\n    require_client()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install 'torchfeed[metrics]'" in out


# -- a real Prometheus server ---------------------------------------------------------------------------


class Prometheus:
    """A Prometheus server on loopback scraping ``targets`` (job -> [host:port]) every second."""

    def __init__(self, folder: Path, targets: dict[str, list[str]]):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("the prometheus program is not installed (Debian: apt-get install prometheus)")
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: [{', '.join(repr(t) for t in addrs)}]\n"
            for job, addrs in targets.items()
        )
        config = folder / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n{jobs}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(folder / "prometheus.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(self.url + "/-/ready")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    why = (folder / "prometheus.log").read_text()[-2000:]
                    raise RuntimeError(f"prometheus did not start: {why}") from None
                time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        _, body = _get(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]["result"]

    def names(self) -> set[str]:
        return set(json.loads(_get(self.url + "/api/v1/label/__name__/values")[1])["data"])

    def until(self, expr: str, accept, timeout: float = 90.0) -> list[dict]:
        """Query ``expr`` until ``accept(result)`` (scrapes every second, on a busy machine)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if accept(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr}: still {result} after {timeout:g} s")
            time.sleep(0.5)

    def close(self) -> None:
        stop_process(self.proc, grace=30)
        self.log.close()


def _value(result: list[dict]) -> float:
    return sum(float(r["value"][1]) for r in result)


def test_prometheus_scrapes_workers_and_loader(tmp_path):
    ports = [free_port(), free_port()]
    pools = [_worker(p) for p in ports]
    prom = None
    try:
        ds = RemoteDataset([w.addresses[0] for w in pools], SleepDataset, N, 0.002)
        loader = RemoteDataLoader(ds, batch_size=10)
        with metrics.serve({"train": loader}, port=0) as served:
            prom = Prometheus(
                tmp_path,
                {
                    "torchfeed-workers": [f"127.0.0.1:{p}" for p in ports],
                    "trainer": [f"127.0.0.1:{served.port}"],
                },
            )
            prom.until('up{job="torchfeed-workers"} == 1', lambda r: len(r) == 2)
            prom.until('up{job="trainer"} == 1', lambda r: len(r) == 1)
            for _ in range(2):  # two passes: every sample delivered exactly once per pass
                assert sorted(i for b in loader for i in b[1].tolist()) == list(range(N))
            delivered = prom.until(
                'torchfeed_loader_worker_samples_total{loader="train"}', lambda r: _value(r) == 2 * N
            )
            assert {r["metric"]["worker"] for r in delivered} == set(ds.workers)
            loaded = prom.until("torchfeed_worker_samples_total", lambda r: _value(r) >= 2 * N)
            assert {r["metric"]["job"] for r in loaded} == {"torchfeed-workers"}
            prom.until('torchfeed_loader_workers{state="serving"}', lambda r: _value(r) == 2)
            advised = prom.until("torchfeed_loader_advised_workers", lambda r: len(r) == 1)
            assert _value(advised) >= 1
            prom.until(
                "rate(torchfeed_worker_busy_seconds_total[10s]) / torchfeed_worker_executors",
                lambda r: len(r) == 2,
            )
            missing = _dashboard_series() - prom.names()
            assert not missing, f"the dashboard queries series Prometheus never stored: {sorted(missing)}"
    finally:
        if prom is not None:
            prom.close()
        for w in pools:
            w.close()
