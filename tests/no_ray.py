"""Run a command as ``python tests/no_ray.py -m unirl_lightning.cli.app ...`` (or ``-c CODE``) with ``ray``
unimportable: a meta-path finder refuses ``ray`` and every ``ray.*`` module, as on a machine where Ray
is not installed. At exit it prints ``RAY_IMPORTS=<n>`` on stderr (the refused attempts)."""

from __future__ import annotations

import atexit
import importlib.abc
import runpy
import sys

attempts: list[str] = []


class RayBlocker(importlib.abc.MetaPathFinder):
    """Refuses ``ray`` (as if it were not installed), counting every attempt."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "ray" or fullname.startswith("ray."):
            attempts.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


if __name__ == "__main__":  # only as the script: importing this file (pytest's collection) blocks nothing
    sys.meta_path.insert(0, RayBlocker())
    atexit.register(
        lambda: print(f"RAY_IMPORTS={len(attempts)} {sorted(set(attempts))[:5]}", file=sys.stderr)
    )
    mode, target, *rest = sys.argv[1:]
    sys.argv = [target, *rest]
    if mode == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        exec(compile(target, "<no_ray>", "exec"), {"__name__": "__main__"})
