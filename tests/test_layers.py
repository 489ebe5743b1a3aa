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

# why it is allowed -> the (module path relative to src/torchfeed, "expression._name") it allows
_ALLOWED_BY_WHY: dict[str, list[tuple[str, str]]] = {
    # documented CPython functions whose names start with an underscore
    "the documented way to leave a process without finalization": [("cli/worker.py", "os._exit")],
    "the documented way to leave a forked child without cleanup": [
        ("worker/forked.py", "os._exit"),
        ("tools/bench_epochs.py", "os._exit"),
    ],
    "documented CPython API: find the user's line for a warning": [("notices.py", "sys._getframe")],
    # torch internals with no public equivalent
    "torch keeps get_worker_info()'s state there": [
        ("worker/context.py", "getattr(torch_worker, '_worker_info')")
    ],
    # torch's worker seeding reproduced (seeding.py); the benchmarks reach into torch's DataLoader
    "torch's worker seeding, reproduced exactly": [
        ("seeding.py", "getattr(torch.utils.data, '_utils')"),
        (
            "seeding.py",
            "getattr(getattr(getattr(torch.utils.data, '_utils', None), 'worker', None), '_generate_state')",
        ),
    ],
    "torch DataLoader: its worker processes' pids": [
        ("tools/measure.py", "getattr(tl, '_iterator')"),
        ("tools/measure.py", "getattr(it, '_workers')"),
        ("tools/bench_epochs.py", "loader._iterator"),
        ("tools/bench_epochs.py", "loader._iterator._workers"),
    ],
    "torch DataLoader: shut its workers down": [
        ("tools/bench_epochs.py", "getattr(torch_loader, '_iterator')"),
        ("tools/measure.py", "getattr(self.loader, '_iterator')"),
    ],
    "torch DataLoader: shut its persistent workers down": [
        ("tools/bench_epochs.py", "it._shutdown_workers"),
        ("tools/measure.py", "self.loader._iterator"),
        ("tools/measure.py", "it._shutdown_workers"),
    ],
    # what a hostile reply could reach: read to refuse it (no public way to read either)
    "copyreg's extension registry: a reply's EXT codes bypass find_class when it is not empty": [
        ("protocol/picklescan.py", "getattr(copyreg, '_extension_registry')")
    ],
    "a tensor's hooks, which a pickle's BUILD can set": [("protocol/rebuild.py", "t._backward_hooks")],
    # a protocol between the Shards dataset (datasets/shards.py) and the worker's streams:
    # hooks on the user's dataset object, named so they cannot clash with the user's own
    "Shards hook on a user dataset": [
        ("worker/streams.py", "getattr(fetcher.setup.dataset, '_torchfeed_plan')"),
        ("worker/streams.py", "getattr(dataset, '_torchfeed_dynamic_iter')"),
    ],
}
# (module path, "expression._name") -> why it is allowed
ALLOWED = {entry: why for why, entries in _ALLOWED_BY_WHY.items() for entry in entries}
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

    def report(node: ast.stmt | ast.expr, text: str) -> None:
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


# -- import direction ---------------------------------------------------------------------
# Every import statement counts: module level, inside functions, under TYPE_CHECKING, and so
# do importlib.import_module / __import__ calls with a constant name. A package's __init__
# importing its own modules (re-exports) is an edge too, so a module that imports its own
# package back is a cycle; it is left out only of the layer order (a package is above its
# modules).

PACKAGE = "torchfeed"

# Layers, lowest first: a module may import its own layer and the layers below it, never above.
# client and worker are two sides of the same layer and never import each other.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "notices", "events", "util", "deprecation", "seeding", "pumps", "stats")),
    ("protocol", ("protocol",)),
    ("client", ("client",)),
    ("worker", ("worker",)),
    ("loader", ("loader",)),
    ("datasets", ("datasets",)),
    (
        "glue",
        ("local", "pools", "checkpoint", "plots", "cluster", "dask", "cli", "launch", "tools", "__main__"),
    ),
    ("glue", ("scaling",)),  # torchfeed.autoscale, its policy and the engines' pools
    ("glue", ("frameworks",)),  # Accelerate and the HF Trainer
    ("glue", ("metrics", "ray", "audit")),  # Prometheus and Ray
]
SIDES = {"client": "worker", "worker": "client"}  # same height, no edges between them
RANK = {"base": 0, "protocol": 1, "client": 2, "worker": 2, "loader": 3, "datasets": 4, "glue": 5}


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_edges(path: Path, root: Path = SRC) -> set[str]:
    """The torchfeed modules ``path`` imports (``from p import m`` with ``m`` a module: ``p.m``),
    its lazy exports (``lazy_exports(__name__, {...})``: imported on first use) included."""
    name = module_name(path, root)
    package = name if _is_package(path) else name.rpartition(".")[0]
    known = {module_name(p, root) for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    edges: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif (dynamic := _dynamic_import(node, package)) is not None:
            targets = [dynamic]
        elif (lazy := _lazy_exports(node, tree, package)) is not None:
            targets = lazy
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # an attribute of a module: the module
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                edges.add(target)
    return edges


def _dynamic_import(node: ast.AST, package: str) -> str | None:
    """The module of ``importlib.import_module("x", ...)`` or ``__import__("x", ...)`` with a
    constant name (relative names resolved against ``package``), else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    name = node.args[0].value
    if called not in ("import_module", "__import__") or not isinstance(name, str):
        return None
    if called == "import_module" and name.startswith("."):
        dots = len(name) - len(name.lstrip("."))
        base = package.split(".")
        return ".".join(base[: len(base) - (dots - 1)] + [name.lstrip(".")]).rstrip(".")
    return name


def _lazy_exports(node: ast.AST, tree: ast.Module, package: str) -> list[str] | None:
    """The modules of ``lazy_exports(__name__, exports)`` (a dict literal, or the name of one
    assigned at module level): each relative to ``package``, as util.lazy_exports imports it."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "lazy_exports"
        and len(node.args) == 2
    ):
        return None
    exports = node.args[1]
    if isinstance(exports, ast.Name):
        exports = next(
            (
                n.value
                for n in tree.body
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                and any(isinstance(t, ast.Name) and t.id == exports.id for t in _targets(n))
                and n.value is not None
            ),
            exports,
        )
    if not isinstance(exports, ast.Dict):
        return None
    found = []
    for value in exports.values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            relative = "." + value.value
            dots = len(relative) - len(relative.lstrip("."))
            base = package.split(".")
            found.append(".".join(base[: len(base) - (dots - 1)] + [relative.lstrip(".")]))
    return found


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return list(node.targets) if isinstance(node, ast.Assign) else [node.target]


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    return {
        module_name(p, root): import_edges(p, root)
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(module: str) -> str | None:
    if module == PACKAGE:
        return "glue"  # the public surface: its imports of its own modules are re-exports
    top = module.split(".")[1]
    for layer, members in LAYERS:
        if top in members:
            return layer
    return None


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, (
        "import cycles (give the lower module a Protocol or an argument instead of importing "
        "back up):\n" + "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in import_graph() if layer_of(m) is None]
    assert not unplaced, f"modules in no layer (add them to LAYERS in {__file__}): {unplaced}"


def test_imports_point_down() -> None:
    wrong = []
    for module, targets in import_graph().items():
        here = layer_of(module)
        if here is None:
            continue
        for target in targets:
            if target.startswith(module + "."):
                continue  # a package importing its own modules (re-exports)
            there = layer_of(target)
            if there is None or here is None or RANK[there] > RANK[here] or SIDES.get(here) == there:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert not wrong, (
        "imports against the layer order " + str([n for n, _ in LAYERS]) + ":\n" + "\n".join(sorted(wrong))
    )


def test_the_cycle_check_catches_what_it_should(tmp_path: Path) -> None:
    """A circle through a function-level import and one under TYPE_CHECKING both count; a
    package __init__ re-exporting its own module is no circle, unless a module imports the
    package back; a constant importlib.import_module counts."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nclass A: ...\n"
    )
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from .d import x\n")
    (pkg / "d.py").write_text("x = 1\n")
    graph = import_graph(pkg)
    graph = {
        k.replace(PACKAGE, "pkg", 1): {t.replace(PACKAGE, "pkg", 1) for t in v} for k, v in graph.items()
    }
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert graph["pkg"] == {"pkg.a"}
    (pkg / "e.py").write_text(
        "from . import d\nimport importlib\nimportlib.import_module('.f', __package__)\n"
    )
    (pkg / "f.py").write_text("def g():\n    from .e import d\n")
    (pkg / "a.py").write_text("from . import helper\n")  # back into the package that re-exports a
    graph = import_graph(pkg)
    graph = {
        k.replace(PACKAGE, "pkg", 1): {t.replace(PACKAGE, "pkg", 1) for t in v} for k, v in graph.items()
    }
    assert import_cycles(graph) == [["pkg", "pkg.a"], ["pkg.e", "pkg.f"]]


ENGINES = ("dask", "ray", "cluster")  # the engines' packages: each holds its pool (BasePool's subclass)


def test_scaling_imports_no_engine_package() -> None:
    """scaling/ is engine-agnostic: the engines' pools import its base, never the reverse
    (lazy exports count; the deprecated old module paths only name the new places)."""
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith(f"{PACKAGE}.scaling")
        for target in targets
        if target.split(".")[1] in ENGINES
    )
    assert not wrong, "\n".join(wrong)


def test_a_lazy_export_is_an_edge(tmp_path: Path) -> None:
    """``lazy_exports(__name__, {...})``, given a dict or the name of one, counts as an import."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text(
        "_EXPORTS = {'A': '.a', 'B': 'b'}\n__getattr__ = lazy_exports(__name__, _EXPORTS)\n"
    )
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.a", f"{PACKAGE}.sub.b"}
    assert import_cycles(graph) == []  # a -> sub.b, sub -> a: no circle
    (pkg / "a.py").write_text("from .sub import B\n")
    assert import_cycles(import_graph(pkg)) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub"]]
