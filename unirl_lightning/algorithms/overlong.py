"""Overlong completions: DAPO's soft overlong punishment and the rows that hit the token budget.

A completion cut off at the generation budget (``max_new_tokens``) without finishing has a
reward that says little about its answer. DAPO (Yu et al. 2025) either leaves such completions
out of the loss ("overlong filtering": :func:`truncated_completions` gives the rows) or
shapes their reward with a length penalty that ramps up over the last ``buffer`` tokens of the
budget (:func:`overlong_penalty`, added to the reward before the advantages).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per completion.

    With ``L`` the completion length, ``L_max = max_tokens`` and ``B = buffer``: 0 if
    ``L <= L_max - B``, ``(L_max - B - L) / B * factor`` if ``L_max - B < L <= L_max`` (from 0
    down to ``-factor`` at the budget). verl's DAPO reward manager:
    ``exceed_len = valid_response_length - expected_len`` (``expected_len = max_resp_len -
    overlong_buffer_len``); ``overlong_reward = min(-exceed_len / overlong_buffer_len *
    overlong_penalty_factor, 0)``.

    Args:
        lengths: ``[B]`` completion lengths in tokens.
        max_tokens: the generation budget ``L_max``, ``>= 1``.
        buffer: the ramp length ``B``, in ``[0, max_tokens]``; 0 = no penalty.
        factor: the penalty at ``L = L_max``, ``>= 0``.

    Returns:
        ``[B]`` float penalties, ``<= 0``, to add to the rewards.
    """
    if not 0 <= buffer <= max_tokens:
        raise ValueError(f"buffer must be in [0, max_tokens={max_tokens}], got {buffer!r}")
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    exceed = lengths.float() - (max_tokens - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def truncated_completions(
    last_tokens: Tensor, lengths: Tensor, max_tokens: int, stop_ids: Sequence[int]
) -> Tensor:
    """Which completions were cut off by the token budget: ``L >= max_tokens`` and a last token
    that is no stop token.

    The engines keep the stop token (EOS, end of turn) of a completion that hit one, so a
    completion of the full budget that ends in one finished (the engines' ``finish_reason``
    ``"stop"``). A completion ended by a stop *string* exactly at the budget reads as
    truncated (it has no stop token); one ended earlier is shorter than the budget.

    Args:
        last_tokens: ``[B]`` the last completion token of every row.
        lengths: ``[B]`` completion lengths in tokens.
        max_tokens: the generation budget, ``>= 1``.
        stop_ids: the token ids that end a completion.

    Returns:
        ``[B]`` bool, True for a truncated completion.
    """
    stops = torch.tensor(list(stop_ids), dtype=last_tokens.dtype, device=last_tokens.device)
    return (lengths >= max_tokens) & ~torch.isin(last_tokens, stops)
