"""The bundled recipes (``examples/`` of the repository, shipped in the wheel as
``unirl_lightning/recipes``) and the model shapes ``plan`` reads, reachable by name:
``unirl-lightning plan --config grpo_qwen2.5_7b_fsdp_vllm`` and ``unirl-lightning recipes``.

One source of truth: the repository's ``examples/`` folder. A checkout (or an editable install) reads
it in place; building the wheel copies it into the package (``setup.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "header_cluster",
    "model_configs_dir",
    "recipe_names",
    "recipes_dir",
    "resolve_config_names",
    "summary",
]

_PACKAGE = Path(__file__).resolve().parents[1]


def header_cluster(files: list[str]) -> str | None:
    """The ``# cluster: X`` line at the top of the last config file, or None."""
    for path in reversed(files):
        for line in Path(path).read_text().splitlines():
            if not line.startswith("#"):
                break
            if line.lower().startswith("# cluster:"):
                return line.split(":", 1)[1].strip()
    return None


def recipes_dir() -> Path | None:
    """The folder of the bundled recipes: the package's ``recipes/`` (installed from a wheel), else the
    checkout's ``examples/`` beside the package; None when neither exists."""
    for folder in (_PACKAGE / "recipes", _PACKAGE.parent / "examples"):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    return None


def model_configs_dir() -> Path | None:
    """``model_configs/`` of the bundled recipes: the ``config.json`` of each model a recipe names."""
    folder = recipes_dir()
    return folder / "model_configs" if folder is not None else None


def recipe_names() -> list[str]:
    """The bundled recipes' names (file names without ``.yaml``), sorted."""
    folder = recipes_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder is not None else []


def _bundled(value: str) -> str:
    """``value`` itself when it is a file (or not a bare recipe name), else the bundled recipe it names."""
    if Path(value).exists() or "/" in value or "\\" in value:
        return value
    folder = recipes_dir()
    name = value[: -len(".yaml")] if value.endswith(".yaml") else value
    if folder is not None and (folder / f"{name}.yaml").is_file():
        return str(folder / f"{name}.yaml")
    return value


def resolve_config_names(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--config NAME`` (or ``--config=NAME``) that is not a file but names a
    bundled recipe replaced by that recipe's path; everything else unchanged (a wrong path still
    fails where LightningCLI reads it, naming it)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _bundled(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + _bundled(arg.split("=", 1)[1])
    return out


def summary(path: Path) -> str:
    """A recipe's first comment line after its ``# cluster:`` header (what it runs), or ''."""
    for line in path.read_text().splitlines()[:12]:
        text = line.lstrip("# ").strip()
        if (
            line.startswith("#")
            and text
            and not text.lower().startswith(("cluster:", "unirl-lightning", "make "))
        ):
            return text
    return ""


def print_recipes() -> None:
    """``unirl-lightning recipes``: every bundled recipe, its cluster and what it runs."""
    folder = recipes_dir()
    if folder is None:
        print("no bundled recipes found (a broken install: reinstall unirl-lightning)")
        return
    print(f"bundled recipes ({folder}); run one by name: unirl-lightning fit --config NAME\n")
    for name in recipe_names():
        path = folder / f"{name}.yaml"
        cluster = header_cluster([str(path)]) or "?"
        print(f"  {name:<32} {cluster:<8} {summary(path)}")
