"""The driver-side controller modules import no torch and no ray, through the whole package chain.

Checked in a fresh interpreter (this test process may already have torch loaded), so that a heavy
import anywhere on the way in — ``unirl_lightning/__init__.py``, ``unirl_lightning/rollout/__init__.py``
or the modules themselves — is caught.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER_MODULES = [
    "unirl_lightning.rollout.controller",
    "unirl_lightning.rollout.interrupts",
    "unirl_lightning.rollout.loop",
    "unirl_lightning.agentic.controller",
    "unirl_lightning.agentic.loop",
]
HEAVY_PACKAGES = ["torch", "ray"]


def loaded_heavy_packages(module: str) -> list[str]:
    probe = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted(name for name in {HEAVY_PACKAGES!r} if name in sys.modules)))\n"
    )
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, f"importing {module} failed:\n{completed.stderr}"
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", DRIVER_MODULES)
def test_driver_module_imports_neither_torch_nor_ray_in_a_fresh_interpreter(module):
    assert loaded_heavy_packages(module) == []


@pytest.mark.parametrize("module", DRIVER_MODULES)
def test_driver_module_source_imports_only_the_standard_library_and_the_package(module):
    source_path = REPO_ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(source_path.read_text(), filename=str(source_path))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    outside = sorted(
        name for name in imported if name not in sys.stdlib_module_names and name != "unirl_lightning"
    )
    assert outside == [], f"{module} must stay standard-library only, but imports {outside}"
