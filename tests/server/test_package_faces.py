"""The house rules a reader relies on, checked over the source tree (issue 27).

- A package of ``kvturn_server`` uses another only through its face (``__init__`` and
  ``__all__``): no import of another package's ``_private`` module or ``_private`` name. The
  top-level modules (``cli.py``, ``_cli_common.py``, ``_plot.py``, ``_control_secret.py``) each
  count as a package of their own; tests may import private modules, package code may not.
- No module of ``server/kvturn_server``, ``sdk/`` or ``integrations/`` is over 500 lines.
- No circle of imports among those modules (type-only imports count: a reader follows them
  too) but the SDK's, kept on purpose: the client, its base and the conversation that each
  hands the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server" / "kvturn_server"
MAX_LINES = 500
SDK_CIRCLE = frozenset({"kvturn._base_client", "kvturn._client", "kvturn._conversation"})


def _imports(tree: ast.AST) -> Iterator[tuple[int, str, list[str]]]:
    """Every absolute import: (line, module, names imported from it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def private_imports(root: Path) -> list[str]:
    """``path:line: module [names]`` for each import of another package's private part."""
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        package = rel.parts[0].removesuffix(".py")
        for line, module, names in _imports(ast.parse(path.read_text(), str(path))):
            parts = module.split(".")
            if parts[0] != root.name or len(parts) < 2 or parts[1] == package:
                continue
            private = [p for p in parts[2:] if p.startswith("_")]
            private_names = [n for n in names if n.startswith("_")]
            if private or private_names:
                offenders.append(f"{rel}:{line}: {module} {names}")
    return offenders


def test_packages_import_each_other_through_their_faces() -> None:
    offenders = private_imports(SERVER)
    assert not offenders, "imports of another package's private modules or names (export " \
        "them from its __init__):\n" + "\n".join(offenders)


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    root = tmp_path / "kvturn_server"
    for package in ("sim", "router"):
        (root / package).mkdir(parents=True)
    (root / "sim" / "_engine.py").write_text(
        "from kvturn_server.router._pool import Pool\n"
        "from kvturn_server.router import _placement\n"
        "import kvturn_server.router._state\n"
        "from kvturn_server.router import Placement\n"
        "from kvturn_server.sim._config import SimSettings\n")
    (root / "cli.py").write_text("from kvturn_server.local._demo import run_demo\n")
    found = private_imports(root)
    assert [f.split(":")[:2] for f in found] == [
        ["cli.py", "1"], ["sim/_engine.py", "1"], ["sim/_engine.py", "2"],
        ["sim/_engine.py", "3"]]


def test_no_module_is_over_500_lines() -> None:
    long = []
    for top in (SERVER, ROOT / "sdk", ROOT / "integrations"):
        for path in sorted(top.rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them along a seam):\n" + \
        "\n".join(long)


def _modules(tops: list[Path]) -> dict[str, Path]:
    """Every module under ``tops`` (each a folder that holds top-level packages) by name."""
    found = {}
    for top in tops:
        for path in sorted(top.rglob("*.py")):
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(tops: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``tops`` it imports (``from package import submodule`` names
    the submodule; anything else the module named)."""
    modules = _modules(tops)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, module, names in _imports(ast.parse(path.read_text(), str(path))):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            if not targets and module in modules:
                targets = [module]
            graph[name].update(t for t in targets if t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_but_the_sdks() -> None:
    found = circles(import_graph([ROOT / "server", ROOT / "sdk", ROOT / "integrations"]))
    others = [sorted(c) for c in found if c != SDK_CIRCLE]
    assert not others, f"modules that import each other (move what both need below them): {others}"


def test_the_circle_check_sees_a_type_only_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_a.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from pkg._b import B\n")
    (package / "_b.py").write_text("from pkg import _c\n")
    (package / "_c.py").write_text("from pkg._a import A\n")
    (package / "_d.py").write_text("from pkg._a import A\n")
    assert circles(import_graph([tmp_path])) == [frozenset({"pkg._a", "pkg._b", "pkg._c"})]
