"""Imports run one way: a package imports only from its own floor or the floors below it, and no
module imports itself back through others (README, "Architecture"). Inside decoding/ too: what
drafts and what runs the target never import the loop that calls them, the values every part
speaks sit at the bottom, and no two parts import each other. Every import counts, those inside
functions included: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "onlinespec"

# Bottom to top. A unit is a subpackage or a top-level module of onlinespec.
FLOORS = [
    {"cpu", "safety", "tokens", "weights", "metrics", "costmodel", "storage", "backends", "memory"},  # plumbing
    {"decoding"},  # the lossless engine, its runners and drafters
    {"models", "formats", "ggufview", "assemble"},  # loading targets and drafts onto a runner; the target's weight format
    {"data"},  # query sources and streams
    {"distill"},  # losses, the target's signal, offline training
    {"drafts"},  # draft heads: warm-up, bulk, specialisation
    {"routing"},  # which draft serves a request
    {"online"},  # replay buffers, learners, registries, the pool
    {"factory"},  # a decoder or drafter from names and paths
    {"baselines"},  # what the benchmark compares against (HF assisted generation, plain llama.cpp)
    {"serve"},  # the serving core and its HTTP app
    {"scale"},  # Ray replicas and learners
    {"stream", "benchmark"},  # experiments over the above
    {"cli"},
]
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The onlinespec modules ``path`` imports (``from a import b`` counts a.b where b is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("onlinespec")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("onlinespec") and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def graph() -> nx.DiGraph:
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        for target in imports(path):
            if target in modules and target != name:
                g.add_edge(name, target)
    return g


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_floor():
    units = {unit(m) for m in graph()} - {""}
    assert not units - set(FLOOR), f"put these in FLOORS: {sorted(units - set(FLOOR))}"


def test_no_package_imports_from_a_floor_above_it():
    upward = [f"{a} -> {b}" for a, b in graph().edges
              if unit(a) and unit(b) and FLOOR[unit(b)] > FLOOR[unit(a)]]
    assert not upward, "imports that run up:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_circle(level):
    g = graph()
    if level == "package":  # packages: onlinespec.decoding.proposers and onlinespec.decoding are one
        g = nx.DiGraph((unit(a), unit(b)) for a, b in g.edges if unit(a) and unit(b) and unit(a) != unit(b))
    else:  # a package's __init__ re-exports its modules: an edge into it is not a circle
        g = nx.DiGraph((a, b) for a, b in g.edges if not any(b == a.rsplit(".", n)[0] for n in range(1, a.count(".") + 1)))
    circles = list(nx.simple_cycles(g))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in circles[:10])


# ---- inside decoding/: a part is one of its files, or a subpackage (proposers/, runners/) as one ----

DRAFTING = {"proposers", "runners"}  # what drafts, and what runs the target
# the loop, what drives it, and its k decisions (drafters read acceptance.py's statistics, not these)
STEERING = {"engine", "scheduler", "speculative", "autoregressive", "planner", "adaptive"}
GROUND = ["sampling", "proposal", "verify"]  # the bottom of decoding/: each imports, inside it, only those before it


def decoding_part(module: str) -> str | None:
    """The part of decoding/ ``module`` is in; None outside decoding/ (and for its empty ``__init__``)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "decoding" else None


def decoding_edges() -> list[tuple[str, str, str, str]]:
    """(part, part it imports, module, module it imports), for imports between two parts of decoding/."""
    return [(decoding_part(a), decoding_part(b), a, b) for a, b in graph().edges
            if decoding_part(a) and decoding_part(b) and decoding_part(a) != decoding_part(b)]


def test_drafters_and_runners_never_import_the_loop_that_calls_them():
    up = sorted(f"{a} -> {b}" for pa, pb, a, b in decoding_edges() if pa in DRAFTING and pb in STEERING)
    assert not up, "imports from proposers/ or runners/ into the engine's loop or its planning:\n" + "\n".join(up)


def test_the_ground_of_decoding_imports_nothing_above_it():
    parts = {decoding_part(m) for m in graph()}
    assert set(GROUND) <= parts, f"the ground of decoding/ lost a file: {sorted(set(GROUND) - parts)}"
    up = sorted(f"{a} -> {b}" for pa, pb, a, b in decoding_edges() if pa in GROUND and pb not in GROUND[: GROUND.index(pa)])
    assert not up, "imports that run up from the ground of decoding/:\n" + "\n".join(up)


def test_no_import_circle_between_the_parts_of_decoding():
    circles = list(nx.simple_cycles(nx.DiGraph((pa, pb) for pa, pb, _, _ in decoding_edges())))
    assert not circles, "import circles inside decoding/:\n" + "\n".join(" -> ".join(c + c[:1]) for c in circles[:10])
