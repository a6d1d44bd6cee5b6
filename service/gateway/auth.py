"""Optional bearer API keys (`Authorization: Bearer <key>`), as OpenAI's clients send
them, and the tenant a request is for. Only digests of the keys are kept, so no key sits
where a log or a traceback could show it, and a check costs one hash and one dict lookup."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from service.gateway.errors import APIError
from service.protocol import DEFAULT_TENANT, TENANT_PATTERN

# Names the request's tenant when its key does not (docs/gateway.md, "Tenants").
TENANT_HEADER = "X-Inflight-Tenant"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class APIKeys:
    def __init__(self, keys: Mapping[str, str | None]) -> None:
        self._tenants = {_digest(key): tenant for key, tenant in keys.items()}  # digest -> bound tenant or None

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def check(self, authorization: str | None) -> str | None:
        """Raises a 401 unless auth is off or the header carries a known key; returns the
        tenant the key is bound to (None: unbound, or auth off)."""
        if not self._tenants:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "missing API key: send it as `Authorization: Bearer <key>`", code="invalid_api_key")
        digest = _digest(key.strip())
        if digest not in self._tenants:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return self._tenants[digest]

    def tenant(self, authorization: str | None, asked: str | None) -> str:
        """The request's tenant: its key's, else the one `asked` for (the X-Inflight-Tenant
        header), else the default. A key bound to a tenant cannot ask for another, so no
        client spends another tenant's share (403); a malformed name is a 400."""
        bound = self.check(authorization)
        if asked is not None and not TENANT_PATTERN.fullmatch(asked):
            raise APIError(
                400,
                f"the {TENANT_HEADER} header must be 1-64 characters of letters, digits and _ . @ -",
                code="invalid_tenant",
            )
        if bound is not None and asked is not None and asked != bound:
            raise APIError(
                403,
                f"this API key is bound to tenant `{bound}`; the {TENANT_HEADER} header cannot name another",
                code="tenant_not_allowed",
            )
        return bound or asked or DEFAULT_TENANT
