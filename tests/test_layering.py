"""The map's arrows point down (DESIGN.md): checked on the import statements.

Every ``import`` in ``jaxkv/`` (top level or inside a function) is read with ``ast``
and reduced to an edge between the package's parts (``models``, ``pallas``,
``cache``, ``engine``, ``serving``, ...). The test asserts that nothing in
``jaxkv/`` imports ``train/`` or ``eval/``, that each part imports only what the
map lets it, and that the parts' import graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxkv"

# part -> parts it must never import (DESIGN.md: "Arrows point down only")
FORBIDDEN = {
    "models": {"pallas", "policies", "serving", "engine", "cache", "chat", "tasks", "server"},
    "pallas": {"models", "policies", "serving", "engine", "cache", "chat", "tasks", "server"},
    "attention": {"models", "pallas", "policies", "serving", "engine", "cache", "chat"},
    # cache -> pallas is allowed: the quantized pools (cache/quantized*.py) are built
    # from the packed formats of pallas.quant; pallas never imports cache.
    "cache": {"engine", "serving", "policies", "models", "chat", "server"},
    "chat": {"engine", "serving", "policies", "cache", "models", "pallas", "server"},
    "policies": {"engine", "serving", "models", "pallas", "server"},
    "tasks": {"engine", "serving", "policies", "cache", "models", "pallas", "server"},
    "engine": {"serving", "policies", "chat", "tasks", "server"},
    "serving": {"server", "cli", "demo"},
}


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_edges() -> set[tuple[str, str, str]]:
    """``(part, imported part or top package, file)`` for every import in jaxkv/."""
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = part_of(module) if module != "jaxkv" else "__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] if node.module != "jaxkv" else [f"jaxkv.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ("eval", "train"):
                    edges.add((src, top, str(rel)))
                elif top == "jaxkv" and "." in name:
                    dst = part_of(name)
                    if dst != src:
                        edges.add((src, dst, str(rel)))
    return edges


def test_the_package_never_imports_train_or_eval():
    bad = sorted(e for e in import_edges() if e[1] in ("eval", "train"))
    assert not bad, bad


def test_every_part_imports_only_what_the_map_allows():
    bad = sorted(e for e in import_edges() if e[1] in FORBIDDEN.get(e[0], ()))
    assert not bad, bad


def test_the_parts_import_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for src, dst, _ in import_edges():
        if src != "__init__":  # the package's __init__ re-exports; parts never import it back
            graph.setdefault(src, set()).add(dst)
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(node):] + [node])}")
        if node in seen:
            return
        stack.append(node)
        for nxt in graph.get(node, ()):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in list(graph):
        visit(node)


def module_import_graph() -> dict[str, set[str]]:
    """Module -> the ``jaxkv`` modules it imports (top level or inside a function).

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module (the
    package's ``__init__`` runs first either way, as for every submodule import),
    else to ``pkg``."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    graph = {}
    for module, path in modules.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
            else:
                continue
            out.update(n for n in names if n in modules and n != module)
        graph[module] = out
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_module_import_graph_has_no_circle():
    """Module by module, imports run one way (DESIGN.md): no two modules import
    each other, nor does any longer loop close. Prints the edges into serving."""
    graph = module_import_graph()
    for module in ("jaxkv.serving.pipeline", "jaxkv.serving.scheduler", "jaxkv.serving.server", "jaxkv.serving.session"):
        print(module, "->", sorted(m for m in graph[module] if m.startswith("jaxkv.serving")))
    assert import_circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_the_engine_never_branches_on_the_pool_kind():
    """``jaxkv/engine.py`` calls the pool interface (``jaxkv.cache.pools``) and never
    tests which pool it holds: no condition reads a quantization mode or a pool
    class, and the engine imports no quantized-pool module."""
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    words = {"quant", "kv_quant", "kv_step", "kv_op", "token_kind", "QuantizedKV", "FloatKV", "DualPool", "QuantizedKVCache", "PagedKVCache"}
    conditions = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    conditions += [v for n in ast.walk(tree) if isinstance(n, ast.BoolOp) for v in n.values]
    named = sorted({ast.unparse(c) for c in conditions for sub in ast.walk(c)
                    if isinstance(sub, (ast.Name, ast.Attribute)) and (sub.id if isinstance(sub, ast.Name) else sub.attr) in words})
    assert named == [], named
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if "quantized" in m}, imported
