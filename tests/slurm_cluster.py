"""A real, private Slurm cluster on this machine: munged, slurmctld and three slurmd.

Nodes ``g1`` (partition ``gpu``) and ``c1``, ``c2`` (partition ``cpu``) are separate
NodeNames on 127.0.0.1 with distinct ports (heterogeneous job components cannot share a
NodeName). Everything (munge key and socket, state, spool, logs) lives under one
directory, so a cluster never touches the machine's own munge or Slurm files.

Usable from a shell for manual trials::

    python tests/slurm_cluster.py /tmp/tfslurm      # starts, prints SLURM_CONF, waits for Ctrl-C
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
NODES = ("g1", "c1", "c2")


def missing_binaries() -> list[str]:
    """Names of the Slurm/munge programs this machine lacks (searching PATH and /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _which(name: str) -> str:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    found = shutil.which(name, path=path)
    if not found:
        raise FileNotFoundError(f"{name} not found: install slurm-wlm and munge")
    return found


def _free_port_block(count: int) -> int:
    """First port of ``count`` consecutive ports that are free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65000:
            continue
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found")


class LocalSlurm:
    """Start and stop a three-node Slurm cluster rooted at ``root``.

    Parameters
    ----------
    root : path
        Empty (or missing) directory for every file of the cluster.
    start_timeout : float
        Seconds allowed for the daemons to start and the nodes to become idle.
    """

    def __init__(self, root: str | os.PathLike, start_timeout: float = 60.0):
        self.root = Path(root).resolve()
        self.start_timeout = start_timeout
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- start ----------------------------------------------------------------
    def start(self) -> LocalSlurm:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(
                lambda: self._run(["scontrol", "ping"], check=False).stdout.count("UP") > 0,
                "slurmctld to answer `scontrol ping`",
                self.root / "slurmctld.log",
            )
            for node in NODES:
                self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self._wait(self._nodes_idle, "nodes g1, c1, c2 to be idle", self.root / "slurmctld.log")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        mdir = self.root / "munge"
        mdir.mkdir(mode=0o700, exist_ok=True)
        key = mdir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        rundir = self.root / "munge-run"  # the socket's directory must be searchable by all
        rundir.mkdir(mode=0o755, exist_ok=True)
        munge = pwd.getpwnam("munge") if os.geteuid() == 0 else None
        if munge is not None:  # munged refuses keys and directories owned by another user
            for p in (mdir, key, rundir):
                os.chown(p, munge.pw_uid, munge.pw_gid)
            self.root.chmod(0o755)
        self.socket = rundir / "munge.socket"
        cmd = [
            _which("munged"),
            "-F",
            f"--socket={self.socket}",
            f"--key-file={key}",
            f"--pid-file={mdir / 'munged.pid'}",
            f"--log-file={mdir / 'munged.log'}",
            f"--seed-file={mdir / 'munged.seed'}",
            "--num-threads=2",
        ]
        kw = {"user": munge.pw_uid, "group": munge.pw_gid, "extra_groups": []} if munge else {}
        self._spawn("munged", cmd, **kw)
        self._wait(self.socket.exists, "munged to create its socket", mdir / "munged.log")

    def _write_conf(self) -> None:
        ctld_port = _free_port_block(1)
        node_port = _free_port_block(3)
        host = socket.gethostname().split(".")[0]
        (self.root / "state").mkdir(exist_ok=True)
        (self.root / "spool").mkdir(exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=torchfeedtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName=g1 NodeHostname={host} NodeAddr=127.0.0.1 Port={node_port} CPUs=8 RealMemory=4000 State=UNKNOWN
NodeName=c[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{node_port + 1}-{node_port + 2}] CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=gpu Nodes=g1 Default=YES MaxTime=INFINITE State=UP
PartitionName=cpu Nodes=c[1-2] MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, cmd: list[str], **kw) -> None:
        log = open(self.root / f"{name}.stdio", "wb")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, stdin=subprocess.DEVNULL, **kw
        )
        log.close()

    def _nodes_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ready, what: str, log: Path) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {p.returncode} while waiting for {what}; "
                        f"see {self.root / (name + '.stdio')} and {log}"
                    )
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {self.start_timeout:g} s waiting for {what}; see {log}")

    # -- use --------------------------------------------------------------------
    def _run(self, cmd: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=check)

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *args]).stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` of the (leader) job as a dict (first component for a hetjob)."""
        out = self._run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        line = out.splitlines()[0] if out.strip() else ""
        fields: dict[str, str] = {}
        for item in line.split():
            k, _, v = item.partition("=")
            fields.setdefault(k, v)
        return fields

    def wait_job(
        self,
        job_id: str,
        timeout: float = 90.0,
        states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
    ) -> dict[str, str]:
        """Poll until the job reaches one of ``states``; return its fields."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(
            f"job {job_id} still {info.get('JobState')} after {timeout:g} s "
            f"({info.get('Reason')}); see {self.root / 'slurmctld.log'}"
        )

    def _settling(self) -> bool:
        """Whether any node is not idle yet (still completing or holding the previous run)."""
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        return not out or any(not state.startswith("idle") for state in out[1::2])

    def release(self, job_id: str, settle: float = 30.0) -> None:
        """Start a requeued job now: Slurm otherwise holds it about two minutes (Reason=BeginTime).

        Waits (up to ``settle`` seconds) until every node is idle again: a launch onto a
        node still completing (or still holding) the previous run's steps can fail the
        restarted job outright.
        """
        deadline = time.monotonic() + settle
        while self._settling() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def signal_batch(self, job_id: str, sig: str = "USR2") -> None:
        """Signal the batch script only, as ``#SBATCH --signal=B:SIG@T`` does before the time limit."""
        self._run(["scancel", "--batch", f"--signal={sig}", job_id])

    def cancel(self, job_id: str) -> None:
        """``scancel`` the job, as a user (or a failing node) ends it."""
        self._run(["scancel", job_id])

    # -- stop -------------------------------------------------------------------
    def stop(self, timeout: float = 20.0) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (SIGTERM, then SIGKILL)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--user", pwd.getpwuid(os.getuid()).pw_name], check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not self._run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                    break
                time.sleep(0.3)
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def started_for_tests():
    """A started cluster for a test module, with ``SLURM_CONF`` set meanwhile; skips the test
    when the programs are missing or this is not root."""
    import pytest

    from torchfeed.util import saved_env

    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge programs missing: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("starting munged (as user munge) and slurmd needs root")
    root = tempfile.mkdtemp(prefix="torchfeed-slurm-")  # not under pytest's 0700 tree: munged must reach it
    os.chmod(root, 0o755)
    cluster = LocalSlurm(root)
    try:
        with saved_env(["SLURM_CONF"]):
            os.environ["SLURM_CONF"] = str(cluster.conf)
            with cluster:
                yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    root = (argv or sys.argv[1:] or ["/tmp/tfslurm"])[0]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the daemons on SIGTERM too
    with LocalSlurm(root) as cluster:
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
