"""`inflight bench` (`--scenario throughput`, the default): the engine and its peers on one
seeded workload, every request at t0, each system in a child process of its own
(`bench/children.py`), one after another: `prepare` (loads the model, draws the workload),
`engine` then `ceiling` (bare forwards over the engine's step schedule), `vllm` once per
`--vllm-settings` entry (the engine and vLLM `--rounds` times, A B B A ..., each reporting its
median round), `hf_continuous` once per `--hf-batch-tokens` value (the best reported),
`hf_static`, `llamacpp`. A peer that is not installed is skipped, with a line saying so.
`single`: the same on one request (docs/benchmarks.md, "One request").
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.children import REPO_ROOT, Children
from bench.metrics import summarize
from bench.report import say
from bench.scenario import Scenario, comma_list

SYSTEMS = ("engine", "hf_continuous", "hf_static", "llamacpp", "vllm")
DEFAULT_PNG = Path("bench-results/bench.png")
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
# `--vllm-settings` entries and the system name each is reported as (bench/peer_vllm.py).
VLLM_SETTINGS = {"both-cores": "vllm", "default": "vllm_default"}
# What each system reports of its own, beside `summarize`'s figures; all but vLLM (its child
# runs in vLLM's environment) also report their RSS once loaded and the host's load (HOST).
DETAILS = {
    "engine": "overhead_fraction forward_s step_s scheduler kv_memory_bytes",
    "hf_continuous": "num_blocks tokens_per_block attn_implementation",
    "hf_static": "batch_size wasted_output_tokens padding_prompt_tokens attn_implementation",
    "llamacpp": "max_batch_tokens micro_batch_tokens context_tokens llama_threads llama_cpp_python system_info",
    "vllm": "vllm environment",
}
HOST = "load_rss_mb load_average_1m"
# The single-stream scenario's workload, where the flags are left at their defaults.
SINGLE_STREAM = {"requests": 1, "prompt_len": [100, 100], "output_len": [256, 256]}


def run(args: argparse.Namespace) -> dict:
    """The throughput (or single) scenario as `args` asks; prints a table, writes JSON/PNG,
    returns the report."""
    if args.scenario == "single":
        single_stream_workload(args)
    from bench.report import HostLoad, build_report, chart_path, format_table, write_json, write_png
    from bench.workload import WORKLOAD_FLAGS, Workload

    systems, sweep, vllm_settings = _checked(args)
    load = HostLoad()
    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        children = Children(Path(tmp), args.model, args.dtype, args.weights)
        prepared = children.run("prepare", **{name: getattr(args, name) for name in WORKLOAD_FLAGS})
        workload = Workload.load(children.workload_path)

        # The engine and vLLM, each --rounds times, alternating A B B A ... against the drift.
        def vllm_round(setting: str) -> dict:
            run = children.run_vllm(args.vllm_python, setting, prepared["model_folder"])
            return figures("vllm", run) | {"setting": setting}

        compared: dict[str, Callable[[], dict]] = {}
        if "engine" in systems:
            compared["engine"] = lambda: _engine_figures(children, args.speculation == "on")
        for setting in vllm_settings if "vllm" in systems else ():
            compared[VLLM_SETTINGS[setting]] = functools.partial(vllm_round, setting)
        rounds: dict[str, list[dict]] = {name: [] for name in compared}
        for i in range(args.rounds):
            for name in list(compared)[:: 1 if i % 2 == 0 else -1]:
                rounds[name].append(compared[name]())
        results = {name: median_round(runs) for name, runs in rounds.items()}
        if "hf_continuous" in systems:
            results["hf_continuous"] = _continuous_figures(children, sweep)
        for peer, params in (("hf_static", {"batch_size": args.static_batch}), ("llamacpp", {})):
            if peer in systems:
                results[peer] = figures(peer, children.run(peer, **params))

    settings = {name: getattr(args, name) for name in ("dtype", "weights", "speculation", "scenario")}
    description = workload.describe() | {"model": prepared["model"]} | settings
    environment = {
        "python": platform.python_version(),
        "torch": prepared["torch"],
        "transformers": prepared["transformers"],
        "torch_threads": prepared["torch_threads"],
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "one_process_per_system": True,
        **load.figures(),
    }
    report = build_report(description, environment, results)
    if args.json is not None:
        write_json(report, args.json)
    png = chart_path(args, DEFAULT_PNG)
    write_png(report, png)
    report_paths = ", ".join(str(p) for p in (args.json, png) if p is not None)
    print(format_table(report))
    print(f"wrote {report_paths}")
    return report


def without_missing_peers(systems: list[str], vllm_python: Path = DEFAULT_VLLM_PYTHON) -> list[str]:
    """`systems` less llamacpp where llama-cpp-python is not installed and less vllm where
    its environment is missing, with a line saying so."""
    if "vllm" in systems and not Path(vllm_python).exists():
        say(f"vllm skipped: {vllm_python} is missing (`make vllm-peer` builds it)")
        systems = [s for s in systems if s != "vllm"]
    from bench.peer_llamacpp import INSTALL_HINT, available

    if "llamacpp" not in systems or available():
        return systems
    say(f"llamacpp skipped: llama-cpp-python is not installed; {INSTALL_HINT}")
    return [s for s in systems if s != "llamacpp"]


def single_stream_workload(args: argparse.Namespace) -> None:
    """One request of SINGLE_STREAM's lengths, for each workload flag left at its default."""
    from bench.main import add_arguments

    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    for name, value in SINGLE_STREAM.items():
        if getattr(args, name) == defaults.get_default(name):
            setattr(args, name, value)


def median_round(runs: list[dict]) -> dict:
    """The round of median output tok/s (the lower of the middle two for an even count),
    with every round's tok/s where there were several."""
    ranked = sorted(runs, key=lambda run: run["output_tokens_per_s"])
    median = ranked[(len(ranked) - 1) // 2]
    if len(runs) == 1:
        return median
    return median | {"rounds_output_tokens_per_s": [run["output_tokens_per_s"] for run in runs]}


def figures(system: str, out: dict) -> dict:
    """A child's result as the report has it: `summarize`'s figures and the system's DETAILS."""
    keys = DETAILS[system] if system == "vllm" else f"{DETAILS[system]} {HOST}"
    return summarize(out["token_times"], out["peak_rss_mb"]) | {key: out[key] for key in keys.split()}


def _checked(args: argparse.Namespace) -> tuple[list[str], list[int], list[str]]:
    """The systems to run (less the peers that are not installed), the hf_continuous sweep
    and vLLM's settings, from the flags; a flag out of range exits with what it needs."""
    systems = comma_list(args.systems, "--systems", SYSTEMS)
    sweep = comma_list(args.hf_batch_tokens, "--hf-batch-tokens", cast=int) if "hf_continuous" in systems else []
    if min(sweep, default=1) < 1:
        raise SystemExit(f"--hf-batch-tokens needs positive integers, got {args.hf_batch_tokens!r}")
    for name in ("prompt_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            raise SystemExit(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    if args.requests < 1 or args.static_batch < 1 or args.rounds < 1:
        raise SystemExit("--requests, --static-batch and --rounds must be >= 1")
    vllm_settings = comma_list(args.vllm_settings, "--vllm-settings", tuple(VLLM_SETTINGS)) if "vllm" in systems else []
    return without_missing_peers(systems, args.vllm_python), sweep, vllm_settings


def _engine_figures(children: Children, speculation: bool) -> dict:
    """The engine's run, then the ceiling replay of its step schedule."""
    engine = children.run("engine", speculation=int(speculation))
    steps = engine["steps"]
    ceiling = children.run("ceiling", step_tokens=[s["num_tokens"] for s in steps])
    result = figures("engine", engine)
    return result | {
        # Bare eager forwards over the same schedule / the engine's wall time (see run_ceiling).
        "ceiling_fraction": ceiling["forward_s"] / result["wall_s"],
        "ceiling_forward_s": ceiling["forward_s"],
        "num_steps": len(steps),
        "mean_tokens_per_step": sum(s["num_tokens"] for s in steps) / max(1, len(steps)),
    }


def _continuous_figures(children: Children, sweep: list[int]) -> dict:
    """One child per max_batch_tokens value; the best by output tok/s, with the whole sweep."""
    outs = {n: children.run("hf_continuous", max_batch_tokens=n) for n in sweep}
    runs = {n: summarize(out["token_times"], out["peak_rss_mb"]) for n, out in outs.items()}
    best = max(runs, key=lambda n: runs[n]["output_tokens_per_s"])
    return figures("hf_continuous", outs[best]) | {
        "max_batch_tokens": best,
        "timing": "per-token timestamps taken by transformers' generation thread (record_timestamps=True)",
        "sweep": {str(n): run for n, run in runs.items()},
    }


THROUGHPUT = Scenario("throughput", run, own_report=True)
SINGLE = Scenario("single", run, own_report=True)
