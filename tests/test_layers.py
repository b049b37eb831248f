"""Imports point down the data flow: the records at the bottom; the probe and the collector on
them; the analysis above; the views above that; the command line on top. Every import counts,
those inside functions included (they hide an edge, they do not remove it)."""
import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"
# Bottom to top; a module belongs to the longest prefix that names it ("traceml" alone is the
# package's public API, which loads the rest lazily: the top).
LAYERS = [
    ("records", ("traceml.records", "traceml.rendezvous", "traceml.rundir", "traceml.words")),
    ("probe and collector", ("traceml.probe", "traceml.collector", "traceml.integrations")),
    ("analysis", ("traceml.analysis", "traceml.diagnose")),
    ("views", ("traceml.views",)),
    ("command line", ("traceml.cli", "traceml.lifecycle", "traceml.launcher", "traceml.agent", "traceml.__main__", "traceml.hf_decorators", "traceml")),
]
# Upward edges not yet turned round, each with what it is waiting for. The list only shrinks:
# a new upward edge fails the test, and so does an entry here that is no longer needed.
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


def test_imports_point_down_the_data_flow():
    upward = {(source, target) for source, target in edges() if layer_of(target) > layer_of(source)}
    new = sorted(upward - set(KNOWN_UPWARD))
    assert not new, "imports against the data flow:\n" + "\n".join(
        f"  {s} ({LAYERS[layer_of(s)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})" for s, t in new)
    stale = sorted(set(KNOWN_UPWARD) - upward)
    assert not stale, f"no longer needed in KNOWN_UPWARD: {stale}"


@pytest.mark.parametrize("planted", ["from traceml.views.summary import flat_summary",
                                     "def f():\n    import traceml.cli\n"])
def test_the_check_sees_an_upward_import_even_inside_a_function(tmp_path, planted, monkeypatch):
    package = tmp_path / "traceml" / "probe"
    package.mkdir(parents=True)
    (tmp_path / "traceml" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "planted.py").write_text(planted)
    for module in ("views/summary.py", "cli.py"):
        (tmp_path / "traceml" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "traceml" / module).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    found = [(s, t) for s, t in edges() if layer_of(t) > layer_of(s)]
    assert found and found[0][0] == "traceml.probe.planted"


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
