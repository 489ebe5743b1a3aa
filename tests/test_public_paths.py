"""Every public import path survives the move into subpackages."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

import torchfeed


@pytest.mark.parametrize("name", torchfeed.__all__)
def test_every_name_in_all_is_the_object_its_module_defines(name):
    module = importlib.import_module(f"torchfeed.{torchfeed._EXPORTS[name]}")
    assert getattr(torchfeed, name) is getattr(module, name)
    assert getattr(module, name).__module__.startswith("torchfeed.")


def test_the_names_type_checkers_see_are_the_public_names():
    """The TYPE_CHECKING imports of torchfeed/__init__.py name exactly _EXPORTS and the old names."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(torchfeed.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {a.asname or a.name for n in ast.walk(block) if isinstance(n, ast.ImportFrom) for a in n.names}
    seen |= {ast.unparse(t) for n in ast.walk(block) if isinstance(n, ast.Assign) for t in n.targets}
    assert seen == set(torchfeed.__all__) | set(torchfeed._RENAMED)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        torchfeed.Nope  # noqa: B018


def test_old_names_are_the_new_objects_and_warn_once_naming_them(monkeypatch):
    import importlib.util
    import warnings

    import torchfeed.cluster
    import torchfeed.dask
    from torchfeed import deprecation

    monkeypatch.setattr(deprecation, "_warned", set())
    old_names = {
        ("torchfeed", "RPCDataset"): torchfeed.RemoteDataset,
        ("torchfeed", "RPCDataloader"): torchfeed.RemoteDataLoader,
        ("torchfeed.pools", "Pool"): torchfeed.scaling.WorkerPool,
        ("torchfeed.pools", "WorkerPool"): torchfeed.scaling.WorkerPool,
        ("torchfeed.scaling", "Pool"): torchfeed.scaling.WorkerPool,
        # the engines' pools moved from scaling/ into their engine's package
        ("torchfeed.scaling.dask_pool", "DaskPool"): torchfeed.dask.DaskPool,
        ("torchfeed.scaling.dask_pool", "PoolProcesses"): importlib.import_module(
            "torchfeed.dask.pool"
        ).PoolProcesses,
        ("torchfeed.scaling.slurm_pool", "SlurmPool"): torchfeed.cluster.SlurmPool,
        ("torchfeed.scaling.slurm_pool", "pool_script"): torchfeed.cluster.pool_script,
    }
    if importlib.util.find_spec("ray") is not None:  # the Ray pool imports Ray
        old_names[("torchfeed.scaling.ray_pool", "RayPool")] = importlib.import_module(
            "torchfeed.ray"
        ).RayPool
        old_names[("torchfeed.scaling.ray_pool", "actor_class")] = importlib.import_module(
            "torchfeed.ray.pool"
        ).actor_class
    for (module, name), new in old_names.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert getattr(importlib.import_module(module), name) is new
            assert getattr(importlib.import_module(module), name) is new  # the second use is silent
        assert [w.category for w in caught] == [FutureWarning], (module, name)
        text = str(caught[0].message)
        assert f"{module}.{name} is deprecated" in text and deprecation.REMOVED_IN in text
        assert new.__name__ in text and caught[0].filename == __file__  # the user's line
    assert not {"RPCDataset", "RPCDataloader"} & set(torchfeed.__all__)  # `import *` stays silent


def test_the_engines_pools_keep_their_documented_names():
    import torchfeed.cluster
    import torchfeed.dask
    import torchfeed.ray
    from torchfeed.cluster import pool as slurm_pool
    from torchfeed.dask import pool as dask_pool

    assert torchfeed.dask.Pool is torchfeed.dask.DaskPool is dask_pool.DaskPool
    assert torchfeed.cluster.SlurmPool is slurm_pool.SlurmPool
    assert torchfeed.cluster.pool_script is slurm_pool.pool_script
    assert issubclass(dask_pool.DaskPool, torchfeed.scaling.BasePool)
    assert issubclass(torchfeed.scaling.LocalPool, torchfeed.scaling.BasePool)
    assert {"Pool", "RayPool"} <= set(torchfeed.ray.__all__)
    if importlib.util.find_spec("ray") is not None:
        assert torchfeed.ray.Pool is torchfeed.ray.RayPool
        assert issubclass(torchfeed.ray.RayPool, torchfeed.scaling.BasePool)


def test_client_api_paths():
    import torchfeed.client as client
    from torchfeed.client import RemoteRef, rpc_async, set_heartbeat

    assert rpc_async is torchfeed.rpc_async and set_heartbeat is torchfeed.set_heartbeat
    assert RemoteRef is torchfeed.RemoteRef
    for name in ("connect", "call", "close_all", "close_connections", "parse_address", "format_address"):
        assert callable(getattr(client, name))


def test_worker_and_loader_paths():
    from torchfeed.loader import RemoteDataLoader, RemoteDataset
    from torchfeed.worker import ConnectionLimits, WorkerServer, run_worker

    assert run_worker is torchfeed.run_worker and WorkerServer is torchfeed.WorkerServer
    from torchfeed.worker import objects

    assert ConnectionLimits is objects.ConnectionLimits  # the lazy name is the defining module's class
    assert RemoteDataLoader is torchfeed.RemoteDataLoader and RemoteDataset is torchfeed.RemoteDataset


@pytest.mark.parametrize(
    "module", ["cluster", "dask", "ray", "datasets", "checkpoint", "plots", "seeding", "launch"]
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
