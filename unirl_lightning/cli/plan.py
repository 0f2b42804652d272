"""What ``unirl-lightning plan`` (``PlanCLI`` in :mod:`unirl_lightning.cli.app`) needs around
:func:`unirl_lightning.planning.plan.plan_recipe`: the config as plain data, the cluster of the recipe's header
line, the bundled model shapes, and the printed table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from unirl_lightning.cli.recipes import model_configs_dir


def plain_data(node: Any) -> Any:
    if isinstance(node, Namespace):
        return {key: plain_data(value) for key, value in vars(node).items()}
    if isinstance(node, list | tuple):
        return [plain_data(value) for value in node]
    if isinstance(node, Path):
        return str(node)
    return node if isinstance(node, str | int | float | bool | type(None) | dict) else str(node)


def bundled_model_config(config: dict[str, Any]) -> Path | None:
    """``model_configs/<last part of the policy's name_or_path>`` of the bundled recipes, when it exists."""
    configs = model_configs_dir()
    policy = ((config.get("model") or {}).get("init_args") or {}).get("policy") or {}
    name = (policy.get("init_args") or {}).get("name_or_path")
    folder = configs / str(name).rstrip("/").split("/")[-1] if name and configs is not None else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def format_plan(result: dict[str, Any]) -> str:
    """The plan as a table: findings, then the figures."""
    lines = [f"plan on {result['cluster']}: {'OK' if result['ok'] else 'FAILS'}"]
    for finding in result["findings"]:
        lines.append(f"  {finding['level']:<7} {finding['key']}: {finding['message']}")
    for name, figure in result["figures"].items():
        if isinstance(figure, dict):
            lines.append(f"  {name}:")
            lines += [f"    {key:<24} {value}" for key, value in figure.items()]
        else:
            lines.append(f"  {name:<26} {figure}")
    return "\n".join(lines)
