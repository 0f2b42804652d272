"""Argument checks with one voice: "``key`` must be <rule>, got <value>".

Every user-facing ``__init__`` validates through these helpers, so an error always names the key,
the value seen and what is allowed. Choice arguments are ``typing.Literal`` aliases (LightningCLI
lists them in ``--help`` and rejects other values at parse time); :func:`require_choice` gives
Python callers the same message. Standard library only: the driver-side controller imports it.

Example::

    >>> require_at_least("max_inflight", 0, 1)
    Traceback (most recent call last):
    ...
    ValueError: max_inflight must be >= 1, got 0
"""

from __future__ import annotations

from typing import Any, get_args

__all__ = ["choices_of", "require_at_least", "require_choice", "require_in_range", "require_positive"]


def choices_of(choices: Any) -> tuple[Any, ...]:
    """The allowed values of a ``Literal[...]`` alias, or the tuple itself."""
    args = get_args(choices)
    return tuple(args) if args else tuple(choices)


def require_choice(key: str, value: Any, choices: Any) -> Any:
    """``value`` if it is one of ``choices`` (a ``Literal`` alias or a tuple), else ``ValueError``.

    >>> require_choice("placement", "elsewhere", ("separate", "colocate"))
    Traceback (most recent call last):
    ...
    ValueError: placement must be one of ('separate', 'colocate'), got 'elsewhere'
    """
    allowed = choices_of(choices)
    if value not in allowed:
        raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    return value


def require_at_least(key: str, value: Any, minimum: float) -> Any:
    """``value`` if ``value >= minimum``, else ``ValueError`` naming both."""
    if not value >= minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value!r}")
    return value


def require_positive(key: str, value: Any) -> Any:
    """``value`` if ``value > 0``, else ``ValueError``."""
    if not value > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")
    return value


def require_in_range(
    key: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> Any:
    """``value`` if it lies in the interval ``[low, high]`` (ends open as asked), else ``ValueError``.

    >>> require_in_range("clip_low", 1.0, 0, 1, high_open=True)
    Traceback (most recent call last):
    ...
    ValueError: clip_low must be in [0, 1), got 1.0
    """
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{key} must be in {interval}, got {value!r}")
    return value
