"""The package's import graph: no circle between its modules (function-level imports
count: a lazy import that closes a circle still ties two files together), and no
private name (``_x``) imported from another of its modules."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from source_tree import REPO, installed_name, package_folders


def source_modules(root: Path) -> dict[str, Path]:
    """Every module of the package folders under ``root``, by its installed dotted name."""
    modules = {}
    for top in package_folders(root):
        package = installed_name(top)
        for path in top.rglob("*.py"):
            parts = path.relative_to(top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """(imported module, imported name or "") for every import statement in the file,
    at any depth, resolved to modules of the package; others are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, "") for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:  # `from . import attention` names a module
                    yield submodule, ""
                elif target in modules:
                    yield target, alias.name


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {
        name: {target for target, _ in _imports(name, path, modules) if target != name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_package_has_no_import_circle():
    found = cycles(import_graph(source_modules(REPO)))
    assert found == [], "import circles (each a set of modules that import one another):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_no_private_name_is_imported_from_another_module():
    modules = source_modules(REPO)
    crossing = sorted(
        f"{name} imports {target}.{imported}"
        for name, path in modules.items()
        for target, imported in _imports(name, path, modules)
        if imported.startswith("_") and not imported.startswith("__")
    )
    assert crossing == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # A lazy, relative import closing a circle of two.
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from .b import f\n",
                "pkg/b.py": "def f():\n    from . import a\n",
            },
            [["glmport.pkg.a", "glmport.pkg.b"]],
        ),
        # A submodule asking its own package's __init__ for a name it defines, while the
        # package imports the submodule: a circle through __init__.
        (
            {"pkg/__init__.py": "from .run import go\nX = 1\n", "pkg/run.py": "from . import X\n"},
            [["glmport.pkg", "glmport.pkg.run"]],
        ),
        # Absolute imports of three modules in a ring, one of them inside a function.
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "import glmport.pkg.b\n",
                "pkg/b.py": "from glmport.pkg.c import x\n",
                "pkg/c.py": "def g():\n    from glmport.pkg import a\n",
            },
            [["glmport.pkg.a", "glmport.pkg.b", "glmport.pkg.c"]],
        ),
        # A chain is no circle; `from . import sub` does not count as importing __init__.
        (
            {
                "pkg/__init__.py": "from . import a\n",
                "pkg/a.py": "from . import b\n",
                "pkg/b.py": "import os\n",
            },
            [],
        ),
    ],
)
def test_the_circle_finder_sees_circles_and_only_circles(tmp_path, files, expected):
    _write(tmp_path, files)
    assert cycles(import_graph(source_modules(tmp_path))) == expected
