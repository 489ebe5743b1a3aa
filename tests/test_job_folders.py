"""Another local user cannot replace the batch scripts torchfeed submits (cluster/private.py).

A real second user (made with useradd; the tests skip without root or useradd) acts through
setpriv with shell commands; sbatch, squeue and scancel are recording stand-ins on PATH
(no Slurm needed): sbatch keeps its arguments and the script it reads on standard input.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from torchfeed import cli
from torchfeed.cluster import SlurmPool
from torchfeed.cluster.private import UnsafeFolderError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def other(other_user):
    return other_user


def as_other(other, command: str, cwd: Path) -> subprocess.CompletedProcess:
    uid, gid = other
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "/bin/sh", "-c", command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def place(monkeypatch):
    """A folder under /tmp the second user can reach, made the working directory; recording
    sbatch/squeue/scancel first on PATH; umask 002 (a shared project's)."""
    base = Path(tempfile.mkdtemp(prefix="tf-folders-", dir="/tmp"))
    base.chmod(0o755)
    fake = base / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(
        f'#!/bin/sh\necho "$@" > {base}/sbatch.args\ncat > {base}/sbatch.stdin\necho 4242\n'
    )
    for name in ("squeue", "scancel"):
        (fake / name).write_text("#!/bin/sh\nexit 0\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    work = base / "project"
    work.mkdir(mode=0o755)
    monkeypatch.chdir(work)
    old = os.umask(0o002)
    yield work
    os.umask(old)
    shutil.rmtree(base)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_pool_folders_are_private_and_cannot_be_swapped(place, other):
    pool = SlurmPool(partition="cpu", pending_warning=60)
    try:
        pools = place / "torchfeed-pools"
        assert mode(pools) == 0o700 and mode(pool.directory) == 0o700  # whatever the umask
        assert mode(pool.directory / "workers") == mode(pool.directory / "logs") == 0o700
        assert mode(pool.script_path) == mode(pool.secret_file) == 0o600
        # the other user can neither rename the pool's folder away nor put one in its place
        moved = as_other(other, f"mv {pool.directory} {place}/stolen; mkdir {pools}/x", place)
        assert moved.returncode != 0 and "ermission denied" in moved.stderr
        assert pool.directory.is_dir() and not (place / "stolen").exists()
        pool.scale(1)
        args = (place.parent / "sbatch.args").read_text().split()
        assert "--array=0-0" in args and str(pool.script_path) not in args  # no path to swap
        assert (place.parent / "sbatch.stdin").read_text() == pool.script()
    finally:
        pool.close()


@pytest.mark.parametrize("shared", ["0777", "2775"])
def test_a_working_directory_others_can_write_is_refused(place, other, shared):
    uid, gid = other
    os.chown(place, 0, gid)  # a project folder of the other user's group (setgid, umask 002)
    place.chmod(int(shared, 8))
    with pytest.raises(UnsafeFolderError) as info:
        SlurmPool(partition="cpu")
    message = str(info.value)
    assert str(place) in message and "can write it" in message and f"chmod go-w '{place}'" in message
    assert not (place / "torchfeed-pools").exists()
    assert cli.main(["slurm", "--", "python", "t.py"]) == 2  # torchfeed slurm: the same refusal
    assert not (place / "torchfeed-jobs").exists()


def test_folders_another_user_made_first_are_refused(place, other):
    made = as_other(other, "true", place)  # can act here at all
    assert made.returncode == 0
    for name in ("torchfeed-pools", "torchfeed-jobs"):
        (place / name).mkdir(mode=0o700)
        os.chown(place / name, *other)
    with pytest.raises(UnsafeFolderError, match=r"torchfeed-pools is not safe .* belongs to user id"):
        SlurmPool(partition="cpu")
    assert cli.main(["slurm", "--", "python", "t.py"]) == 2
    assert os.listdir(place / "torchfeed-jobs") == []


def test_torchfeed_slurm_never_writes_through_a_planted_link(place, capsys):
    bashrc = place / "bashrc"
    bashrc.write_text("# mine\n")
    jobs = place / "torchfeed-jobs"
    jobs.mkdir(mode=0o700)
    (jobs / "torchfeed.sbatch").symlink_to(bashrc)
    assert cli.main(["slurm", "--", "python", "t.py"]) == 0
    script = jobs / "torchfeed.sbatch"
    assert bashrc.read_text() == "# mine\n" and not script.is_symlink() and mode(script) == 0o700
    assert cli.main(["slurm", "--submit", "--", "python", "t.py"]) == 0  # sbatch gets the script on stdin
    assert (place.parent / "sbatch.args").read_text().split() == ["--parsable"]
    assert (place.parent / "sbatch.stdin").read_text() == script.read_text()
    assert "submitted job 4242" in capsys.readouterr().out


def test_folders_of_the_users_own_are_checked_not_changed(place):
    # job files straight in the working directory: it stays as it is (0755), the script is 0700
    assert cli.main(["slurm", "--job-dir", "%j", "--", "python", "t.py"]) == 0
    assert mode(place) == 0o755 and mode(place / "torchfeed.sbatch") == 0o700
