"""Pure tensor RL math: advantages, log-probs, losses, KL estimators, off-policy correction, flow SDE.

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
from unirl_lightning.algorithms.correction import truncated_importance_weights
from unirl_lightning.algorithms.flow import flow_grpo_kl, gaussian_log_prob, sde_std_dev_t, sde_step
from unirl_lightning.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_penalty
from unirl_lightning.algorithms.logprobs import entropy_from_logits, token_logprobs
from unirl_lightning.algorithms.losses import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    gspo_loss,
    masked_mean,
    ppo_clip_loss,
)
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
    "GroupNormalization",
    "GroupStd",
    "KLEstimator",
    "LossAggregation",
    "aggregate_loss",
    "clipped_value_loss",
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
    "ppo_clip_loss",
    "rloo_advantages",
    "sde_std_dev_t",
    "sde_step",
    "token_logprobs",
    "truncated_importance_weights",
]
