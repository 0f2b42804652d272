"""The restricted integer types of the public signatures, for LightningCLI / jsonargparse.

With jsonargparse installed (a dependency of the package: the CLI) a bad YAML value fails at parse time
naming the key. Without it (a machine with torch alone, e.g. to run ``python -m benchmarks.gpu.gpu_smoke``) they
are plain ``int`` and the library still imports; the constructors check their values themselves.
"""

from __future__ import annotations

try:
    from jsonargparse.typing import NonNegativeInt, PositiveInt
except ImportError:  # pragma: no cover - exercised where jsonargparse is absent
    NonNegativeInt = PositiveInt = int  # type: ignore[misc]

__all__ = ["NonNegativeInt", "PositiveInt"]
