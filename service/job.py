"""A request-stream entry decoded into a typed, validated `Job` (docs/protocol.md, "A request").

A job is either flat string fields (what `redis-cli XADD` writes) or one `payload` field
holding a msgpack map of the same fields, with native types. The `Field` tables below are
the wire format: each field names what its value must be (its `Kind`), how the flat form
spells such a value, and any further rule. `decode_job` reads them in order and raises
`ProtocolError`, with a stable code, at the first that is wrong. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from service.text import text
from workers.api import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN, SamplingParams

REPLY_PREFIX = "inflight:out:"
# Largest accepted entry: prompt, messages and everything else together.
MAX_ENTRY_BYTES = 1 << 20
MAX_ID_CHARS = 200
DEFAULT_TENANT = "default"
# A tenant names Redis keys and metric labels: a short, plain name.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
# A LoRA adapter's name, as `--lora-dir`'s subfolders and vLLM's model names spell them:
# a plain name, also a key's field and a metric label.
ADAPTER_PATTERN = re.compile(r"[A-Za-z0-9_.@:/-]{1,128}")
ADAPTER_RULE = "adapter must be 1-128 characters of letters, digits and _ . @ : / -"
FLAT_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


class ProtocolError(ValueError):
    """A job entry that cannot be served. `code` is stable; `message` is for humans.

    `request_id` and `reply_to` are set when they could be read, so the error can be
    published where the producer listens.
    """

    def __init__(self, code: str, message: str, request_id: str | None = None, reply_to: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.reply_to = reply_to


@dataclass(frozen=True)
class Job:
    """A request as decoded from its entry: what to run, and where its replies go."""

    request_id: str
    prompt: str | list[dict]
    params: SamplingParams
    priority: int
    deadline_ms: int | None
    reply_to: str
    tenant: str = DEFAULT_TENANT
    batch: bool = False
    adapter: str | None = None  # a LoRA adapter's name; None: the base model


def reply_stream(request_id: str) -> str:
    """The default reply stream; `{id}` is a Redis Cluster hash tag, so all of one
    request's keys live in one slot."""
    return f"{REPLY_PREFIX}{{{request_id}}}"


def hash_tag(key: str) -> str:
    """The part of `key` that Redis Cluster hashes when it is not the whole key: the text
    between the first `{` and the next `}`, if not empty ("" when there is none)."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else ""


# -- kinds: what a value must be, and how the flat form spells it ----------------------


def _as_is(name: str, value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Kind:
    """`check(name, value)` returns the value as a `Job` keeps it, or raises
    `ProtocolError`; `parse(name, text)` reads a flat field's text into a value to check."""

    check: Callable[[str, Any], Any] = _as_is
    parse: Callable[[str, str], Any] = _as_is


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("invalid_type", f"{name} must be an integer")
    return value


def _parse_integer(name: str, flat: str) -> int:
    try:
        return int(flat)
    except ValueError:
        raise ProtocolError("invalid_type", f"{name} must be an integer") from None


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError("invalid_type", f"{name} must be a number")
    if not math.isfinite(value):
        raise ProtocolError("invalid_field", f"{name} must be finite")
    return float(value)


def _parse_number(name: str, flat: str) -> float:
    try:
        return float(flat)
    except ValueError:
        raise ProtocolError("invalid_type", f"{name} must be a number") from None


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError("invalid_type", f"{name} must be true or false")
    return value


def _parse_boolean(name: str, flat: str) -> Any:
    return FLAT_BOOLEANS.get(flat.lower(), flat)


def _parse_json(name: str, flat: str) -> Any:
    try:
        return json.loads(flat)
    except (ValueError, RecursionError):  # nesting deeper than the parser's stack
        raise ProtocolError("invalid_type", f"{name} must be JSON in the flat form") from None


def _stop(name: str, value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError("invalid_field", f"{name} must be a string or a list of non-empty strings")
    return tuple(stops)


def _parse_stop(name: str, flat: str) -> Any:
    """A JSON array, or else one stop string."""
    return _parse_json(name, flat) if flat.startswith("[") else flat


def _json_schema(name: str, value: Any) -> dict | bool | None:
    if value is not None and not isinstance(value, (dict, bool)):
        raise ProtocolError("invalid_type", f"{name} must be a JSON schema: an object (JSON text in the flat form)")
    return value


def _optional_string(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ProtocolError("invalid_type", f"{name} must be a string")
    return value


def _choice(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
        raise ProtocolError("invalid_type", f"{name} must be a list of strings (a JSON array in the flat form)")
    return tuple(value)


ANY = Kind()
JSON = Kind(parse=_parse_json)
INTEGER = Kind(_integer, _parse_integer)
NUMBER = Kind(_number, _parse_number)
BOOLEAN = Kind(_boolean, _parse_boolean)
STOP = Kind(_stop, _parse_stop)
JSON_SCHEMA = Kind(_json_schema, _parse_json)
OPTIONAL_STRING = Kind(_optional_string)
CHOICE = Kind(_choice, _parse_json)


# -- fields: the wire format -----------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field of a job entry. `rule`, when given, must hold for its value (else
    `invalid_field` with `breaks_rule` as the message). `default` is its value when the
    entry leaves it out (a sampling field's default is SamplingParams')."""

    name: str
    kind: Kind
    default: Any = None
    rule: Callable[[Any], bool] | None = None
    breaks_rule: str = ""

    def read(self, value: Any, typed: bool) -> Any:
        """The field's value as a `Job` keeps it; `typed`: from a msgpack payload."""
        value = self.kind.check(self.name, value if typed else self.kind.parse(self.name, value))
        if self.rule is not None and not self.rule(value):
            raise ProtocolError("invalid_field", self.breaks_rule)
        return value


def _is_chat(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


# Exactly one of the two is given.
PROMPT = Field(
    "prompt", ANY, rule=lambda p: isinstance(p, str) and bool(p), breaks_rule="prompt must be a non-empty string"
)
MESSAGES = Field(
    "messages", JSON, rule=_is_chat, breaks_rule="messages must be a non-empty list of {role, content} string maps"
)
# SamplingParams' fields, in the order they are checked: the first bad one is the one
# reported. SamplingParams.validate then checks them together (ranges, one constraint).
SAMPLING_FIELDS = (
    Field("stop", STOP),
    Field("ignore_eos", BOOLEAN),
    Field("json_schema", JSON_SCHEMA),
    Field("regex", OPTIONAL_STRING),
    Field("choice", CHOICE),
    Field("max_tokens", INTEGER),
    Field("temperature", NUMBER),
    Field("top_k", INTEGER),
    Field("top_p", NUMBER),
    Field("seed", INTEGER),
    Field("n", INTEGER),
    Field("json_object", BOOLEAN),
    Field("logprobs", BOOLEAN),
    Field("top_logprobs", INTEGER),
)
# The job's own fields, checked after its sampling.
JOB_FIELDS = (
    Field(
        "priority",
        INTEGER,
        DEFAULT_PRIORITY,
        rule=lambda p: PRIORITY_MIN <= p <= PRIORITY_MAX,
        breaks_rule=f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]",
    ),
    Field("deadline_ms", INTEGER, rule=lambda t: t >= 0, breaks_rule="deadline_ms must be a unix time in milliseconds"),
    Field(
        "tenant",
        ANY,
        DEFAULT_TENANT,
        rule=lambda t: isinstance(t, str) and TENANT_PATTERN.fullmatch(t) is not None,
        breaks_rule="tenant must be 1-64 characters of letters, digits and _ . @ -",
    ),
    Field("batch", BOOLEAN, False),
    Field(
        "adapter",
        ANY,
        rule=lambda a: isinstance(a, str) and ADAPTER_PATTERN.fullmatch(a) is not None,
        breaks_rule=ADAPTER_RULE,
    ),
)
# Where the replies go: read first, so that any later error can be published there.
ADDRESS_FIELDS = ("id", "reply_to")
FIELDS = frozenset(
    [*ADDRESS_FIELDS, PROMPT.name, MESSAGES.name, *(f.name for f in SAMPLING_FIELDS), *(f.name for f in JOB_FIELDS)]
)


# -- decoding --------------------------------------------------------------------------


def decode_job(entry_id: str, fields: dict, reply_prefixes: tuple[str, ...] = (REPLY_PREFIX,)) -> Job:
    """A request-stream entry (field names and values as bytes or str) -> a `Job`.
    `reply_to` must start with one of `reply_prefixes`."""
    entry_id = _wire_text(entry_id, "entry id")
    values, typed = _values(fields)
    request_id, reply_to = _address(values, entry_id, reply_prefixes)
    try:
        return _job(values, typed, request_id, reply_to)
    except ProtocolError as error:  # now it can be published where the producer listens
        raise ProtocolError(error.code, error.message, request_id, reply_to) from None


def _values(fields: Mapping) -> tuple[dict[str, Any], bool]:
    """The entry's fields by name, and whether they are typed (a msgpack payload)
    rather than flat strings."""
    raw = {_wire_text(k, "field name"): v for k, v in fields.items()}
    size = sum(len(k) + len(v if isinstance(v, (bytes, str)) else b"") for k, v in raw.items())
    if size > MAX_ENTRY_BYTES:
        raise ProtocolError("too_large", f"entry is {size} bytes; the limit is {MAX_ENTRY_BYTES}")
    if "payload" in raw:
        if len(raw) > 1:
            raise ProtocolError("invalid_field", "an entry with `payload` must have no other fields")
        values, typed = _unpack(raw["payload"]), True
    else:
        values, typed = {k: _wire_text(v, k) for k, v in raw.items()}, False
    return values, typed


def _address(values: dict[str, Any], entry_id: str, reply_prefixes: tuple[str, ...]) -> tuple[str, str]:
    """The request id (by default the entry id) and where its replies go."""
    request_id = values.get("id", entry_id)
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_ID_CHARS:
        raise ProtocolError("invalid_field", f"id must be a non-empty string of at most {MAX_ID_CHARS} characters")
    reply_to = values.get("reply_to", reply_stream(request_id))
    if not isinstance(reply_to, str) or not reply_to.startswith(reply_prefixes):
        raise ProtocolError(
            "invalid_field", f"reply_to must be a key starting with {' or '.join(reply_prefixes)}", request_id
        )
    if ("{" in reply_to or "}" in reply_to) and not hash_tag(reply_to):
        # Its owner key could not share its Redis Cluster slot.
        raise ProtocolError(
            "invalid_field",
            "braces in reply_to (or in the id it defaults to) must enclose a "
            "Redis Cluster hash tag, as in inflight:out:{job-1}",
            request_id,
        )
    return request_id, reply_to


def _job(values: dict[str, Any], typed: bool, request_id: str, reply_to: str) -> Job:
    unknown = sorted(set(values) - FIELDS)
    if unknown:
        raise ProtocolError("unknown_field", f"unknown field(s): {', '.join(unknown)}")
    if ("prompt" in values) == ("messages" in values):
        raise ProtocolError(
            "missing_field" if "prompt" not in values else "invalid_field",
            "give exactly one of `prompt` and `messages`",
        )
    given = PROMPT if "prompt" in values else MESSAGES
    prompt = given.read(values[given.name], typed)
    params = SamplingParams(**_read(SAMPLING_FIELDS, values, typed))
    try:
        params.validate()
    except ValueError as error:
        raise ProtocolError("invalid_field", str(error)) from None
    job = {field.name: field.default for field in JOB_FIELDS} | _read(JOB_FIELDS, values, typed)
    return Job(request_id, prompt, params, reply_to=reply_to, **job)


def _read(fields: tuple[Field, ...], values: dict[str, Any], typed: bool) -> dict[str, Any]:
    """The values of those of `fields` that the entry gives, read in order."""
    return {field.name: field.read(values[field.name], typed) for field in fields if field.name in values}


def _wire_text(value: Any, name: str) -> str:
    """A field name or flat value as text; the entry is refused when it is not UTF-8."""
    if not isinstance(value, (bytes, str)):
        raise ProtocolError("invalid_type", f"{name} must be a string")
    try:
        return text(value)
    except UnicodeDecodeError:
        raise ProtocolError("invalid_type", f"{name} is not UTF-8") from None


def _unpack(payload: bytes | str) -> dict[str, Any]:
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogateescape")
    try:
        values = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several types for bad input
        raise ProtocolError("malformed_payload", f"payload is not valid msgpack: {type(error).__name__}") from None
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise ProtocolError("malformed_payload", "payload must be a msgpack map with string keys")
    if "payload" in values:
        raise ProtocolError("unknown_field", "unknown field(s): payload")
    return values
