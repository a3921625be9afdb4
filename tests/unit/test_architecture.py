"""The package's shape: imports point one way, from HTTP and the loops down to the queue's
decisions and the database, with no cycle; only ``store`` (and the development stand-ins, with
databases of their own) talks to the database driver; the client is a layer of its own that
imports nothing else of the package; production code needs no development stand-in."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "analysis_queue"
# Each layer may import itself and the layers listed before it. The composition root (app, cli,
# demo) may import anything. The client (``client``) stands apart: it imports nothing else of
# the package, and only the composition root imports it (test_the_client_stands_apart).
LAYERS = [
    {"client"},
    {"errors", "models", "metrics", "logs", "config", "tracing"},
    {"store", "core"},
    {"dev"},  # the development stand-ins: only the composition root uses them
    {"queue"},
    {"loops"},
    {"http"},
    {"app", "cli", "demo", "__main__"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it (function bodies too)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            if target in modules and target != name:
                found.add(target)
                break
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for rank, members in enumerate(LAYERS):
        if top in members:
            return rank
    return -1 if top == "__init__" else 99


def test_the_scan_finds_the_packages_imports() -> None:
    graph = _graph()
    assert "analysis_queue.store.database" in graph["analysis_queue.queue.admit"]
    assert "analysis_queue.queue.followup" in graph["analysis_queue.queue.finish"]
    assert len(graph) >= 30


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == []


def test_imports_point_down_the_layers() -> None:
    upward = [
        (module, target)
        for module, targets in _graph().items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert upward == []
    assert all(_layer(m) != 99 for m in _graph()), "a module in no layer"


def test_only_the_store_imports_the_database_driver() -> None:
    users = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if any(
            isinstance(node, ast.Import | ast.ImportFrom)
            and any(
                (alias.name if isinstance(node, ast.Import) else (node.module or "")).split(".")[0]
                == "asyncpg"
                for alias in node.names
            )
            for node in ast.walk(ast.parse(path.read_text()))
        )
    )
    assert users and all(name.startswith(("store/", "dev/")) for name in users), users
    assert any(name.startswith("store/") for name in users)


def test_production_code_needs_no_stand_in() -> None:
    """``dev`` (the Core simulator, the embedded server, scratch databases) is for
    ``analysis-queue dev``, the demo and the tests: the composition root wires it in, and the
    app's typed state names the simulator it may hold; nothing else imports it."""
    graph = _graph()
    dev = {m for m in graph if m.split(".")[1:2] == ["dev"]}
    assert "analysis_queue.dev.core_sim" in dev
    users = sorted(
        module
        for module, targets in graph.items()
        if module not in dev and targets & dev and _layer(module) != len(LAYERS) - 1
    )
    assert users == ["analysis_queue.http.state"]


def test_the_client_stands_apart() -> None:
    """Users install the package for the client: it must not need the server's modules, and
    the server's modules must not need it (only the composition root, the demo, uses it)."""
    graph = _graph()
    client = {m for m in graph if m.split(".")[1:2] == ["client"]}
    assert "analysis_queue.client.api" in client
    outside = sorted(
        (module, target)
        for module in client
        for target in graph[module]
        if target not in client and target != "analysis_queue"
    )
    assert outside == []
    users = sorted(
        module
        for module, targets in graph.items()
        if module not in client and targets & client and _layer(module) != len(LAYERS) - 1
    )
    assert users == []


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (rootdir, no packages): two of one name stop
    the whole collection, so a new test file must not reuse a name."""
    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
