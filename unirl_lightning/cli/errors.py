"""Errors of a wrong config whose last line names the key: a value a class refuses at instantiation
(:func:`config_error`) and jsonargparse's nested parse errors (:func:`summarize_parse_error`, used by
:class:`RLArgumentParser`), with did-you-mean for misspelled keys and class paths."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import re
import traceback
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from unirl_lightning.cli.config import _import_class

SECTIONS = (
    ("unirl_lightning.engines.base", "EngineConfig", "trainer.strategy.init_args.engine.init_args."),
    ("unirl_lightning.strategy", "RolloutStrategyMixin", "trainer.strategy.init_args."),
    ("unirl_lightning.modules.base", "RLModule", "model.init_args."),
    ("lightning.pytorch", "LightningDataModule", "data.init_args."),
    ("lightning.pytorch.callbacks", "Callback", "trainer.callbacks: "),
)
"""Where a class's ``__init__`` arguments sit in a fit config, by base class (most specific first)."""


def config_error(exc: BaseException) -> str | None:
    """The message of the check that refused a value during instantiation, with the config key it sits
    under (``model.init_args.``, ``data.init_args.``, ...), or None when no error of the chain came from
    a class's ``__init__`` in a config section (a bug, not a config value)."""
    chain, seen = [], set()
    pending = [exc]
    while pending:  # jsonargparse chains the error of each Union branch it tried
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        pending += [current.__context__, current.__cause__]
    bases = [(getattr(importlib.import_module(m), c), prefix) for m, c, prefix in SECTIONS]
    for error in chain:
        if not isinstance(error, ValueError | TypeError):
            continue
        for frame, _ in traceback.walk_tb(error.__traceback__):
            owner = frame.f_locals.get("self")
            if frame.f_code.co_name not in ("__init__", "__post_init__") or owner is None:
                continue
            prefix = next((prefix for base, prefix in bases if isinstance(owner, base)), None)
            if prefix is not None:
                text = str(error).splitlines()[0] if str(error) else type(error).__name__
                return _keyed(text, type(owner), prefix)
    # a Union (``trainer.strategy: str | Strategy``) reports its branches' errors in its message only
    message = str(exc)
    named = re.search(r"class_path='([\w.]+)'", message)
    reasons = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
    reasons = [r for r in reasons if not r.startswith("Expected a ")]
    if named and reasons:
        try:
            owner_cls = _import_class(named[1])
        except (ImportError, AttributeError, ValueError):
            return None
        prefix = next((prefix for base, prefix in bases if issubclass(owner_cls, base)), None)
        if prefix is not None:
            return _keyed(reasons[0], owner_cls, prefix)
    return None


def _keyed(text: str, owner: type, prefix: str) -> str:
    """``text`` under the config key of the argument of class ``owner`` it names."""
    if prefix.endswith(": "):
        return f"{prefix}{owner.__name__}: {text}"
    keys = _init_keywords(f"{owner.__module__}.{owner.__qualname__}")
    if text.split(" ", 1)[0] in keys:
        return f"{prefix}{text}"
    named = next((k for k in keys if re.search(rf"\b{re.escape(k)}=", text)), None)
    return f"{prefix}{named}: {text}" if named else f"{prefix.rstrip('.')}: {text}"


def summarize_parse_error(message: str) -> str | None:
    """One line for jsonargparse's nested message: the full key and what was wrong, with the accepted
    keys closest to a misspelled one (``difflib``) and the classes a module offers for an unknown
    ``class_path``; None when the message has no such structure."""
    return _summarize([line.strip() for line in message.splitlines()], "")


def _summarize(lines: list[str], parent: str) -> str | None:
    """:func:`summarize_parse_error` of the message ``lines`` of the key under ``parent`` (a class
    inside a class: an engine config inside the strategy, recursed into)."""
    outer = re.match(r'Parser key "([^"]+)":', lines[0]) if lines else None
    problem = next(
        (i for i, line in enumerate(lines) if line.startswith("- Problem with given class_path")), None
    )
    if outer is None or problem is None or problem + 1 >= len(lines):
        return None
    section = parent + outer[1]
    class_path = re.search(r"class_path '([^']+)'", lines[problem])[1]
    detail = lines[problem + 1]
    inner = re.match(r'Parser key "([^"]+)":', detail)
    if inner:  # a class inside this one (an engine config in the strategy) names the deeper key
        deeper = _summarize(lines[problem + 1 :], f"{section}.init_args.")
        if deeper is not None:
            return deeper
        key = f"{section}.init_args.{inner[1]}"
        reasons = [
            line.lstrip("- ") for line in lines[problem + 2 :] if line and not line.startswith("Given value")
        ]
        literal = next((r for r in reasons if "Literal[" in r), None)
        if literal is not None:
            choices = re.search(r"Literal\[([^\]]*)\]", literal)[1]
            value = next(
                (r.split(": ", 1)[1] for r in reasons if r.startswith("Expected a dot import path")), None
            )
            got = f", got {value!r}" if value else ""
            return (
                f"{key}: expected one of [{choices}] or a class_path{got}" if value else f"{key}: {literal}"
            )
        return f"{key}: {reasons[0] if reasons else 'invalid value'}"
    option = re.match(r"Option '([^']+)' is not accepted", detail)
    if option:
        key = f"{section}.init_args.{option[1]}"
        accepted = _init_keywords(class_path)
        close = difflib.get_close_matches(option[1], accepted, n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"{key}: {class_path.rsplit('.', 1)[-1]} has no setting {option[1]!r}{hint}"
    missing = re.match(r"module '([^']+)' has no attribute '([^']+)'", detail)
    if missing:
        module = importlib.import_module(missing[1])
        names = sorted(n for n in getattr(module, "__all__", dir(module)) if n[:1].isupper())
        close = difflib.get_close_matches(missing[2], names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{section}.class_path: {missing[1]} has no class {missing[2]!r}{hint} Classes there: {', '.join(names)}"
    return f"{section}: {detail}"


def _init_keywords(class_path: str) -> list[str]:
    """The keyword arguments ``class_path``'s ``__init__`` accepts, those its ``**kwargs`` pass to its
    bases included."""
    try:
        cls = _import_class(class_path)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__") or klass.__dict__.get("init_rollout")  # a strategy's **rollout
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        names += [
            p.name
            for p in parameters
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break  # this __init__ forwards nothing to its bases
    return sorted(set(names))


class RLArgumentParser(LightningArgumentParser):
    """Lightning's parser whose error messages end with one line naming the key (:func:`summarize_parse_error`)."""

    def error(self, message: str, *args: Any, **kwargs: Any) -> NoReturn:
        summary = summarize_parse_error(str(message))
        if summary is not None:
            message = f"{message}\n{summary}"
        super().error(message, *args, **kwargs)
