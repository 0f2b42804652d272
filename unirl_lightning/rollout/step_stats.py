"""The figures every rollout loop logs for one step: rewards, reward parts, waits and per-token
versions, and the zero-variance test of dynamic sampling. Standard library only."""

from __future__ import annotations

from typing import Any

__all__ = ["reward_part_means", "step_stats", "token_version_stats", "zero_variance"]


def zero_variance(group: list[Any]) -> bool:
    """True when every sample of ``group`` has the same reward (no group-relative signal).

    >>> from types import SimpleNamespace as Row
    >>> zero_variance([Row(reward=1.0), Row(reward=1.0)]), zero_variance([Row(reward=1.0), Row(reward=0.0)])
    (True, False)
    """
    return len({rollout.reward for rollout in group}) <= 1


def reward_part_means(rollouts: list[Any], prefix: str = "rollout/reward/") -> dict[str, float]:
    """``{prefix + name + "_mean": mean}`` of every reward function's own score over ``rollouts``
    (their ``reward_parts``; a rollout a function had no opinion on is left out of its mean).

    >>> from types import SimpleNamespace as Row
    >>> reward_part_means([Row(reward_parts={"a": 1.0, "b": 0.0}), Row(reward_parts={"a": 0.0})])
    {'rollout/reward/a_mean': 0.5, 'rollout/reward/b_mean': 0.0}
    """
    sums: dict[str, list[float]] = {}
    for rollout in rollouts:
        for name, value in rollout.reward_parts.items():
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += float(value)
            total[1] += 1.0
    return {f"{prefix}{name}_mean": total / count for name, (total, count) in sums.items()}


def step_stats(
    rewards: list[list[float]], evicted_groups: int, blocked_s: float, generate_s: float
) -> dict[str, float]:
    """The figures every rollout loop logs for one step: the rewards of its groups, the groups evicted
    so far, and how much generation the trainer waited for (``perf/overlap``: 1 = all hidden).

    >>> step_stats([[1.0, 0.0], [1.0, 1.0]], 0, 0.5, 2.0)["perf/overlap"]
    0.75
    """
    flat = [x for group in rewards for x in group]
    mean = sum(flat) / len(flat)
    overlap = 1.0 - min(1.0, blocked_s / generate_s) if generate_s > 0 else 0.0
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((x - mean) ** 2 for x in flat) / max(1, len(flat) - 1)) ** 0.5,
        "rollout/zero_variance_groups": sum(len(set(g)) == 1 for g in rewards) / len(rewards),
        "rollout/evicted_groups": float(evicted_groups),
        "perf/generate_time_s": generate_s,
        "perf/wait_time_s": blocked_s,
        "perf/overlap": overlap,
    }


def token_version_stats(groups: list[list[Any]], weight_version: int, max_staleness: int) -> dict[str, float]:
    """Per-token version figures of the samples a step trains: ``rollout/interrupted_samples`` (samples
    whose tokens span more than one version), ``rollout/token_versions_max_spread`` (the largest
    ``newest - oldest`` token version of one sample) and ``rollout/token_staleness/<k>`` (the fraction
    of the step's tokens ``k`` versions old, ``k = 0..max_staleness``). Raises ``RuntimeError`` for a
    token older than ``max_staleness`` (the controller's eviction makes that impossible).

    >>> from types import SimpleNamespace as Row
    >>> rows = [Row(versions=lambda: [0, 0, 1]), Row(versions=lambda: [1])]
    >>> token_version_stats([rows], 1, 1)["rollout/token_staleness/1"]
    0.5
    """
    counts = [0] * (max_staleness + 1)
    interrupted = spread = 0
    for group in groups:
        for rollout in group:
            versions = rollout.versions() if hasattr(rollout, "versions") else []  # token rollouts only
            if not versions:
                continue
            oldest, newest = min(versions), max(versions)
            if weight_version - oldest > max_staleness:
                raise RuntimeError(
                    f"a sample of gen_id {getattr(rollout, 'gen_id', '?')} holds a token of version {oldest}, "
                    f"{weight_version - oldest} versions old at version {weight_version}: over max_staleness="
                    f"{max_staleness}, it must have been evicted"
                )
            interrupted += newest > oldest
            spread = max(spread, newest - oldest)
            for version in versions:
                counts[weight_version - version] += 1
    total = sum(counts)
    if not total:  # no token rollouts (diffusion)
        return {}
    return {
        "rollout/interrupted_samples": float(interrupted),
        "rollout/token_versions_max_spread": float(spread),
        **{f"rollout/token_staleness/{k}": count / total for k, count in enumerate(counts)},
    }
