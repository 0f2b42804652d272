"""AgenticGRPOModule: GRPO on multi-turn episodes with an environment (tools, games), in Lightning.

What it adds to :class:`~unirl_lightning.modules.grpo.GRPOModule` is only what is agentic: the
environment (a class path from YAML, validated by
:func:`~unirl_lightning.envs.resolve_environment`), the turn limit, the tail policy and what an
environment crash does. Its :meth:`rollout_spec` carries them as an
:class:`~unirl_lightning.agentic.loop.AgenticSpec`, so the strategy installs the
:class:`~unirl_lightning.agentic.loop.AgenticRolloutLoop` and the workers play episodes
turn by turn (:mod:`unirl_lightning.envs.coordinator`).

Training is GRPOModule's, unchanged: one episode is one row (its initial observation as the
prompt, every later token as the completion), the group is the ``num_generations`` episodes of one
prompt record, the reward is the episode's return, and the loss is taken only where
``response_mask`` is 1: the model's own tokens (``Rollout.loss_mask``), never the tool or
environment tokens between turns, whose behaviour log-probs are 0. The trainer scores exactly the
token ids the engine sampled. Staleness is counted from the version at which a group *completed*;
``max_turn_staleness`` also bounds the version of its oldest turn (see
:mod:`unirl_lightning.agentic.loop`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from unirl_lightning.agentic.controller import TailPolicy
from unirl_lightning.agentic.loop import AgenticSpec
from unirl_lightning.core.checks import require_at_least, require_choice
from unirl_lightning.core.types import NonNegativeInt, PositiveInt
from unirl_lightning.envs import EnvSpec, OnEnvError, resolve_environment
from unirl_lightning.envs.coordinator import TruncatedTurn
from unirl_lightning.modules.grpo import GRPOModule
from unirl_lightning.modules.spec import RolloutSpec


class AgenticGRPOModule(GRPOModule):
    """GRPO over multi-turn episodes; only model tokens are trained.

    Args:
        env: the environment: a class path ``"pkg.mod:EnvClass"``, or ``{"class_path": ...,
            "init_args": {...}}`` (YAML), or an :class:`~unirl_lightning.envs.EnvSpec`. The
            environment's reward is the reward: there is no ``reward`` argument.
        max_turns: model turns per episode; overrides the environment's ``max_turns`` init
            argument when given.
        tail_policy: what a weight sync does to groups whose episodes it interrupted: ``"carry"``
            (they resume after the sync and finish later) or ``"drop"`` (discarded, counted in
            ``agentic/dropped``).
        on_env_error: an environment that raises: ``"raise"`` stops the run with an
            :class:`~unirl_lightning.envs.EnvStepError` naming the environment and the record;
            ``"drop"`` fails that episode's group (counted in ``agentic/env_errors``) and goes on.
        max_turn_staleness: the most versions an episode's *oldest* turn may lag the current weights
            when its group is drained; older groups are evicted, never trained (counted in
            ``agentic/turn_evicted_groups``). Groups are stamped at completion, so under
            ``tail_policy="carry"`` ``max_staleness`` alone does not bound a carried episode's early
            turns. None (default) = no bound on that clock.
        truncated_turn: a model turn cut at ``max_new_tokens`` in a chat episode (the policy's chat
            template renders the conversation) has no end-of-turn token: ``"close"`` (default)
            appends the template's end of turn, masked out of the loss, before the next
            observation; ``"end"`` ends the episode there with the return the environment paid so
            far. Counted in ``agentic/truncated_turns``. Raw-string episodes (no chat template) are
            left as they are. A module argument, not the environment's: the environment sees text,
            the end of turn is the policy's chat template and the cut is the per-turn token budget.
        max_context_tokens: an episode ends cleanly, with its return so far, before a model turn
            would take its context (prompt + every token so far + ``max_new_tokens``) past this many
            tokens, or past the engine's ``max_model_len`` when the engine has one (counted in
            ``agentic/context_limited``). None (default) = only the engine's limit.
        **kwargs: every :class:`~unirl_lightning.modules.grpo.GRPOModule` argument but ``reward``
            (``policy``, ``num_generations``, sampling: ``max_new_tokens`` is per model turn,
            AdamW, the loss, clipping, KL, ``ppo_epochs``/``mini_batches``, ``micro_batch_tokens``
            (episodes are long rows: the token budget packs them by their own length),
            ``micro_batch_rows``, ``gradient_checkpointing``, ...); not
            ``mask_truncated`` nor ``overlong_buffer``, whose budget is per sequence.

    Example::

        module = AgenticGRPOModule(
            env={"class_path": "unirl_lightning.envs.GuessingGameEnv", "init_args": {"syntax": "compact"}},
            max_turns=4, policy=TinyCausalLM(), num_generations=8, max_new_tokens=1, lr=1e-3)
    """

    def __init__(
        self,
        env: str | dict[str, Any] | EnvSpec,
        max_turns: PositiveInt | None = None,
        tail_policy: TailPolicy = "carry",
        on_env_error: OnEnvError = "raise",
        max_turn_staleness: NonNegativeInt | None = None,
        truncated_turn: TruncatedTurn = "close",
        max_context_tokens: PositiveInt | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("reward") is not None:
            raise ValueError(
                "AgenticGRPOModule takes no reward: the environment scores each episode (its step rewards "
                f"summed); configure the environment's reward instead, got reward={kwargs['reward']!r}"
            )
        if kwargs.get("filter_groups", False):
            raise ValueError(
                "filter_groups is not supported by AgenticGRPOModule: its loop drives episodes turn by turn "
                "with a per-turn staleness bound, not one request per step, so there is no step request to "
                "replace a dropped group with; leave filter_groups off, got filter_groups=True"
            )
        for key, off in (("mask_truncated", False), ("overlong_buffer", 0)):
            if kwargs.get(key, off) != off:
                raise ValueError(
                    f"{key} reads a completion's length against max_new_tokens, which is per model turn in "
                    f"an episode (the turn limit ends episodes): leave it off, got {key}={kwargs[key]!r}"
                )
        max_turn_staleness = _optional_int("max_turn_staleness", max_turn_staleness, 0)
        truncated_turn = require_choice("truncated_turn", truncated_turn, TruncatedTurn)
        max_context_tokens = _optional_int("max_context_tokens", max_context_tokens, 1)
        super().__init__(**kwargs)
        self.reward = None  # the environment's return is the reward
        spec = resolve_environment(env, key="model.env")
        if max_turns is not None:
            spec = resolve_environment(
                EnvSpec(spec.class_path, {**spec.init_args, "max_turns": int(max_turns)}), key="model.env"
            )
        self.env = spec
        self.max_turns = spec.build().max_turns
        self.tail_policy = require_choice("tail_policy", tail_policy, TailPolicy)
        self.on_env_error = require_choice("on_env_error", on_env_error, OnEnvError)
        self.max_turn_staleness = max_turn_staleness
        self.truncated_turn: TruncatedTurn = truncated_turn
        self.max_context_tokens = max_context_tokens

    def rollout_spec(self) -> RolloutSpec:
        agentic = AgenticSpec(
            env=self.env,
            tail_policy=self.tail_policy,
            on_env_error=self.on_env_error,
            max_turn_staleness=self.max_turn_staleness,
            truncated_turn=self.truncated_turn,
            max_context_tokens=self.max_context_tokens,
        )
        return replace(super().rollout_spec(), reward=None, agentic=agentic)

    def eval_sampling(self, temperature: float) -> Any:
        """Held-out episodes (``RolloutEvalCallback``) sample like training (per-turn budget, stop
        strings) at ``temperature``."""
        return replace(self.sampling, temperature=temperature)


def _optional_int(key: str, value: Any, minimum: int) -> int | None:
    """None, or an int ``>= minimum`` (``ValueError`` naming ``key`` otherwise)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be None or an int >= {minimum}, got {value!r}")
    return int(require_at_least(key, value, minimum))
