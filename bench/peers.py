"""Transformers' two peers of the engine on the same loaded model: its continuous batching
and `model.generate` on fixed left-padded batches. Each returns `{"token_times": {request_id:
[seconds after t0, one per output token]}, ...}`; all requests arrive at t0, after a warmup."""

from __future__ import annotations

import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList

from bench.drive import kv_bytes
from bench.workload import Workload

# transformers CB takes -1 as "no EOS" (RequestState keeps only ids >= 0).
NO_EOS = -1


def run_hf_continuous(model, workload: Workload, max_batch_tokens: int, kv_memory_bytes: int,
                      threads: int | None = None, allow_block_sharing: bool | None = None) -> dict:  # fmt: skip
    """Transformers' continuous batching, EOS off, each token stamped by the generation thread
    (`record_timestamps`; not streamed: a consumer thread would compete for the GIL).
    `threads`: torch threads for the generation thread. The KV cache gets the engine's byte
    budget (unset, transformers zero-fills 60% of RAM). `allow_block_sharing`: its prefix
    caching (None: its default); `prefix_hit_tokens` counts the prompt tokens it found cached."""
    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    if allow_block_sharing is not None:
        cb_config.allow_block_sharing = allow_block_sharing
    # transformers 5.24 calls it page_size; 5.17 (the GPU host's) calls it block_size.
    tokens_per_block = getattr(cb_config, "page_size", None) or cb_config.block_size
    assert tokens_per_block is not None
    cb_config.num_blocks = max(1, kv_memory_bytes // kv_bytes(model, tokens_per_block))
    # A fresh config: greedy and no logits processors from the model's defaults.
    generation_config = GenerationConfig(
        do_sample=False, eos_token_id=NO_EOS, max_new_tokens=max(r.output_len for r in workload.requests)
    )
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cb_config)
    manager.warmup()  # builds the paged cache now, as the engine does before t0
    if threads is not None:
        torch.set_num_threads(threads)  # for the generation thread, which starts now
    manager.start()
    try:
        warmup = workload.requests[0]
        _cb_generate(manager, {"warmup": (warmup.prompt_ids[:8], 2)})
        with _PrefixHits() as hits:
            t0 = time.perf_counter()
            outputs = _cb_generate(manager, {r.request_id: (r.prompt_ids, r.output_len) for r in workload.requests})
    finally:
        manager.stop(block=True)
        manager.destroy()

    # A token is counted by its timestamp (record_timestamps=True stamps each one).
    token_times = {r.request_id: [t - t0 for t in outputs[r.request_id].timestamps or []] for r in workload.requests}
    workload.check_lengths("hf_continuous", token_times)
    if any(len(outputs[r].generated_tokens) != len(times) for r, times in token_times.items()):
        raise RuntimeError("hf_continuous: a request's tokens and timestamps differ in number")
    return {
        "token_times": token_times,
        "max_batch_tokens": max_batch_tokens,
        "num_blocks": cb_config.num_blocks,
        "tokens_per_block": tokens_per_block,
        "attn_implementation": model.config._attn_implementation,
        "allow_block_sharing": cb_config.allow_block_sharing,
        "prefix_hit_tokens": hits.tokens,
    }


class _PrefixHits:
    """Counts the prompt tokens transformers' CB found cached while open, by wrapping
    `PagedAttentionCache.search_prefix_match` (its cache has no such counter)."""

    def __enter__(self) -> _PrefixHits:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        self.tokens = 0
        self._cls, self._original = PagedAttentionCache, PagedAttentionCache.search_prefix_match

        def counted(cache, request_id, prompt_ids):
            matched = self._original(cache, request_id, prompt_ids)
            self.tokens += matched
            return matched

        PagedAttentionCache.search_prefix_match = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        self._cls.search_prefix_match = self._original  # type: ignore[method-assign]


def _cb_generate(manager, requests: dict[str, tuple[list[int], int]]) -> dict:
    """Submit requests to a running manager and wait for all of them to finish."""
    for request_id, (prompt_ids, output_len) in requests.items():
        manager.add_request(
            prompt_ids, request_id=request_id, max_new_tokens=output_len, record_timestamps=True, eos_token_id=NO_EOS
        )
    finished: dict[str, object] = {}
    while len(finished) < len(requests):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("hf_continuous: the generation thread stopped before all requests finished")
            continue
        if result.error is not None:
            raise RuntimeError(f"hf_continuous: request {result.request_id} failed: {result.error}")
        if result.is_finished():
            finished[result.request_id] = result
    return finished


class StepClock(LogitsProcessor):
    """Records when each generation step's logits are ready: the step's tokens exist then."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def run_hf_static(model, workload: Workload, batch_size: int, pad_token_id: int) -> dict:
    """`model.generate` over batches of `batch_size` requests in arrival order, each batch
    left-padded and generating its longest output length for every row: a request counts its
    own first `output_len` tokens, the rest is waste. A later batch's wait is in its TTFT."""
    warmup = workload.requests[0]
    _generate_batch(model, [warmup.prompt_ids[:8]], 2, pad_token_id)

    token_times, wasted, padding = {}, 0, 0
    t0 = time.perf_counter()
    for start in range(0, len(workload.requests), batch_size):
        batch = workload.requests[start : start + batch_size]
        longest = max(r.output_len for r in batch)
        step_times, width = _generate_batch(model, [r.prompt_ids for r in batch], longest, pad_token_id)
        for request in batch:
            token_times[request.request_id] = [t - t0 for t in step_times[: request.output_len]]
            wasted += longest - request.output_len
            padding += width - len(request.prompt_ids)
    return {
        "token_times": token_times,
        "batch_size": batch_size,
        "wasted_output_tokens": wasted,
        "padding_prompt_tokens": padding,
        "attn_implementation": model.config._attn_implementation,
    }


def _generate_batch(model, prompts: list[list[int]], new_tokens: int, pad_token_id: int) -> tuple[list[float], int]:
    """Greedy generate of exactly `new_tokens` for left-padded prompts: (step times, padded width)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_token_id
    )
    processors = LogitsProcessorList([clock])
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, generation_config=config, logits_processor=processors
    )
    if out.shape[1] - width != new_tokens or len(clock.times) != new_tokens:
        raise RuntimeError(f"hf_static: generated {out.shape[1] - width} tokens, expected {new_tokens}")
    return clock.times, width
