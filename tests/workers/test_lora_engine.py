"""Multi-LoRA through the engine (`LoRAConfig`, `GenerationRequest.adapter`): requests of
four PEFT adapters and of none, batched, each getting exactly the greedy tokens of PEFT's
merged model for its adapter (the base model for none).

A tiny random checkpoint is saved as a user's would be (tests/workers/test_architectures.py),
with four random adapters of ranks 8 to 64 in a `lora_dir` (tests/gpu/test_lora.py makes
them); the references are greedy continuations computed by the merged models, one request
at a time, without a KV cache. The model side itself (deltas, slots, fused projections) is
tests/gpu/test_lora.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.drive import Driver
from gpu.attention import PagedBatch
from gpu.lora import BadAdapter
from gpu.prepare import BaseStepsOnly
from tests.gpu.test_lora import ATTENTION, MLP, save_adapter
from tests.workers.test_architectures import VOCAB, save_tiny_model
from workers.api import ErrorCode, FinishReason, SamplingParams
from workers.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.model_loader import load_model
from workers.plan import StepPlan
from workers.random_models import build_tokenizer

# name: (rank, targets); the ranks the issue asks for, over different projections.
ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"]),
    "r16": (16, ATTENTION + MLP),
    "r32": (32, MLP),
    "r64": (64, ["k_proj", "o_proj", "up_proj"]),
}
NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: a second torch thread costs more than it saves on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Checkpoint:
    """A saved tiny model, its adapters' folder, and the models the references come from."""

    folder: Path
    lora_dir: Path
    models: dict[str | None, nn.Module]  # by adapter; None: the base model
    references: dict[tuple[str | None, tuple[int, ...]], list[int]]

    def reference(self, adapter: str | None, prompt: Sequence[int]) -> list[int]:
        """The greedy tokens after `prompt` of the merged model for `adapter`, with no KV cache."""
        key = (adapter, tuple(prompt))
        if key not in self.references:
            ids = torch.tensor([list(prompt)])
            with torch.inference_mode():
                for _ in range(NEW_TOKENS):
                    following = self.models[adapter](ids).logits[:, -1].argmax(-1, keepdim=True)
                    ids = torch.cat([ids, following], dim=1)
            self.references[key] = ids[0, len(prompt) :].tolist()
        return self.references[key]


def checkpoint(arch: str, folder: Path) -> Checkpoint:
    model_dir = save_tiny_model(arch, folder / "model", build_tokenizer(VOCAB))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    models: dict[str | None, nn.Module] = {None: base}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        models[name] = save_adapter(base, folder / "adapters" / name, rank, targets, seed)
    return Checkpoint(model_dir, folder / "adapters", models, {})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Checkpoint:
    return checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Checkpoint:
    return checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def make_engine(ckpt: Checkpoint, lora_dir: Path | None = None, **lora) -> Engine:
    """Steps of 32 tokens at most, prompts in chunks of 11."""
    loaded = load_model(ModelConfig(source=str(ckpt.folder), device="cpu"))
    return Engine(
        loaded,
        EngineConfig(
            cache=CacheConfig(kv_memory_bytes=4 << 20, swap_memory_bytes=0),
            scheduler=SchedulerConfig(max_batch_tokens=32, max_prefill_chunk=11),
            lora=LoRAConfig(lora_dir=lora_dir or ckpt.lora_dir, **lora),
        ),
    )


def prompts(*lengths: int, seed: int = 1) -> Iterator[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    for length in lengths:
        yield torch.randint(3, VOCAB, (length,), generator=generator).tolist()


# (request id, prompt, adapter) of each request, by the step it arrives before.
Arrivals = dict[int, list[tuple[str, list[int], str | None]]]


def serve(engine: Engine, arrivals: Arrivals, params: SamplingParams = PARAMS, max_steps: int = 2000) -> Driver:
    driver = Driver(engine, raise_errors=False)
    pending = dict(arrivals)
    while pending or engine.has_unfinished():
        for request_id, prompt, adapter in pending.pop(driver.num_steps, []):
            driver.submit(request_id, prompt, params, adapter=adapter)
        driver.step()
        assert driver.num_steps < max_steps
    return driver


def record_plans(engine: Engine) -> list[StepPlan]:
    """Every plan the scheduler makes from now on."""
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule

    def recorded() -> StepPlan:
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    return plans


def step_adapters(plan: StepPlan) -> list[str | None]:
    return [chunk.adapter for chunk in plan.chunks]


def mixed_arrivals() -> Arrivals:
    """Each adapter's requests and the base model's, some together, some two steps apart;
    one prompt under the base model and two adapters."""
    shared, *others = prompts(13, 24, 5, 30, 9, 20, 17, 28)
    return {
        0: [("base-a", shared, None), ("r8-a", shared, "r8"), ("r16-a", others[0], "r16"),
            ("r32-a", others[1], "r32"), ("r64-a", others[2], "r64")],
        2: [("r8-b", others[3], "r8"), ("base-b", others[4], None)],
        4: [("r64-b", others[5], "r64"), ("r16-b", shared, "r16")],
        6: [("r32-b", others[6], "r32")],
    }  # fmt: skip


def expected_tokens(ckpt: Checkpoint, arrivals: Arrivals) -> dict[str, list[int]]:
    return {rid: ckpt.reference(adapter, prompt) for jobs in arrivals.values() for rid, prompt, adapter in jobs}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_mixed_batch_gets_each_adapters_merged_model_tokens(arch, request):
    ckpt = request.getfixturevalue(arch)
    engine = make_engine(ckpt)
    assert (engine.runner.lean is not None) == (arch == "llama")  # the lean forward, and transformers' own
    assert engine.adapters == sorted(ADAPTERS)
    plans = record_plans(engine)
    arrivals = mixed_arrivals()
    want = expected_tokens(ckpt, arrivals)
    # The adapters change the tokens: served on the base model, these would fail.
    assert len({tuple(want[rid]) for rid in ("base-a", "r8-a", "r16-b")}) == 3

    driver = serve(engine, arrivals)

    assert {rid: driver.tokens[rid] for rid in want} == want
    assert all(final.finish_reason is FinishReason.LENGTH for final in driver.finals.values())
    # Steps mixed adapters and the base model, each adapter's chunks together.
    assert max(len(set(step_adapters(plan))) for plan in plans) >= 3
    for plan in plans:
        runs = [adapter for adapter, _ in itertools.groupby(step_adapters(plan))]
        assert len(runs) == len(set(runs)), runs
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_parallel_choices_and_drafts_run_under_their_adapter(llama):
    """n = 2 forks from the lead under its adapter; drafts are verified by the adapter's
    model (a proposer that drafts the base model's tokens, wrong under the adapter, and
    the adapter's own, right)."""
    engine = make_engine(llama)
    first, second = prompts(12, 7, seed=3)
    guesses = {tuple(first): llama.reference(None, first), tuple(second): llama.reference("r16", second)}

    class Guess:
        def propose(self, histories, lengths):
            proposals = []
            for history, length in zip(histories, lengths):
                tokens = history.tokens
                prompt = next(p for p in guesses if tuple(tokens[: len(p)]) == p)
                proposals.append(guesses[prompt][len(tokens) - len(prompt) :][:length])
            return proposals

    assert engine.scheduler.drafts is not None
    engine.scheduler.drafts.proposer = Guess()
    plans = record_plans(engine)
    driver = Driver(engine, raise_errors=False)
    driver.submit("forked", first, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, n=2), adapter="r32")
    driver.submit("drafted", second, PARAMS, adapter="r16")
    driver.run_until(lambda: not engine.has_unfinished(), 500)

    assert driver.choice_tokens["forked"] == {0: llama.reference("r32", first), 1: llama.reference("r32", first)}
    assert driver.tokens["drafted"] == llama.reference("r16", second)
    drafted = {chunk.adapter for plan in plans for chunk in plan.chunks if chunk.drafts}
    assert drafted == {"r16", "r32"}


def test_at_most_max_loras_adapters_a_step_and_every_request_completes(llama):
    engine = make_engine(llama, max_loras=2, max_host_loras=3)  # one adapter is read again from its folder
    plans = record_plans(engine)
    arrivals = mixed_arrivals()
    want = expected_tokens(llama, arrivals)

    driver = serve(engine, arrivals)

    assert {rid: driver.tokens[rid] for rid in want} == want
    per_step = [set(step_adapters(plan)) - {None} for plan in plans]
    assert max(map(len, per_step)) == 2
    assert set().union(*per_step) == set(ADAPTERS)
    assert len(engine.runner.lora.resident) == 2 and len(engine.runner.lora.adapters) == 3


def test_a_request_waiting_for_an_adapter_slot_keeps_its_place(llama):
    """With one slot: r8's request waits at the head while r16's runs, and the base
    request queued behind it waits too (the queue is strict); r8's starts as soon as
    r16's ends, before a later r16 request."""
    engine = make_engine(llama, max_loras=1)
    plans = record_plans(engine)
    a, b, c, d = prompts(6, 6, 6, 6, seed=4)
    driver = serve(engine, {0: [("r16-first", a, "r16"), ("r8-waits", b, "r8"), ("base", c, None)],
                            1: [("r16-later", d, "r16")]})  # fmt: skip

    first_step = {}
    for index, plan in enumerate(plans):
        for chunk in plan.chunks:
            first_step.setdefault(chunk.request.request_id, index)
    assert first_step["r16-first"] < first_step["r8-waits"] <= first_step["base"] < first_step["r16-later"]
    assert all(len(set(step_adapters(plan)) - {None}) <= 1 for plan in plans)
    assert driver.tokens["r8-waits"] == llama.reference("r8", b)


def test_a_prefix_is_reused_only_under_its_own_adapter(llama):
    engine = make_engine(llama)
    hits: list[int] = []
    engine.observer = lambda stats: hits.append(stats.cache.device_hit_tokens)
    (prompt,) = prompts(40, seed=5)  # two full blocks of 16, cached after the first request
    found = {}
    for rid, adapter in [("a", "r8"), ("b", "r16"), ("base", None), ("a-again", "r8"), ("base-again", None)]:
        hits.clear()
        driver = serve(engine, {0: [(rid, prompt, adapter)]})
        assert driver.tokens[rid] == llama.reference(adapter, prompt)
        found[rid] = sum(hits)
    assert found == {"a": 0, "b": 0, "base": 0, "a-again": 32, "base-again": 32}


def test_an_unknown_adapter_is_that_requests_error_only(llama):
    engine = make_engine(llama)
    one, two, three = prompts(5, 8, 11, seed=6)
    driver = serve(engine, {0: [("base", one, None), ("unknown", two, "r9"), ("r32", three, "r32")]})

    error = driver.finals["unknown"]
    assert error.finish_reason is FinishReason.ERROR and error.error_code is ErrorCode.UNKNOWN_ADAPTER
    assert "r9" in (error.error or "")
    assert driver.tokens["base"] == llama.reference(None, one)
    assert driver.tokens["r32"] == llama.reference("r32", three)


def test_an_adapter_over_the_rank_bound_stops_the_start_in_one_line(llama):
    with pytest.raises(BadAdapter) as refused:
        make_engine(llama, max_lora_rank=32)  # r64 is over it
    message = str(refused.value)
    assert "'r64'" in message and "rank 64" in message and "\n" not in message


def test_adapters_registered_while_serving(llama, tmp_path):
    only_r8 = tmp_path / "only-r8"
    only_r8.mkdir()
    (only_r8 / "r8").symlink_to(llama.lora_dir / "r8")
    engine = make_engine(llama, lora_dir=only_r8)
    assert engine.adapters == ["r8"]
    one, two = prompts(9, 14, seed=7)
    driver = Driver(engine, raise_errors=False)
    driver.submit("running", one, PARAMS, adapter="r8")
    driver.step()
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadAdapter, match="no adapter_config.json"):
        engine.load_adapter("broken", tmp_path / "empty")
    engine.load_adapter("late", llama.lora_dir / "r64")  # under a name of its own
    assert engine.adapters == ["late", "r8"]
    driver.submit("late", two, PARAMS, adapter="late")
    driver.submit("broken", two, PARAMS, adapter="broken")
    driver.run_until(lambda: not engine.has_unfinished(), 500)

    assert driver.tokens["running"] == llama.reference("r8", one)
    assert driver.tokens["late"] == llama.reference("r64", two)
    assert driver.finals["broken"].error_code is ErrorCode.UNKNOWN_ADAPTER


def test_without_a_lora_dir_nothing_is_wrapped_and_no_adapter_is_served(llama):
    loaded = load_model(ModelConfig(source=str(llama.folder), device="cpu"))
    engine = Engine(loaded, EngineConfig(cache=CacheConfig(kv_memory_bytes=4 << 20, swap_memory_bytes=0)))
    assert engine.runner.lora is None and engine.adapters == []
    with pytest.raises(ValueError, match="--lora-dir"):
        engine.load_adapter("r8", llama.lora_dir / "r8")
    (prompt,) = prompts(5, seed=8)
    driver = serve(engine, {0: [("r8", prompt, "r8"), ("base", prompt, None)]})
    assert driver.finals["r8"].error_code is ErrorCode.UNKNOWN_ADAPTER
    assert driver.tokens["base"] == llama.reference(None, prompt)


def test_tensor_parallelism_with_lora_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="^--lora-dir does not run with --tensor-parallel yet; use one rank$"):
        EngineConfig(model=ModelConfig(tensor_parallel=2), lora=LoRAConfig(lora_dir=tmp_path))


def test_steps_with_adapters_never_replay_a_cuda_graph(llama):
    """A stand-in for the CUDA graphs (the base model's forward, counted): decode-only
    steps without adapters take it, those with an adapter row run the eager forward."""
    engine = make_engine(llama)
    engine.scheduler.drafts = None  # steps with drafts never replay a graph either
    runner = engine.runner

    class Graphs:
        backend = runner.backend
        replays = 0

        def applies(self, sequences) -> bool:
            return all(seq.query_len == 1 for seq in sequences)

        def run(self, token_ids, positions, sequences, sample_rows):
            self.replays += 1
            batch = PagedBatch(runner.backend, runner.backend.prepare(sequences, len(token_ids)))
            return runner.forward(token_ids, positions, sample_rows, batch)

    graphs = Graphs()
    runner.graphs = graphs  # type: ignore[assignment]
    one, two = prompts(6, 6, seed=9)
    driver = Driver(engine, raise_errors=False)
    driver.submit("r16", one, SamplingParams(max_tokens=3, ignore_eos=True), adapter="r16")
    driver.submit("base", two, PARAMS)
    driver.run_until(lambda: not engine.has_unfinished(), 500)

    # r16's decodes ran beside the base request's, eagerly; then the base request's alone, replayed.
    assert driver.tokens["r16"] == llama.reference("r16", one)[:3]
    assert driver.tokens["base"] == llama.reference(None, two)
    assert graphs.replays == NEW_TOKENS - 3


def test_int4s_one_call_decode_takes_only_steps_without_adapters(tmp_path):
    """int4's decode step runs the bare int4 linears (no deltas): steps with an adapter
    row take the torch path over the wrapped ones; decode steps without one still take it."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "model")
    build_tokenizer(VOCAB).save_pretrained(tmp_path / "model")
    save_adapter(base, tmp_path / "adapters" / "r8", 8, ["q_proj", "v_proj", "down_proj"])
    settings = ModelConfig(source=str(tmp_path / "model"), device="cpu", dtype="bfloat16", weights="int4")
    engine = Engine(
        load_model(settings),
        EngineConfig(
            model=settings,
            cache=CacheConfig(kv_memory_bytes=4 << 20, swap_memory_bytes=0),
            lora=LoRAConfig(lora_dir=tmp_path / "adapters"),
        ),
    )
    engine.scheduler.drafts = None
    assert engine.runner.lean is not None and engine.runner.lora is not None
    guarded = engine.runner.lean.decode_step
    if guarded is None:
        pytest.skip("g++ cannot build the int4 decode step here")
    assert isinstance(guarded, BaseStepsOnly)
    one_call, batch = guarded.step, engine.runner.lora.batch
    with_adapter_rows: list[bool] = []  # of each step the one call ran

    class Counted:
        def takes(self, metadata, num_tokens: int) -> bool:
            return one_call.takes(metadata, num_tokens)

        def __call__(self, *args):
            with_adapter_rows.append(bool(batch.segments))
            return one_call(*args)

    guarded.step = Counted()  # type: ignore[assignment]
    one, two = prompts(6, 6, seed=10)
    driver = Driver(engine, raise_errors=False)
    driver.submit("r8", one, SamplingParams(max_tokens=3, ignore_eos=True), adapter="r8")
    driver.submit("base", two, PARAMS)
    driver.run_until(lambda: not engine.has_unfinished(), 500)

    assert len(driver.tokens["r8"]) == 3 and len(driver.tokens["base"]) == NEW_TOKENS
    assert with_adapter_rows == [False] * (NEW_TOKENS - 3)  # the base request's decodes alone
