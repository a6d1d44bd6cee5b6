"""Pick each request's next token from one step's logits: greedy, or temperature with top-k and top-p."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from gpu.cpu.fusions import row_argmax
from workers.api import SamplingParams

# How many of the best tokens to rank when looking for a top-p nucleus; rows whose nucleus
# is wider sort their whole vocabulary instead. Ranking a few candidates is much cheaper
# than sorting the whole vocabulary on CPU (see docs/benchmarks.md).
_NUCLEUS_CANDIDATES = 256


def make_generator(seed: int | None) -> torch.Generator | None:
    """A request's own CPU generator, created once and passed back every step; None without a seed."""
    if seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # Rows without a seed of their own all draw from this generator.
        self._shared_generator = torch.Generator(device="cpu")
        if seed is None:
            self._shared_generator.seed()
        else:
            self._shared_generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """One token per row of `logits` [N, vocab]; row i follows params[i] and draws from generators[i]."""
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators")
        # Every step of a greedy batch ends here: one argmax, one copy to the host.
        tokens = self.argmax(logits)
        if all(p.greedy for p in params):
            return tokens

        vocab_size = logits.shape[-1]
        groups: dict[tuple[int | str, int | None], list[int]] = defaultdict(list)
        for row, (p, generator) in enumerate(zip(params, generators)):
            if not p.greedy:
                # A seeded row is sampled on its own, so neither its float math nor its
                # draws depend on which other rows share the batch.
                alone = row if generator is not None else None
                groups[_candidate_rule(p, vocab_size), alone].append(row)

        for (rule, alone), rows in groups.items():
            generator = (generators[alone] if alone is not None else None) or self._shared_generator
            group_params = [params[row] for row in rows]
            chosen = _sample_group(logits[rows], group_params, rule, generator)
            for row, token in zip(rows, chosen.tolist()):
                tokens[row] = token
        return tokens

    @staticmethod
    def argmax(logits: torch.Tensor) -> list[int]:
        """The greedy token of each row (the first of tied maxima, as `argmax` picks):
        on a CPU our one-pass kernel, elsewhere torch's `max` over the last dimension,
        which runs faster than its `argmax` with the same indices."""
        return row_argmax(logits)


def _candidate_rule(params: SamplingParams, vocab_size: int) -> int | str:
    """Which tokens a row samples among; rows with the same rule are sampled together."""
    if 0 < params.top_k < vocab_size:
        return params.top_k  # the k best, then a nucleus among them if top_p < 1
    if params.top_p < 1.0:
        return "nucleus"  # the nucleus of the whole vocabulary
    return "all"


def _sample_group(
    logits: torch.Tensor, params: list[SamplingParams], rule: int | str, generator: torch.Generator
) -> torch.Tensor:
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits.float() / temperature[:, None]
    if rule == "all":
        return _draw((scaled - scaled.amax(dim=-1, keepdim=True)).exp(), None, generator)
    # top_p = 1 must keep everything, even when float sums fall a hair short of the total.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=logits.device)
    if rule == "nucleus":
        return _sample_nucleus(scaled, top_p, generator)
    # Top-k on the raw logits: dividing by the temperature first can flush tiny values to
    # zero and tie them with tokens outside the k best. The distribution is renormalized over these.
    values, token_ids = logits.float().topk(int(rule), dim=-1)
    return _draw(_nucleus_weights(values / temperature[:, None], top_p), token_ids, generator)


def _sample_nucleus(scaled: torch.Tensor, top_p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Top-p over the whole vocabulary, ranking only the best few tokens where they hold the nucleus."""
    best = scaled.amax(dim=-1, keepdim=True)
    total = (scaled - best).exp().sum(dim=-1, keepdim=True)
    values, token_ids = scaled.topk(min(_NUCLEUS_CANDIDATES, scaled.shape[-1]), dim=-1)
    weights = _nucleus_weights(values, top_p, total)
    # The last candidate dropped out, so the nucleus ended among the candidates (or all the
    # rest weighs nothing): sampling among them is exact.
    covered = (weights[:, -1] == 0).cpu()
    if covered.all():
        return _draw(weights, token_ids, generator)

    wide = ~covered
    tokens = torch.empty(len(scaled), dtype=torch.long)
    if covered.any():
        tokens[covered] = _draw(weights[covered], token_ids[covered], generator)
    ranked, ranked_ids = scaled[wide].sort(dim=-1, descending=True, stable=True)
    tokens[wide] = _draw(_nucleus_weights(ranked, top_p[wide], total[wide]), ranked_ids, generator)
    return tokens


def _nucleus_weights(ranked: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalized probabilities of `ranked` (best first), zero past each row's top-p nucleus.

    `total` is the weight of the whole distribution when `ranked` holds only part of it.
    A token stays while the mass ranked above it is short of top_p: the smallest set that
    reaches top_p, and always the best token.
    """
    weights = (ranked - ranked[:, :1]).exp()
    cumulative = weights.cumsum(dim=-1)
    if total is None:
        total = cumulative[:, -1:]
    return weights.masked_fill(cumulative - weights >= top_p[:, None] * total, 0.0)


def _draw(weights: torch.Tensor, token_ids: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    """One draw per row, proportional to `weights`; the token ids of the drawn columns, on the CPU.

    Each row's cumulative weights are inverted at one uniform number: one random number a
    row, where `torch.multinomial` draws one per column (most of a sampled step's time on
    a whole vocabulary). Float32 sums shift each token's probability by far less than the
    float32 softmax already does.
    """
    weights = weights.cpu().float()  # the generators live on the CPU, so the draw does too
    cumulative = weights.cumsum(dim=-1)
    targets = torch.rand(len(weights), 1, generator=generator) * cumulative[:, -1:]
    columns = torch.searchsorted(cumulative, targets, right=True).clamp_(max=weights.shape[1] - 1)
    # A target that rounded up to the row's total lands past its last token with weight.
    past_the_end = weights.gather(1, columns).squeeze(1) == 0
    if past_the_end.any():
        columns[past_the_end, 0] = (weights[past_the_end] > 0).cumsum(dim=-1).argmax(dim=-1)
    if token_ids is None:
        return columns.squeeze(1)
    return token_ids.cpu().gather(1, columns).squeeze(1)
