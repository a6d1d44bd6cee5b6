"""Redis answers in bytes (or str, with decode_responses): one way to read them as text."""

from __future__ import annotations


def text(value: bytes | str, errors: str = "strict") -> str:
    """`value` as a str: bytes decoded as UTF-8 (`errors` as for `bytes.decode`)."""
    return value.decode(errors=errors) if isinstance(value, bytes) else value
