"""The layering of docs/architecture.md, read from the code (``ast``): a lower layer never
imports a higher one, the gateway and the emulator never import each other, and nothing outside
``engine/`` reads an underscored attribute of another object (the engine's arrays are its own).
Inside the gateway, its stages are sub-layers by the same rule (the composition root, ``app``,
imported by none of them), and no function is longer than a screen.

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
    "policy": 3, "autoscale": 3,
    "emulator": 4, "sim": 4, "gateway": 4,
    "metrics": 5,
    "experiments": 6, "service": 6, "plan": 6,
    "cli": 7, "__main__": 8, "__init__": 8,
}
SIDEWAYS = {frozenset({"gateway", "emulator"})}  # same layer, never each other

# the gateway's stages (docs/architecture.md, "The gateway as a pipeline")
GATEWAY_LAYERS: dict[str, int] = {
    "__init__": 0, "config": 0, "keys": 0, "prometheus": 0, "upstream": 0, "changes": 0,
    "dns": 0, "kubernetes": 0, "autoscaling": 0,
    "state": 1,
    "intake": 2,
    "routing": 3,
    "relay": 4, "picker": 4, "observe": 4,
    "backends": 5,
    "app": 6,
}
GATEWAY_SIDEWAYS = {frozenset(p) for p in (("relay", "picker"), ("relay", "observe"),
                                            ("picker", "observe"))}
MAX_FUNCTION_LINES = 80  # in the gateway
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


def _gateway_modules() -> list[tuple[Path, str, ast.Module]]:
    """The gateway's modules with their stage (sub-package, or module beside them)."""
    return [(rel, rel.parts[1].removesuffix(".py"), tree) for rel, pkg, tree in _modules()
            if pkg == "gateway"]


def _gateway_violations(modules: list[tuple[Path, str, ast.Module]]) -> list[str]:
    bad = []
    for rel, stage, tree in modules:
        for line, target in _gateway_imports(rel, tree):
            if target == stage:
                continue
            if (target not in GATEWAY_LAYERS or GATEWAY_LAYERS[target] > GATEWAY_LAYERS[stage]
                    or frozenset({stage, target}) in GATEWAY_SIDEWAYS):
                bad.append(f"{rel}:{line} imports duetime.gateway.{target}")
    return bad


def _gateway_imports(rel: Path, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, gateway stage) of every import of a gateway module."""
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
            if node.module == "duetime.gateway":  # (``from duetime.gateway import state``)
                names = [f"duetime.gateway.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["duetime", "gateway"]:
                out.append((node.lineno, parts[2] if len(parts) > 2 else "__init__"))
    return out


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


def test_every_gateway_stage_has_a_sub_layer():
    assert {stage for _, stage, _ in _gateway_modules()} <= set(GATEWAY_LAYERS)


def test_the_gateways_stages_import_only_their_own_or_lower_ones():
    """state < intake < routing < relay, picker, observe (never each other) < backends < app:
    live state never imports a backend, and nothing in the gateway imports its composition
    root."""
    bad = _gateway_violations(_gateway_modules())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("stage", "target"), [("state", "backends"), ("routing", "app"),
                                               ("relay", "picker"), ("intake", "routing")])
def test_the_gateway_check_catches_what_it_forbids(stage, target):
    rel = Path("gateway") / stage / "x.py"
    tree = ast.parse(f"from duetime.gateway.{target}.y import z\n")
    assert _gateway_violations([(rel, stage, tree)]) == [
        f"{rel}:1 imports duetime.gateway.{target}"]


def test_no_function_in_the_gateway_is_longer_than_a_screen():
    long = []
    for rel, _, tree in _gateway_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


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
