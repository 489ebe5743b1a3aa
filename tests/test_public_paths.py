"""Every public import path survives the move into subpackages (issue 19)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import torchfeed


@pytest.mark.parametrize("name", torchfeed.__all__)
def test_every_name_in_all_resolves(name):
    assert getattr(torchfeed, name) is not None


def test_seed_aliases_are_the_primary_classes():
    assert torchfeed.RPCDataset is torchfeed.RemoteDataset
    assert torchfeed.RPCDataloader is torchfeed.RemoteDataLoader


def test_client_api_paths():
    import torchfeed.client as client
    from torchfeed.client import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, RemoteRef, rpc_async, set_heartbeat

    assert rpc_async is torchfeed.rpc_async and set_heartbeat is torchfeed.set_heartbeat
    assert RemoteRef is torchfeed.RemoteRef
    assert HEARTBEAT_INTERVAL == client.default_session().heartbeat_interval
    assert HEARTBEAT_TIMEOUT == client.default_session().heartbeat_timeout
    for name in ("connect", "call", "close_all", "close_connections", "parse_address", "format_address"):
        assert callable(getattr(client, name))


def test_worker_and_loader_paths():
    from torchfeed.loader import RemoteDataLoader, RemoteDataset
    from torchfeed.worker import ConnectionLimits, WorkerServer, run_worker

    assert run_worker is torchfeed.run_worker and WorkerServer is torchfeed.WorkerServer
    assert ConnectionLimits().max_refs >= 1
    assert RemoteDataLoader is torchfeed.RemoteDataLoader and RemoteDataset is torchfeed.RemoteDataset


@pytest.mark.parametrize(
    "module", ["cluster", "dask", "datasets", "checkpoint", "plots", "seeding", "launch"]
)
def test_subpackages_and_modules_import(module):
    importlib.import_module(f"torchfeed.{module}")


def _env():
    src = os.path.dirname(os.path.dirname(torchfeed.__file__))
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "torchfeed.launch", "--help"],
        [sys.executable, "-m", "torchfeed", "--help"],
        [sys.executable, "-m", "torchfeed.cluster", "--help"],
    ],
    ids=["launch", "package", "cluster"],
)
def test_module_entry_points_run(argv):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower()


def test_console_script_is_declared_for_cli_main():
    from importlib.metadata import entry_points

    from torchfeed.cli import main

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("torchfeed") == "torchfeed.cli:main"
    assert callable(main)


def test_help_does_not_import_torch():
    code = "import sys, torchfeed.cli as c; c.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert done.stdout.strip() == "False", done.stderr


def test_objects_pickled_under_the_old_flat_modules_still_load():
    """A pickle made before the subpackages names torchfeed.sampling (and 27 other old modules):
    it loads, the old name being the new module (with a DeprecationWarning saying where)."""
    import pickle
    import warnings

    from torchfeed.loader.sampling import DistributedSampler

    data = pickle.dumps(
        DistributedSampler(list(range(10)), num_replicas=2, rank=0, shuffle=False), protocol=0
    )
    old = data.replace(b"torchfeed.loader.sampling", b"torchfeed.sampling")
    assert old != data
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = pickle.loads(old)
    assert isinstance(loaded, DistributedSampler) and list(loaded) == [0, 2, 4, 6, 8]
    assert any("torchfeed.sampling moved to torchfeed.loader.sampling" in str(w.message) for w in caught)


@pytest.mark.parametrize("old", sorted(torchfeed._MOVED))
def test_every_old_module_name_is_its_new_module(old):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(f"torchfeed.{old}")
    assert module is importlib.import_module(f"torchfeed.{torchfeed._MOVED[old]}")
