"""The serving core's declared interface (onlinespec.serve.interface.Core): both cores implement it,
with the same signatures, and the HTTP app knows only it. Builds the cores without loading a model
or starting Ray."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from onlinespec.serve.interface import Core

SRC = Path(__file__).resolve().parents[2] / "src"
METHODS = sorted(name for name in Core.__abstractmethods__ if name != "ready")
ATTRIBUTES = sorted(inspect.get_annotations(Core))


def ray_core():
    pytest.importorskip("ray")
    from onlinespec.scale.cluster import RayCore

    return RayCore


def cores():
    return [ServingCore, ray_core()]


def shape(function) -> list[tuple]:
    """A signature as a caller sees it: the parameters' names, kinds and defaults."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_interface_declares_what_the_app_uses():
    assert set(METHODS) == {"load", "shutdown", "submit", "drafts", "replica_rows", "routing", "learning", "governance", "operate", "purge"}
    assert set(ATTRIBUTES) == {"config", "status", "error", "started_at", "context", "tokenizer", "metrics"}


@pytest.mark.parametrize("name", METHODS)
def test_both_cores_implement_each_method_with_its_signature(name):
    for cls in cores():
        assert Core in cls.__mro__, f"{cls.__name__} does not name Core as a base"
        method = inspect.getattr_static(cls, name)
        assert method is not inspect.getattr_static(Core, name), f"{cls.__name__}.{name} is the interface's, not its own"
        assert shape(getattr(cls, name)) == shape(getattr(Core, name)), f"{cls.__name__}.{name}'s signature differs from Core's"


def test_both_cores_are_ready_by_a_property_and_abstract_in_nothing():
    for cls in cores():
        assert isinstance(inspect.getattr_static(cls, "ready"), property)
        assert not cls.__abstractmethods__


def test_a_built_core_holds_every_attribute(tmp_path):
    """Built, not loaded: the attributes exist from the start (tokenizer and context None until loaded)."""
    for i, cls in enumerate(cores()):
        core = cls(CoreConfig(), tmp_path / str(i))
        try:
            for name in ATTRIBUTES:
                inspect.getattr_static(core, name)  # never a property's getter: RayCore's tokenizer loads on first use
            assert (core.status, core.ready, core.error) == ("starting", False, None)
            assert callable(core.metrics.text)
        finally:
            core.shutdown()


def test_a_core_missing_a_method_cannot_be_built():
    class Partial(Core):
        @property
        def ready(self) -> bool:
            return False

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def _imports(module: str) -> set[str]:
    path = SRC / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = SRC / module.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {m for m in found if m.startswith("onlinespec") and ((SRC / m.replace(".", "/")).with_suffix(".py").exists()
                                                               or (SRC / m.replace(".", "/") / "__init__.py").exists())}


def test_the_app_imports_the_interface_and_never_a_core():
    """Every module the app imports, directly or through others: the interface, never ServingCore,
    its builder or the Ray front."""
    seen, todo = set(), ["onlinespec.serve.app"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += _imports(module)
    assert "onlinespec.serve.interface" in seen
    assert not {m for m in seen if m in ("onlinespec.serve.core", "onlinespec.serve.builder") or m.startswith("onlinespec.scale")}


def test_the_app_and_its_routers_are_typed_against_the_interface():
    from onlinespec.serve import admin_routes, app, openai_routes, tokenizer_routes

    for function in (app.create_app, app.health_router, openai_routes.openai_router, openai_routes.complete,
                     admin_routes.admin_router, tokenizer_routes.tokenizer_router):
        assert inspect.signature(function).parameters["core"].annotation == "Core", function.__qualname__
