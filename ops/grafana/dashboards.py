"""The Grafana dashboard, as code: `make dashboards` (`python ops/grafana/dashboards.py`)
writes `ops/grafana/dashboards/inflight.json`, which is committed and provisioned as is.

The panels are built with Grafana's own typed builders (grafana-foundation-sdk, a `dev`
dependency), so the JSON has the shape Grafana's dashboard schema expects. Only this
generator needs them: the worker never imports it, and Grafana reads the committed JSON.

Edit the panels here, never the JSON; `tests/ops/test_dashboards.py` fails when the JSON is
stale, holds a field Grafana's typed model does not know, or a panel queries a metric the
worker does not export, and
`tests/service/test_observability.py` runs every query against a real Prometheus scraping a
real worker. Queries use `$__rate_interval`, which Grafana fills in from the scrape
interval.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from grafana_foundation_sdk.builders.common import VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TimeZoneBrowser,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUTPUT = Path(__file__).parent / "dashboards" / "inflight.json"
# As provisioned in provisioning/datasources.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="inflight-prometheus")
RATE = "$__rate_interval"
WIDTH, HEIGHT = 12, 8  # two panels a row


def quantiles(metric: str, qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}])))", f"p{round(q * 100)}") for q in qs]


def mean_per_step(metric: str, by: str) -> tuple[str, str]:
    return (
        f"sum by ({by}) (rate({metric}_sum[{RATE}])) / sum by ({by}) (rate({metric}_count[{RATE}]))",
        f"{{{{{by}}}}}",
    )


# (section, [(title, unit, [(expr, legend)], description)])
SECTIONS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    (
        "Throughput",
        [
            (
                "Tokens per second",
                "short",
                [
                    (f"sum(rate(inflight_generation_tokens_total[{RATE}]))", "generated"),
                    (f"sum(rate(inflight_prompt_tokens_total[{RATE}]))", "prompt"),
                ],
                "Tokens of finished requests, all workers.",
            ),
            (
                "Requests per second by outcome",
                "reqps",
                [
                    (f"sum by (outcome) (rate(inflight_requests_total[{RATE}]))", "{{outcome}}"),
                ],
                "Finish reason, or rejected before reaching the engine.",
            ),
        ],
    ),
    (
        "Latency",
        [
            (
                "Time to first token",
                "s",
                quantiles("inflight_time_to_first_token_seconds"),
                "From arrival at the engine.",
            ),
            (
                "Inter-token latency",
                "s",
                quantiles("inflight_inter_token_latency_seconds"),
                "Between consecutive tokens.",
            ),
            ("End-to-end latency", "s", quantiles("inflight_request_duration_seconds"), "Arrival to final event."),
            ("Queue time", "s", quantiles("inflight_queue_time_seconds"), "Arrival to first scheduled."),
            (
                "Publish lag",
                "s",
                quantiles("inflight_publish_lag_seconds"),
                "From the step that produced a reply event to its write landing in Redis.",
            ),
        ],
    ),
    (
        "Queues",
        [
            (
                "Requests by state and priority",
                "short",
                [
                    ("sum by (state, priority) (inflight_scheduler_requests)", "{{state}} p{{priority}}"),
                ],
                "Running, waiting and swapped requests in the engines.",
            ),
            (
                "Ingest lag and pending entries",
                "short",
                [
                    ("max(inflight_ingest_lag_entries)", "lag (not yet delivered)"),
                    ("max(inflight_ingest_pending_entries)", "pending (delivered, not acked)"),
                ],
                "The request stream's consumer group, as Redis reports it.",
            ),
            (
                "Oldest waiting request",
                "s",
                [
                    ("max(inflight_oldest_waiting_age_seconds)", "age"),
                ],
                "Time since arrival of the longest-waiting queued request (starvation).",
            ),
            (
                "Workers up",
                "short",
                [
                    ('sum(up{job="inflight"})', "up"),
                ],
                "Workers Prometheus scraped successfully.",
            ),
        ],
    ),
    (
        "Tenants and batch jobs",
        [
            (
                "Tokens served by tenant",
                "short",
                [
                    (
                        f"sum by (tenant, class, kind) (rate(inflight_tenant_tokens_total[{RATE}]))",
                        "{{tenant}} {{class}} {{kind}}",
                    ),
                ],
                "Tokens per second all workers served each tenant, interactive and batch jobs apart: output "
                "tokens as generated, prompt tokens as their requests end. (other): the tenants past the first "
                "100 a worker saw.",
            ),
            (
                "Queued jobs by tenant",
                "short",
                [
                    ("max by (tenant) (inflight_tenant_queued_requests)", "{{tenant}}"),
                ],
                "Jobs admitted into each tenant's queues and not yet taken by a worker (--fair-queue): what "
                "--max-queued-jobs and --tenant-max-queued-jobs count. Every worker reports the same.",
            ),
            (
                "Queued prompt tokens by tenant",
                "short",
                [
                    ("max by (tenant) (inflight_tenant_queued_tokens)", "{{tenant}}"),
                ],
                "Prompt tokens of those jobs: what --max-queued-tokens and --tenant-max-queued-tokens count.",
            ),
            (
                "Refusals by tenant and code",
                "reqps",
                [
                    (f"sum by (tenant, code) (rate(inflight_refused_requests_total[{RATE}]))", "{{tenant}} {{code}}"),
                ],
                "Jobs refused at admission per second: queue_full (a cap on queued jobs or tokens) or "
                "quota_exceeded (the tenant's --tenant-tokens-per-s). The producer was told to retry after "
                "retry_after_s.",
            ),
            (
                "Batch backlog",
                "short",
                [
                    ("max(inflight_batch_queued_requests)", "batch jobs queued"),
                    (
                        f'sum(rate(inflight_tenant_tokens_total{{class="batch", kind="output"}}[{RATE}]))',
                        "batch output tokens/s",
                    ),
                ],
                "Batch jobs admitted and not yet taken (--fair-queue; workers take them only when no interactive "
                "job is queued), and the output tokens batch jobs are served per second.",
            ),
            (
                "Batch capacity used",
                "percentunit",
                [
                    (
                        f'sum(rate(inflight_tenant_tokens_total{{class="batch", kind="output"}}[{RATE}]))'
                        f' / clamp_min(sum(rate(inflight_tenant_tokens_total{{kind="output"}}[{RATE}])), 1e-9)',
                        "output tokens (0 when idle)",
                    ),
                    (
                        f'sum(rate(inflight_tenant_tokens_total{{class="batch", kind="prompt"}}[{RATE}]))'
                        f' / clamp_min(sum(rate(inflight_tenant_tokens_total{{kind="prompt"}}[{RATE}])), 1e-9)',
                        "prompt tokens (0 when idle)",
                    ),
                ],
                "Batch jobs' share of the output and of the prompt tokens served, all workers: the capacity "
                "they used, which interactive jobs left free (they preempt batch jobs the step they need room).",
            ),
        ],
    ),
    (
        "KV cache",
        [
            (
                "KV cache usage",
                "percentunit",
                [
                    ("max by (pool) (inflight_kv_cache_usage_ratio)", "{{pool}}"),
                ],
                "Fraction of blocks in use: device pool and host (swap) pool.",
            ),
            (
                "KV blocks",
                "short",
                [
                    ("sum by (pool, state) (inflight_kv_cache_blocks)", "{{pool}} {{state}}"),
                ],
                "Used and free blocks per pool.",
            ),
            (
                "Preemptions",
                "short",
                [
                    (f"sum by (mode) (rate(inflight_preemptions_total[{RATE}]))", "{{mode}}"),
                ],
                "Running requests preempted per second: swapped to host, or sent back to recompute.",
            ),
            (
                "Swaps",
                "short",
                [
                    (f"sum by (direction) (rate(inflight_swapped_blocks_total[{RATE}]))", "blocks {{direction}}"),
                    (f"sum by (direction) (rate(inflight_swapped_requests_total[{RATE}]))", "requests {{direction}}"),
                ],
                "KV blocks and requests moved between device and host per second.",
            ),
        ],
    ),
    (
        "Prefix cache",
        [
            (
                "Prefix cache hit rate",
                "percentunit",
                [
                    (
                        f"sum by (tier) (rate(inflight_prefix_cache_hit_tokens_total[{RATE}]))"
                        f" / ignoring (tier) group_left sum(rate(inflight_prefix_cache_queried_tokens_total[{RATE}]))",
                        "{{tier}}",
                    ),
                    (
                        f"sum(rate(inflight_prefix_cache_hit_tokens_total[{RATE}]))"
                        f" / sum(rate(inflight_prefix_cache_queried_tokens_total[{RATE}]))",
                        "either tier",
                    ),
                ],
                "Fraction of admitted requests' tokens found cached: in the device pool, or in the "
                "host tier (copied back).",
            ),
            (
                "Prefix cache blocks",
                "short",
                [
                    ("sum by (tier) (inflight_prefix_cache_blocks)", "{{tier}}"),
                ],
                "KV blocks registered in the prefix cache, held by requests or free to evict.",
            ),
            (
                "Prefix cache evictions",
                "short",
                [
                    (f"sum by (tier) (rate(inflight_prefix_cache_evicted_blocks_total[{RATE}]))", "evicted {{tier}}"),
                    (f"sum(rate(inflight_prefix_cache_offloaded_blocks_total[{RATE}]))", "offloaded to host"),
                ],
                "Cached blocks dropped per second to reuse the block, and device evictions copied to the host tier.",
            ),
        ],
    ),
    (
        "Steps",
        [
            (
                "Batch composition (tokens per step)",
                "short",
                [
                    mean_per_step("inflight_step_tokens", "kind"),
                ],
                "Mean prefill and decode tokens in a step.",
            ),
            (
                "Step time",
                "s",
                quantiles("inflight_step_duration_seconds")
                + [
                    (f"sum(rate(inflight_step_duration_seconds_count[{RATE}]))", "steps/s"),
                ],
                "Wall time of one engine step.",
            ),
            (
                "Budget saturation",
                "percentunit",
                [
                    mean_per_step("inflight_step_budget_used_ratio", "budget"),
                ],
                "Mean fraction of each token budget a step used: batch, prefill, decode.",
            ),
        ],
    ),
    (
        "Speculative decoding",
        [
            (
                "Draft tokens",
                "short",
                [
                    (f"sum by (kind) (rate(inflight_speculative_tokens_total[{RATE}]))", "{{kind}}/s"),
                    (
                        f'sum(rate(inflight_speculative_tokens_total{{kind="accepted"}}[{RATE}]))'
                        f' / clamp_min(sum(rate(inflight_speculative_tokens_total{{kind="drafted"}}[{RATE}])), 1e-9)',
                        "acceptance (0 when none drafted)",
                    ),
                ],
                "Prompt-lookup draft tokens verified and accepted per second, and the accepted "
                "share. Requests below the "
                "acceptance threshold stop drafting for a cool-down, so a low share should not last.",
            ),
            (
                "Draft acceptance per verification",
                "short",
                [
                    (f"sum by (le) (rate(inflight_speculative_acceptance_ratio_bucket[{RATE}]))", "≤ {{le}}"),
                ],
                "Verifications per second whose accepted / drafted share is at most each bucket's bound (cumulative): "
                "copying requests sit at 1, requests about to be gated below 0.5.",
            ),
        ],
    ),
    (
        "Output-length prediction",
        [
            (
                "Predicted against actual length",
                "short",
                [
                    (f"sum by (le) (rate(inflight_length_prediction_log2_ratio_bucket[{RATE}]))", "≤ {{le}}"),
                ],
                "Requests per second whose log2(actual / predicted) output length is at most each bound "
                "(cumulative): 0 is exact, 1 twice as long as predicted. Empty without --length-policy.",
            ),
            (
                "Ranking quality and early refusals",
                "short",
                [
                    ("inflight_length_prediction_tau_ratio", "Kendall tau, last 256 ended ({{instance}})"),
                    (
                        f'sum(rate(inflight_dead_letters_total{{code="deadline_unmeetable"}}[{RATE}]))',
                        "refused as deadline_unmeetable /s",
                    ),
                ],
                "How well predicted lengths order requests (1 perfect, 0 no better than chance), and jobs "
                "refused when read because their predicted finish missed their deadline.",
            ),
        ],
    ),
    (
        "Disaggregated prefill and decode",
        [
            (
                "Handoffs by outcome",
                "reqps",
                [
                    (f"sum by (outcome) (rate(inflight_handoff_requests_total[{RATE}]))", "{{outcome}}"),
                ],
                "Jobs per second through the handoff (--role prefill / decode): handed_off by prefill workers; "
                "then, on decode workers, kv_read (the prompt's K/V read with NIXL), kv_computed (none to read: "
                "expired, the prefill worker gone, its handoff memory full, no transfer engine) or kv_failed (a "
                "read failed). The last two compute the prompt again. Zero on colocated workers.",
            ),
            (
                "KV transfer throughput",
                "Bps",
                [
                    (f"sum(rate(inflight_kv_transfer_bytes_total[{RATE}]))", "moved"),
                    (
                        f"sum(rate(inflight_kv_transfer_bytes_total[{RATE}]))"
                        f" / sum(rate(inflight_kv_transfer_seconds_sum[{RATE}]))",
                        "while reading",
                    ),
                ],
                "Prompt K/V decode workers read from prefill workers: bytes per second of wall time (moved), and "
                "bytes over the time the reads took (while reading: the transfer's own speed).",
            ),
            (
                "KV transfer time",
                "s",
                quantiles("inflight_kv_transfer_seconds", (0.5, 0.99)),
                "One prompt's K/V read by a decode worker, from asking the prefill worker to having them.",
            ),
            (
                "KV held for handoff",
                "bytes",
                [
                    ("sum by (instance) (inflight_handoff_kv_held_bytes)", "{{instance}}"),
                ],
                "Handoff memory in use (--handoff-memory-mb): on a prefill worker, prompts staged until a decode "
                "worker confirms (or --handoff-hold-s passes); on a decode worker, K/V read and not yet placed. "
                "Full, a handoff carries no K/V.",
            ),
            (
                "Handoffs waiting",
                "short",
                [
                    ("max by (instance) (inflight_ingest_lag_entries)", "{{instance}} not yet taken"),
                    ("max by (instance) (inflight_ingest_pending_entries)", "{{instance}} taken, not finished"),
                ],
                "Each worker's consumer-group lag and pending entries on the stream it reads. A decode worker "
                "reads the handoff stream: its lines are handoffs no decode worker has taken yet (a growing lag: "
                "the decode pool is short) and those being decoded. A prefill or colocated worker's lines are "
                "the request stream's, as in Queues.",
            ),
        ],
    ),
    (
        "Gateway",
        [
            (
                "Gateway requests by route and status",
                "reqps",
                [
                    (f"sum by (route, status) (rate(inflight_gateway_requests_total[{RATE}]))", "{{route}} {{status}}"),
                ],
                "HTTP answers of the OpenAI-compatible gateways: 429 is backpressure, 499 a client "
                "gone before any answer.",
            ),
            (
                "Gateway time to first token",
                "s",
                quantiles("inflight_gateway_time_to_first_token_seconds"),
                "Streamed requests, from arrival at the gateway to the first token sent: the queue, "
                "the worker and both hops.",
            ),
            (
                "Gateway request duration",
                "s",
                quantiles("inflight_gateway_request_duration_seconds"),
                "From a completion's arrival to the end of its answer.",
            ),
            (
                "Gateway streams and cancels",
                "short",
                [
                    ("sum(inflight_gateway_requests_in_progress)", "in progress"),
                    (f"sum by (reason) (rate(inflight_gateway_cancels_total[{RATE}]))", "cancels/s ({{reason}})"),
                ],
                "Completions being answered now; jobs cancelled because the client left or no reply came in time.",
            ),
            (
                "Gateway backlog",
                "short",
                [
                    ("max(inflight_gateway_queue_depth_entries)", "jobs no worker took yet"),
                    ("max(inflight_gateway_queue_age_seconds)", "oldest one's wait (s)"),
                ],
                "What the gateways' backpressure sees: over --max-queue-depth or --max-queue-age-s, "
                "new requests get 429.",
            ),
        ],
    ),
    (
        "Errors",
        [
            (
                "Errors and rejections",
                "reqps",
                [
                    (
                        f'sum by (outcome) (rate(inflight_requests_total{{outcome=~"error|rejected"}}[{RATE}]))',
                        "{{outcome}}",
                    ),
                ],
                "Requests that ended in an error or were rejected.",
            ),
            (
                "Dead letters",
                "short",
                [
                    (f"sum by (code) (increase(inflight_dead_letters_total[{RATE}]))", "{{code}}"),
                    ("max(inflight_dead_letter_stream_entries)", "in the dead-letter stream"),
                ],
                "Entries parked on the dead-letter stream, by error code.",
            ),
        ],
    ),
]


def timeseries_panel(
    panel_id: int, title: str, unit: str, targets: list[tuple[str, str]], description: str
) -> Timeseries:
    panel = (
        Timeseries()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(WIDTH)
        .height(HEIGHT)
        .unit(unit)
        # Said outright: the builders' defaults would hide the legend and sort the tooltip.
        .legend(
            VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
        )
        .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.NONE))
    )
    for i, (expr, legend) in enumerate(targets):
        panel.with_target(
            PrometheusQuery().ref_id(chr(ord("A") + i)).datasource(DATASOURCE).expr(expr).legend_format(legend)
        )
    return panel


def dashboard() -> Dashboard:
    """Each section is an expanded row; the builder lays its panels out below it, two a row."""
    builder = (
        Dashboard("inflight")
        .uid("inflight-overview")
        .description(
            "LLM inference workers: throughput, latency, queues, tenants and batch jobs, KV cache, prefix cache, "
            "steps, disaggregated prefill and decode, the gateway, errors."
        )
        .tags(["inflight"])
        .timezone(TimeZoneBrowser)
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .version(1)
    )
    panel_ids = itertools.count(1)
    for section, section_panels in SECTIONS:
        builder.with_row(Row(section).id(next(panel_ids)))
        for title, unit, targets, description in section_panels:
            builder.with_panel(timeseries_panel(next(panel_ids), title, unit, targets, description))
    return builder


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(dashboard().build()) + "\n"


if __name__ == "__main__":
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}", file=sys.stderr)
