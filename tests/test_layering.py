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
