"""Pure tensor RL math: advantages, log-probs, losses, KL estimators, off-policy correction, overlong
completions, flow SDE.

No Lightning, no state: every function takes tensors and returns tensors, and is pinned by
hand-computed tests in ``tests/unit/``. Each set of string choices is a ``typing.Literal`` alias
(for signatures: LightningCLI lists and enforces its values) with its values as a tuple.
"""

from unirl_lightning.algorithms.advantages import (
    GROUP_NORMALIZATIONS,
    GROUP_STDS,
    GroupNormalization,
    GroupStd,
    gae_advantages,
    group_advantages,
    rloo_advantages,
)
from unirl_lightning.algorithms.correction import (
    sequence_masked_importance_weights,
    truncated_importance_weights,
)
from unirl_lightning.algorithms.flow import flow_grpo_kl, gaussian_log_prob, sde_std_dev_t, sde_step
from unirl_lightning.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_penalty
from unirl_lightning.algorithms.logprobs import entropy_from_logits, token_logprobs
from unirl_lightning.algorithms.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    RATIO_LEVELS,
    LossAggregation,
    PolicyLoss,
    RatioLevel,
    aggregate_loss,
    cispo_loss,
    dual_clip,
    gspo_loss,
    masked_mean,
    ppo_clip_loss,
    safe_log_ratio,
    sequence_log_ratio,
)
from unirl_lightning.algorithms.overlong import overlong_penalty, truncated_completions
from unirl_lightning.algorithms.value import (
    clipped_value_loss,
    explained_variance,
    last_token_rewards,
    masked_whiten,
)

__all__ = [
    "GROUP_NORMALIZATIONS",
    "GROUP_STDS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "RATIO_LEVELS",
    "GroupNormalization",
    "GroupStd",
    "KLEstimator",
    "LossAggregation",
    "PolicyLoss",
    "RatioLevel",
    "aggregate_loss",
    "cispo_loss",
    "clipped_value_loss",
    "dual_clip",
    "explained_variance",
    "last_token_rewards",
    "masked_whiten",
    "entropy_from_logits",
    "flow_grpo_kl",
    "gae_advantages",
    "gaussian_log_prob",
    "group_advantages",
    "gspo_loss",
    "kl_penalty",
    "masked_mean",
    "overlong_penalty",
    "ppo_clip_loss",
    "rloo_advantages",
    "safe_log_ratio",
    "sde_std_dev_t",
    "sde_step",
    "sequence_log_ratio",
    "sequence_masked_importance_weights",
    "token_logprobs",
    "truncated_completions",
    "truncated_importance_weights",
]
