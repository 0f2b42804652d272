"""The package's import structure: no import cycle (function-local imports included), modules never
import serving engines, callbacks depend on the strategy and never the reverse."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "unirl_lightning"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (``from pkg import sub`` counts as
    importing ``pkg.sub`` when that is a module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
                targets = [t for t in targets if t in modules] or [node.module]
                if len(targets) > 1:  # names that are submodules: not the package itself as well
                    targets = [t for t in targets if t != node.module]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_modules_never_import_serving_engines():
    graph = import_graph()
    offending = {
        m: sorted(t for t in deps if t.startswith("unirl_lightning.engines")) for m, deps in graph.items()
    }
    assert not {m: d for m, d in offending.items() if m.startswith("unirl_lightning.modules") and d}


def strategy_imports() -> set[str]:
    """What the modules of ``unirl_lightning.strategy`` import, together."""
    graph = import_graph()
    return {
        d for m, deps in graph.items() if m.split(".")[:2] == ["unirl_lightning", "strategy"] for d in deps
    }


def test_the_strategy_never_imports_callbacks_or_modules():
    deps = strategy_imports()
    assert "unirl_lightning.strategy.mixin" in import_graph()["unirl_lightning.strategy"]
    assert not [d for d in deps if d.startswith(("unirl_lightning.callbacks", "unirl_lightning.modules"))]


def test_the_strategy_imports_no_agentic_module_and_branches_on_no_family():
    """The strategy is Lightning's hooks, the Ray connection and the sync verb; each family's rollout
    side is its runtime (``unirl_lightning.runtime``), picked by ``runtime_for``."""
    deps = strategy_imports()
    assert not [d for d in deps if "agentic" in d]
    source = "\n".join(p.read_text() for p in sorted((PACKAGE / "strategy").glob("*.py")))
    assert "agentic" not in source and "episodes" not in source
    read = {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}
    assert not read & {"family", "agentic", "order"}, "the strategy reads a family's fields"


def test_the_generic_worker_knows_no_episodes():
    from unirl_lightning.workers.actor import RolloutWorker
    from unirl_lightning.workers.agentic_actor import AgenticRolloutWorker

    generic = {name for name in dir(RolloutWorker) if not name.startswith("__")}
    assert not [name for name in generic if "agentic" in name or "episode" in name]
    assert {"agentic_submit", "agentic_abort", "agentic_evaluate"} <= set(dir(AgenticRolloutWorker))
    assert "episodes" not in import_graph()["unirl_lightning.workers.actor"]


DOC = PACKAGE.parent / "docs" / "architecture.md"


def read_layers(text: str) -> list[tuple[str, ...]]:
    """The floors of docs/architecture.md's table, lowest first: each row ``| n | `a`, `b` | ...``
    gives floor n's entries (``(package)`` is the package itself, the empty entry)."""
    layers: dict[int, tuple[str, ...]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            entries = re.findall(r"`([^`]*)`", cells[1])
            layers[int(cells[0])] = tuple("" if e == "(package)" else e for e in entries)
    assert sorted(layers) == list(range(1, len(layers) + 1)), "the floors must be numbered 1..n"
    return [layers[n] for n in sorted(layers)]


# The package's floors, lowest first (docs/architecture.md). A module's floor is that of the longest
# entry that prefixes its name; it may import its own floor and the ones below.
LAYERS: list[tuple[str, ...]] = read_layers(DOC.read_text())


def test_the_table_has_every_floor_and_the_package_itself():
    assert len(LAYERS) == 17 and "" in LAYERS[-1] and LAYERS[0] == ("core",)
    assert read_layers("| 1 | `a`, `b.c` | x | y |\n| 2 | `d`, `(package)` | x | y |") == [
        ("a", "b.c"),
        ("d", ""),
    ]


def layer_of(module: str) -> int:
    name = module.removeprefix("unirl_lightning").removeprefix(".")
    best, depth = None, -1
    for floor, entries in enumerate(LAYERS, start=1):
        for entry in entries:
            if (name == entry or (entry and name.startswith(entry + "."))) and len(entry) > depth:
                best, depth = floor, len(entry)
    assert best is not None, f"{module} has no floor in LAYERS"
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} (floor {layer_of(m)}) -> {d} (floor {layer_of(d)})"
        for m, deps in graph.items()
        for d in deps
        if layer_of(d) > layer_of(m)
    )


def test_no_import_goes_to_a_higher_floor():
    graph = import_graph()
    assert all(layer_of(m) for m in graph)  # every module has a floor
    assert upward_imports(graph) == []


def test_the_floor_check_flags_the_edges_it_exists_for():
    """The two edges the records split and the adapter-naming move removed: a weight-sync backend
    importing a serving engine, and the environments importing a rollout module above them."""
    graph = {
        "unirl_lightning.weight_sync.object_store": {"unirl_lightning.engines.serving"},
        "unirl_lightning.envs.coordinator": {"unirl_lightning.agentic.loop"},
        "unirl_lightning.engines.vllm": {"unirl_lightning.weight_sync.collective"},
    }
    assert upward_imports(graph) == [
        "unirl_lightning.envs.coordinator (floor 6) -> unirl_lightning.agentic.loop (floor 7)",
        "unirl_lightning.weight_sync.object_store (floor 9) -> unirl_lightning.engines.serving (floor 10)",
    ]


def test_the_records_and_the_coordinator_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import unirl_lightning.rollout.records, unirl_lightning.envs.coordinator, unirl_lightning.core.seeding\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
