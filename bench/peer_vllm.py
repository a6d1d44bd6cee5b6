"""vLLM's CPU backend as a peer (docs/benchmarks.md, "vLLM as a peer"): its offline engine
on the same model folder and token ids, run in its own environment as `.venv-vllm/bin/python
-m bench.peer_vllm JOB.json OUT.json` (importing nothing of inflight but the workload and the
RSS figure). Each token is stamped when the `LLMEngine.step` that made it returns."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from bench.metrics import peak_rss_mb
from bench.workload import Workload

KV_CACHE_GB = "4"


def settings(cores: int) -> dict[str, dict[str, str]]:
    """Each setting's environment: `both-cores` gives its engine every core; `default` is what
    a user gets (vLLM keeps a core for its front end)."""
    return {
        "both-cores": {
            "OMP_NUM_THREADS": str(cores),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB,
        },
        "default": {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB},
    }


def environment(setting: str) -> dict[str, str]:
    """This process's environment less its OpenMP/vLLM variables, plus `setting`'s."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "VLLM_"))}
    return base | settings(len(os.sched_getaffinity(0)))[setting]


def reported(environment: Mapping[str, str]) -> dict[str, str | None]:
    """The variables a setting sets, as `environment` has them: reported with each run."""
    return {k: environment.get(k) for k in settings(1)["both-cores"]}


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = Workload.load(Path(job["workload"]))
    longest = max(len(r.prompt_ids) + r.output_len for r in workload.requests)
    llm = LLM(model=job["params"]["model_folder"], dtype=job["dtype"], max_model_len=max(2048, longest), seed=0)
    engine = llm.llm_engine

    def drive(requests) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {r.request_id: [] for r in requests}
        started = time.perf_counter()
        for r in requests:
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(r.request_id, TokensPrompt(prompt_token_ids=r.prompt_ids), params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter() - started
            for output in outputs:
                stamped = times[output.request_id]
                made = len(output.outputs[0].token_ids)
                stamped.extend([now] * (made - len(stamped)))
        return times

    warmup = workload.requests[0]
    drive([type(warmup)("warmup", warmup.prompt_ids[:16], 4)])
    token_times = drive(workload.requests)
    workload.check_lengths("vllm", token_times)
    return {"token_times": token_times, "vllm": vllm.__version__, "environment": reported(os.environ)}


def main() -> None:
    job_path, out_path = sys.argv[1:3]
    result = run(json.loads(Path(job_path).read_text()))
    Path(out_path).write_text(json.dumps(result | {"peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this module again
    main()
