"""Optional bearer API keys (`Authorization: Bearer <key>`), as OpenAI's clients send
them. Only digests of the keys are kept, so no key sits where a log or a traceback
could show it, and a check costs one hash and one set lookup."""

from __future__ import annotations

import hashlib

from service.gateway.errors import APIError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class APIKeys:
    def __init__(self, keys: frozenset[str]) -> None:
        self._digests = frozenset(_digest(key) for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """Raises a 401 unless auth is off or the header carries a known key."""
        if not self._digests:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "missing API key: send it as `Authorization: Bearer <key>`", code="invalid_api_key")
        if _digest(key.strip()) not in self._digests:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
