"""The benchmark's workload: seeded prompts of random token ids, or ShareGPT first turns
(`bench/sharegpt.py`). Every system must produce exactly `output_len` tokens for each
request (EOS ignored), so throughput compares the same work."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Workload:
    seed: int
    prompt_len: tuple[int, int]  # inclusive range
    output_len: tuple[int, int]  # inclusive range
    requests: list[BenchRequest]
    source: str = "random"  # "random" token ids, or "sharegpt" first turns (bench/sharegpt.py)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> dict:
        """The workload's parameters and totals, for the report (not the token ids)."""
        return {
            "requests": len(self.requests),
            "source": self.source,
            "prompt_len": list(self.prompt_len),
            "output_len": list(self.output_len),
            "seed": self.seed,
            "arrival": "all at t0",
            "total_prompt_tokens": sum(len(r.prompt_ids) for r in self.requests),
            "total_output_tokens": self.total_output_tokens,
        }

    def check_lengths(self, system: str, token_times: dict[str, list[float]]) -> None:
        """Every request got exactly its output length, or `system` did other work than the rest."""
        for r in self.requests:
            got = len(token_times[r.request_id])
            if got != r.output_len:
                raise RuntimeError(f"{system}: {r.request_id} produced {got} tokens, expected {r.output_len}")

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        raw = json.loads(Path(path).read_text())
        raw["requests"] = [BenchRequest(**r) for r in raw["requests"]]
        raw["prompt_len"], raw["output_len"] = tuple(raw["prompt_len"]), tuple(raw["output_len"])
        return cls(**raw)


# The flags (and `prepare` child params) that say which workload to draw: `draw_workload`'s keywords.
WORKLOAD_FLAGS = ("workload", "requests", "prompt_len", "output_len", "sharegpt_max_output", "seed")


def draw_workload(tokenizer, vocab_size: int, workload: str, requests: int, prompt_len, output_len,
                  sharegpt_max_output: int, seed: int) -> Workload:  # fmt: skip
    """`--workload`'s requests: random token ids of the length ranges, or ShareGPT first
    turns (their replies' lengths capped by `sharegpt_max_output`)."""
    if workload == "sharegpt":
        from bench.sharegpt import make_sharegpt_workload

        return make_sharegpt_workload(tokenizer, requests, sharegpt_max_output, seed)
    return make_workload(requests, tuple(prompt_len), tuple(output_len), prompt_vocabulary(tokenizer, vocab_size), seed)


def prompt_vocabulary(tokenizer, vocab_size: int) -> list[int]:
    """Ids a random prompt may use: those both the tokenizer and the model know, but the special ones."""
    return allowed_token_ids(min(len(tokenizer), vocab_size), special_token_ids(tokenizer))


def allowed_token_ids(vocab_size: int, special_ids: set[int]) -> list[int]:
    return [i for i in range(vocab_size) if i not in special_ids]


def special_token_ids(tokenizer) -> set[int]:
    """Every special id: the named ones (bos/eos/pad...) and added tokens flagged special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def make_workload(
    num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], allowed_ids: list[int], seed: int = 0
) -> Workload:
    """Draw `num_requests` requests; lengths uniform in the inclusive ranges."""
    prompt_len, output_len = (prompt_len[0], prompt_len[1]), (output_len[0], output_len[1])
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got {lo} {hi}")
    if num_requests < 1:
        raise ValueError(f"requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.choice(allowed_ids) for _ in range(rng.randint(*prompt_len))]
        requests.append(BenchRequest(f"req-{i}", prompt, rng.randint(*output_len)))
    return Workload(seed, prompt_len, output_len, requests)
