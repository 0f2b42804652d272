"""The wheel ships the repository's ``examples/`` (the recipes, their model shapes and data) as the
package's ``recipes/`` folder, so ``unirl-lightning demo`` and ``--config NAME`` work outside a
checkout. Everything else is in ``pyproject.toml``."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithRecipes(build_py):
    def run(self):
        super().run()
        source = Path(__file__).resolve().parent / "examples"
        if source.is_dir() and not self.editable_mode:  # an editable install reads examples/ in place
            target = Path(self.build_lib) / "unirl_lightning" / "recipes"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithRecipes})
