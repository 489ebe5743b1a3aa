"""Layering rules checked on the source: no module reaches into another module's private names.

A module may use ``x._name`` only when ``_name`` is its own: defined in that module (a
function, a class attribute or method, or ``self._name = ...`` in one of its classes).
Reaching through a module object (``resume._check``), importing a private name from
another module (``from .resume import _INT63``), naming it in ``getattr(x, "_name")``, or
using a private attribute no class of the module defines (``loader._source`` outside
loader.py) fails here. Other modules offer public methods, properties or Protocols instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "torchfeed"

# (module path relative to src/torchfeed, "expression._name") -> why it is allowed
ALLOWED = {
    # documented CPython functions whose names start with an underscore
    ("cli/__init__.py", "os._exit"): "the documented way to leave a forked child without cleanup",
    ("notices.py", "sys._getframe"): "documented CPython API: find the user's line for a warning",
    # torch internals with no public equivalent
    (
        "loader/context.py",
        "getattr(torch_worker, '_worker_info')",
    ): "torch keeps get_worker_info()'s state there",
    # torch's worker seeding reproduced (seeding.py); the benchmarks reach into torch's DataLoader
    ("seeding.py", "getattr(torch.utils.data, '_utils')"): "torch's worker seeding, reproduced exactly",
    (
        "seeding.py",
        "getattr(getattr(getattr(torch.utils.data, '_utils', None), 'worker', None), '_generate_state')",
    ): "torch's worker seeding, reproduced exactly",
    ("tools/bench.py", "getattr(tl, '_iterator')"): "torch DataLoader: its worker processes' pids",
    ("tools/bench.py", "getattr(it, '_workers')"): "torch DataLoader: its worker processes' pids",
    ("tools/bench_epochs.py", "os._exit"): "the documented way to leave a forked child without cleanup",
    ("tools/bench_epochs.py", "loader._iterator"): "torch DataLoader: its worker processes' pids",
    ("tools/bench_epochs.py", "loader._iterator._workers"): "torch DataLoader: its worker processes' pids",
    (
        "tools/bench_epochs.py",
        "getattr(torch_loader, '_iterator')",
    ): "torch DataLoader: shut its workers down",
    ("tools/bench_epochs.py", "it._shutdown_workers"): "torch DataLoader: shut its persistent workers down",
    ("tools/measure.py", "getattr(self.loader, '_iterator')"): "torch DataLoader: shut its workers down",
    ("tools/measure.py", "self.loader._iterator"): "torch DataLoader: shut its persistent workers down",
    ("tools/measure.py", "it._shutdown_workers"): "torch DataLoader: shut its persistent workers down",
    # a protocol between the Shards dataset (datasets/shards.py) and the worker's streams:
    # hooks on the user's dataset object, named so they cannot clash with the user's own
    (
        "loader/streams.py",
        "getattr(fetcher.setup.dataset, '_torchfeed_plan')",
    ): "Shards hook on a user dataset",
    ("loader/streams.py", "getattr(dataset, '_torchfeed_dynamic_iter')"): "Shards hook on a user dataset",
}
# private modules of other packages that may be imported from
ALLOWED_PRIVATE_IMPORTS = {
    "torch.utils.data._utils.collate": "torch's default_collate machinery (no public home)",
    "torch.utils.data._utils": "torch keeps get_worker_info()'s state in _utils.worker",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    """Private names this module defines: functions, classes, their attributes, self._x assignments."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
    for node in ast.walk(tree):  # __slots__ entries are attributes too
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            for elt in getattr(node.value, "elts", []):
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                    own.add(elt.value)
    return own


def _imported_modules(tree: ast.Module) -> set[str]:
    """Local names bound to modules (``import x``, ``from . import x``, ``import a.b as c``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level and node.module is None:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def violations(path: Path, root: Path = SRC, allowed: dict | None = None) -> list[str]:
    allowed = ALLOWED if allowed is None else allowed
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    own = _own_names(tree)
    modules = _imported_modules(tree)
    found = []

    def report(node: ast.AST, text: str) -> None:
        if (rel, text) not in allowed:
            found.append(f"{rel}:{node.lineno}: {text}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and not module.startswith("torchfeed"):
                if any(_private(part) for part in module.split(".")) and not any(
                    module == m or module.startswith(m + ".") for m in ALLOWED_PRIVATE_IMPORTS
                ):
                    report(node, f"from {module} import ...")
                continue
            for alias in node.names:
                if _private(alias.name):
                    report(node, f"from {'.' * node.level}{module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue  # a class's own (or its base classes') private attributes
            through_module = isinstance(base, ast.Name) and base.id in modules
            if through_module or node.attr not in own:
                report(node, f"{ast.unparse(base)}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
        ):
            report(node, f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(SRC).as_posix())
def test_no_module_reaches_into_another_modules_private_names(path: Path) -> None:
    found = violations(path)
    assert not found, (
        "private names of other modules are used (give that module a public method, property or "
        "Protocol instead, or justify an entry in ALLOWED):\n" + "\n".join(found)
    )


def test_the_check_catches_what_it_should(tmp_path: Path) -> None:
    """The rule itself: cross-module private access fails, own private access passes."""
    sample = tmp_path / "probe.py"
    sample.write_text(
        "from . import resume\n"
        "from .resume import _INT63\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._x = 1\n"
        "    def f(self, other, loader):\n"
        "        return other._x, loader._source, resume._check, getattr(loader, '_estimates')\n"
    )
    texts = sorted(f.split(": ", 1)[1] for f in violations(sample, root=tmp_path))
    assert texts == sorted(
        ["from .resume import _INT63", "loader._source", "resume._check", "getattr(loader, '_estimates')"]
    )


def test_allow_list_has_no_stale_entries() -> None:
    """Every allowed entry is still used somewhere: drop it once its module no longer needs it."""
    sources = {p.relative_to(SRC).as_posix(): p.read_text() for p in _modules()}
    used = {
        (p.relative_to(SRC).as_posix(), f.split(": ", 1)[1])
        for p in _modules()
        for f in violations(p, allowed={})
    }
    stale = [f"{rel}: {text}" for rel, text in ALLOWED if rel in sources and (rel, text) not in used]
    assert not stale, "stale ALLOWED entries (remove them):\n" + "\n".join(stale)
