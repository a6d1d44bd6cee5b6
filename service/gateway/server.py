"""Serving the app: uvicorn on the running (uvloop) event loop, with the httptools
parser, logging through the worker's structlog setup and no access log (the per-request
line is the gateway's own, without headers, so no API key is ever written)."""

from __future__ import annotations

from urllib.parse import urlsplit

import structlog
import uvicorn

from service.config import GatewayConfig
from service.gateway.app import Gateway
from service.structured_logging import configure_logging

# On SIGTERM: streams still going after this long are cut (and their jobs cancelled).
GRACEFUL_SHUTDOWN_S = 30


async def serve(config: GatewayConfig) -> int:
    configure_logging(config.logging)
    log = structlog.get_logger("inflight.gateway")
    gateway = Gateway(config)
    server = uvicorn.Server(
        uvicorn.Config(
            gateway.app(),
            host=config.host,
            port=config.port,
            http="httptools",
            lifespan="on",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    log.info(
        "gateway_started",
        host=config.host,
        port=config.port,
        redis=_without_password(config.redis_url),
        requests_stream=config.requests_stream,
        model=config.model_name,
        auth=f"{len(config.api_keys)} key(s)" if config.api_keys else "off",
        max_queue_depth=config.max_queue_depth,
        max_queue_age_s=config.max_queue_age_s,
    )
    await server.serve()
    log.info("gateway_stopped")
    return 0 if server.started else 1


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    return url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1)
