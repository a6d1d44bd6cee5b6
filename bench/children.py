"""The throughput scenario's child processes: each system runs in a process of its own
(`python -m bench --child JOB --out RESULT`) that loads the model itself, so peak RSS is
per system and one system's allocations cannot slow another. The parent writes a job
file, the child writes its result as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


class Children:
    """Runs one system per child process and reads back its JSON result."""

    def __init__(self, tmp: Path, model: str, dtype: str, weights: str = "dense") -> None:
        self.tmp = tmp
        self.model = model
        self.dtype = dtype
        self.weights = weights
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

        return self._child(
            "vllm",
            {"setting": setting, "model_folder": model_folder},
            lambda job, out: [str(python), "-m", "bench.peer_vllm", job, out],
            environment(setting),
        )

    def _child(self, system: str, params: dict, command, environment: dict | None = None) -> dict:
        self.count += 1
        stem = self.tmp / f"{self.count:02d}-{system}"
        job = {
            "system": system,
            "model": self.model,
            "dtype": self.dtype,
            "weights": self.weights,
            "workload": str(self.workload_path),
            "params": params,
        }
        Path(f"{stem}.job.json").write_text(json.dumps(job))
        env = dict(os.environ if environment is None else environment)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        label = system + "".join(
            f" {k}={v}" for k, v in params.items() if isinstance(v, (int, str)) and k != "model_folder"
        )
        print(f"bench: {label} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        with open(f"{stem}.log", "w") as log:
            code = subprocess.call(
                command(f"{stem}.job.json", f"{stem}.out.json"),
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if code != 0:
            tail = Path(f"{stem}.log").read_text()[-4000:]
            raise RuntimeError(f"bench child {system!r} exited with {code}:\n{tail}")
        print(f"bench: {label} done in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
        return json.loads(Path(f"{stem}.out.json").read_text())


def run_child(job_path: Path, out_path: Path) -> None:
    """Inside a child: load the model, run one system, write its result."""
    import torch
    import transformers

    from bench import engine_side, peers
    from bench.metrics import peak_rss_mb
    from bench.workload import Workload, draw_workload
    from workers.config import EngineConfig, ModelConfig, SpeculativeConfig
    from workers.model_loader import load_model, model_folder

    job = json.loads(Path(job_path).read_text())
    system, params = job["system"], job["params"]
    # The weights setting only changes the engine: the ceiling and the peers run the loaded (dense) model.
    model_config = ModelConfig(source=job["model"], dtype=job["dtype"], weights=job.get("weights", "dense"))
    if system == "llamacpp":
        _run_llamacpp_child(job, Path(out_path))
        return
    # The ceiling is plain transformers eager; the peers use sdpa; the engine sets its own.
    attn = "eager" if system == "ceiling" else "sdpa"
    threads = torch.get_num_threads()
    if system == "hf_continuous":
        # Its generation loop runs on a thread of its own: loading here with one thread
        # leaves that thread the process's only OpenMP team (see workers/async_engine.py),
        # as the engine's worker has.
        torch.set_num_threads(1)
    loaded = load_model(model_config, attn_implementation=attn)
    load_rss = peak_rss_mb()
    load_average = os.getloadavg()[0]
    model = loaded.model

    if system == "prepare":
        workload = draw_workload(
            params.get("workload", "random"),
            loaded.tokenizer,
            model.config.vocab_size,
            params["requests"],
            params["prompt_len"],
            params["output_len"],
            params["sharegpt_max_output"],
            params["seed"],
        )
        workload.save(Path(job["workload"]))
        result = {
            "model": loaded.name,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "model_folder": model_folder(model_config),
        }
    else:
        workload = Workload.load(Path(job["workload"]))
        if system == "engine":
            speculative = SpeculativeConfig(enabled=bool(params.get("speculation", 1)))
            result = engine_side.run_engine(loaded, workload, EngineConfig(model=model_config, speculative=speculative))
        elif system == "ceiling":
            result = engine_side.run_ceiling(model, params["step_tokens"], seed=workload.seed)
        elif system == "hf_continuous":
            kv_bytes = EngineConfig().cache.kv_memory_bytes  # the engine's KV budget, for a like-for-like cache
            result = peers.run_hf_continuous(
                model, workload, params["max_batch_tokens"], kv_bytes, threads, params.get("allow_block_sharing")
            )
        elif system == "hf_static":
            pad = model.generation_config.pad_token_id
            pad = loaded.tokenizer.pad_token_id if pad is None else pad
            pad = loaded.tokenizer.eos_token_id if pad is None else pad
            result = peers.run_hf_static(model, workload, params["batch_size"], pad)
        else:
            raise ValueError(f"unknown system {system!r}")
    result.update(
        peak_rss_mb=peak_rss_mb(),
        load_rss_mb=load_rss,
        torch_threads=torch.get_num_threads(),
        # Host 1-min load before and after the run: above the core count, the figures are skewed.
        load_average_1m=[round(load_average, 2), round(os.getloadavg()[0], 2)],
    )
    Path(out_path).write_text(json.dumps(result))


def _run_llamacpp_child(job: dict, out_path: Path) -> None:
    """llama.cpp reads the GGUF itself: no transformers model is loaded in its process."""
    import torch

    from bench.metrics import peak_rss_mb
    from bench.peer_llamacpp import run_llamacpp
    from bench.workload import Workload
    from workers.model_loader import gguf_source

    gguf = gguf_source(job["model"])
    if gguf is None:
        raise SystemExit(f"llamacpp needs a GGUF model, got {job['model']!r}")
    load_average = os.getloadavg()[0]
    result = run_llamacpp(gguf, Workload.load(Path(job["workload"])), threads=torch.get_num_threads())
    result.update(
        peak_rss_mb=peak_rss_mb(),
        load_rss_mb=None,  # the model loads inside the run
        load_average_1m=[round(load_average, 2), round(os.getloadavg()[0], 2)],
    )
    out_path.write_text(json.dumps(result))
