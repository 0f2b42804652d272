"""Plugging a user's environment in by class path: :class:`EnvSpec` and :func:`resolve_environment`.

Who calls it
    The driver, at config-parse time: ``resolve_environment(config_value, key="env")`` accepts
    a class path ``"my_pkg.envs:MyEnv"`` (or ``"my_pkg.envs.MyEnv"``), a YAML mapping
    ``{"class_path": ..., "init_args": {...}}``, an :class:`EnvSpec` or an :class:`Environment`
    subclass, validates it and returns an :class:`EnvSpec`. The spec is shipped to the rollout
    workers (it pickles as two plain fields: the class travels by name, not by value), where the
    coordinator calls :meth:`EnvSpec.build` once per episode.

What it guarantees
    A spec returned by :func:`resolve_environment` names an importable subclass of
    :class:`~unirl_lightning.envs.base.Environment` defined at module level, its ``init_args`` bind
    to the class's constructor, one instance was built from them, and the spec pickles. The class
    must be importable on the workers too (same package installed, or on ``PYTHONPATH``).

What raises
    ``ValueError`` for a malformed path or mapping and for ``init_args`` the constructor rejects;
    ``ImportError`` for a missing module or attribute; ``TypeError`` for something that is not an
    :class:`Environment` subclass. Every message names the config key and the path, and says what was
    expected.

Example (YAML, e.g. a rollout section of a recipe)::

    env:
      class_path: unirl_lightning.envs.GuessingGameEnv
      init_args: {max_turns: 4, syntax: compact}

This module imports only the standard library and :mod:`unirl_lightning.envs.base`.
"""

from __future__ import annotations

import inspect
import pickle
from dataclasses import dataclass, field
from typing import Any

from unirl_lightning.core.imports import import_object
from unirl_lightning.envs.base import Environment

__all__ = ["EnvSpec", "import_environment_class", "resolve_environment"]

_EXPECTED = "a subclass of unirl_lightning.envs.Environment"
_PATH_FORMS = "'package.module:ClassName' (or 'package.module.ClassName')"


@dataclass(frozen=True)
class EnvSpec:
    """Picklable recipe for building environments: the class by import path and its constructor arguments.

    Args:
        class_path: ``"package.module:ClassName"`` or ``"package.module.ClassName"``.
        init_args: keyword arguments of the class's constructor (plain, picklable data).

    Build specs with :func:`resolve_environment`, which validates them.

    Example::

        spec = resolve_environment("unirl_lightning.envs:GuessingGameEnv", init_args={"max_turns": 4})
        env = spec.build()  # one per episode, inside the worker
    """

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)

    def environment_class(self, key: str = "env") -> type[Environment]:
        """Import and check the class (errors name ``key`` and the path)."""
        return import_environment_class(self.class_path, key)

    def build(self) -> Environment:
        """A new, independent environment: ``EnvironmentClass(**init_args)``."""
        return self.environment_class()(**self.init_args)


def import_environment_class(path: str, key: str = "env") -> type[Environment]:
    """Import the class at ``path`` and check that it subclasses :class:`Environment`.

    Raises:
        ValueError: ``path`` is not of the form ``package.module:ClassName``.
        ImportError: the module does not exist, fails to import, or lacks the attribute.
        TypeError: the attribute is not a class, or not an :class:`Environment` subclass.
    """
    where = f"{key}={path!r}"
    target = import_object(path, key, kind="class", forms=_PATH_FORMS, expected=_EXPECTED)
    if not inspect.isclass(target):
        raise TypeError(f"{where} resolves to {target!r}, which is not a class; expected {_EXPECTED}.")
    if not issubclass(target, Environment):
        raise TypeError(
            f"{where} resolves to class {target.__module__}.{target.__qualname__}, which is not {_EXPECTED}; "
            "subclass Environment and implement on_reset(record) and on_step(assistant_text)."
        )
    return target


def _spec_of(env: Any, init_args: dict[str, Any] | None, key: str) -> EnvSpec:
    if isinstance(env, EnvSpec):
        if init_args is not None:
            raise ValueError(f"{key}: give init_args inside the EnvSpec, not both; got EnvSpec {env!r}.")
        return env
    if isinstance(env, str):
        return EnvSpec(env, dict(init_args or {}))
    if isinstance(env, dict):
        unknown = sorted(set(env) - {"class_path", "init_args"})
        if "class_path" not in env or unknown:
            raise ValueError(
                f"{key}: mapping {env!r} is invalid; expected {{'class_path': {_PATH_FORMS}, 'init_args': "
                f"{{...}}}}" + (f" (unknown keys {unknown})" if unknown else " (class_path is missing)")
            )
        if init_args is not None:
            raise ValueError(f"{key}: give init_args inside the mapping, not both; got {env!r}.")
        nested = env.get("init_args") or {}
        if not isinstance(nested, dict):
            raise ValueError(
                f"{key}.init_args={nested!r} is invalid; expected a mapping of constructor arguments."
            )
        return EnvSpec(env["class_path"], dict(nested))
    if inspect.isclass(env):
        if not issubclass(env, Environment):
            raise TypeError(f"{key}: class {env.__module__}.{env.__qualname__} is not {_EXPECTED}.")
        if "<locals>" in env.__qualname__:
            raise ValueError(
                f"{key}: class {env.__qualname__} is defined inside a function; define it at module level so "
                "the rollout workers can import it by path."
            )
        return EnvSpec(f"{env.__module__}:{env.__qualname__}", dict(init_args or {}))
    if isinstance(env, Environment):
        raise TypeError(
            f"{key}: got an Environment instance {env!r}; pass its class (or a class path / EnvSpec) with "
            "init_args: the worker builds one environment per episode."
        )
    raise TypeError(
        f"{key}={env!r} is invalid; expected a class path {_PATH_FORMS}, a mapping "
        "{'class_path', 'init_args'}, an EnvSpec or an Environment subclass."
    )


def resolve_environment(
    env: str | dict[str, Any] | EnvSpec | type[Environment],
    init_args: dict[str, Any] | None = None,
    key: str = "env",
) -> EnvSpec:
    """Validate an environment config value and return its picklable :class:`EnvSpec`.

    Args:
        env: a class path, a ``{"class_path", "init_args"}`` mapping, an :class:`EnvSpec` or an
            :class:`Environment` subclass (defined at module level).
        init_args: constructor arguments, with a class path or a class only.
        key: the config key, named in every error (e.g. ``"model.env"``).

    Checks, in order: the class imports and subclasses :class:`Environment`; ``init_args`` is a
    mapping with string keys that binds to the constructor; the constructor accepts it (one instance
    is built and discarded); the spec pickles. See the module docstring for the errors.

    Example::

        >>> resolve_environment("unirl_lightning.envs:GuessingGameEnv", {"max_turns": 4})
        EnvSpec(class_path='unirl_lightning.envs:GuessingGameEnv', init_args={'max_turns': 4})
    """
    spec = _spec_of(env, init_args, key)
    if not isinstance(spec.init_args, dict) or not all(isinstance(name, str) for name in spec.init_args):
        raise ValueError(f"{key}.init_args={spec.init_args!r} is invalid; expected a mapping with str keys.")
    cls = spec.environment_class(key)
    where = f"{key}={spec.class_path!r}"
    try:
        inspect.signature(cls).bind(**spec.init_args)
    except TypeError as err:
        parameters = [name for name in inspect.signature(cls).parameters if name not in ("args", "kwargs")]
        raise ValueError(
            f"{where}: init_args {sorted(spec.init_args)} do not fit {cls.__name__}({', '.join(parameters)}): {err}."
        ) from err
    try:
        spec.build()
    except Exception as err:
        raise ValueError(
            f"{where}: {cls.__name__}(**{spec.init_args!r}) raised {type(err).__name__}: {err}"
        ) from err
    try:
        pickle.dumps(spec)
    except Exception as err:
        raise ValueError(
            f"{where}: init_args {spec.init_args!r} do not pickle ({type(err).__name__}: {err}); the spec is "
            "shipped to the rollout workers, so use plain data (numbers, strings, lists, dicts)."
        ) from err
    return spec
