"""The import graph of fgchat/: every `import` / `from` statement that runs (module level and
inside functions), relative and package imports resolved to fgchat modules. Its largest cycle
(strongly connected component) has at most 3 modules, and the engine never imports the TUI or
its libraries. Imports under `if TYPE_CHECKING:` never run (they name types for annotations
only), so they make no edge."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "fgchat"
MAX_CYCLE = 3
UI_PACKAGES = ("fgchat.tui", "textual", "rich")


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package is its __init__)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST):
    """Every node of `tree`, less the bodies of `if TYPE_CHECKING:` (their else runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _type_checking_only(node):
            todo.extend(node.orelse)
            todo.append(node.test)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name `path` imports where the import runs (any depth in its tree); `from a
    import b` gives a.b too, since b may be a submodule."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
    return names


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between fgchat modules, every imported name per module). An import of a.b.c
    reaches module a.b.c where it exists, else the nearest package above it that exists."""
    modules = module_names(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    raw: dict[str, set[str]] = {}
    for mod, path in modules.items():
        raw[mod] = imported_names(path, mod)
        for name in raw[mod]:
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != mod:
                edges[mod].add(target)
    return edges, raw


def components(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.add(member)
                    if member == node:
                        break
                out.append(comp)
    return out


def largest_cycle(edges: dict[str, set[str]]) -> set[str]:
    return max(components(edges), key=len)


def test_the_largest_import_cycle_has_at_most_three_modules():
    edges, _ = import_graph()
    assert len(edges) > 100 and "fgchat.engine.core" in edges["fgchat.engine.process"]  # a function-level import
    big = largest_cycle(edges)
    assert len(big) <= MAX_CYCLE, sorted(big)


def test_the_engine_never_imports_the_tui_textual_or_rich():
    _, raw = import_graph()
    bad = {mod: sorted(n for n in names if n.split(".")[0] in UI_PACKAGES or n.startswith(UI_PACKAGES))
           for mod, names in raw.items() if mod.startswith("fgchat.engine")}
    assert not {m: b for m, b in bad.items() if b}


def test_a_planted_cycle_is_found(tmp_path):
    pkg = tmp_path / "fgchat"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from fgchat.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    from .. import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nimport fgchat.a\n"
                              "if TYPE_CHECKING:\n    from fgchat import e\n")
    (pkg / "e.py").write_text("import fgchat.d\n")  # d -> e only for type checkers: no cycle
    edges, _ = import_graph(pkg)
    assert largest_cycle(edges) == {"fgchat.a", "fgchat.sub.b", "fgchat.sub.c"}
    assert {"fgchat.d"} in components(edges) and {"fgchat.e"} in components(edges)
