"""The benchmark's outputs: progress lines, the host's load, the JSON report, a comparison
PNG and a text table."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Keys every system carries under `systems.<name>` (the contract).
SYSTEM_KEYS = tuple("output_tokens_per_s requests_per_s ttft_p50_s ttft_p99_s itl_p50_s itl_p99_s peak_rss_mb".split())
PEERS = ("hf_continuous", "hf_static", "llamacpp", "vllm", "vllm_default")


def say(what: str) -> None:
    """A progress line, on stderr: stdout carries the figures."""
    print(f"bench: {what}", file=sys.stderr, flush=True)


class HostLoad:
    """The host's 1-minute load average from now to `figures()`, and the seconds between:
    other processes on the host skew every figure, and this says whether there were any."""

    def __init__(self) -> None:
        self.before, self.started = os.getloadavg()[0], time.perf_counter()

    def figures(self) -> dict:
        load = [round(self.before, 2), round(os.getloadavg()[0], 2)]
        return {"load_average_1m": load, "elapsed_s": round(time.perf_counter() - self.started, 2)}


def build_report(workload: dict, environment: dict, systems: dict[str, dict]) -> dict:
    """`systems` maps a name to its figures (SYSTEM_KEYS and extras); adds the engine's ratios."""
    report: dict = {"workload": workload, "environment": environment, "systems": systems}
    for peer in PEERS:  # the throughput ratio; null when either side did not run
        ran = "engine" in systems and peer in systems
        ratio = systems["engine"]["output_tokens_per_s"] / systems[peer]["output_tokens_per_s"] if ran else None
        report[f"engine_vs_{peer}"] = ratio
    return report


def write_json(report: dict, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def write_png(report: dict, path: Path) -> None:
    """Three panels: output tok/s, TTFT p50/p99 and ITL p50/p99, one bar (group) per system."""
    systems = report["systems"]
    names = list(systems)
    x = range(len(names))
    fig, axes = _figure(3, (13, 4.2))

    _labelled_bars(axes[0], list(x), [systems[n]["output_tokens_per_s"] for n in names], 0.6, "tab:blue", "{:.1f}")
    axes[0].set_title("Output throughput (tok/s, higher is better)")

    width = 0.38
    for ax, metric, scale, unit, fmt in ((axes[1], "ttft", 1, "s", "{:.1f}"), (axes[2], "itl", 1000, "ms", "{:.0f}")):
        for offset, q, color in ((-width / 2, "p50", "tab:green"), (width / 2, "p99", "tab:red")):
            values = [systems[n][f"{metric}_{q}_s"] * scale for n in names]
            _labelled_bars(ax, [i + offset for i in x], values, width, color, fmt, label=q)
        ax.set_title(f"{metric.upper()} p50/p99 ({unit}, lower is better)")
        ax.legend()
    # An ITL p99 can be orders of magnitude above its p50 (a long prefill step between two decodes).
    axes[2].set_yscale("log")
    axes[2].set_title("ITL p50/p99 (ms, log scale, lower is better)")

    for ax in axes:
        ax.set_xticks(list(x), names, rotation=15)
    workload = report["workload"]
    fig.suptitle(
        f"{workload.get('model', '')}: {workload['requests']} requests, prompts {workload['prompt_len']}, "
        f"outputs {workload['output_len']} tokens, all at t0",
        fontsize=10,
    )
    _save(fig, path)


def write_bar_panels(panels: list[tuple[str, dict[str, float], str]], path: Path, title: str) -> None:
    """One bar chart per panel, side by side: `(panel title, {bar label: value}, value format)`."""
    count = max(1, len(panels))
    fig, axes = _figure(count, (4.2 * count, 4.4))
    for ax, (panel_title, bars, fmt) in zip(axes, panels):
        x = list(range(len(bars)))
        _labelled_bars(ax, x, list(bars.values()), 0.6, "tab:blue", fmt)
        ax.set_xticks(x, list(bars), rotation=20, fontsize=8)
        ax.set_title(panel_title, fontsize=9)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def chart_path(args, default: Path) -> Path:
    """Where a scenario's chart goes: `--png`, else next to `--json`, else `default`."""
    return args.png or (args.json.with_suffix(".png") if args.json is not None else default)


def _figure(panels: int, size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    return fig, list(axes[0])


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def system_panel(title: str, systems: dict[str, dict], key: str, fmt: str, scale: float = 1.0) -> tuple:
    """A `write_bar_panels` panel: one bar per system of its figure `key` (times `scale`);
    a system without that figure has no bar."""
    return title, {name: f[key] * scale for name, f in systems.items() if f.get(key) is not None}, fmt


def _labelled_bars(ax, xs, values, width, color, fmt, label=None) -> None:
    bars = ax.bar(xs, values, width, color=color, label=label)
    ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=7)


def format_table(report: dict) -> str:
    """A fixed-width table of every system's figures, then the engine's extras and ratios."""
    columns = {"tok/s": ("output_tokens_per_s", "{:.1f}"), "req/s": ("requests_per_s", "{:.3f}"),
               "TTFT p50": ("ttft_p50_s", "{:.2f}s"), "TTFT p99": ("ttft_p99_s", "{:.2f}s"),
               "ITL p50": ("itl_p50_s", "{:.0f}ms"), "ITL p99": ("itl_p99_s", "{:.0f}ms"),
               "peak RSS": ("peak_rss_mb", "{:.0f}MB"), "wall": ("wall_s", "{:.1f}s")}  # fmt: skip

    def cell(value, fmt: str) -> str:
        return "-" if value is None else fmt.format(value * 1000 if fmt.endswith("ms") else value)

    rows = [["system", *columns]]
    rows += [[name, *(cell(f.get(key), fmt) for key, fmt in columns.values())] for name, f in report["systems"].items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    # System names left-aligned, figures right-aligned.
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))

    engine = report["systems"].get("engine")
    if engine is not None:
        lines.append(f"engine overhead_fraction: {engine['overhead_fraction']:.3f}")
        if engine.get("ceiling_fraction") is not None:
            lines.append(f"engine ceiling_fraction:  {engine['ceiling_fraction']:.3f}")
    continuous = report["systems"].get("hf_continuous")
    if continuous is not None and "sweep" in continuous:
        sweep = ", ".join(f"{k}: {v['output_tokens_per_s']:.1f}" for k, v in continuous["sweep"].items())
        lines.append(f"hf_continuous max_batch_tokens sweep (tok/s): {sweep}; best {continuous['max_batch_tokens']}")
    for peer in PEERS:
        if report.get(f"engine_vs_{peer}") is not None:
            lines.append(f"engine vs {peer}: {report[f'engine_vs_{peer}']:.2f}x output tok/s")
    if report["workload"]["requests"] == 1:
        gaps = ", ".join(f"{name} {f['itl_p50_s'] * 1000:.1f} ms" for name, f in report["systems"].items())
        lines.append(f"time between tokens (p50, one request): {gaps}")
    return "\n".join(lines)
