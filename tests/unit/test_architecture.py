"""The package's import structure: no import cycle (function-local imports included), modules never
import serving engines, callbacks depend on the strategy and never the reverse."""

from __future__ import annotations

import ast
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


def test_the_strategy_never_imports_callbacks_or_modules():
    deps = import_graph()["unirl_lightning.strategy"]
    assert not [d for d in deps if d.startswith(("unirl_lightning.callbacks", "unirl_lightning.modules"))]


def test_the_strategy_imports_no_agentic_module_and_branches_on_no_family():
    """The strategy is Lightning's hooks, the Ray connection and the sync verb; each family's rollout
    side is its runtime (``unirl_lightning.runtime``), picked by ``runtime_for``."""
    deps = import_graph()["unirl_lightning.strategy"]
    assert not [d for d in deps if "agentic" in d]
    source = (PACKAGE / "strategy.py").read_text()
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
