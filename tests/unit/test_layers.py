"""The import contract: packages import only downward, and no module imports itself back in a circle.

Each package of ``toolkit`` has a layer; a module may import from its own package and from packages of
lower layers only. Packages in one layer are peers and import none of each other. Read from the source
with ``ast`` (every import, inside functions too), so a new upward import fails here, not at a user's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "toolkit"

LAYERS: list[set[str]] = [
    {"core"},
    {"config"},
    {"model", "client"},
    {"session", "weights"},
    {"router", "engine", "samples"},
    {"gateway"},
    {"rollout"},
    {"cluster"},
    {"report"},
    {"launch"},
    {"plan"},
    {"bench"},
]
"""Bottom to top. ``client``, ``weights`` and ``samples`` are the trainer API's modules (``weights``
streams through the router: above ``client``)."""

RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a toolkit module in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "toolkit":  # ``from toolkit import x``: x is the module
                found += [(node.lineno, f"toolkit.{a.name}") for a in node.names]
            elif target.startswith("toolkit."):
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("toolkit.")]
    return found


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def _all_modules() -> dict[str, Path]:
    return {_module(p): p for p in ROOT.rglob("*.py")}


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _all_modules() if m != "toolkit"}
    assert packages - set(RANK) == set(), "add the new package to LAYERS"


def test_packages_import_only_downward():
    bad = []
    for mod, path in sorted(_all_modules().items()):
        if mod == "toolkit":
            continue
        mine = _package(mod)
        for line, target in _imports(path):
            theirs = _package(target)
            if theirs in ("toolkit", mine):
                continue
            if RANK[theirs] >= RANK[mine]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({mine}, layer {RANK[mine]}) imports "
                           f"{target} ({theirs}, layer {RANK[theirs]})")
    assert not bad, "imports that do not run downward:\n" + "\n".join(bad)


def test_no_import_circles():
    modules = _all_modules()
    graph = {m: {t for _, t in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(" -> ".join(trail[trail.index(t):] + [m, t]) if t in trail else f"{m} -> {t}")
            elif t not in state:
                visit(t, trail + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(circles)


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_layers_are_not_empty(layer):
    packages = {_package(m) for m in _all_modules()}
    assert LAYERS[layer] & packages, f"layer {layer} ({LAYERS[layer]}) names no package"
