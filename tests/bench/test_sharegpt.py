"""The bench's real-text workload (`bench/sharegpt.py`): ShareGPT V3's first turns,
read up to the packaged file's cut, chat-templated and filtered as vLLM's benchmark does."""

from __future__ import annotations

from bench.sharegpt import (
    MAX_PROMPT_TOKENS,
    MAX_TOTAL_TOKENS,
    MIN_TOKENS,
    conversations,
    first_turns,
    make_sharegpt_workload,
)
from bench.workload import Workload


def test_the_packaged_file_is_read_whole_up_to_its_cut():
    assert sum(1 for _ in conversations()) == 17_671


def test_requests_are_chat_templated_first_turns_within_the_filters(smollm2):
    tokenizer = smollm2.tokenizer
    workload = make_sharegpt_workload(tokenizer, 32, max_output_len=128, seed=3)
    assert workload.source == "sharegpt" and len(workload.requests) == 32
    replies = dict(first_turns())
    for request in workload.requests:
        text = tokenizer.decode(request.prompt_ids)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        assert MIN_TOKENS <= len(request.prompt_ids) <= MAX_PROMPT_TOKENS
        assert MIN_TOKENS <= request.output_len <= 128
        assert len(request.prompt_ids) + request.output_len <= MAX_TOTAL_TOKENS
    assert len(replies) > 10_000
    assert max(r.output_len for r in workload.requests) == 128  # long replies are capped


def test_the_seed_picks_the_sample_and_it_survives_a_save(smollm2, tmp_path):
    first = make_sharegpt_workload(smollm2.tokenizer, 8, 256, seed=0)
    again = make_sharegpt_workload(smollm2.tokenizer, 8, 256, seed=0)
    other = make_sharegpt_workload(smollm2.tokenizer, 8, 256, seed=1)
    assert first == again and first.requests != other.requests
    first.save(tmp_path / "w.json")
    assert Workload.load(tmp_path / "w.json") == first
