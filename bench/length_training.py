"""`inflight train-length-predictor`: fit the output-length predictor
(`workers/length_predictor.py`) to the served model's own replies to ShareGPT prompts.

The model answers each training prompt twice, greedy and sampled, EOS honoured and
capped at `--max-tokens` (a reply cut there counts as the cap). Training prompts are
the conversations of even index, the held-out ones those of odd index, so
`inflight bench --scenario length` (odd) never serves a prompt the predictor saw. The
ridge strength is picked on a fifth of the training prompts, then the fit is redone on
all of them and scored on the held-out prompts' greedy replies: Kendall's τ between
predicted and actual lengths (the order the scheduler uses) and the mean absolute error
in tokens. The file goes into the model cache, where the engine looks first. `greedy_vs_sampled_tau`
ranks the greedy and the sampled reply of each training prompt against each other: how
much of a reply's length the prompt decides at all, a ceiling for any predictor's τ.
`--reuse-lengths` refits from the lengths a previous run wrote (`--lengths-json`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from gpu.hf_module import HFModule

RIDGES = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="the served model (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=600, help="training prompts (each answered twice)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out prompts (answered greedily)")
    parser.add_argument("--max-tokens", type=int, default=512, help="the reply cap")
    parser.add_argument("--temperature", type=float, default=0.7, help="of the sampled replies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="the predictor file (default: the model cache's)")
    parser.add_argument("--lengths-json", default=None, help="also write every prompt's measured lengths here")
    parser.add_argument(
        "--reuse-lengths",
        action="store_true",
        help="read the lengths from --lengths-json (a run with the same prompts) instead of generating them",
    )


def run(args: argparse.Namespace) -> dict:
    from bench.sharegpt import make_sharegpt_workload
    from workers.api import GenerationRequest, SamplingParams
    from workers.config import EngineConfig, ModelConfig, SchedulerConfig
    from workers.engine import Engine
    from workers.length_predictor import fit, kendall_tau, model_predictor_path, prompt_features
    from workers.model_loader import load_model

    model_config = ModelConfig(source=args.model, dtype=args.dtype)
    loaded = load_model(model_config)
    engine = Engine(loaded, EngineConfig(model=model_config, scheduler=SchedulerConfig(max_running_requests=64)))
    tokenizer = loaded.tokenizer
    train = make_sharegpt_workload(tokenizer, args.prompts, args.max_tokens, args.seed, keep=training_prompt).requests
    held_out = make_sharegpt_workload(
        tokenizer, args.held_out, args.max_tokens, args.seed, keep=held_out_prompt
    ).requests

    greedy = SamplingParams(max_tokens=args.max_tokens)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    jobs = [(f"g{i}", r.prompt_ids, greedy) for i, r in enumerate(train)]
    jobs += [(f"s{i}", r.prompt_ids, sampled) for i, r in enumerate(train)]
    jobs += [(f"h{i}", r.prompt_ids, greedy) for i, r in enumerate(held_out)]
    started = time.perf_counter()
    if args.reuse_lengths:
        with open(args.lengths_json) as file:
            lengths = json.load(file)["lengths"]
        if missing := [job[0] for job in jobs if job[0] not in lengths]:
            raise SystemExit(f"{args.lengths_json} lacks {len(missing)} of these prompts' lengths, e.g. {missing[0]}")
    else:
        lengths = _generate(engine, GenerationRequest, jobs)
    generate_s = time.perf_counter() - started

    embedding: HFModule = loaded.model.get_input_embeddings()  # its weight is a tensor
    embeddings = embedding.weight.detach().float().numpy()
    train_x = np.stack([prompt_features(embeddings, r.prompt_ids) for r in train])
    train_x = np.concatenate([train_x, train_x])
    greedy_y = [lengths[f"g{i}"] for i in range(len(train))]
    sampled_y = [lengths[f"s{i}"] for i in range(len(train))]
    train_y = np.array(greedy_y + sampled_y)
    ridge = _pick_ridge(train_x, train_y, len(train))
    regression = fit(train_x, train_y, ridge)
    predictor = regression.fold(embeddings)
    predicted = [predictor.predict(r.prompt_ids) for r in held_out]
    actual = [lengths[f"h{i}"] for i in range(len(held_out))]
    path = model_predictor_path(model_config) if args.output is None else Path(args.output)
    regression.save(path)
    figures = {
        "model": loaded.name,
        "file": str(path),
        "train_prompts": len(train),
        "held_out_prompts": len(held_out),
        "ridge": ridge,
        "kendall_tau": round(kendall_tau(predicted, actual), 3),
        "mae_tokens": round(float(np.mean(np.abs(np.array(predicted) - np.array(actual)))), 1),
        "baseline_mae_tokens": round(float(np.mean(np.abs(np.median(train_y) - np.array(actual)))), 1),
        "held_out_mean_len": round(float(np.mean(actual)), 1),
        # How far the model's own length is from a function of its prompt: one greedy and
        # one sampled reply to the same prompts ranked against each other.
        "greedy_vs_sampled_tau": round(kendall_tau(greedy_y, sampled_y), 3),
        "capped_share": round(float(np.mean(np.array(list(lengths.values())) >= args.max_tokens)), 3),
        "generate_s": round(generate_s, 1),
    }
    if args.lengths_json and not args.reuse_lengths:
        with open(args.lengths_json, "w") as file:
            json.dump({"figures": figures, "lengths": lengths}, file)
    print(json.dumps(figures, indent=2))
    return figures


def training_prompt(index: int) -> bool:
    return index % 2 == 0


def held_out_prompt(index: int) -> bool:
    return index % 2 == 1


def _generate(engine, request_type, jobs) -> dict[str, int]:
    """Every job's reply length in tokens, all of them through one engine."""
    from workers.api import FinalEvent

    for request_id, prompt_ids, params in jobs:
        engine.add_request(request_type(request_id, prompt_ids, params))
    lengths: dict[str, int] = {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, FinalEvent):
                if event.error:
                    raise RuntimeError(f"{event.request_id}: {event.error}")
                lengths[event.request_id] = event.usage.completion_tokens
    return lengths


def _pick_ridge(x: np.ndarray, y: np.ndarray, num_prompts: int) -> float:
    """The ridge strength whose fit on four fifths of the prompts ranks the last fifth best."""
    from workers.length_predictor import fit, kendall_tau

    cut = num_prompts * 4 // 5
    rows = np.arange(len(x)) % num_prompts < cut  # both replies of a prompt on the same side
    best, best_tau = RIDGES[0], -math.inf
    for ridge in RIDGES:
        regression = fit(x[rows], y[rows], ridge)
        tau = kendall_tau(_predict_features(regression, x[~rows]), y[~rows])
        if tau > best_tau:
            best, best_tau = ridge, tau
    return best


def _predict_features(regression, x: np.ndarray) -> np.ndarray:
    hidden = regression.whole.shape[0]
    return (
        x[:, :hidden] @ regression.whole
        + x[:, hidden : 2 * hidden] @ regression.tail
        + (regression.length_weight * x[:, -1] + regression.bias)
    )
