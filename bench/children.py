"""The throughput scenario's systems, each in a child process (`python -m bench --child JOB
--out RESULT`) that loads the model itself, so peak RSS is per system and one system's
allocations cannot slow another. The child writes each request's token times after t0
and the system's own figures as JSON. The engine and the ceiling are here."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.processes import REPO_ROOT
from bench.report import say


class Children:
    """Runs one system per child process and reads back its JSON result."""

    def __init__(self, tmp: Path, model: str, dtype: str, weights: str = "dense") -> None:
        self.tmp, self.model, self.dtype, self.weights = tmp, model, dtype, weights
        self.workload_path = tmp / "workload.json"
        self.count = 0

    def run(self, system: str, **params) -> dict:
        """`system` in a child of this Python (`bench --child`)."""
        return self._child(
            system, params, lambda job, out: [sys.executable, "-m", "bench", "--child", job, "--out", out]
        )

    def run_vllm(self, python: Path, setting: str, model_folder: str) -> dict:
        """vLLM in a child of its own environment's Python, with `setting`'s environment."""
        from bench.peer_vllm import environment

        params = {"setting": setting, "model_folder": model_folder}
        return self._child("vllm", params, lambda job, out: [str(python), "-m", "bench.peer_vllm", job, out],
                           environment(setting))  # fmt: skip

    def _child(self, system: str, params: dict, command, environment: dict | None = None) -> dict:
        self.count += 1
        stem = self.tmp / f"{self.count:02d}-{system}"
        job = {"system": system, "model": self.model, "dtype": self.dtype, "weights": self.weights,
               "workload": str(self.workload_path), "params": params}  # fmt: skip
        Path(f"{stem}.job.json").write_text(json.dumps(job))
        env = dict(os.environ if environment is None else environment)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        shown = (f" {k}={v}" for k, v in params.items() if isinstance(v, (int, str)) and k != "model_folder")
        label = system + "".join(shown)
        say(f"{label} ...")
        started = time.perf_counter()
        with open(f"{stem}.log", "w") as log:
            code = subprocess.call(command(f"{stem}.job.json", f"{stem}.out.json"), cwd=REPO_ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        if code != 0:
            tail = Path(f"{stem}.log").read_text()[-4000:]
            raise RuntimeError(f"bench child {system!r} exited with {code}:\n{tail}")
        say(f"{label} done in {time.perf_counter() - started:.1f}s")
        return json.loads(Path(f"{stem}.out.json").read_text())


def run_child(job_path: Path, out_path: Path) -> None:
    """Inside a child: run one system (`prepare` draws the workload), write its result with
    the process's peak RSS and the host's load average."""
    import torch

    from bench.metrics import peak_rss_mb

    job = json.loads(Path(job_path).read_text())
    if job["system"] == "llamacpp":  # llama.cpp reads the GGUF itself: no transformers model in its process
        from bench.peer_llamacpp import run_llamacpp
        from bench.workload import Workload
        from workers.model_loader import gguf_source

        gguf = gguf_source(job["model"])
        if gguf is None:
            raise SystemExit(f"llamacpp needs a GGUF model, got {job['model']!r}")
        load_average = os.getloadavg()[0]
        workload = Workload.load(Path(job["workload"]))
        result = run_llamacpp(gguf, workload, threads=torch.get_num_threads()) | {"load_rss_mb": None}
    else:
        result, load_average = _run_on_loaded_model(job)
    result.update(
        peak_rss_mb=peak_rss_mb(),
        torch_threads=torch.get_num_threads(),
        # Host 1-min load before and after the run: above the core count, the figures are skewed.
        load_average_1m=[round(load_average, 2), round(os.getloadavg()[0], 2)],
    )
    Path(out_path).write_text(json.dumps(result))


def _run_on_loaded_model(job: dict) -> tuple[dict, float]:
    """`prepare`, the engine, the ceiling or a transformers peer on the model this process
    loads: its result, and the load average once loaded."""
    import torch
    import transformers

    from bench import peers
    from bench.metrics import peak_rss_mb
    from bench.workload import Workload, draw_workload
    from workers.config import EngineConfig, ModelConfig, SpeculativeConfig
    from workers.model_loader import load_model, model_folder

    system, params = job["system"], job["params"]
    # The weights setting only changes the engine: the ceiling and the peers run the loaded (dense) model.
    model_config = ModelConfig(source=job["model"], dtype=job["dtype"], weights=job.get("weights", "dense"))
    threads = torch.get_num_threads()
    if system == "hf_continuous":
        # Loaded with one thread, its generation thread is the only OpenMP team (workers/async_engine.py).
        torch.set_num_threads(1)
    # The ceiling is plain transformers eager; the peers use sdpa; the engine sets its own.
    loaded = load_model(model_config, attn_implementation="eager" if system == "ceiling" else "sdpa")
    model, tokenizer = loaded.model, loaded.tokenizer
    figures = {"load_rss_mb": peak_rss_mb()}
    load_average = os.getloadavg()[0]
    if system == "prepare":
        draw_workload(tokenizer, model.config.vocab_size, **params).save(Path(job["workload"]))
        return figures | {"model": loaded.name, "torch": torch.__version__, "transformers": transformers.__version__,
                          "model_folder": model_folder(model_config)}, load_average  # fmt: skip
    workload = Workload.load(Path(job["workload"]))
    if system == "engine":
        speculative = SpeculativeConfig(enabled=bool(params.get("speculation", 1)))
        result = run_engine(loaded, workload, EngineConfig(model=model_config, speculative=speculative))
    elif system == "ceiling":
        result = run_ceiling(model, params["step_tokens"], seed=workload.seed)
    elif system == "hf_continuous":
        kv_bytes = EngineConfig().cache.kv_memory_bytes  # the engine's KV budget, for a like-for-like cache
        result = peers.run_hf_continuous(
            model, workload, params["max_batch_tokens"], kv_bytes, threads, params.get("allow_block_sharing")
        )
    elif system == "hf_static":
        pads = (model.generation_config.pad_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id)
        pad = next((p for p in pads if p is not None), None)
        if pad is None:
            raise ValueError("hf_static pads its batches, and the model names no pad or EOS token")
        result = peers.run_hf_static(model, workload, params["batch_size"], pad)
    else:
        raise ValueError(f"unknown system {system!r}")
    return result | figures, load_average


def run_engine(loaded, workload, config) -> dict:
    """Every request added at t0, then `step()` until none is left (`Driver`'s token times)."""
    from bench.drive import Driver, StepRecorder
    from workers.engine import Engine  # here, so the peers run even where the engine cannot import

    engine = Engine(loaded, config)
    steps_done = StepRecorder(engine)
    warmup = Driver(engine)
    warmup.add("warmup", workload.requests[0].prompt_ids[:8], 2)
    warmup.drain()
    steps_done.clear()  # the schedule and overhead cover the measured run only

    drive = Driver(engine)
    for r in workload.requests:
        drive.add(r.request_id, r.prompt_ids, r.output_len)
    drive.drain()
    token_times = {r.request_id: drive.token_times[r.request_id] for r in workload.requests}
    workload.check_lengths("engine", token_times)

    steps = [{"num_tokens": s.num_tokens, "forward_s": s.forward_s, "step_s": s.step_s} for s in steps_done]
    forward_s, step_s = (sum(s[key] for s in steps) for key in ("forward_s", "step_s"))
    return {
        "token_times": token_times,
        "steps": steps,
        "forward_s": forward_s,
        "step_s": step_s,
        # Share of the engine's step time outside the model forward (scheduling, sampling, ...).
        "overhead_fraction": 1 - forward_s / step_s,
        "scheduler": vars(config.scheduler),
        "kv_memory_bytes": config.cache.kv_memory_bytes,
    }


def run_ceiling(model, step_tokens: list[int], seed: int = 0) -> dict:
    """For each engine step of T tokens, one timed plain transformers forward (eager, no KV
    cache, logits everywhere) on [1, T] random ids. `ceiling_fraction` = their sum / engine
    wall time. No strict bound: it computes every position's logits (the engine can beat
    it), but never attends to a cached context (it undercharges long decodes)."""
    import torch

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    times = []
    with torch.inference_mode():
        for num_tokens in [16, *step_tokens]:  # the first is the warmup
            input_ids = torch.tensor([[rng.randrange(vocab) for _ in range(num_tokens)]])
            started = time.perf_counter()
            model(input_ids=input_ids, use_cache=False)
            times.append(time.perf_counter() - started)
    attn = model.config._attn_implementation
    return {"forward_s": sum(times[1:]), "steps": len(step_tokens), "attn_implementation": attn}
