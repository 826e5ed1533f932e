"""The product's imports point one way, and no two modules import each other.

Every import in the product code counts, at module level or inside a function: an
import hidden in a function still ties the two modules together, it only moves the
failure to run time. Imports for type checking only (``if TYPE_CHECKING:``) count
for the layers too (a type is a dependency), but not for cycles: two modules of one
layer may name each other's types (a channel and its connection).

The layers, lowest first (a module may import its own layer's modules and those of
lower layers only):

    0 model        storage.model, .api, .errors, .names, .clock, .lifecycle, ...
    1 engine, rpc  storage.engine, storage.rpc, storage.replicated (the log in JetStream)
    2 directories  nameserver, navigation          (soft state, over the RPC)
    3 pool         storage.remote, .cluster*, .node, .replicated.host (clients and nodes)
    4 gateway      gateway (processor, accounts, metering, listener machinery)
    5 protocols    protocols
    6 conformance  conformance                     (drives clients; serves nothing)
    7 root         gateway.cli, .server, .roles, .assembly, .cluster_tool, .cluster_status,
                   .workers

The root is the one place that knows the list of protocols and the storage backend.
"""

from __future__ import annotations

import ast
import fnmatch
from collections import defaultdict
from pathlib import Path

ONE_FORM = True  # reads source files; starts no server
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "nameserver", "navigation", "gateway", "protocols", "conformance")
NAMESPACE = "polymq."  # every package installs under it

# The longest dotted prefix wins; a key ending in * matches by name prefix.
LAYERS: dict[str, int] = {
    "storage": 0,
    "storage.engine": 1,
    "storage.memory": 1,
    "storage.rpc": 1,
    "storage.replicated": 1,
    "storage.replicated.host": 3,
    "nameserver": 2,
    "navigation": 2,
    "storage.remote": 3,
    "storage.cluster*": 3,
    "storage.node": 3,
    "storage.node_metrics": 3,
    "gateway": 4,
    "protocols": 5,
    "conformance": 6,
    "gateway.cli": 7,
    "gateway.__main__": 7,
    "gateway.server": 7,
    "gateway.assembly": 7,
    "gateway.cluster_tool": 7,
    "gateway.cluster_status": 7,
    "gateway.roles": 7,
    "gateway.workers": 7,
}
NAMES = ["model", "engine/rpc", "directories", "pool", "gateway", "protocols", "conformance"]
NAMES.append("root")


def _package_prefix(module: str) -> str:
    return module.split(".")[0]


def layer_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
        for pattern, layer in LAYERS.items():
            if pattern.endswith("*") and fnmatch.fnmatchcase(prefix, pattern):
                return layer
    raise KeyError(f"{module} is in no layer: add it to tests/test_layers.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(imported: str, modules: set[str]) -> list[str]:
    """The product modules an import loads: the one it names (``from a.b import c``
    may name the module ``a.b.c`` or a name inside ``a.b``) and every package above
    it, whose ``__init__`` runs first."""
    candidate = imported
    while candidate and candidate not in modules:
        candidate = candidate.rpartition(".")[0]
    loaded = []
    while candidate:
        if candidate in modules:
            loaded.append(candidate)
        candidate = candidate.rpartition(".")[0]
    return loaded


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for inner in ast.walk(child):
                    hidden.add(id(inner))
    return hidden


def import_graph(*, runtime_only: bool = False) -> dict[str, set[str]]:
    files = [
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "node_modules" not in path.parts
    ]
    modules = {_module_name(path) for path in files}
    graph: dict[str, set[str]] = defaultdict(set)
    for path in files:
        source = _module_name(path)
        graph[source]
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree) if runtime_only else set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                if not name.startswith(NAMESPACE):
                    continue
                name = name.removeprefix(NAMESPACE)
                for target in _resolve(name, modules):
                    # A package's own modules run after its __init__: not an edge back.
                    if target != source and not source.startswith(target + "."):
                        graph[source].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = []
    for module in import_graph():
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert unplaced == []


def test_no_import_points_up() -> None:
    upward = sorted(
        f"{source} ({NAMES[layer_of(source)]}) imports {target} ({NAMES[layer_of(target)]})"
        for source, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    )
    assert upward == []


def test_no_import_cycles() -> None:
    assert _cycles(import_graph(runtime_only=True)) == []


def test_the_checker_sees_an_upward_import_and_a_cycle() -> None:
    """The checks above can fail: a graph with both faults is caught."""
    graph = {"storage.model": {"gateway.processor"}, "gateway.processor": {"storage.model"}}
    assert _cycles(graph) == [["gateway.processor", "storage.model"]]
    assert layer_of("gateway.processor") > layer_of("storage.model")
