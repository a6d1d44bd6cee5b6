"""Seeded JSON schemas for the structured-output proof and benchmark: nested objects, bounded
arrays, enums, bounded numbers, string formats and patterns, `anyOf`, optional and required
keys; bounded so that a small model can finish an object within a few hundred tokens."""

from __future__ import annotations

import random

# Formats that both the grammar engine constrains and `jsonschema`'s format checker checks.
FORMATS = ("date", "email", "ipv4", "uuid")
PATTERNS = (r"^[A-Z]{3}-[0-9]{3}$", r"^[a-z]+(_[a-z]+)?$", r"^\+?[0-9]{6,10}$", r"^#[0-9a-f]{6}$")
WORDS = ("red", "green", "blue", "small", "large", "open", "closed", "draft", "final", "cat", "dog", "tree")
KEYS = tuple(
    (
        "name id title count price tags color status owner email created size score items kind code note "
        "level address value"
    ).split()
)


def generate_schemas(count: int = 300, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, depth=0) for _ in range(count)]


def _object(rng: random.Random, depth: int) -> dict:
    keys = rng.sample(KEYS, rng.randint(1, 4 if depth else 5))
    properties = {key: _value(rng, depth + 1) for key in keys}
    required = [key for key in keys if rng.random() < 0.6]  # the rest are optional
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "format", "pattern", "array", "any_of"]
    if depth < 3:
        kinds += ["object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(4, 24)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if kind == "number":
        low = round(rng.uniform(-50, 50), 1)
        schema = {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 500)}
        if rng.random() < 0.3:
            schema["exclusiveMinimum"] = schema.pop("minimum")
        return schema
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "array":
        low = rng.randint(0, 2)
        item = _value(rng, depth + 1) if depth < 3 else {"type": "string", "maxLength": 12}
        return {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.randint(1, 3)}
    if kind == "any_of":
        return {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 99},
                {"type": "string", "maxLength": 10},
                {"type": "null"},
            ][: rng.randint(2, 3)]
        }
    return _object(rng, depth)
