"""The documentation works: every ```python block of README.md and docs/ runs, and the site builds.

Each block runs as a script (``python example.py``) in an empty directory, with this
repository's ``src`` first on ``PYTHONPATH``: a process forked from a warm interpreter that
imported torch and torchfeed once (tests/docsrunner.py), run as ``__main__``; on failure the
test shows the block's location and its output. An HTML comment on the line just before a block's
fence says how to run it:

- ``<!-- docs-test: skip (reason) -->``: the block cannot run here as it stands (a
  fragment, a Slurm cluster, GPUs); it is only compiled, so its syntax cannot rot, and the
  test is skipped with the reason;
- ``<!-- docs-test: dask -->``: runs a Dask ``LocalCluster`` (marked ``dask``, more time);
- ``<!-- docs-test: s3 -->``: needs an S3 server: a SeaweedFS one is started first
  (``tests/s3server.py``) and its endpoint passed in ``S3_ENDPOINT_URL``; skipped when it
  cannot start.
- ``<!-- docs-test: ray -->``: needs a Ray cluster: one is started on loopback
  (``tests/raycluster.py``, a second node offering the ``torchfeed_worker`` resource) and its
  address passed in ``RAY_ADDRESS``; skipped where Ray is not installed (marked ``ray``).
- ``<!-- docs-test: dns -->``: needs a DNS server: dnsmasq is started (``tests/dnsserver.py``)
  answering ``torchfeed-workers.test`` with 127.0.0.2 and 127.0.0.3, and its address passed in
  ``TORCHFEED_DNS_SERVER``; skipped where dnsmasq is missing.

Blocks without a marker just run. Every block that runs is marked ``slow`` (a process that
imports torch and starts workers takes seconds); compile-only ones are fast.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*(?:\((?P<reason>.*)\))?\s*-->")
KINDS = {"skip", "dask", "s3", "ray", "dns"}
RUN_TIMEOUT = {None: 100, "s3": 100, "dask": 170, "ray": 200, "dns": 100}  # seconds for the block's process


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    kind: str | None
    reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The ```python blocks of a Markdown file, and what is wrong with its markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT)
    blocks: list[Block] = []
    problems: list[str] = []
    used: set[int] = set()  # lines of markers attached to a python block
    fenced: set[int] = set()  # lines inside code blocks (markers shown there are examples)
    i = 0
    while i < len(lines):
        opening = lines[i].strip()
        if not opening.startswith("```"):
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            problems.append(f"{rel}:{i + 1}: code fence never closed")
            break
        fenced.update(range(i, end + 1))
        if opening[3:].strip() == "python":
            kind = reason = None
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            if marker:
                used.add(i - 1)
                kind, reason = marker["kind"], marker["reason"]
                if kind not in KINDS:
                    problems.append(f"{rel}:{i}: unknown docs-test marker {kind!r} (known: {sorted(KINDS)})")
                if kind == "skip" and not (reason or "").strip():
                    problems.append(f"{rel}:{i}: a skipped block needs a reason: docs-test: skip (why)")
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            blocks.append(Block(path, i + 1, code, kind, reason))
        i = end + 1
    for n, line in enumerate(lines):
        if MARKER.fullmatch(line.strip()) and n not in used and n not in fenced:
            problems.append(f"{rel}:{n + 1}: docs-test marker not on the line just before a ```python fence")
    return blocks, problems


BLOCKS: list[Block] = []
PROBLEMS: list[str] = []
for _path in DOC_FILES:
    _blocks, _problems = parse(_path)
    BLOCKS += _blocks
    PROBLEMS += _problems


def _params() -> list:
    params = []
    for block in BLOCKS:
        marks = []
        if block.kind != "skip":
            marks.append(pytest.mark.slow)
        if block.kind == "dask":
            marks += [pytest.mark.dask, pytest.mark.timeout(RUN_TIMEOUT["dask"] + 30)]
        if block.kind == "ray":  # the cluster's start counts too
            marks += [pytest.mark.ray, pytest.mark.timeout(RUN_TIMEOUT["ray"] + 300)]
        params.append(pytest.param(block, id=block.name, marks=marks))
    return params


def test_markers_are_well_formed():
    assert BLOCKS, "no ```python blocks found in README.md and docs/"
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.fixture(scope="session")
def s3_endpoint():
    pytest.importorskip("s3fs")
    from s3server import S3Server  # tests/ is on sys.path (conftest.py)

    try:
        return S3Server.shared().endpoint
    except RuntimeError as exc:
        pytest.skip(f"no S3 server: {exc}")


@pytest.fixture
def ray_address(ray_cluster_shared):  # tests/conftest.py: shared with test_ray.py
    return ray_cluster_shared.address


@pytest.fixture
def dns_server(tmp_path_factory):
    pytest.importorskip("dns.resolver")
    from dnsserver import Dnsmasq, Unavailable

    try:
        server = Dnsmasq(tmp_path_factory.mktemp("dns"), "torchfeed-workers.test")
    except Unavailable as exc:
        pytest.skip(str(exc))
    server.set(["127.0.0.2", "127.0.0.3"])
    yield f"127.0.0.1:{server.port}"
    server.close()


@pytest.fixture(scope="session")
def runner():
    """A warm interpreter that runs the blocks (tests/docsrunner.py): one per test process."""
    from docsrunner import Runner

    warm = Runner(_block_env())
    yield warm
    warm.close()


def _block_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["MPLBACKEND"] = "Agg"
    return env


@pytest.mark.parametrize("block", _params())
def test_block(block: Block, tmp_path, request):
    compile(block.code, block.name, "exec")  # every block, skipped ones included
    if block.kind == "skip":
        pytest.skip(f"{block.name}: {block.reason}")
    env = _block_env()
    if block.kind == "dask":
        pytest.importorskip("distributed")
    if block.kind == "s3":
        env["S3_ENDPOINT_URL"] = request.getfixturevalue("s3_endpoint")
    if block.kind == "ray":
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_address")
    if block.kind == "dns":
        env["TORCHFEED_DNS_SERVER"] = request.getfixturevalue("dns_server")
    timeout = RUN_TIMEOUT[block.kind]
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    code, out = request.getfixturevalue("runner").run(script, env, timeout)
    print(out)  # shown with -rP
    if code is None:
        pytest.fail(f"{block.name} did not finish within {timeout} s; its output:\n{out}", pytrace=False)
    if code != 0:
        pytest.fail(f"{block.name} exited with code {code}; its output:\n{out}", pytrace=False)


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        cwd=ROOT,  # the snippets (DESIGN.md, benchmarks/) are found from the repository root
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, output
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "reference" / "loader" / "index.html").exists()
