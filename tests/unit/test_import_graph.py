"""The import graph of service/genserve: no circles, no arrow that runs up the layers, the
engine and the worker without the launcher's config, and no module past ~500 lines without
its reason.

Every module is parsed with ``ast`` (nothing is imported), and every ``import`` counts:
module level, inside functions, and under ``TYPE_CHECKING`` (a circle that only the type
checker sees is still two modules that cannot be understood apart).  The layer order below
is the picture of docs/architecture.md; a module may import its own package and any package
on a lower layer, never one on its own layer or above.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "service"
PACKAGE = "genserve"

# Top first.  A "unit" is a subpackage (``engine``) or a top-level module (``config``).
# Units on one layer are siblings: neither may import the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli", "bench"),  # launchers: flags → objects, wiring; the benchmark harness
    (
        "cache_cli",  # genserve cache list|prune (the launcher dispatches to it)
        "serving_defaults",  # the launcher's auto switches (CUDA: overlap, engine process)
    ),
    ("server",),  # gRPC: conversion of requests, the servicer, rendering, observability
    ("engine", "worker", "testing"),  # scheduling | execution (Runner) | tiny test models
    ("model",),  # parts, families, weights, adapters on disk
    ("kernels", "kv_cache"),  # CPU/GPU ops | blocks and prefix hashes (pure Python)
    (  # shared services and contracts every layer may use
        "limits",
        "tokenizer",
        "chat_template",
        "dtype_choice",
        "parallel",
        "metrics",
        "adapter_metrics",
        "tracing",
        "logging",
        "stray_output",  # --json-output's capture of stdout/stderr
    ),
    ("config", "step"),  # the launcher's frozen config; the scheduler ↔ runner contract
)

# Known violations, each owned by a branch in flight.  The test fails when one is gone
# (so its entry gets removed) as well as when a new one appears.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()
KNOWN_UPWARD: tuple[tuple[str, str], ...] = ()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        name = _module_name(path)
        if not name.startswith(f"{PACKAGE}.v1"):  # generated stubs
            modules[name] = path
    return modules


def _imported_names(path: Path, module: str) -> Iterator[str]:
    """Every module name an import statement of ``path`` may refer to (``from a import b``
    yields ``a.b`` and ``a``; the caller keeps the ones that are modules)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                yield f"{source}.{alias.name}"
            yield source


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imported_names(path, name):
            # The longest prefix that is one of ours: ``a.b.C`` (a class) means module ``a.b``.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _cycle_path(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """One concrete circle through ``component``, for the failure message."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                return [*paths[node], start]
            if child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    return sorted(component)


def _unit(module: str) -> str:
    return module.split(".")[1]


def _layer_of() -> dict[str, int]:
    return {unit: depth for depth, units in enumerate(LAYERS) for unit in units}


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    layer = _layer_of()
    bad = []
    for source, targets in graph.items():
        for target in targets:
            a, b = _unit(source), _unit(target)
            if a != b and layer[b] <= layer[a]:
                bad.append((source, target))
    return sorted(bad)


GRAPH = _import_graph()


def test_every_unit_has_a_layer() -> None:
    units = {_unit(m) for m in GRAPH}
    missing = units - set(_layer_of())
    assert not missing, f"add these to LAYERS in {__file__}: {sorted(missing)}"
    assert len(GRAPH) > 100, "the walk found too few modules: is ROOT right?"


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(" -> ".join(_cycle_path(GRAPH, c)) for c in new)
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"fixed, remove from KNOWN_CYCLES: {gone}"


def test_no_upward_imports() -> None:
    upward = _upward(GRAPH)
    new = [edge for edge in upward if edge not in KNOWN_UPWARD]
    layer = _layer_of()
    assert not new, "imports that run up (or sideways across) the layers:\n" + "\n".join(
        f"{s} (layer {layer[_unit(s)]}) imports {t} (layer {layer[_unit(t)]})" for s, t in new
    )
    gone = [edge for edge in KNOWN_UPWARD if edge not in upward]
    assert not gone, f"fixed, remove from KNOWN_UPWARD: {gone}"


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for child in GRAPH[node] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def test_request_conversion_stands_below_the_servicer() -> None:
    """The conversion package never reaches the servicer or the renderers, whichever of its
    modules one starts from."""
    servicer = f"{PACKAGE}.server.servicer"
    conversion = [m for m in GRAPH if m.startswith(f"{PACKAGE}.server.conversion.")]
    assert conversion
    for module in conversion:
        reached = _reachable(module)
        assert servicer not in reached, module
        assert not {m for m in reached if m.endswith("_render")}, module


def _method(tree: ast.Module, cls: str, name: str) -> ast.AsyncFunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.AsyncFunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found")


@pytest.mark.parametrize(
    ("rpc", "conversion"),
    [
        ("Generate", "generate"),
        ("GenerateStream", "generate_stream"),
        ("Chat", "chat"),
        ("ChatStream", "chat"),
    ],
)
def test_rpc_converts_its_request_in_one_call(rpc: str, conversion: str) -> None:
    """Each RPC hands its request to the conversion once: one ``RequestConverter`` method
    call, no other conversion module called from the servicer."""
    path = ROOT / PACKAGE / "server" / "servicer.py"
    tree = ast.parse(path.read_text())
    calls = [
        node.func.attr
        for node in ast.walk(_method(tree, "TextGenerationServicer", rpc))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    ]
    assert calls.count(conversion) == 1, calls
    assert calls.count("_convert") == 1, calls
    imported_conversion = {t for t in GRAPH[f"{PACKAGE}.server.servicer"] if ".conversion." in t}
    assert imported_conversion <= {
        f"{PACKAGE}.server.conversion.convert",
        f"{PACKAGE}.server.conversion.errors",
        f"{PACKAGE}.server.conversion.limits",
    }, imported_conversion


def test_engine_and_worker_take_their_own_settings() -> None:
    """The engine and the worker get small settings objects of their own (SchedulerConfig,
    AdapterSettings, ShardSettings...) from the launcher, never its ``Config``: nothing
    there imports from ``genserve.config`` but the --cuda-graphs flag's parser."""
    allowed = {f"{PACKAGE}.config.parse_batch_sizes"}
    for module, path in _modules().items():
        if _unit(module) not in ("engine", "worker"):
            continue
        names = {n for n in _imported_names(path, module) if n.startswith(f"{PACKAGE}.config")}
        assert names <= allowed | {f"{PACKAGE}.config"}, (module, names - allowed)


# A module past this many lines says why in its docstring ("~500 lines").
MAX_LINES = 500


def test_long_modules_give_their_reason() -> None:
    long = {}
    for module, path in _modules().items():
        lines = path.read_text().count("\n")
        if lines > MAX_LINES:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if "~500 lines" not in doc:
                long[module] = lines
    assert not long, f"over {MAX_LINES} lines without a reason in the docstring: {long}"
