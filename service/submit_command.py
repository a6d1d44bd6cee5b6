"""`inflight submit`: one prompt through Redis, its answer streamed to the terminal (the
producer SDK's `SyncClient`, `service/sdk.py`), with its flags; and `inflight
load-adapter`, which asks a stream's workers to load a LoRA adapter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.config import RedisConfig
from service.flags import default_queue_url


def add_submit_arguments(submit: argparse.ArgumentParser) -> None:
    """The flags of `inflight submit`."""
    submit.add_argument("prompt", help="the text; sent as a chat message unless --raw")
    submit.add_argument("--raw", action="store_true", help="send the text as a plain prompt, not a chat message")
    submit.add_argument("--max-tokens", type=int, default=64)
    submit.add_argument("--temperature", type=float, default=0.0)
    submit.add_argument("--priority", type=int, default=0, help="-10..10, higher first")
    submit.add_argument(
        "--tenant",
        type=_tenant_name,
        help="who the job is for: fair share, caps and quotas count per tenant (default: default)",
    )
    submit.add_argument(
        "--adapter",
        type=_adapter_name,
        metavar="NAME",
        help="the LoRA adapter to answer with, as the workers loaded it (default: the base model)",
    )
    submit.add_argument(
        "--batch", action="store_true", help="a batch job: it runs only on capacity interactive jobs leave free"
    )
    submit.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        default=None,
        help="after the answer, list each token's log probability and its K most likely alternatives (0..20) on stderr",
    )
    shape = submit.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema", type=Path, metavar="FILE", help="the answer is JSON valid under this JSON schema file"
    )
    shape.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    shape.add_argument("--regex", help="the answer fully matches this regular expression")
    shape.add_argument("--choice", action="append", help="the answer is exactly one of these strings (repeatable)")
    submit.add_argument(
        "--redis-url",
        default=default_queue_url(),
        help="default: $REDIS_URL, else the embedded server's address (%(default)s)",
    )
    submit.add_argument("--requests-stream", default=RedisConfig().requests_stream)
    submit.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="give up when no reply arrives for this long, e.g. no worker is running; "
        "0 waits forever (default: %(default)s)",
    )


def _output_shape(args: argparse.Namespace) -> dict:
    """The job's structured-output field, from `--json-schema`, `--json-object`, `--regex` or `--choice`."""
    import json

    if args.json_schema is not None:
        try:
            return {"json_schema": json.loads(args.json_schema.read_text())}
        except json.JSONDecodeError as error:
            raise ValueError(f"{args.json_schema} is not JSON: {error}") from None
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return {}


def _tenant_name(text: str) -> str:
    """--tenant's value, checked as a worker checks it (a usage error, not a dead letter)."""
    from service.protocol import TENANT_PATTERN

    if not TENANT_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError("must be 1-64 characters of letters, digits and _ . @ -")
    return text


def _adapter_name(text: str) -> str:
    """--adapter's value, checked as a worker checks it."""
    from service.adapters import check_name

    try:
        return check_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_load_adapter_arguments(load: argparse.ArgumentParser) -> None:
    """The flags of `inflight load-adapter`."""
    load.add_argument("name", type=_adapter_name, help="the name jobs will give as `adapter`")
    load.add_argument("path", help="the PEFT adapter's folder, on the workers' filesystem")
    load.add_argument(
        "--redis-url",
        default=default_queue_url(),
        help="default: $REDIS_URL, else the embedded server's address (%(default)s)",
    )
    load.add_argument("--control-stream", default=RedisConfig().control_stream)


def run_load_adapter(args: argparse.Namespace) -> int:
    """Send the control message; the load itself happens in each worker, which logs it."""
    from service.sdk import InflightError, SyncClient

    try:
        with SyncClient(args.redis_url, control_stream=args.control_stream) as client:
            client.load_adapter(args.name, args.path)
    except (InflightError, ValueError) as error:
        print(f"inflight load-adapter: {error}", file=sys.stderr)
        return 1
    print(f"asked the workers on {args.control_stream} to load {args.path} as {args.name}", file=sys.stderr)
    return 0


def run_submit(args: argparse.Namespace) -> int:
    """Send the prompt and print its answer; the exit status (1: refused, failed or no answer)."""
    from service.sdk import InflightError, SyncClient

    text = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
    try:
        shape = _output_shape(args)
    except (OSError, ValueError) as error:
        print(f"inflight submit: {error}", file=sys.stderr)
        return 1
    if args.logprobs is not None:
        shape.update(logprobs=True, top_logprobs=args.logprobs)
    streaming = False  # whether the answer so far left the cursor mid-line
    tokens = []
    try:
        with SyncClient(
            args.redis_url, requests_stream=args.requests_stream, reply_timeout_s=args.timeout_s or None
        ) as client:
            for event in client.generate(
                **text,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                priority=args.priority,
                tenant=args.tenant,
                adapter=args.adapter,
                batch=args.batch or None,  # left out unless asked: the job reads as before
                **shape,
            ):
                if event["type"] == "token":
                    print(event["text"], end="", flush=True)
                    streaming = True
                    tokens.append(event)
                elif event["type"] == "done":
                    usage, timings = event["usage"], event["timings"]
                    first = timings["first_token_s"]
                    print(event["text"])
                    if args.logprobs is not None:
                        print(_logprob_table(tokens), file=sys.stderr)
                    print(
                        f"({event['finish_reason']}: {usage['completion_tokens']} tokens, first token "
                        f"{'-' if first is None else f'{first * 1000:.0f} ms'}, total {timings['total_s']:.2f} s)",
                        file=sys.stderr,
                    )
                else:
                    retry = f" (retry after {event['retry_after_s']:g} s)" if "retry_after_s" in event else ""
                    print(f"error {event['code']}: {event['message']}{retry}", file=sys.stderr)
                    return 1
    except InflightError as error:  # one line, not a traceback: the server went away or no worker answers
        if streaming:
            print(flush=True)
        print(f"inflight submit: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


def _logprob_table(tokens: list[dict]) -> str:
    """One line a token: its text, log probability, and the alternatives asked for."""
    lines = []
    for event in tokens:
        tops = "  ".join(f"{top['token']!r} {top['logprob']:.2f}" for top in event.get("top_logprobs", ()))
        lines.append(f"{event['token']!r:>16} {event['logprob']:8.3f}" + (f"   | {tops}" if tops else ""))
    return "\n".join(lines)
