"""The OpenAI API's shapes: request bodies in, as one protocol job each; reply events out,
as OpenAI responses and stream chunks.

Parameters are taken where the queue can honour them and refused with a 400 naming the
parameter where it cannot (tools, penalties, ...), so a client never gets an answer
computed other than it asked. `response_format` (JSON object, JSON schema) and inflight's
own `regex` and `choice` constrain the output; `logprobs` come back in OpenAI's shapes,
each token's text as the worker decoded it alone. Fields OpenAI clients send for bookkeeping only
(`user`, `metadata`, ...) are accepted and ignored; an unknown field is a 400, as with
OpenAI. The job's own checks (`service.protocol.decode_job`, the worker's decoder) run
here before anything is queued, so a bad value is refused at once, in the worker's words.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from service.config import GatewayConfig
from service.gateway.errors import APIError, bad_request, from_queue
from service.protocol import DEFAULT_TENANT, ProtocolError, decode_job

CHAT, TEXT = "chat", "text"

# Sampling and inflight's own fields, the same in both APIs: body name -> job field.
# `priority` and `deadline_ms` are inflight's; `top_k` and `ignore_eos` as vLLM has them.
PASSED = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "n": "n",
    "priority": "priority",
    "deadline_ms": "deadline_ms",
    "top_k": "top_k",
    "ignore_eos": "ignore_eos",
    "regex": "regex",
    "choice": "choice",
}
# Bookkeeping fields clients send that change nothing about the answer.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Fields accepted only at their "off" value: the queue cannot honour anything else.
OFF_ONLY = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}
COMMON = {"model", "max_tokens", "stream", "stream_options", "response_format", *PASSED, *IGNORED}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
}
TEXT_FIELDS = COMMON | {
    "prompt",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "echo",
    "suffix",
    "best_of",
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Parsed:
    """One request, read: what to queue, and how to answer."""

    kind: str  # CHAT or TEXT
    model: str
    job: dict  # the protocol job's fields, but its id
    stream: bool
    include_usage: bool
    n: int

    def payload(self, request_id: str, tenant: str = DEFAULT_TENANT, batch: bool = False) -> bytes:
        """The job as the request entry's msgpack `payload`, checked as a worker checks
        it (a ProtocolError becomes the status its code has from a worker: 413 for
        `too_large`, else 400). The default tenant and interactive jobs are left
        implicit, so the job reads the same to workers older than tenants."""
        job = {"id": request_id, **self.job}
        if tenant != DEFAULT_TENANT:
            job["tenant"] = tenant
        if batch:
            job["batch"] = True
        payload = msgpack.packb(job)
        try:
            decode_job("0-0", {"payload": payload})
        except ProtocolError as error:
            raise from_queue(error.code, error.message) from None
        return payload


def read_request(kind: str, body, config: GatewayConfig, adapters: Collection[str] = ()) -> Parsed:
    """A request body for the served model, or for one of its LoRA `adapters` (the
    registry's names: `model` names the adapter, as with vLLM) -> `Parsed`; an APIError
    (400, or 404 for another model) otherwise. An HTTP request and a batch's line are
    both read here."""
    parsed = parse(kind, body, config.default_max_tokens)
    if parsed.model == config.model_name:
        return parsed
    if parsed.model in adapters:
        parsed.job["adapter"] = parsed.model
        return parsed
    raise APIError(
        404,
        f"The model `{parsed.model}` does not exist; this server has `{config.model_name}`"
        + (f" and its adapters {', '.join(f'`{a}`' for a in sorted(adapters))}" if adapters else ""),
        param="model",
        code="model_not_found",
    )


def names_another_model(body, config: GatewayConfig) -> bool:
    """Whether the body's `model` is a name other than the base model's: then it may name
    an adapter, and the registry is worth a look."""
    return isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] != config.model_name


def response_id(kind: str, request_id: str) -> str:
    """The answer's `id`: OpenAI's prefix for the API, then the job's id."""
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + request_id


def parse(kind: str, body, default_max_tokens: int) -> Parsed:
    """A request body (decoded JSON) -> `Parsed`, or an APIError (400) saying what is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    known = CHAT_FIELDS if kind == CHAT else TEXT_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    for name in sorted(set(body) & OFF_ONLY.keys()):
        value = body[name]
        if not any(value == off and type(value) is type(off) for off in OFF_ONLY[name]):
            raise bad_request(f"{name} is not supported by this server", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model must be a non-empty string", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)

    job: dict[str, Any] = (
        {"messages": _messages(body.get("messages"))} if kind == CHAT else {"prompt": _prompt(body.get("prompt"))}
    )
    max_tokens = body.get("max_completion_tokens") if kind == CHAT else None
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    job["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    job["temperature"] = 1.0  # OpenAI's default; 0 is greedy
    for name, field_name in PASSED.items():
        if body.get(name) is not None:
            job[field_name] = body[name]
    job.update(_response_format(body.get("response_format")))
    job.update(_chat_logprobs(body) if kind == CHAT else _text_logprobs(body.get("logprobs")))
    n = job.get("n", 1)
    return Parsed(kind, model, job, stream, include_usage, n if isinstance(n, int) else 1)


def _response_format(response_format) -> dict:
    """OpenAI's response_format as the job's constraint: `json_object` or `json_schema`."""
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text" and len(response_format) == 1:
        return {}
    if kind == "json_object" and len(response_format) == 1:
        return {"json_object": True}
    if kind == "json_schema" and set(response_format) == {"type", "json_schema"}:
        spec = response_format["json_schema"]
        if isinstance(spec, dict) and not set(spec) - {"name", "description", "schema", "strict"}:
            # No schema: any JSON (OpenAI requires one; accepting it is harmless).
            schema = spec.get("schema")
            return {"json_object": True} if schema is None else {"json_schema": schema}
    raise bad_request(
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        "response_format",
    )


def _chat_logprobs(body: dict) -> dict:
    """Chat: `logprobs` (true/false) and `top_logprobs` (0-20, with logprobs only)."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs must be true or false", "logprobs")
    if top is not None and not logprobs:
        raise bad_request("top_logprobs is only allowed when logprobs is true", "top_logprobs")
    if not logprobs:
        return {}
    return {"logprobs": True} if top is None else {"logprobs": True, "top_logprobs": top}


def _text_logprobs(logprobs) -> dict:
    """Completions: `logprobs` is how many alternatives to list (0 = the chosen token's only)."""
    if logprobs is None:
        return {}
    if isinstance(logprobs, bool) or not isinstance(logprobs, int):
        raise bad_request("logprobs must be an integer", "logprobs")
    return {"logprobs": True, "top_logprobs": logprobs}


def _stream_options(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request("stream_options may hold include_usage only", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be true or false", "stream_options")
    return include


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"{where}: role must be one of {', '.join(ROLES)} (tools are not supported)", where)
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise bad_request(f"{where}: unsupported field(s) {', '.join(extra)}", where)
        out.append({"role": ROLES[message["role"]], "content": _content(message.get("content"), where)})
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or text parts (joined by newlines; no images)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(part["text"] for part in content)
    raise bad_request(f"{where}: content must be a string or a list of text parts", where)


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # one prompt is one job; batches go as separate requests
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string (token ids and batches of prompts are not supported)", "prompt")
    return prompt


# -- answers -------------------------------------------------------------------------------


def choices_of(done: dict) -> list[dict]:
    """Each choice's index, finish reason and last held-back text, from a done event."""
    if "choices" in done:
        return sorted(done["choices"], key=lambda c: c["index"])
    return [{"index": 0, "finish_reason": done["finish_reason"], "text": done["text"]}]


def usage_of(done: dict) -> dict:
    prompt, completion = done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class Renderer:
    """Builds one request's answer: its id, creation time and model stay the same in
    every chunk."""

    parsed: Parsed
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    started: set[int] = field(default_factory=set)  # choices whose first chunk went out
    offsets: dict[int, int] = field(default_factory=dict)  # each choice's text length so far

    @property
    def chat(self) -> bool:
        return self.parsed.kind == CHAT

    @property
    def with_logprobs(self) -> bool:
        return bool(self.parsed.job.get("logprobs"))

    def chunk(
        self, index: int, text: str, finish_reason: str | None = None, tokens: Sequence[dict] = ()
    ) -> bytes | None:
        """One SSE event carrying a choice's text delta and, when asked for, its tokens'
        log probabilities (None when there is nothing to say)."""
        logprobs = self.logprobs(index, tokens) if self.with_logprobs and tokens else None
        quiet = text == "" and logprobs is None
        if self.chat:
            delta = {} if quiet and finish_reason else {"content": text}
            if index not in self.started:
                delta = {"role": "assistant", "content": text}
            elif quiet and finish_reason is None:
                return None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            if quiet and finish_reason is None:
                return None
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        self.started.add(index)
        return self._event(
            {
                **self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [choice],
                **({"usage": None} if self.parsed.include_usage else {}),
            }
        )

    def ending(self, done: dict) -> list[bytes]:
        """The last events of a stream: each choice's held-back text and finish reason,
        the usage when asked for, and `[DONE]`."""
        # A choice's last chunk carries its finish reason, so it always says something.
        chunks = (self.chunk(c["index"], c["text"], c["finish_reason"]) for c in choices_of(done))
        events = [chunk for chunk in chunks if chunk is not None]
        if self.parsed.include_usage:
            events.append(
                self._event(
                    {
                        **self._head("chat.completion.chunk" if self.chat else "text_completion"),
                        "choices": [],
                        "usage": usage_of(done),
                    }
                )
            )
        return [*events, b"data: [DONE]\n\n"]

    def whole(self, tokens: list[dict], done: dict) -> dict:
        """The non-streaming answer, from the token events and the done event."""
        by_choice: dict[int, list[dict]] = {}
        for event in tokens:
            by_choice.setdefault(event.get("index", 0), []).append(event)
        choices = []
        for c in choices_of(done):
            events = by_choice.get(c["index"], [])
            text = "".join(event["text"] for event in events) + c["text"]
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            logprobs = self.logprobs(c["index"], events) if self.with_logprobs else None
            choices.append({"index": c["index"], **body, "logprobs": logprobs, "finish_reason": c["finish_reason"]})
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": usage_of(done),
        }

    def logprobs(self, index: int, tokens: Sequence[dict]) -> dict:
        """Token events' log probabilities in the API's shape: chat's `content` list, or
        the completions API's parallel lists (offsets count characters of the text)."""
        if self.chat:
            return {
                "content": [
                    {
                        **_token_logprob(t["token"], t["logprob"]),
                        "top_logprobs": [
                            _token_logprob(top["token"], top["logprob"]) for top in t.get("top_logprobs", ())
                        ],
                    }
                    for t in tokens
                ]
            }
        offsets, offset = [], self.offsets.get(index, 0)
        for event in tokens:
            offsets.append(offset)
            offset += len(event["text"])
        self.offsets[index] = offset
        want_tops = self.parsed.job.get("top_logprobs", 0) > 0
        return {
            "tokens": [t["token"] for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{top["token"]: top["logprob"] for top in t.get("top_logprobs", ())} for t in tokens]
            if want_tops
            else None,
            "text_offset": offsets,
        }

    def _head(self, object_: str) -> dict:
        return {"id": self.response_id, "object": object_, "created": self.created, "model": self.parsed.model}

    @staticmethod
    def _event(data: dict) -> bytes:
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _token_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def error_event(error: APIError) -> bytes:
    """An error once the stream has begun (headers sent): said as an SSE event, as
    OpenAI's clients expect; no `[DONE]` follows."""
    return b"data: " + error.json() + b"\n\n"
