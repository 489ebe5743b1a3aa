"""LocalWorkers' fork server: workers forked fast, from a clean process, never from the trainer."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys

import pytest

import torchfeed
from helpers import PROMPT, RangeDataset, wait_for
from torchfeed.util import pid_alive

pytestmark = pytest.mark.timeout(180)

MARKER: str | None = None  # set by a trainer, in its copy of this module, before its workers start


def trainer_state_seen() -> dict:
    """What code on a worker finds of its trainer: this module's MARKER in the worker's modules,
    the environment the worker's process started with, and its parent."""
    module = sys.modules.get(__name__)
    with open("/proc/self/environ", "rb") as f:
        environ = f.read()
    return {"marker": getattr(module, "MARKER", None), "environ": environ, "ppid": os.getppid()}


def say(text: str) -> None:
    print(text, flush=True)


def _trainer(script: str, key: str) -> subprocess.Popen:
    """A trainer process started with ``TORCHFEED_SECRET=key`` in its environment, as users start theirs."""
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "TORCHFEED_SECRET": key},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _report(trainer: subprocess.Popen) -> dict:
    """The trainer's JSON line (its workers' output lines are skipped)."""
    assert trainer.stdout is not None
    for line in trainer.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"the trainer ended without its report (exit code {trainer.wait()})")


SEEN = """
import json, os, secrets
import test_fork_server as probe
import torchfeed
probe.MARKER = secrets.token_hex(16)
with torchfeed.LocalWorkers(1) as w:
    seen = torchfeed.rpc_async(w.addresses[0], probe.trainer_state_seen, timeout=60).wait()
environ = seen["environ"].decode(errors="replace")
print(json.dumps({"marker": probe.MARKER, "seen": seen["marker"], "environ": environ,
                  "ppid": seen["ppid"], "trainer": os.getpid()}), flush=True)
"""


def test_code_on_a_worker_finds_neither_trainer_objects_nor_the_secret_in_its_environment():
    key = secrets.token_hex(32)
    trainer = _trainer(SEEN, key)
    try:
        got = _report(trainer)
    finally:
        trainer.kill()
        trainer.wait()
    assert got["marker"] and got["seen"] is None  # the worker's modules are not the trainer's
    assert "TORCHFEED_SECRET" not in got["environ"] and key not in got["environ"]
    assert got["ppid"] != got["trainer"]  # forked by the fork server, not by the trainer


HELD = """
import json, sys
import torchfeed
w = torchfeed.LocalWorkers(2)
print(json.dumps({"server": w.fork_server.pid, "workers": [p.pid for p in w.processes]}), flush=True)
sys.stdin.read()  # then leaves without closing w: interpreter exit stops everything
"""


@pytest.mark.parametrize("end", ["SIGKILL", "exit"])
def test_the_fork_server_and_its_workers_end_with_the_trainer(end):
    trainer = _trainer(HELD, secrets.token_hex(32))
    try:
        pids = _report(trainer)
        started = [pids["server"], *pids["workers"]]
        assert all(pid_alive(pid) for pid in started)
        if end == "SIGKILL":
            trainer.send_signal(signal.SIGKILL)
        assert trainer.stdin is not None
        trainer.stdin.close()
        trainer.wait(timeout=60)
        assert wait_for(lambda: not any(pid_alive(pid) for pid in started), timeout=PROMPT), [
            pid for pid in started if pid_alive(pid)
        ]
    finally:
        trainer.kill()
        trainer.wait()


def test_workers_serve_and_share_one_fork_server_without_the_secret(capsys):
    with torchfeed.LocalWorkers(2) as a, torchfeed.LocalWorkers(1) as b:
        assert a.start == b.start == "forkserver" and a.fork
        server = a.fork_server
        assert server is not None and b.fork_server is server  # one per trainer process
        ds = torchfeed.RemoteDataset(a.addresses + b.addresses, RangeDataset, 30)
        assert set(ds.run_on_workers(os.getppid).values()) == {server.pid}
        got = [int(i) for _, y in torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True) for i in y]
        assert sorted(got) == list(range(30))
        with open(f"/proc/{server.pid}/environ", "rb") as f:
            assert b"TORCHFEED_SECRET=" not in f.read()  # this process has it (conftest)
        # the workers' output still reaches this process, prefixed with their names
        token = secrets.token_hex(8)
        torchfeed.rpc_async(b.addresses[0], say, (token,), timeout=60).wait()
        out: list[str] = []

        def printed() -> bool:
            out.append(capsys.readouterr().out)
            return token in "".join(out)

        assert wait_for(printed, timeout=PROMPT)
        assert f"[worker 0 {b.addresses[0]}] {token}" in "".join(out)
        procs = a.processes + b.processes
    assert all(p.returncode == 0 for p in procs)  # stopped by SIGTERM, reaped by the server
    assert not any(pid_alive(p.pid) for p in procs)
    assert server.running  # kept for the next LocalWorkers


def test_an_answer_to_an_earlier_fork_request_is_not_taken_for_the_next():
    """A fork whose caller gave up waiting is answered late: the next fork must get its own
    worker's pid, not the stale one."""
    with torchfeed.LocalWorkers(1) as first:
        server = first.fork_server
        assert server is not None
        server._answers.put({"op": "forked", "seq": -1, "pid": 1})  # late, for a request gone
        with torchfeed.LocalWorkers(1) as second:
            assert second.fork_server is server
            pid = second.processes[0].pid
            assert pid != 1 and os.getpid() != pid
            ds = torchfeed.RemoteDataset(second.addresses, RangeDataset, 4)
            assert ds.run_on_workers(os.getpid) == {second.addresses[0]: pid}
