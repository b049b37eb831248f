"""Imports point down the data flow, and each layer imports only the layers it reads: the records
at the bottom; the probe (inside training) and the collector (its own process) on them, apart;
the per-step analysis; the diagnosis rules over it; the report, which builds a run's figures and
findings from the store or the live collector; the views, which show the report and never read
the store; the command line on top. Every import counts, those inside functions included (they
hide an edge, they do not remove it)."""
import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"
# Bottom to top; a module belongs to the longest prefix that names it ("traceml" alone is the
# package's public API, which loads the rest lazily: the top).
LAYERS = [
    ("records", ("traceml.records", "traceml.record_types", "traceml.wire", "traceml.rendezvous", "traceml.rundir",
                 "traceml.words")),
    ("probe", ("traceml.probe", "traceml.integrations")),
    ("collector", ("traceml.collector",)),
    ("analysis", ("traceml.analysis",)),
    ("diagnose", ("traceml.diagnose",)),
    ("report", ("traceml.report",)),
    ("views", ("traceml.views",)),
    ("command line", ("traceml.cli", "traceml.lifecycle", "traceml.launcher", "traceml.agent", "traceml.__main__",
                      "traceml.hf_decorators", "traceml")),
]
# The layers below each one that it may import (its own always). The probe and the collector
# run in different processes and share only the records; the analysis and the rules are pure
# arithmetic over records; the views read a run through the report, never the store.
MAY_IMPORT = {
    "records": set(),
    "probe": {"records"},
    "collector": {"records"},
    "analysis": {"records"},
    "diagnose": {"records", "analysis"},
    "report": {"records", "collector", "analysis", "diagnose"},
    "views": {"records", "analysis", "diagnose", "report"},
    "command line": {name for name, _ in LAYERS[:-1]},
}
# Edges against the layers not yet turned round, each with what it is waiting for. The list only
# shrinks: a new such edge fails the test, and so does an entry here that is no longer needed.
KNOWN_UPWARD: dict = {}


# Modules that import each other (in functions, since Python could not load them otherwise).
# None are left; the list only shrinks.
KNOWN_CYCLES: list = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = SRC.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path):
    """Every traceml module this file imports, anywhere in it."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" if is_module(f"{node.module}.{alias.name}") else node.module
                     for alias in node.names]
        else:
            continue
        yield from (name for name in names if name == "traceml" or name.startswith("traceml."))


def layer_of(module: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "traceml" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def edges():
    for path in sorted((SRC / "traceml").rglob("*.py")):
        source = module_name(path)
        for target in imports_of(path):
            if target != source:
                yield source, target


def test_every_module_has_a_layer():
    for path in (SRC / "traceml").rglob("*.py"):
        layer_of(module_name(path))


def layer_name(module: str) -> str:
    return LAYERS[layer_of(module)][0]


def against_the_layers(source: str, target: str) -> bool:
    """An import from a layer to one it may not read: above it, or a layer it skips."""
    source_layer, target_layer = layer_name(source), layer_name(target)
    return target_layer != source_layer and target_layer not in MAY_IMPORT[source_layer]


def test_every_layer_may_import_only_layers_below_it():
    order = [name for name, _ in LAYERS]
    assert set(MAY_IMPORT) == set(order)
    for name, below in MAY_IMPORT.items():
        assert all(order.index(lower) < order.index(name) for lower in below), name


def test_imports_keep_to_the_layers():
    found = {(source, target) for source, target in edges() if against_the_layers(source, target)}
    new = sorted(found - set(KNOWN_UPWARD))
    assert not new, "imports against the layers:\n" + "\n".join(
        f"  {s} ({layer_name(s)}) imports {t} ({layer_name(t)})" for s, t in new)
    stale = sorted(set(KNOWN_UPWARD) - found)
    assert not stale, f"no longer needed in KNOWN_UPWARD: {stale}"


@pytest.mark.parametrize("where, planted", [
    ("probe", "from traceml.views.summary import flat_summary"),  # up
    ("probe", "def f():\n    import traceml.cli\n"),  # up, hidden in a function
    ("probe", "from traceml.collector.store import Store"),  # across: another process's
    ("views", "from traceml.collector.store import Store"),  # down, but past the report
    ("analysis", "from traceml.diagnose import diagnose"),  # up one
])
def test_the_check_sees_an_import_against_the_layers(tmp_path, where, planted, monkeypatch):
    package = tmp_path / "traceml" / where
    package.mkdir(parents=True)
    (tmp_path / "traceml" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "planted.py").write_text(planted)
    for module in ("views/summary.py", "cli.py", "collector/store.py", "diagnose/__init__.py"):
        (tmp_path / "traceml" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "traceml" / module).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    found = [(s, t) for s, t in edges() if against_the_layers(s, t)]
    assert found == [(f"traceml.{where}.planted", found[0][1])]
    assert not [(s, t) for s, t in edges() if s != f"traceml.{where}.planted" and against_the_layers(s, t)]


def cycles(graph):
    """The groups of modules that reach each other through imports (Tarjan's components)."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = set()
            while not group or module not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                found.append(group)

    for module in list(graph):
        if module not in order:
            visit(module)
    return found


def test_no_modules_import_each_other():
    graph = {}
    for source, target in edges():
        graph.setdefault(source, set()).add(target)
    found = cycles(graph)
    assert all(group in KNOWN_CYCLES for group in found), f"import cycles: {found}"
    assert all(group in found for group in KNOWN_CYCLES), "a known cycle is gone: take it out of KNOWN_CYCLES"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]  # the finder finds


MAX_FUNCTION_LINES = 60  # outside views/, whose render functions lay out whole tables


def long_functions(tree: ast.AST, where: str):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield f"{where}:{node.lineno} {node.name} ({lines} lines)"


def test_no_function_outside_the_views_is_over_60_lines():
    found = [long for path in sorted((SRC / "traceml").rglob("*.py")) if "views" not in path.parts
             for long in long_functions(ast.parse(path.read_text()), str(path.relative_to(SRC)))]
    assert found == []
    planted = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert len(list(long_functions(ast.parse(planted), "planted"))) == 1  # the check sees one
