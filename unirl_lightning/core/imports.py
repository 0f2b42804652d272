"""Importing a user's object by path (standard library only): rewards, data hooks, environments and
the CLI's checks all resolve ``"pkg.mod:attr.sub"``, ``"pkg.mod.attr"`` or ``"path/to/file.py:attr"``
here, and every error names what was being imported (``reward``, ``map_fn``, ``env``...) and the path.

A file path is relative to the working directory; :func:`absolute_file_path` pins it before the path
travels to a worker in another folder. A dotted path without ``:`` tries the longest importable
module prefix first, so ``pkg.mod.Class.method`` works as well as ``pkg.mod:Class.method``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CALLABLE_FORMS", "absolute_file_path", "import_callable", "import_object"]

CALLABLE_FORMS = "'package.module:function' (or 'package.module.function', or 'path/to/file.py:function')"
_WHERE = "importable on the driver and on every rollout worker (installed, or on PYTHONPATH)"


def _candidates(path: str) -> list[tuple[str, str]]:
    """``(module, attribute path)`` pairs to try, the longest module first."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        return [(module_name, attr_path)]
    parts = path.split(".")
    return [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]


def _attribute(where: str, owner: Any, owner_name: str, attr_path: str, forms: str, expected: str) -> Any:
    target = owner
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            naming = f" naming {expected}" if expected else ""
            raise ImportError(
                f"{where}: {owner_name} has no attribute {attr_path!r}; expected {forms}{naming}."
            ) from None
    return target


def _import_file(where: str, file: str) -> Any:
    """The module of the Python file ``file`` (loaded once per process, by its absolute path)."""
    location = Path(file).expanduser().resolve()
    if not location.is_file():
        raise ImportError(f"{where}: there is no file {file!r} (looked at {location}).")
    name = "_unirl_user_file_" + re.sub(r"\W", "_", str(location))
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, location)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException as err:
            del sys.modules[name]
            raise ImportError(f"{where}: importing {file!r} failed: {type(err).__name__}: {err}") from err
    return module


def import_object(
    path: str, what: str = "object", kind: str = "function", forms: str = CALLABLE_FORMS, expected: str = ""
) -> Any:
    """The object at ``path``; errors begin ``{what}={path!r}`` and name the expected ``forms``.

    Raises:
        ValueError: ``path`` is not of an accepted form (``kind`` names the form: "function", "class").
        ImportError: the file or module does not exist, fails to import, or lacks the attribute.
    """
    where = f"{what}={path!r}"
    if not isinstance(path, str):
        raise ValueError(f"{where} is not a {kind} path; expected {forms}.")
    file, sep, attr_path = path.rpartition(":")
    if sep and file.endswith(".py") and attr_path and all(attr_path.split(".")):
        return _attribute(where, _import_file(where, file), f"file {file!r}", attr_path, forms, expected)
    candidates = _candidates(path)
    if not candidates or not all(module and attrs and all(attrs.split(".")) for module, attrs in candidates):
        raise ValueError(f"{where} is not a {kind} path; expected {forms}.")
    missing = []
    for module_name, attr_path in candidates:
        try:
            target = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
                missing.append(module_name)
                continue  # the module itself is missing: try a shorter module prefix
            raise ImportError(f"{where}: importing module {module_name!r} failed: {err}") from err
        except Exception as err:
            raise ImportError(
                f"{where}: importing module {module_name!r} failed: {type(err).__name__}: {err}"
            ) from err
        return _attribute(where, target, f"module {module_name!r}", attr_path, forms, expected)
    raise ImportError(f"{where}: no module named {missing[-1]!r}; expected {forms} {_WHERE}.")


def import_callable(path: str, what: str = "reward") -> Callable:
    """:func:`import_object` of a function (or any callable); ``what`` names it in errors.

    >>> import_callable("os.path:join")("a", "b") == "a/b"
    True
    """
    target = import_object(path, what)
    if not callable(target):
        raise TypeError(f"{what}={path!r} resolves to {target!r}, which is not callable.")
    return target


def absolute_file_path(path: str) -> str:
    """``"dir/file.py:fn"`` with the file made absolute (so a worker in another folder finds it);
    any other path unchanged."""
    file, sep, attr = path.rpartition(":")
    if sep and file.endswith(".py"):
        return f"{Path(file).expanduser().resolve()}:{attr}"
    return path
