"""A scenario of `inflight bench`: its flags, a run that returns its figures, and for some a
chart. The registry imports each scenario module when asked: one that needs a missing
package (redis on a GPU host's stock image) is still listed, its flags absent."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[argparse.Namespace], dict | Coroutine[None, None, dict]]  # the figures (async: run on uvloop)
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None  # its own --help group
    chart_panels: Callable[[dict], list[tuple]] | None = None  # (title, bars, format) per panel
    own_report: bool = False  # writes its report itself (throughput, single), else the harness does

    def figures(self, args: argparse.Namespace) -> dict:
        """The run's figures; an async run's on uvloop, the loop a worker runs on."""
        figures = self.run(args)
        if isinstance(figures, Coroutine):
            import uvloop

            return uvloop.run(figures)
        return figures


D = " (default: %(default)s)"  # a flag's help that shows its default ends with this


def add_flags(parser: argparse.ArgumentParser, title: str, flags: dict[str, tuple]):
    """A `--help` group of flags, each `--name: (default, help[, choices])`, typed by its
    default: False is a switch, a [MIN, MAX] list a length range (inclusive)."""
    group = parser.add_argument_group(title)
    for name, (default, text, *rest) in flags.items():
        choices = rest[0] if rest else None
        if isinstance(default, bool):
            group.add_argument(name, action="store_true", help=text)
        elif isinstance(default, list):
            group.add_argument(name, type=int, nargs=2, default=default, metavar=("MIN", "MAX"), help=text)
        else:
            group.add_argument(name, type=type(default), default=default, help=text, choices=choices)
    return group


def comma_list(text: str, flag: str, allowed: tuple = (), cast: Callable = str, count: int | None = None,
               empty: bool = False) -> list:  # fmt: skip
    """A comma-separated flag's values, cast: at least one unless `empty` (exactly `count` if
    given), each of `allowed` if given; else the run exits saying what the flag takes."""
    wanted = f"some of {','.join(allowed)}" if allowed else f"{count or 'some'} {cast.__name__} values"
    try:
        values = [cast(value.strip()) for value in text.split(",") if value.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes {wanted}, comma-separated, got {text!r}") from None
    if (not values and not empty) or (count and len(values) != count) or (allowed and set(values) - set(allowed)):
        raise SystemExit(f"{flag} takes {wanted}, comma-separated, got {text!r}")
    return values


def with_model(run: Callable) -> Callable[[argparse.Namespace], dict]:
    """`run(loaded, args, vocab_ids)` as a scenario's run, on the bench's model loaded here."""

    def loaded_run(args: argparse.Namespace) -> dict:
        from bench.workload import prompt_vocabulary
        from workers.config import ModelConfig
        from workers.model_loader import load_model

        loaded = load_model(ModelConfig(source=args.model, dtype=args.dtype))
        return run(loaded, args, prompt_vocabulary(loaded.tokenizer, loaded.model.config.vocab_size))

    return loaded_run


# Every scenario, in the order `--help` lists their flags: where its SCENARIO is declared.
REGISTRY = {
    "throughput": "bench.throughput:THROUGHPUT", "single": "bench.throughput:SINGLE",
    "storm": "bench.storm", "priority": "bench.priority", "swap": "bench.swap", "prefix": "bench.prefix",
    "scheduler": "bench.scheduler_cost", "redis": "bench.through_redis", "edge": "bench.edge", "soak": "bench.soak",
    "intake": "bench.intake", "overhead": "bench.overhead", "gateway": "bench.gateway",
    "structured": "bench.structured", "spec": "bench.spec", "serve": "bench.serve", "length": "bench.length",
    "disagg": "bench.disagg", "tenants": "bench.tenants", "tp": "bench.tp",
}  # fmt: skip


def scenario(name: str) -> Scenario:
    """The scenario registered as `name`; an ImportError names a package it needs that is missing."""
    module, _, attribute = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), attribute or "SCENARIO")
