"""Tensor parallelism on a CPU: one engine over two ranks (two processes, real
torch.distributed over gloo), each with half the heads and half the MLP, answers token
for token as the same model on one rank (greedy, float32, batched, chunked prefill)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpu.tensor_parallel import Shard, check_shardable, shard_model
from tests.conftest import run_to_completion
from workers.api import SamplingParams
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.random_models import build_model, model_config
from workers.tensor_parallel import EXIT_GROUP_LOST

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.slow


def engine(tensor_parallel: int, kv_memory_bytes: int = 4 << 20) -> Engine:
    """tiny-llama (4 heads over 2 KV heads) on `tensor_parallel` ranks, `kv_memory_bytes`
    in all (each rank's share of it: as many blocks on every rank count)."""
    return Engine.from_config(
        EngineConfig(
            model=ModelConfig(source="random:tiny-llama", threads=1, tensor_parallel=tensor_parallel),
            cache=CacheConfig(kv_memory_bytes=kv_memory_bytes // tensor_parallel, swap_memory_bytes=4 << 20),
            scheduler=SchedulerConfig(max_batch_tokens=48, max_prefill_chunk=13),
        )
    )


def greedy(engine: Engine, **options) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(3)
    prompts = {f"r{n}": torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (1, 9, 30, 75)}
    params = SamplingParams(max_tokens=16, ignore_eos=True, **options)
    arrivals = {2 * i: [(rid, ids, params)] for i, (rid, ids) in enumerate(prompts.items())}
    return {rid: tokens for rid, (tokens, _, _) in run_to_completion(engine, arrivals).items()}


def stopped(engine: Engine) -> None:
    assert engine.runner.leader is not None
    engine.runner.leader.stop()


def test_two_ranks_answer_token_for_token_as_one():
    one = greedy(engine(1))
    two_ranks = engine(2)
    try:
        assert greedy(two_ranks) == one
        assert all(len(tokens) == 16 for tokens in one.values())
    finally:
        stopped(two_ranks)


def test_short_of_blocks_every_rank_swaps_its_own_share_and_the_tokens_stay_exact():
    """Six blocks in all: requests are swapped out and back (each rank moving its own
    heads' blocks), with speculative decoding on (the default) and logprobs asked for."""
    one_engine = engine(1, kv_memory_bytes=6 * 16 * 2048)
    one = greedy(one_engine, logprobs=True)
    two_ranks = engine(2, kv_memory_bytes=6 * 16 * 2048)
    swapped: list[int] = []
    two_ranks.observer = lambda stats: swapped.append(stats.step.num_swapped_out if stats.step else 0)
    try:
        assert two_ranks.allocator.num_blocks == one_engine.allocator.num_blocks == 6
        assert greedy(two_ranks, logprobs=True) == one
        assert sum(swapped) > 0
    finally:
        stopped(two_ranks)


def test_a_rank_holds_its_share_of_the_heads_the_mlp_and_the_vocabulary():
    model = build_model("tiny-llama", torch.float32, torch.device("cpu"))
    heads, kv_heads, mlp = (model.config.num_attention_heads, model.config.num_key_value_heads,
                            model.config.intermediate_size)  # fmt: skip
    vocab_rows = model.lm_head.weight[512:].clone()
    shard_model(model, Shard(1, 2))
    assert torch.equal(model.lm_head.head.weight, vocab_rows)  # rank 1: the second half of the logits
    attention, layer_mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    head_dim = model.config.head_dim
    assert attention.q_proj.weight.shape[0] == heads // 2 * head_dim
    assert attention.k_proj.weight.shape[0] == kv_heads // 2 * head_dim
    assert layer_mlp.up_proj.weight.shape[0] == layer_mlp.down_proj.linear.weight.shape[1] == mlp // 2
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (heads // 2, kv_heads // 2)


@pytest.mark.parametrize(
    ("name", "world", "says"),
    [
        ("tiny-qwen2", 4, "does not divide the model's 2 attention heads"),
        ("tiny-gemma3", 2, "tensor parallelism covers"),
    ],
)
def test_a_model_the_ranks_cannot_share_is_refused_in_one_line(name, world, says):
    config = model_config(name)
    architecture = (config.architectures or [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"])[0]
    with pytest.raises(ValueError, match=says):
        check_shardable(config, architecture, world)


# A worker's engine over two ranks, in a process of its own: it prints its follower's pid,
# then serves one request per line it reads.
TWO_RANKS = """
import sys
from tests.workers.test_tensor_parallel import engine, greedy
two = engine(2)
print(two.runner.leader.followers[0].pid, flush=True)
for _ in sys.stdin:
    print(len(greedy(two)), flush=True)
"""


def two_ranks() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", TWO_RANKS], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_a_rank_that_dies_takes_the_worker_down_at_its_next_step_with_a_line_and_its_exit_code():
    leader = two_ranks()
    follower = int(leader.stdout.readline())
    os.kill(follower, signal.SIGKILL)
    leader.stdin.write("go\n")
    leader.stdin.flush()
    assert leader.wait(timeout=60) == EXIT_GROUP_LOST
    assert "a tensor-parallel rank is gone" in leader.stderr.read().strip().splitlines()[-1]


def test_a_follower_whose_leader_dies_exits_rather_than_hang():
    leader = two_ranks()
    follower = int(leader.stdout.readline())
    leader.kill()
    leader.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(follower):
        time.sleep(0.1)
    assert not _alive(follower)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) is gone too
        return stat.read().split()[2] != "Z"
