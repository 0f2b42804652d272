"""Pure tensor RL math: advantages, log-probs, losses, KL estimators, off-policy correction, flow SDE.

No Lightning, no state: every function takes tensors and returns tensors, and is pinned by
hand-computed tests in ``tests/unit/``.
"""

from unirl_lightning.algorithms.advantages import gae_advantages, group_advantages, rloo_advantages
from unirl_lightning.algorithms.correction import truncated_importance_weights
from unirl_lightning.algorithms.flow import gaussian_log_prob, sde_step
from unirl_lightning.algorithms.kl import kl_penalty
from unirl_lightning.algorithms.logprobs import entropy_from_logits, token_logprobs
from unirl_lightning.algorithms.losses import aggregate_loss, gspo_loss, masked_mean, ppo_clip_loss
from unirl_lightning.algorithms.value import (
    clipped_value_loss,
    explained_variance,
    last_token_rewards,
    masked_whiten,
)

__all__ = [
    "aggregate_loss",
    "clipped_value_loss",
    "explained_variance",
    "last_token_rewards",
    "masked_whiten",
    "entropy_from_logits",
    "gae_advantages",
    "gaussian_log_prob",
    "group_advantages",
    "gspo_loss",
    "kl_penalty",
    "masked_mean",
    "ppo_clip_loss",
    "rloo_advantages",
    "sde_step",
    "token_logprobs",
    "truncated_importance_weights",
]
