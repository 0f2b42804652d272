"""Export a trained policy out of a Lightning checkpoint into the Hugging Face layout.

``unirl-lightning export --config X.yaml --ckpt_path PATH --output DIR [--merge]`` (and the
:class:`~unirl_lightning.callbacks.ExportOnTrainEnd` callback) write what the policy is:

* a causal LM trained in full: a ``transformers`` model directory (``config.json``,
  ``model.safetensors``, ``generation_config.json``) with the tokenizer and its chat template, loadable
  with ``AutoModelForCausalLM.from_pretrained(DIR)`` and servable by vLLM or SGLang as it is;
* a causal LM trained with LoRA: the ``peft`` adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``) plus the tokenizer, loadable with ``PeftModel.from_pretrained(base, DIR)``;
  with ``merge=True`` the adapters are merged into the base weights (``merge_and_unload``) and the
  full model is written as above;
* a Flow-GRPO image model: the diffusers layout, ``DIR/transformer`` (or ``DIR/unet``) written by the
  denoiser's ``save_pretrained`` and ``DIR/scheduler``; with LoRA the peft adapter of the denoiser in
  ``DIR/transformer`` instead, and for an SD3 transformer the same adapter in diffusers' LoRA format,
  ``DIR/pytorch_lora_weights.safetensors`` (``pipe.load_lora_weights(DIR)``); ``merge=True``: the
  merged denoiser. A Stable Diffusion 3 policy
  (:class:`~unirl_lightning.models.diffusion.SD3FlowModel`) is written as its whole pipeline
  (``StableDiffusion3Pipeline.save_pretrained``: text encoders, VAE, trained transformer) when the
  transformer is full or merged.

The checkpoint is a single ``.ckpt`` file or the folder of ``torch.distributed.checkpoint`` shards
that Lightning's ``ModelParallelStrategy`` writes with ``save_distributed_checkpoint=True``; a
folder is read in one process, and only the policy's tensors are read (not the optimizer's).
The output directory is written next to its final place and renamed into it, so a failed export
leaves no half-written model behind.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SHARDED_METADATA = "meta.pt"  # what Lightning writes beside the shards (lightning.fabric.utilities.load)


def has_lora(module: Any) -> bool:
    """Whether ``module``'s policy trains LoRA adapters (a ``peft`` model)."""
    from peft import PeftModel

    return isinstance(module.policy, PeftModel)


def check_output(output: str | os.PathLike, overwrite: bool) -> Path:
    """``output`` as a path; ``FileExistsError`` when it is a non-empty directory (or a file) and
    ``overwrite`` is off."""
    path = Path(output).expanduser()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"output {os.fspath(output)!r} exists and is a file, not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output {os.fspath(output)!r} exists and is not empty; give another directory, or --overwrite "
            "(overwrite=True) to replace it"
        )
    return path


def check_checkpoint_path(ckpt_path: str | os.PathLike) -> Path:
    """``ckpt_path`` as a path; ``FileNotFoundError`` naming it when it is neither a checkpoint file
    nor a sharded checkpoint folder."""
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"ckpt_path {os.fspath(ckpt_path)!r} does not exist (looked at {path.resolve()})"
        )
    if path.is_dir() and not (path / SHARDED_METADATA).is_file():
        raise FileNotFoundError(
            f"ckpt_path {os.fspath(ckpt_path)!r} is a folder but not a sharded Lightning checkpoint (it has no "
            f"{SHARDED_METADATA}); give a .ckpt file or the folder ModelParallelStrategy wrote"
        )
    return path


def check_merge(module: Any, merge: bool) -> None:
    """``ValueError`` for ``merge=True`` on a policy without LoRA adapters."""
    if merge and not has_lora(module):
        raise ValueError(
            "merge: the policy has no LoRA adapters (model.init_args.lora is not set), so its weights are already "
            "the full model; export without --merge"
        )


def load_policy_checkpoint(module: Any, ckpt_path: str | os.PathLike) -> dict[str, Any]:
    """Load the policy weights of a Lightning checkpoint into ``module.policy`` (strictly: every
    tensor of the policy, nothing else under ``policy.``); return the checkpoint's other entries
    (``global_step``, ``epoch``, ...) without the state dict and optimizer states.

    ``ckpt_path`` is a ``.ckpt`` file or a sharded checkpoint folder (read in this process, one
    process, no process group needed). ``FileNotFoundError`` naming it when it is neither;
    ``KeyError`` naming the tensors when the checkpoint's policy is not the configured one.
    """
    path = check_checkpoint_path(ckpt_path)
    template = {f"policy.{name}": tensor for name, tensor in module.policy.state_dict().items()}
    if path.is_dir():
        import torch.distributed.checkpoint as dcp

        state = {"state_dict": dict(template)}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load(state, checkpoint_id=path)
            except Exception as exc:  # noqa: BLE001 - a missing or mis-shaped key: name the checkpoint
                raise KeyError(
                    f"the sharded checkpoint {os.fspath(ckpt_path)!r} does not hold this config's policy: {exc}"
                ) from exc
        weights = state["state_dict"]
        meta = torch.load(path / SHARDED_METADATA, map_location="cpu", weights_only=True)
    else:
        meta = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if "state_dict" not in meta:
            raise KeyError(f"{os.fspath(ckpt_path)!r} is not a Lightning checkpoint (it has no 'state_dict')")
        weights = {name: t for name, t in meta.pop("state_dict").items() if name.startswith("policy.")}
        meta.pop("optimizer_states", None)
    missing = sorted(set(template) - set(weights))
    unexpected = sorted(set(weights) - set(template))
    if missing or unexpected:
        raise KeyError(
            f"the checkpoint {os.fspath(ckpt_path)!r} does not hold this config's policy: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}"
            " (was it written with this config, LoRA settings included?)"
        )
    module.policy.load_state_dict({name.removeprefix("policy."): t for name, t in weights.items()})
    return meta


def export_policy(
    module: Any,
    output: str | os.PathLike,
    merge: bool = False,
    overwrite: bool = False,
    policy: torch.nn.Module | None = None,
) -> Path:
    """Write ``module``'s policy to ``output`` in the Hugging Face layout (see the module docstring);
    returns the directory.

    Args:
        module: an RL module: a causal-LM module (``policy``, ``tokenizer``) or a Flow-GRPO module
            (``policy`` = the denoiser, ``pipeline``).
        output: the directory to write; it must not exist or be empty unless ``overwrite``.
        merge: with a LoRA policy, write the merged full model instead of the adapter.
        overwrite: replace a non-empty ``output``.
        policy: the network to write in place of ``module.policy`` (an unsharded copy of a sharded
            policy); same class and names.

    Raises:
        FileExistsError: ``output`` is not empty and ``overwrite`` is off.
        ValueError: ``merge`` on a policy without LoRA adapters.
    """
    check_merge(module, merge)
    target = check_output(output, overwrite)
    policy = module.policy if policy is None else policy
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary directory
        if hasattr(module, "pipeline"):
            _write_diffusion(module, policy, staging, merge)
        else:
            _write_causal_lm(module, policy, staging, merge)
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported the %s policy to %s", _describe(module, merge), target)
    return target


def _describe(module: Any, merge: bool) -> str:
    if not has_lora(module):
        return "full"
    return "merged LoRA" if merge else "LoRA adapter of the"


def _merged(policy: torch.nn.Module) -> torch.nn.Module:
    """The base model with the LoRA adapters merged in, as a copy (``policy`` is left as it is)."""
    return copy.deepcopy(policy).merge_and_unload()


def _write_causal_lm(module: Any, policy: torch.nn.Module, directory: Path, merge: bool) -> None:
    model = _merged(policy) if merge else policy
    model.save_pretrained(directory, safe_serialization=True)
    module.tokenizer.save_pretrained(directory)  # with its chat template, when it has one


def _write_diffusion(module: Any, policy: torch.nn.Module, directory: Path, merge: bool) -> None:
    pipeline = module.pipeline
    lora = has_lora(module)
    denoiser = _merged(policy) if merge else policy
    pipe = getattr(pipeline, "pipe", None)  # a whole diffusers pipeline (SD3FlowModel)
    if pipe is not None and not (lora and not merge):
        trained = pipe.transformer
        pipe.transformer = denoiser
        try:
            pipe.save_pretrained(directory, safe_serialization=True)
        finally:
            pipe.transformer = trained
        return
    folder = "unet" if pipeline.arch == "unet" else "transformer"
    denoiser.save_pretrained(directory / folder, safe_serialization=True)
    pipeline.scheduler.save_pretrained(directory / "scheduler")
    if lora and not merge and pipeline.arch == "sd3":
        _write_diffusers_lora(denoiser, directory)


def _write_diffusers_lora(denoiser: torch.nn.Module, directory: Path) -> None:
    """The adapter of a peft-wrapped SD3 transformer in diffusers' LoRA format as well
    (``pytorch_lora_weights.safetensors``, with its LoRA config): ``pipe.load_lora_weights(DIR)``, or
    ``transformer.load_lora_adapter(DIR, prefix="transformer", use_safetensors=True)``."""
    from diffusers import StableDiffusion3Pipeline
    from peft import get_peft_model_state_dict

    state = {
        name.removeprefix("base_model.model."): tensor.detach().cpu()
        for name, tensor in get_peft_model_state_dict(denoiser).items()
    }
    StableDiffusion3Pipeline.save_lora_weights(
        directory,
        transformer_lora_layers=state,
        safe_serialization=True,
        transformer_lora_adapter_metadata=denoiser.peft_config["default"].to_dict(),
    )


def export_checkpoint(
    module: Any,
    ckpt_path: str | os.PathLike,
    output: str | os.PathLike,
    merge: bool = False,
    overwrite: bool = False,
) -> Path:
    """Load ``ckpt_path``'s policy into ``module`` (:func:`load_policy_checkpoint`) and export it
    (:func:`export_policy`); the checks come first, so a bad output or ``merge`` fails before the
    checkpoint is read."""
    check_merge(module, merge)
    target = check_output(output, overwrite)
    source = check_checkpoint_path(ckpt_path).resolve()
    if target.exists() and source.is_relative_to(target.resolve()):
        raise FileExistsError(
            f"output {os.fspath(output)!r} holds the checkpoint {os.fspath(ckpt_path)!r}; give another"
        )
    meta = load_policy_checkpoint(module, ckpt_path)
    log.info("loaded the policy of %s (global step %s)", ckpt_path, meta.get("global_step"))
    return export_policy(module, output, merge=merge, overwrite=overwrite)
