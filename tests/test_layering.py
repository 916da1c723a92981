"""The layering of docs/architecture.md, read from the code (``ast``): a lower layer never
imports a higher one, the gateway and the emulator never import each other, and nothing outside
``engine/`` reads an underscored attribute of another object (the engine's arrays are its own).

    pytest tests/test_layering.py        # the check anyone can run
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "duetime"

# lower number = lower layer; a module may import its own layer or lower ones
LAYERS: dict[str, int] = {
    "engine": 0, "argtypes": 0, "client": 0,
    "web": 1, "predict": 1,
    "workload": 2, "estimate": 2, "calibrate": 2,
    "policy": 3,
    "emulator": 4, "sim": 4, "gateway": 4,
    "metrics": 5,
    "experiments": 6, "service": 6,
    "cli": 7, "__main__": 8, "__init__": 8,
}
SIDEWAYS = {frozenset({"gateway", "emulator"})}  # same layer, never each other
OK_PRIVATE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults", "_getframe", "_exit"}


def _modules() -> list[tuple[Path, str, ast.Module]]:
    out = []
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC)
        out.append((rel, rel.parts[0].removesuffix(".py"), ast.parse(f.read_text(), str(f))))
    return out


def _imports(rel: Path, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level duetime package) of every import of a duetime module."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel.parts[:-1])[:len(rel.parts) - node.level]
                names = [".".join(["duetime", *base, *([node.module] if node.module else [])])]
            elif node.module:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "duetime" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def test_every_package_has_a_layer():
    assert {pkg for _, pkg, _ in _modules()} <= set(LAYERS)


def test_no_upward_or_sideways_imports():
    bad = []
    for rel, pkg, tree in _modules():
        for line, target in _imports(rel, tree):
            if target not in LAYERS or target == pkg:
                continue
            if LAYERS[target] > LAYERS[pkg] or frozenset({pkg, target}) in SIDEWAYS:
                bad.append(f"{rel}:{line} imports duetime.{target}")
    assert not bad, "\n".join(bad)


def test_nothing_outside_the_engine_reads_another_objects_underscored_attributes():
    bad = []
    for rel, pkg, tree in _modules():
        if pkg == "engine":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in OK_PRIVATE
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))):
                bad.append(f"{rel}:{node.lineno} .{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("pkg", "target"), [("engine", "gateway"), ("gateway", "emulator"),
                                             ("predict", "workload")])
def test_the_check_catches_what_it_forbids(pkg, target):
    """The rule itself, on a forbidden import (a check that cannot fail checks nothing)."""
    rel = Path(pkg) / "x.py"
    tree = ast.parse(f"from duetime.{target}.y import z\n")
    (_line, got), = _imports(rel, tree)
    assert got == target
    assert LAYERS[got] > LAYERS[pkg] or frozenset({pkg, got}) in SIDEWAYS
