"""Multi-LoRA (gpu/lora.py): rows of different PEFT adapters, and of none, in one forward,
each computing what PEFT's merged model for its adapter computes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from gpu.cpu.fusions import FusedGatedMLP, fuse_for_cpu
from gpu.cpu.lean_forward import LeanForward
from gpu.cpu.packed_linear import PackedLinear, amx_kernel, can_pack, pack_linears
from gpu.lora import BadAdapter, LoRAAdapter, LoRALinear, LoRASlots
from workers.config import CacheConfig
from workers.model_runner import ModelRunner
from workers.plan import ScheduledChunk, StepPlan

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)  # fmt: skip
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name: (rank, targets, other LoraConfig fields); the ranks the issue asks for, over
# PEFT's default targets, all of them, the MLP alone, and rsLoRA's scaling.
ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj"], {}),
    "r16": (16, ATTENTION + MLP, {"use_rslora": True}),
    "r32": (32, MLP, {}),
    "r64": (64, ["k_proj", "o_proj", "up_proj"], {}),
}
PROMPT_LENGTH = 5


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and on a busy 2-core machine two threads
    wait on each other at every operation (as in test_lean_forward.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


def save_adapter(base: nn.Module, folder: Path, rank: int, targets: list[str], seed: int = 0, **config) -> nn.Module:
    """A PEFT adapter of random weights (PEFT starts B at zero, which would change nothing)
    saved in `folder`; returns PEFT's merged model of it."""
    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, **config)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, tuple[Path, nn.Module]]:
    """Each adapter's folder and PEFT's merged model of it."""
    made = {}
    for seed, (name, (rank, targets, config)) in enumerate(ADAPTERS.items()):
        folder = tmp_path_factory.mktemp(name)
        made[name] = folder, save_adapter(base, folder, rank, targets, seed, **config)
    return made


def served(base: nn.Module, adapters, max_loras: int, modules: str = "hf") -> tuple[nn.Module, LoRASlots]:
    """A copy of the base model with the adapters loaded, its modules as the CPU worker
    runs them where `modules` says so (fused projections, then packed ones)."""
    model = copy.deepcopy(base)
    if modules != "hf":
        fuse_for_cpu(model)
    if modules == "fused+packed":
        if not can_pack(model):
            pytest.skip("oneDNN does not pack float32 here")
        pack_linears(model)
    slots = LoRASlots(model, max_loras=max_loras, max_rank=64)
    for name, (folder, _) in adapters.items():
        slots.load(name, folder)
    return model, slots


def prompts(count: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (count, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def logits_of(model: nn.Module, slots: LoRASlots, ids: torch.Tensor, row_adapters: list[str | None]) -> torch.Tensor:
    """One step of the whole sequences, each batch row of its adapter."""
    slots.begin_step([(name, ids.shape[1]) for name in row_adapters])
    return model(ids).logits


@torch.no_grad()
def reference_logits(base, adapters, ids: torch.Tensor, row_adapters: list[str | None]) -> torch.Tensor:
    """Each row alone through its adapter's merged model (or the base model)."""
    models = [base if name is None else adapters[name][1] for name in row_adapters]
    return torch.cat([model(row[None]).logits for model, row in zip(models, ids)])


# Each adapter's rows in one run (slices of the packed rows), and scattered among others
# (gathered once per step, in slot order).
MIXED_ROWS = {
    "grouped": ["r8", None, "r16", "r32", None, "r64"],
    "scattered": ["r64", "r8", "r16", "r8", None, "r32", "r16", "r64", None],
}


@pytest.mark.parametrize("modules", ["hf", "fused", "fused+packed"])
@pytest.mark.parametrize("rows", sorted(MIXED_ROWS))
def test_each_row_gets_its_adapters_merged_model_logits(base, adapters, modules, rows):
    row_adapters = MIXED_ROWS[rows]
    model, slots = served(base, adapters, max_loras=4, modules=modules)
    if modules == "fused":
        assert {type(m.base) for m in model.modules() if isinstance(m, LoRALinear)} == {nn.Linear}
        assert sum("qkv_proj" in name for name, m in model.named_modules() if isinstance(m, LoRALinear)) == 2
    if modules == "fused+packed":
        assert {type(m.base) for m in model.modules() if isinstance(m, LoRALinear)} == {PackedLinear}
    ids = prompts(len(row_adapters))
    got = logits_of(model, slots, ids, row_adapters)
    expected = reference_logits(base, adapters, ids, row_adapters)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The adapters matter: an adapter row differs from the base model's.
    base_logits = reference_logits(base, adapters, ids, [None] * len(row_adapters))
    for index, name in enumerate(row_adapters):
        difference = (expected[index] - base_logits[index]).abs().max().item()
        assert difference == 0 if name is None else difference > 0.1, (name, difference)


@pytest.mark.parametrize("modules", ["hf", "fused"])
def test_greedy_tokens_equal_the_merged_models(base, adapters, modules):
    row_adapters = MIXED_ROWS["scattered"]
    model, slots = served(base, adapters, max_loras=4, modules=modules)
    ids = expected = prompts(len(row_adapters))
    for _ in range(6):  # every step recomputes the whole sequences (no KV cache)
        ids = torch.cat([ids, logits_of(model, slots, ids, row_adapters)[:, -1].argmax(-1, keepdim=True)], dim=1)
        following = reference_logits(base, adapters, expected, row_adapters)[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, following], dim=1)
    assert ids.tolist() == expected.tolist()


def test_the_cpu_workers_lean_forward_serves_each_sequence_its_adapter(base, adapters):
    """The CPU worker's path: fused and packed modules, the lean forward over the paged
    cache, a step of prompts then steps of decodes, each step's spans set before it."""
    runner = ModelRunner(copy.deepcopy(base), CacheConfig(kv_memory_bytes=8 << 20, swap_memory_bytes=0))
    slots = LoRASlots(runner.model, max_loras=4, max_rank=64)
    for name, (folder, _) in adapters.items():
        slots.load(name, folder)
    runner.lean = LeanForward(runner.model)  # after the wrapping: it keeps the modules' bound forwards
    assert isinstance(runner.model.model.layers[0].self_attn.qkv_proj, LoRALinear)
    row_adapters = ["r32", None, "r8", "r64", "r16", "r8"]
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, TINY["vocab_size"], (3 + i,), generator=generator).tolist() for i in range(6)]
    tables = [([1 + 2 * i, 2 + 2 * i],) for i in range(len(sequences))]
    chunks = [ScheduledChunk(None, 0, tuple(s), table, True, False) for s, table in zip(sequences, tables)]
    for _ in range(4):
        slots.begin_step([(name, chunk.num_tokens) for name, chunk in zip(row_adapters, chunks)])
        logits = runner.execute(StepPlan(chunks)).logits
        with torch.no_grad():
            expected = torch.stack([
                (base if name is None else adapters[name][1])(torch.tensor([s])).logits[0, -1]
                for name, s in zip(row_adapters, sequences)
            ])  # fmt: skip
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        for sequence, token in zip(sequences, logits.argmax(-1).tolist()):
            sequence.append(token)
        chunks = [ScheduledChunk(None, len(s) - 1, (s[-1],), table, True, True) for s, table in zip(sequences, tables)]


class GatedGateUp(nn.Linear):
    """A gate_up projection with SiLU(gate) x up in its own pass, as packed on AMX."""

    gated = True

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up


def test_a_gated_gate_up_projection_adds_the_delta_before_the_silu(base, adapters):
    model = copy.deepcopy(base)
    fuse_for_cpu(model)
    gated = []
    for mlp in (m for m in model.modules() if isinstance(m, FusedGatedMLP)):
        stub = GatedGateUp(mlp.gate_up_proj.in_features, mlp.gate_up_proj.out_features, bias=False)
        stub.weight, stub.calls = mlp.gate_up_proj.weight, 0
        mlp.gate_up_proj = stub
        gated.append(stub)
    slots = LoRASlots(model, max_loras=1, max_rank=64)
    slots.load("r32", adapters["r32"][0])
    ids = prompts(2)
    got = logits_of(model, slots, ids, ["r32", None])
    torch.testing.assert_close(got, reference_logits(base, adapters, ids, ["r32", None]), rtol=1e-5, atol=1e-5)
    assert [stub.calls for stub in gated] == [0, 0]
    logits_of(model, slots, ids, [None, None])  # no adapter in the step: the one-pass product again
    assert [stub.calls for stub in gated] == [1, 1]


def test_bfloat16_on_amx_agrees_with_the_merged_models_to_its_rounding(base, adapters):
    model = copy.deepcopy(base).to(torch.bfloat16)
    fuse_for_cpu(model)
    pack_linears(model)
    if amx_kernel() is None or not model.model.layers[0].mlp.gate_up_proj.gated:
        pytest.skip("no AMX here: bfloat16 linears are not packed gated")
    slots = LoRASlots(model, max_loras=4, max_rank=64)
    for name, (folder, _) in adapters.items():
        slots.load(name, folder)
    row_adapters = MIXED_ROWS["scattered"]
    ids = prompts(len(row_adapters))
    got = logits_of(model, slots, ids, row_adapters).float()
    # bfloat16's rounding moves these logits by about 0.01; the adapters move them by over 0.1.
    torch.testing.assert_close(got, reference_logits(base, adapters, ids, row_adapters), rtol=0, atol=0.03)


def test_a_step_without_adapters_is_the_base_model_exactly(base, adapters):
    model, slots = served(base, adapters, max_loras=4)
    ids = prompts(3)
    logits_of(model, slots, ids, ["r8", "r16", "r32"])
    slots.end_step()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)
        assert torch.equal(logits_of(model, slots, ids, [None] * 3), base(ids).logits)


def test_the_least_recently_used_adapter_not_in_the_step_is_evicted(base, adapters):
    three = {name: adapters[name] for name in ("r8", "r16", "r32")}
    model, slots = served(base, three, max_loras=2)
    ids = prompts(3)

    def step(row_adapters: list[str | None]) -> None:
        got = logits_of(model, slots, ids[: len(row_adapters)], row_adapters)
        expected = reference_logits(base, adapters, ids[: len(row_adapters)], row_adapters)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    step(["r8", "r16"])
    step(["r8", None])  # r16 is now the least recently used
    assert list(slots.resident) == ["r16", "r8"]
    step(["r16", "r32"])  # the step uses r16: r8 goes, though r16 was used less recently
    assert list(slots.resident) == ["r16", "r32"]
    freed = slots.resident["r16"]
    step(["r8", None, "r8"])  # r8 comes back from host memory, into r16's slot
    assert list(slots.resident) == ["r32", "r8"] and slots.resident["r8"] == freed
    step(["r16"])
    assert list(slots.resident) == ["r8", "r16"]
    with pytest.raises(ValueError, match="a step names 3 adapters; 2 fit"):
        slots.begin_step([("r8", 1), ("r16", 1), ("r32", 1)])
    with pytest.raises(KeyError, match="'r99' is not loaded"):
        slots.begin_step([("r99", 1)])
    slots.begin_step([("r8", 2)])
    with torch.no_grad(), pytest.raises(ValueError, match="spans cover 2 rows; model.layers.0.self_attn.q_proj got 3"):
        model(ids[:1, :3])  # not the rows the step's spans described


def test_host_memory_keeps_the_most_recently_used_adapters_and_reads_the_others_again(base, adapters, monkeypatch):
    model = copy.deepcopy(base)
    slots = LoRASlots(model, max_loras=1, max_rank=64, max_host_loras=2)
    for name in ("r8", "r16", "r32"):
        slots.load(name, adapters[name][0])
    assert list(slots.adapters) == ["r16", "r32"]  # r8 left host memory
    ids = prompts(2)
    got = logits_of(model, slots, ids, ["r8", None])  # read again from its folder
    torch.testing.assert_close(got, reference_logits(base, adapters, ids, ["r8", None]), rtol=1e-5, atol=1e-5)
    assert list(slots.adapters) == ["r32", "r8"] and list(slots.resident) == ["r8"]
    slots.load("r16", adapters["r16"][0])
    slots.load("r64", adapters["r64"][0])  # r8 leaves host memory, not its slot
    assert list(slots.adapters) == ["r16", "r64"] and list(slots.resident) == ["r8"]
    monkeypatch.setattr(LoRAAdapter, "load", None)  # a resident adapter is not read again
    got = logits_of(model, slots, ids, ["r8", None])
    torch.testing.assert_close(got, reference_logits(base, adapters, ids, ["r8", None]), rtol=1e-5, atol=1e-5)
    slots.unload("r8")
    with pytest.raises(KeyError, match="'r8' is not loaded"):
        slots.begin_step([("r8", 1)])


def test_an_adapter_saved_as_bin_loads_the_same(base, tmp_path):
    rank, targets, config = ADAPTERS["r16"]
    merged = save_adapter(base, tmp_path, rank, targets, seed=7, **config)
    weights = tmp_path / "adapter_model.safetensors"
    torch.save(load_file(weights), tmp_path / "adapter_model.bin")  # PEFT's older format
    weights.unlink()
    model, slots = served(base, {"bin": (tmp_path, merged)}, max_loras=1)
    ids = prompts(2)
    got = logits_of(model, slots, ids, ["bin", None])
    torch.testing.assert_close(got, reference_logits(base, {"bin": (tmp_path, merged)}, ids, ["bin", None]))


def test_only_the_llama_projections_and_their_cpu_fusions_are_wrapped_once(base):
    model = copy.deepcopy(base)
    LoRASlots(model, max_loras=1, max_rank=8)
    wrapped = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert wrapped == set(ATTENTION + MLP)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj already carries adapters"):
        LoRASlots(model, max_loras=1, max_rank=8)
    # Phi-3's own qkv_proj and gate_up_proj are no CPU fusion: their adapters are not Llama's.
    phi3 = Phi3ForCausalLM(Phi3Config(**TINY, pad_token_id=0))
    LoRASlots(phi3, max_loras=1, max_rank=8)
    wrapped = {name.rpartition(".")[2] for name, m in phi3.named_modules() if isinstance(m, LoRALinear)}
    assert wrapped == {"o_proj", "down_proj"}


def refused(base: nn.Module, folder: Path, max_rank: int = 64) -> str:
    """The one-line message with which loading `folder` as "bad" is refused."""
    model = copy.deepcopy(base)
    slots = LoRASlots(model, max_loras=1, max_rank=max_rank)
    with pytest.raises(BadAdapter) as refusal:
        slots.load("bad", folder)
    message = str(refusal.value)
    assert "\n" not in message and message.startswith("adapter 'bad': "), message
    assert "bad" not in slots.adapters
    return message


def test_a_rank_over_the_cap_is_refused(base, adapters):
    assert refused(base, adapters["r64"][0], max_rank=32) == (
        "adapter 'bad': rank 64 is over the maximum 32 (--max-lora-rank)"
    )


@pytest.mark.parametrize(
    ("other_base", "target", "reason"),
    [
        ({"hidden_size": 32, "intermediate_size": 64}, "q_proj",
         "model.layers.0.self_attn.q_proj has A [8, 32] and B [32, 8] where the base model takes [8, 64] and [64, 8]"),
        ({"intermediate_size": 96}, "gate_proj", "model.layers.0.mlp.gate_proj has A [8, 64] and B [96, 8]"),
        ({"num_hidden_layers": 3}, "o_proj", "targets model.layers.2.self_attn.o_proj, which the base model lacks"),
    ],
)  # fmt: skip
def test_an_adapter_for_another_base_model_is_refused(base, tmp_path, other_base, target, reason):
    save_adapter(tiny_llama(**other_base), tmp_path, 8, [target])
    assert reason in refused(base, tmp_path)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"use_dora": True}, "uses DoRA, which is not supported"),
        ({"modules_to_save": ["lm_head"]}, "uses modules_to_save (fully trained modules), which is not supported"),
        ({"bias": "lora_only"}, "trains biases (bias='lora_only'), which is not supported"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "targets embed_tokens; only q_proj, k_proj"),
        ({"rank_pattern": {"q_proj": 4}}, "uses per-module ranks (rank_pattern), which is not supported"),
    ],
)
def test_unsupported_peft_features_are_refused(base, tmp_path, config, reason):
    save_adapter(base, tmp_path, 8, config.pop("target_modules", ["q_proj", "v_proj"]), **config)
    assert reason in refused(base, tmp_path)


def test_missing_or_broken_files_are_refused(base, adapters, tmp_path):
    assert refused(base, tmp_path / "absent") == f"adapter 'bad': no adapter_config.json in {tmp_path / 'absent'}"
    (tmp_path / "adapter_config.json").write_text((adapters["r8"][0] / "adapter_config.json").read_text())
    assert refused(base, tmp_path) == f"adapter 'bad': no adapter_model.safetensors or adapter_model.bin in {tmp_path}"
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    assert refused(base, tmp_path).startswith("adapter 'bad': cannot read its weights: ")
    (tmp_path / "adapter_config.json").write_text("{")
    assert refused(base, tmp_path).startswith(f"adapter 'bad': cannot read {tmp_path / 'adapter_config.json'}: ")


V_PROJ_B = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda weights: weights.pop(V_PROJ_B), "model.layers.1.self_attn.v_proj has lora_A without lora_B"),
        (lambda weights: weights[V_PROJ_B].fill_(float("nan")),
         "model.layers.1.self_attn.v_proj has weights that are not finite"),
        (lambda weights: weights.update(stray=torch.zeros(1)), "holds stray, which is not a LoRA weight"),
    ],
)  # fmt: skip
def test_broken_weights_are_refused(base, adapters, tmp_path, change, reason):
    weights = load_file(adapters["r8"][0] / "adapter_model.safetensors")
    change(weights)
    save_file(weights, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text((adapters["r8"][0] / "adapter_config.json").read_text())
    assert refused(base, tmp_path) == f"adapter 'bad': {reason}"
