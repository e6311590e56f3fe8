"""The repository's package boundaries: the gateway (``extproc``) never imports the simulator
(``llmgw_sim``) or the test servers (``llmgw_testing``); they may import the gateway."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OUTSIDE_THE_GATEWAY = ("llmgw_sim", "llmgw_testing")


def imported_modules(source: str) -> list[tuple[int, str]]:
    """Every absolute module a source imports, with its line: ``import``/``from`` statements at any
    depth (a function body's lazy import too), and ``importlib.import_module``/``__import__`` of a
    literal name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def in_package(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def offenders(package: Path, forbidden: tuple[str, ...]) -> list[str]:
    """``path:line imports module`` for each import of ``forbidden`` under ``package``."""
    return [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in sorted(package.rglob("*.py"))
        for line, module in imported_modules(path.read_text())
        if in_package(module, forbidden)
    ]


@pytest.mark.parametrize(
    ("source", "modules"),
    [
        ("import llmgw_sim.server as s", ["llmgw_sim.server"]),
        ("from llmgw_testing.redis_server import RedisServer", ["llmgw_testing.redis_server"]),
        ("def f():\n    from llmgw_sim import build_app", ["llmgw_sim"]),  # a lazy import counts
        ("import importlib\nimportlib.import_module('llmgw_sim')", ["importlib", "llmgw_sim"]),
        ("from . import tokens", []),  # relative: stays inside its own package
        ("cmd = ['python', '-m', 'llmgw_sim']", []),  # starting the pod as a process is not an import
    ],
    ids=["import-as", "from-import", "lazy", "import_module", "relative", "subprocess-argv"],
)
def test_imported_modules(source: str, modules: list[str]) -> None:
    assert [module for _, module in imported_modules(source)] == modules


def test_the_gateway_imports_neither_the_simulator_nor_the_test_servers() -> None:
    modules = list((REPO / "extproc").rglob("*.py"))
    assert len(modules) > 50  # the walk really reads the gateway's tree
    assert offenders(REPO / "extproc", OUTSIDE_THE_GATEWAY) == []


def test_the_check_sees_a_real_import_across_the_boundary() -> None:
    # The other direction is allowed and happens: were the walk blind, this would be empty too.
    assert any("imports extproc." in line for line in offenders(REPO / "llmgw_sim", ("extproc",)))
    assert any(line.endswith("imports extproc.launcher") for line in offenders(REPO / "llmgw_testing", ("extproc",)))


# Layers inside the gateway: what a package may not import (the director sits above the others).
LAYERS = [
    # routing picks pods and hears outcomes; it knows nothing of the director's requests or steps
    ("extproc/routing", ("extproc.gateway", "extproc.stages", "extproc.state", "extproc.steps", "extproc.sinks",
                         "extproc.server")),
    # the metrics read records and counters, not the stores that keep them
    ("extproc/telemetry", ("extproc.ledger", "extproc.quota", "extproc.cache", "extproc.gateway", "extproc.stages",
                           "extproc.sinks")),
    # the quota store answers admissions; it does not know who asks
    ("extproc/quota", ("extproc.gateway", "extproc.stages", "extproc.state", "extproc.steps", "extproc.routing")),
    # the stages are pure: no shell, no settlement, no gRPC
    ("extproc/stages", ("extproc.server", "extproc.sinks", "extproc.app", "grpc", "extproc.cache.lookup")),
]


@pytest.mark.parametrize(("package", "forbidden"), LAYERS, ids=[package for package, _ in LAYERS])
def test_a_layer_does_not_import_the_layers_above_it(package: str, forbidden: tuple[str, ...]) -> None:
    assert list((REPO / package).glob("*.py"))
    assert offenders(REPO / package, forbidden) == []


def test_settlement_reaches_routing_only_through_its_feedback() -> None:
    imports = {module for _, module in imported_modules((REPO / "extproc/sinks.py").read_text())}
    assert {module for module in imports if module.startswith("extproc.routing")} == {"extproc.routing.feedback"}
    assert "extproc.gateway" not in imports
