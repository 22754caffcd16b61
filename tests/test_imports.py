"""The package's layout: no module imports another that imports it back (directly or around a loop), and no
module hides such an import inside a function. The CLI alone defers its imports (so that ``--help`` answers at
once), and it is the top of the graph. Read from the source with ``ast``, independently of how Python resolves
the imports at run time."""

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "thunder_fsdp_mem"
DEFERRED_ALLOWED = {
    "thunder_fsdp_mem.cli",
    "thunder_fsdp_mem.cli.__main__",
    "thunder_fsdp_mem.cli.commands",
    "thunder_fsdp_mem.cli.console",
    "thunder_fsdp_mem.cli.parser",
    "thunder_fsdp_mem.cli.validate",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, *, top_level: bool) -> set[str]:
    """Names of this package's modules imported at module level (``top_level``) or inside functions."""
    found = set()
    nodes = (
        tree.body
        if top_level
        else [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    )
    for node in nodes:
        for sub in [node] if top_level else ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("thunder_fsdp_mem"):
                found.add(sub.module)
                found.update(f"{sub.module}.{a.name}" for a in sub.names)
            elif isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names if a.name.startswith("thunder_fsdp_mem"))
    return found


def _graph():
    modules = {_module_name(p): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, tree in modules.items():
        for target in _imports(tree, top_level=True):
            if target in modules and target != name:
                graph.add_edge(name, target)
    return modules, graph


def test_no_import_loops():
    _, graph = _graph()
    # A package's __init__ re-exports from its modules: an edge into an __init__ that only re-exports is fine,
    # so loops are looked for among the modules proper.
    inits = {n for n in graph if (PACKAGE.parent / n.replace(".", "/") / "__init__.py").exists()}
    modules = graph.subgraph(set(graph) - inits)
    assert list(nx.simple_cycles(modules)) == []


def test_no_deferred_imports_of_the_package_outside_the_cli():
    modules, _ = _graph()
    deferred = {
        name: sorted(_imports(tree, top_level=False))
        for name, tree in modules.items()
        if name not in DEFERRED_ALLOWED and _imports(tree, top_level=False)
    }
    assert deferred == {}


GROUND = {"thunder_fsdp_mem.thunder_internals"}  # the door to Thunder's internals, under every floor


def test_the_floors_point_down():
    # analysis knows nothing of the rest but the door to Thunder's internals; passes know analysis; predict may know
    # everything but the CLI and the report, which sit on top.
    _, graph = _graph()

    def reaches(module: str) -> set[str]:
        return set(nx.descendants(graph, module))

    for name in graph:
        if name.startswith("thunder_fsdp_mem.analysis."):
            assert all(t.startswith("thunder_fsdp_mem.analysis") or t in GROUND for t in reaches(name)), name
        if name.startswith("thunder_fsdp_mem.passes."):
            assert not any(
                t.startswith(
                    (
                        "thunder_fsdp_mem.predict",
                        "thunder_fsdp_mem.training",
                        "thunder_fsdp_mem.report",
                        "thunder_fsdp_mem.cli",
                    )
                )
                for t in reaches(name)
            ), name
    assert "thunder_fsdp_mem.cli" not in set().union(*(reaches(n) for n in graph))
