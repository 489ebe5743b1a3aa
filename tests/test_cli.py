"""The ``torchfeed worker`` command (and the seed's ``python -m torchfeed.launch``), run as
real processes: address lines on stdout, --procs, --address-file, signals, --help."""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import torchfeed
from helpers import (
    WORKER_COMMAND,
    RangeDataset,
    deep_equal,
    listen_on_if_free,
    secret_seen_by_worker_code,
    wait_for,
)
from torchfeed import cli
from torchfeed.cli import bench as benchcli
from torchfeed.protocol.addrfile import read_address_file
from torchfeed.tools.measure import child_pids
from torchfeed.util import cpu_count, free_port, pid_alive

pytestmark = pytest.mark.timeout(60)

ADDRESS = re.compile(r"^127\.0\.0\.1:(\d{1,5})$")
WORKER = [*WORKER_COMMAND, "--port", "0"]
LAUNCH = [sys.executable, "-m", "torchfeed.launch", "--host", "127.0.0.1", "--port", "0"]


# -- helpers ------------------------------------------------------------------------


def child_env():
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)  # the address line must be flushed explicitly
    return env


class Command:
    """A command under test, in its own session; reaped (with its children) at the end."""

    def __init__(self, argv, tmp_path: Path):
        self.stderr_path = tmp_path / f"stderr-{time.monotonic_ns()}"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=child_env(),
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self._pending = ""  # read from stdout, not yet returned

    def read_lines(self, n: int, timeout: float = 120.0):
        """The next ``n`` stdout lines (fails if they do not come within ``timeout``)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()  # read the pipe itself: a buffered reader would hide lines from select
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while self._pending.count("\n") < n:
                left = deadline - time.monotonic()
                assert left > 0, f"got {self._pending!r}, not {n} lines; stderr: {self.stderr()}"
                if sel.select(timeout=min(left, 0.2)):
                    chunk = os.read(fd, 65536)
                    assert chunk, f"stdout closed after {self._pending!r}; stderr: {self.stderr()}"
                    self._pending += chunk.decode()
        *lines, self._pending = self._pending.split("\n", n)
        return lines

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()[-3000:]

    def children(self):
        return sorted(child_pids(self.pid))

    def stop(self, sig=signal.SIGTERM, timeout: float = 10.0, group: bool = False):
        """Send ``sig``; return (exit code, seconds it took to exit)."""
        start = time.monotonic()
        if group:
            os.killpg(self.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit {timeout} s after {sig!r}; stderr: {self.stderr()}") from None
        return code, time.monotonic() - start

    def rest_of_stdout(self) -> str:
        assert self.proc.poll() is not None
        assert self.proc.stdout is not None
        rest, self._pending = self._pending + self.proc.stdout.read(), ""
        return rest

    def reap(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        else:
            try:  # children left behind by a failed test
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture
def run(tmp_path):
    made = []

    def start(argv):
        made.append(Command(argv, tmp_path))
        return made[-1]

    yield start
    for c in made:
        c.reap()


def serving_pid(address: str) -> int:
    return torchfeed.rpc_async(address, os.getpid, timeout=20).wait()


def check_addresses(lines, n: int):
    assert len(lines) == n
    for line in lines:
        assert ADDRESS.match(line), f"not a host:port line: {line!r}"
    assert len(set(lines)) == n, f"repeated addresses: {lines}"


# -- one process ----------------------------------------------------------------------


def test_single_workers_print_one_line_share_an_address_file_and_stop_on_signals(run, tmp_path):
    """`torchfeed worker` and the seed's `python -m torchfeed.launch`, started at once and
    appending to one address file; one stops on SIGTERM, the other on SIGINT."""
    path = tmp_path / "workers.txt"
    path.write_text("previous:1\n")  # appended to, never truncated
    commands = {
        signal.SIGTERM: run(WORKER + ["--address-file", str(path)]),
        signal.SIGINT: run(LAUNCH + ["--address-file", str(path)]),
    }
    printed = {}
    for sig, cmd in commands.items():
        [line] = cmd.read_lines(1)  # flushed: stdout is a pipe and PYTHONUNBUFFERED is unset
        check_addresses([line], 1)
        assert serving_pid(line) == cmd.pid  # ready when announced, and it is this process
        assert torchfeed.rpc_async(line, lambda a: a + 1, args=(41,)).wait() == 42
        printed[sig] = line

    def file_lines():
        return path.read_text().splitlines()

    assert wait_for(lambda: len(file_lines()) >= 3)
    assert path.read_text().endswith("\n")
    lines = file_lines()
    assert lines[0] == "previous:1"
    check_addresses(lines[1:], 2)  # each line intact
    assert sorted(lines[1:]) == sorted(printed.values())

    for sig, cmd in commands.items():
        code, _ = cmd.stop(sig)  # within stop()'s timeout
        assert code == 0, cmd.stderr()
        assert cmd.rest_of_stdout() == "", "stdout must hold exactly one line"
    assert len(file_lines()) == 3  # nothing else appended at exit


_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def signal_thread(pid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to one thread of another process (tgkill)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_TGKILL, pid, tid, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")


@pytest.mark.skipif(_TGKILL is None, reason="tgkill syscall number unknown on this machine")
def test_worker_stops_whichever_thread_receives_the_signal(run):
    """A process-directed signal may be delivered to any thread; emulate that with tgkill."""
    cmd = run(WORKER)
    [line] = cmd.read_lines(1)
    assert serving_pid(line) == cmd.pid
    others = sorted(int(t.name) for t in Path(f"/proc/{cmd.pid}/task").iterdir() if int(t.name) != cmd.pid)
    assert others, "the worker has helper threads"
    signal_thread(cmd.pid, others[-1], signal.SIGTERM)
    assert wait_for(lambda: cmd.proc.poll() is not None, 3), "the worker ignored SIGTERM"
    assert cmd.proc.returncode == 0


# -- the secret ------------------------------------------------------------------------


@pytest.mark.parametrize("procs", ["1", "2"])
def test_code_on_a_worker_does_not_see_the_secret(run, procs):
    """Started with TORCHFEED_SECRET, the worker takes it out of its environment: dataset code
    and its subprocesses find none. The processes of --procs N get it on their standard input,
    so it was never in their environment at all. And the workers still authenticate."""
    assert os.environ["TORCHFEED_SECRET"]  # conftest's, inherited by the command
    cmd = run(WORKER + ["--procs", procs])
    addresses = cmd.read_lines(int(procs))
    check_addresses(addresses, int(procs))
    for address in addresses:
        seen = torchfeed.rpc_async(address, secret_seen_by_worker_code, timeout=60).wait()
        assert seen["os.environ"] is None and seen["subprocess"] == "", seen
        assert seen["started with it"] == (procs == "1"), seen  # a --procs child never had it
        with pytest.raises(torchfeed.AuthenticationError):  # its secret is still the same one
            torchfeed.rpc_async(address, os.getpid, secret=secrets.token_hex(32), timeout=20).wait()
    assert cmd.stop()[0] == 0, cmd.stderr()


def test_local_workers_hand_the_secret_over_on_stdin():
    key = secrets.token_hex(32)
    with torchfeed.LocalWorkers(1, env={"TORCHFEED_SECRET": key}) as workers:
        address = workers.addresses[0]
        seen = torchfeed.rpc_async(address, secret_seen_by_worker_code, secret=key, timeout=60).wait()
        assert seen == {"os.environ": None, "subprocess": "", "started with it": False, "pid": seen["pid"]}
        with pytest.raises(torchfeed.AuthenticationError):  # the tests' secret is not this pool's
            torchfeed.rpc_async(address, os.getpid, timeout=20).wait()


@pytest.mark.parametrize("procs", ["1", "2"])
def test_a_weak_secret_is_one_line_exit_2(procs):
    env = dict(child_env(), TORCHFEED_SECRET="0123456789abcdef" * 4)
    done = subprocess.run(WORKER + ["--procs", procs], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("torchfeed worker: error: the secret from environment variable")
    assert "too easy to guess" in done.stderr and "secrets.token_hex(32)" in done.stderr
    assert "0123456789abcdef" not in done.stderr


def test_secret_on_stdin_without_a_secret_is_one_line_exit_2():
    done = subprocess.run(
        WORKER + ["--secret-on-stdin"], input="", env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "standard input did not start with the secret" in done.stderr


# -- several processes ------------------------------------------------------------------


@pytest.mark.slow
def test_procs_three_and_sigterm(run):
    cmd = run(WORKER + ["--procs", "3"])
    lines = cmd.read_lines(3)
    check_addresses(lines, 3)
    kids = cmd.children()
    assert len(kids) == 3
    assert sorted(serving_pid(a) for a in lines) == kids
    code, _ = cmd.stop(signal.SIGTERM)  # within stop()'s timeout
    assert code == 0, cmd.stderr()
    assert wait_for(lambda: not any(pid_alive(k) for k in kids), 5), "worker processes outlived the command"
    assert cmd.rest_of_stdout() == ""


def test_remote_data_loader_fed_by_procs_2_then_sigint(run):
    cmd = run(WORKER + ["--procs", "2"])
    addresses = cmd.read_lines(2)
    check_addresses(addresses, 2)
    kids = cmd.children()
    assert sorted(serving_pid(a) for a in addresses) == kids
    dataset = torchfeed.RemoteDataset(addresses, RangeDataset, 23)
    settings: list[dict[str, Any]] = [dict(batch_size=4), dict(batch_size=5, shuffle=True, drop_last=True)]
    for kw in settings:
        torch.manual_seed(7)
        remote = list(torchfeed.RemoteDataLoader(dataset, **kw))
        torch.manual_seed(7)
        expected = list(DataLoader(RangeDataset(23), **kw))
        assert len(remote) == len(expected)
        assert deep_equal(remote, expected)
    code, _ = cmd.stop(signal.SIGINT)  # within stop()'s timeout
    assert code == 0, cmd.stderr()
    assert wait_for(lambda: not any(pid_alive(k) for k in kids), 5), "worker processes outlived the command"
    assert cmd.rest_of_stdout() == ""


@pytest.mark.slow
def test_procs_auto_starts_one_process_per_usable_cpu(run):
    n = cpu_count()
    if n > 8:
        pytest.skip(f"{n} CPUs: too many worker processes for a quick test")
    cmd = run(WORKER + ["--procs", "auto"])
    lines = cmd.read_lines(n)
    check_addresses(lines, n)
    assert len(cmd.children()) == n
    code, _ = cmd.stop()
    assert code == 0, cmd.stderr()
    assert cmd.rest_of_stdout() == ""


def zombie_of(pid: int, parent: int) -> bool:
    """Whether ``pid`` is a child of ``parent`` that ended and was not reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] == "Z" and int(fields[1]) == parent


def two_free_ports() -> int:
    """A port P such that P and P+1 are free now."""
    import socket

    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_procs_restart_a_killed_process_and_keep_the_address_file_true(run, tmp_path):
    """A process killed with SIGKILL is reaped (no zombie), said on stderr, taken out of the
    address file and started again: the file then lists only live processes that answer."""
    path = tmp_path / "workers"
    cmd = run(WORKER + ["--procs", "2", "--address-file", str(path)])
    first = cmd.read_lines(2, timeout=90)
    check_addresses(first, 2)
    assert read_address_file(str(path)) == first
    victim = serving_pid(first[0])
    os.kill(victim, signal.SIGKILL)
    (again,) = cmd.read_lines(1, timeout=90)  # the new process's address, printed when ready
    assert ADDRESS.match(again), again
    assert not zombie_of(victim, cmd.pid), "the killed process was left a zombie"
    filed = read_address_file(str(path))
    assert sorted(filed) == sorted([first[1], again]), filed
    kids = cmd.children()
    assert len(kids) == 2 and victim not in kids
    assert sorted(serving_pid(a) for a in filed) == kids  # every filed address answers, from a child
    err = cmd.stderr()
    assert f"process 1 of 2 ({first[0]}) was killed by signal SIGKILL; starting it again in" in err, err
    assert f"process 1 of 2 is back: {again}" in err, err
    code, _ = cmd.stop()
    assert code == 0, cmd.stderr()
    assert wait_for(lambda: not any(pid_alive(k) for k in kids), 5), "worker processes outlived the command"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_procs_crash_loop_gives_up_that_process_and_keeps_the_others(run, tmp_path):
    """Process 1's port is taken once it died (another user could bind it): each restart fails
    at once, and after a few the command gives that process up, says why and how to see more,
    and the other process keeps serving; the command's status says one was given up."""
    import socket

    port = two_free_ports()
    path = tmp_path / "workers"
    cmd = run(WORKER[:-2] + ["--port", str(port), "--procs", "2", "--address-file", str(path)])
    first = cmd.read_lines(2, timeout=90)
    assert first == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    kids = cmd.children()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    os.kill(serving_pid(first[0]), signal.SIGKILL)

    given_up = (
        f"torchfeed worker: process 1 of 2 (127.0.0.1:{port}) ended 5 times within 120 s, the last time "
        f"it exited with code 1 (cannot serve on 127.0.0.1:{port}: Address already in use): giving it up, "
        "1 of 2 keep serving"
    )
    with holder:
        assert wait_for(lambda: listen_on_if_free(holder, port), 10, interval=0.01), (
            "the killed process's port was not freed"
        )
        assert wait_for(lambda: given_up in cmd.stderr(), 200), cmd.stderr()
    assert "run `torchfeed worker` without --procs to see it alone" in cmd.stderr()
    assert read_address_file(str(path)) == [first[1]]  # the dead address was taken out
    assert serving_pid(first[1]) in kids  # the other process still serves
    code, _ = cmd.stop()
    assert code == 1, cmd.stderr()
    assert wait_for(lambda: not any(pid_alive(k) for k in kids), 5), "worker processes outlived the command"
    assert not cmd.children(), "processes left behind (or unreaped)"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_procs_keep_serving_when_the_address_file_cannot_be_written(run, tmp_path):
    """The address file replaced by a link (O_NOFOLLOW refuses it) while a process restarts:
    the command says it cannot file the new address, and every process keeps serving."""
    path = tmp_path / "workers"
    cmd = run(WORKER + ["--procs", "2", "--address-file", str(path)])
    first = cmd.read_lines(2, timeout=90)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    os.kill(serving_pid(first[0]), signal.SIGKILL)
    (again,) = cmd.read_lines(1, timeout=90)  # printed though it could not be filed
    assert wait_for(lambda: f"cannot add {again} to it" in cmd.stderr(), 30), cmd.stderr()
    assert sorted(serving_pid(a) for a in (first[1], again)) == cmd.children()
    code, _ = cmd.stop()
    assert code == 0, cmd.stderr()


# -- help and usage errors -----------------------------------------------------------------


def test_help_exits_0():
    script = shutil.which("torchfeed")
    argv = [script, "worker", "--help"] if script else [sys.executable, "-m", "torchfeed", "worker", "--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ["--host", "--port", "--procs", "--address-file", "--handshake-timeout"]:
        assert option in proc.stdout, f"`torchfeed worker --help` does not document {option}"


@pytest.mark.parametrize("argv", [["--help"], ["worker", "--help"]])
def test_help_in_process(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: torchfeed")
    assert ("--procs" in out) if "worker" in argv else ("worker" in out)


@pytest.mark.parametrize("extra", [["--procs", "0"], ["--procs", "many"], ["--port", "x"]])
def test_bad_arguments_exit_2(extra, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["worker", "--host", "127.0.0.1", *extra])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err  # one line, no usage block, no traceback
    assert captured.err.startswith("torchfeed worker: error: argument --")
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("extra", [["--log-level", "loud"], ["--procs", "-3"], ["--timeout", "soon"]])
def test_more_bad_arguments_are_one_line(extra, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["worker", *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    if "--log-level" in extra:
        assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in err


def _taken_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_port_in_use_is_one_line(run):
    holder, port = _taken_port()
    with holder:
        cmd = run([sys.executable, "-m", "torchfeed", "worker", "--host", "127.0.0.1", "--port", str(port)])
        assert cmd.proc.wait(60) == 1
        err = cmd.stderr()
        assert err == f"torchfeed worker: cannot serve on 127.0.0.1:{port}: Address already in use\n", err
        assert cmd.rest_of_stdout() == ""


@pytest.mark.slow
def test_procs_start_all_or_none(run, tmp_path):
    """One process of three cannot bind its port: none keeps running, nothing is announced."""
    holder, port = _taken_port()
    path = tmp_path / "workers"
    with holder:
        cmd = run([*WORKER_COMMAND, "--port", str(port - 1), "--procs", "3", "--address-file", str(path)])
        assert wait_for(lambda: cmd.children(), 20)
        kids = cmd.children()
        assert cmd.proc.wait(90) == 1
        err = cmd.stderr()
        assert err.count("\n") == 1, err
        assert (
            f"torchfeed worker: process 2 of 3 (127.0.0.1:{port}) could not start: cannot serve on "
            f"127.0.0.1:{port}: Address already in use; all 3 processes were stopped"
        ) in err
    assert cmd.rest_of_stdout() == "" and not path.exists()
    assert wait_for(lambda: not any(pid_alive(k) for k in kids), 10), (
        "a process of the failed start is still running"
    )


@pytest.mark.slow
def test_procs_output_of_the_processes_is_prefixed(run, tmp_path):
    cmd = run(WORKER + ["--procs", "2", "--address-file", str(tmp_path / "w")])
    addresses = cmd.read_lines(2)
    assert (tmp_path / "w").read_text().split() == addresses
    torchfeed.rpc_async(addresses[1], lambda: print("hello from a worker", flush=True)).wait()
    assert cmd.read_lines(1) == [f"[{addresses[1]}] hello from a worker"]
    assert cmd.stop()[0] == 0


def test_version_and_help_for_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"torchfeed {torchfeed.__version__}"
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subcommands) == {"worker", "demo", "bench", "top", "slurm"}
    for name, sub in subcommands.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, (
                    f"`torchfeed {name}` option {action.option_strings or action.dest} has no help"
                )
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in subcommands["worker"].format_help()
    bench_help = subcommands["bench"].format_help()
    assert all(case in bench_help for case in benchcli.BENCH_CASES)


def test_bench_cases_listed_by_the_command_are_the_benchmarks():
    from torchfeed.tools import bench

    assert benchcli.BENCH_CASES is bench.BENCH_CASES  # one list
    assert bench.CASES == list(benchcli.BENCH_CASES) and sorted(bench.RUNNERS) == sorted(benchcli.BENCH_CASES)


def test_help_does_not_import_torch():
    code = (
        "import sys, atexit\n"
        "atexit.register(lambda: print('torch imported' if 'torch' in sys.modules else 'no torch'))\n"
        "from torchfeed.cli import main\nmain(['{}', '--help'])\n"
    )
    for sub in ["worker", "demo", "bench", "top", "slurm"]:
        proc = subprocess.run(
            [sys.executable, "-c", code.format(sub)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.rstrip().endswith("no torch"), (sub, proc.stdout[-300:])


@pytest.mark.parametrize("procs", ["1", "2"])
def test_address_file_in_a_missing_directory_is_one_line_exit_2(tmp_path, procs):
    path = tmp_path / "missing" / "dir" / "workers"
    proc = subprocess.run(
        WORKER + ["--procs", procs, "--address-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"torchfeed worker: error: --address-file {path}: ")
    assert "does not exist" in proc.stderr and str(path.parent) in proc.stderr, proc.stderr


def test_top_level_help_names_every_command_in_plain_text(capsys):
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # after the usage line, before the argument lists
    assert all(name in description for name in subcommands), description
    for text in [out] + [sub.format_help() for sub in subcommands.values()]:
        assert "``" not in text, text


@pytest.mark.parametrize("mode, refused", [(0o2775, True), (0o757, True), (0o1777, False), (0o755, False)])
def test_an_address_file_in_a_folder_others_can_change_is_refused(tmp_path, mode, refused):
    """A folder its group or others can write (without the sticky bit) lets another user
    replace the address file with a link or a file of theirs: said at once, exit 2."""
    from torchfeed.protocol.addrfile import why_unwritable

    folder = tmp_path / "job"
    folder.mkdir()
    folder.chmod(mode)
    why = why_unwritable(str(folder / "workers"))
    if refused:
        assert why is not None and "can be written by other users" in why and "chmod go-w" in why, why
        # a folder above it that others can write could be renamed away with the file
        inner = folder / "inner"
        inner.mkdir(mode=0o700)
        assert "can be written by other users" in (why_unwritable(str(inner / "workers")) or "")
        done = subprocess.run(
            WORKER + ["--address-file", str(folder / "workers")],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and "can be written by other users" in done.stderr, done.stderr
    else:
        assert why is None
