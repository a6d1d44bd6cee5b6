"""Log probabilities of sampled tokens: `log_softmax` of the model's logits in float32.

They are taken from the logits as the model made them, before temperature, top-k/top-p
and any constraint's mask: the model's own distribution, whatever the sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def log_probs(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """[len(rows), vocab] float32 log probabilities of those rows."""
    return torch.log_softmax(logits[list(rows)].float(), dim=-1)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], tops: Sequence[int]
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Each row's chosen token's log probability, and its `tops[row]` best (token id,
    log probability) pairs, best first."""
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None])[:, 0].tolist()
    k = max(tops, default=0)
    if not k:
        return [(value, ()) for value in chosen]
    best_values, best_ids = logprobs.topk(k, dim=-1)
    values, ids = best_values.tolist(), best_ids.tolist()
    return [
        (value, tuple(zip(ids[row][:top], values[row][:top]))) for row, (value, top) in enumerate(zip(chosen, tops))
    ]
