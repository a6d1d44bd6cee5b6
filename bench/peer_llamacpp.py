"""llama.cpp as a peer (docs/benchmarks.md, "llama.cpp as a peer"): llama-cpp-python's
low-level API on the same GGUF and token ids, one `llama_context` scheduled as llama-server
schedules its slots. A token is stamped once `llama_decode` returned and its logits were read."""

from __future__ import annotations

import ctypes
import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.workload import Workload

# llama-server's defaults: up to 2048 tokens a step, computed 512 at a time.
MAX_BATCH_TOKENS = 2048
MICRO_BATCH_TOKENS = 512
INSTALL_HINT = "pip install 'inflight[llamacpp]' (or `make llamacpp`, which builds it for this CPU)"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class _Sequence:
    seq_id: int
    request_id: str
    prompt: list[int]
    output_len: int
    fed: int = 0  # prompt tokens in the cache
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @property
    def prefilled(self) -> bool:
        return self.fed == len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.tokens) == self.output_len


class LlamaCpp:
    """One model and context, sized for `max_sequences` sequences of `context_tokens` in all:
    each step is one batch of every running sequence's next token, then prompt chunks up to
    the token budget in arrival order; greedy, a finished sequence's cache freed at once."""

    def __init__(self, gguf: Path, context_tokens: int, max_sequences: int, threads: int,
                 max_batch_tokens: int = MAX_BATCH_TOKENS) -> None:  # fmt: skip
        import llama_cpp

        self.ll = ll = llama_cpp
        self.version = llama_cpp.__version__
        self._quiet = ll.llama_log_callback(lambda level, text, user_data: None)  # kept alive: C holds it
        ll.llama_log_set(self._quiet, ctypes.c_void_p(0))
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {gguf}")
        params = ll.llama_context_default_params()
        params.n_ctx = context_tokens
        params.n_batch = max_batch_tokens
        params.n_ubatch = min(MICRO_BATCH_TOKENS, max_batch_tokens)
        params.n_seq_max = max_sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one cache shared by all sequences, as llama-server sizes it
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp cannot make a context of {context_tokens} tokens, {max_sequences} sequences")
        self.memory = ll.llama_get_memory(self.ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.max_batch_tokens = max_batch_tokens
        self.batch = ll.llama_batch_init(max_batch_tokens, 0, 1)

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)

    def generate(self, sequences: list[_Sequence], t0: float) -> None:
        """Run `sequences` to completion, stamping each token at `time.perf_counter() - t0`."""
        ll, batch = self.ll, self.batch
        live = list(sequences)
        while live:
            n, sampled = 0, []
            for seq in live:  # decodes first: each running sequence's last token
                if seq.prefilled and seq.tokens:
                    self._put(n, seq.tokens[-1], len(seq.prompt) + len(seq.tokens) - 1, seq.seq_id, True)
                    sampled.append(seq)
                    n += 1
            for seq in live:  # then prompt chunks, in arrival order, while the budget lasts
                if n == self.max_batch_tokens:
                    break
                if seq.prefilled:
                    continue
                take = min(len(seq.prompt) - seq.fed, self.max_batch_tokens - n)
                for i in range(seq.fed, seq.fed + take):
                    self._put(n, seq.prompt[i], i, seq.seq_id, i == len(seq.prompt) - 1)
                    n += 1
                seq.fed += take
                if seq.prefilled:
                    sampled.append(seq)
            batch.n_tokens = n
            status = ll.llama_decode(self.ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status} for a batch of {n} tokens")
            # Sampled rows' logits, in batch order: the decodes, then each completed prompt.
            logits = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(len(sampled), self.n_vocab))
            next_tokens = logits.argmax(axis=1).tolist()
            now = time.perf_counter() - t0
            for seq, token in zip(sampled, next_tokens):
                seq.tokens.append(token)
                seq.times.append(now)
                if seq.done:
                    ll.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
            live = [seq for seq in live if not seq.done]

    def _put(self, i: int, token: int, position: int, seq_id: int, logits: bool) -> None:
        batch = self.batch
        batch.token[i] = token
        batch.pos[i] = position
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = logits


def run_llamacpp(gguf: Path, workload: Workload, threads: int, max_batch_tokens: int = MAX_BATCH_TOKENS) -> dict:
    """The workload on llama.cpp; the same result shape as the other peers (`bench.peers`)."""
    requests = workload.requests
    # Cache room for every request's prompt and output at once (all arrive at t0), in 256s.
    context = -(-sum(len(r.prompt_ids) + r.output_len for r in requests) // 256) * 256
    runner = LlamaCpp(gguf, context, max_sequences=len(requests), threads=threads, max_batch_tokens=max_batch_tokens)
    try:
        warmup = requests[0]
        runner.generate([_Sequence(0, "warmup", warmup.prompt_ids[:8], 2)], time.perf_counter())
        sequences = [_Sequence(i, r.request_id, r.prompt_ids, r.output_len) for i, r in enumerate(requests)]
        runner.generate(sequences, time.perf_counter())
        info = runner.ll.llama_print_system_info().decode()
    finally:
        runner.close()
    return {
        "token_times": {s.request_id: s.times for s in sequences},
        "tokens": {s.request_id: s.tokens for s in sequences},
        "max_batch_tokens": max_batch_tokens,
        "micro_batch_tokens": min(MICRO_BATCH_TOKENS, max_batch_tokens),
        "context_tokens": context,
        "llama_threads": threads,
        "llama_cpp_python": runner.version,
        "system_info": info,
    }
