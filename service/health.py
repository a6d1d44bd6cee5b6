"""`inflight health`: whether the worker beside it serves; a container's healthcheck.

Healthy when all three checks pass, each asked of the real thing:
1. metrics: the worker's `/metrics` answers with inflight's metrics (the process is up);
2. Redis: the worker's Redis answers PING;
3. serving: the worker's consumer is in its consumer group (XINFO CONSUMERS), which it
   joins once the model has loaded, so a worker still loading is not healthy yet; and
   it talked to the group within `max_idle_s`, so one whose serving loop is stuck is not
   healthy any more, even while its metrics thread still answers. A worker with room
   blocks in XREADGROUP for `block_ms` (0.5 s) at a time, a full one renews its leases
   every `claim_idle_ms / 4` (0.5 s): from Redis 7.2 (and on Valkey) both reset the
   consumer's idle time. Before 7.2 an empty read does not, so an idle worker would look
   silent: there the idle time is not judged (Redis 7.2 added the `inactive` field, by
   which the check tells).

It prints one line, and exits 0 when healthy, 1 when not (the line names what failed):
what Docker records as the container's health.
"""

from __future__ import annotations

import http.client
import urllib.request
from dataclasses import dataclass, field

from redis.exceptions import RedisError, ResponseError

from service.config import MetricsConfig, RedisConfig
from service.connect import connect_sync
from service.flags import default_queue_url
from service.text import text

# A metric every worker serves from its start: the endpoint is inflight's, not another server's.
WORKER_METRIC = b"inflight_requests_total"


@dataclass(frozen=True)
class HealthConfig:
    # The worker's metrics port; the check runs beside the worker (in its container).
    metrics_port: int = MetricsConfig.port
    # The worker's Redis, found as the worker finds it: $REDIS_URL, else the embedded server.
    redis_url: str = field(default_factory=default_queue_url)
    requests_stream: str = RedisConfig.requests_stream
    group: str = RedisConfig.group
    # The worker's consumer name; the host name by default, as the worker's.
    consumer: str = field(default_factory=lambda: RedisConfig().consumer)
    # Silent in its consumer group for longer than this: not serving. A serving worker
    # is silent for at most about a second.
    max_idle_s: float = 10.0
    # How long each check waits for an answer (below Docker's own healthcheck timeout).
    timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if not 0 < self.metrics_port <= 65535:
            raise ValueError("metrics_port must be in [1, 65535]: a worker without metrics cannot be checked")
        if not self.max_idle_s > 0 or not self.timeout_s > 0:
            raise ValueError("max_idle_s and timeout_s must be > 0")


@dataclass(frozen=True)
class Health:
    problems: tuple[str, ...]  # one per failed check; none when healthy
    idle_s: float | None = None  # since the consumer last talked to its group (Redis 7.2 and later)

    @property
    def healthy(self) -> bool:
        return not self.problems


def check(config: HealthConfig) -> Health:
    problems = [problem for problem in (_metrics_problem(config),) if problem]
    try:
        client = connect_sync(
            config.redis_url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
        )
        try:
            client.ping()
            consumers = client.xinfo_consumers(config.requests_stream, config.group)
        finally:
            client.close()
    except ResponseError as error:
        if "NOGROUP" in str(error) or "no such key" in str(error):  # no group, or not even the stream
            problems.append(
                f"no consumer group {config.group} on {config.requests_stream} yet: no worker has started serving it"
            )
        else:  # e.g. an ACL that forbids XINFO
            problems.append(f"Redis refused XINFO CONSUMERS: {error}")
        return Health(tuple(problems))
    except RedisError as error:  # the message names the address, never the password
        problems.append(f"cannot reach Redis: {error}")
        return Health(tuple(problems))

    row = next((row for row in consumers if text(row["name"], errors="replace") == config.consumer), None)
    if row is None:
        problems.append(
            f"consumer {config.consumer} is not in group {config.group} of {config.requests_stream}: "
            "the worker has not started serving (still loading the model?)"
        )
        return Health(tuple(problems))
    if "inactive" not in row:  # before Redis 7.2: `idle` does not tell a silent worker from an idle one
        return Health(tuple(problems))
    idle_s = row["idle"] / 1000
    if idle_s > config.max_idle_s:
        problems.append(
            f"consumer {config.consumer} last talked to {config.requests_stream} {idle_s:.1f} s ago "
            f"(over {config.max_idle_s:g} s): it has stopped serving"
        )
    return Health(tuple(problems), idle_s)


def report(config: HealthConfig, health: Health) -> str:
    """The one line `inflight health` prints."""
    if health.healthy:
        idle = "" if health.idle_s is None else f" (last talked to it {health.idle_s:.1f} s ago)"
        return (
            f"healthy: {config.consumer} serves {config.requests_stream}{idle}, metrics on port {config.metrics_port}"
        )
    return "unhealthy: " + "; ".join(health.problems)


def _metrics_problem(config: HealthConfig) -> str | None:
    url = f"http://127.0.0.1:{config.metrics_port}/metrics"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an $http_proxy
    try:
        with opener.open(url, timeout=config.timeout_s) as response:
            body = response.read()
    except (OSError, http.client.HTTPException) as error:  # URLError, HTTPError, timeouts
        return f"metrics at {url} do not answer: {getattr(error, 'reason', error)}"
    if WORKER_METRIC not in body:
        return f"{url} answers without inflight's metrics: another server holds the port"
    return None


def add_health_arguments(parser) -> None:
    """The flags of `inflight health`: the worker's own, where it was given others than the defaults."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=HealthConfig.metrics_port,
        help="the worker's metrics port (default: %(default)s)",
    )
    parser.add_argument(
        "--redis-url",
        default=default_queue_url(),
        help="the worker's Redis (default: $REDIS_URL, else the embedded server's address: %(default)s)",
    )
    parser.add_argument("--requests-stream", default=HealthConfig.requests_stream)
    parser.add_argument(
        "--consumer",
        default=RedisConfig().consumer,
        help="the worker's consumer name (default: this host's name, %(default)s)",
    )
    parser.add_argument(
        "--max-idle-s",
        type=float,
        default=HealthConfig.max_idle_s,
        help="unhealthy when the consumer has been silent longer (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=HealthConfig.timeout_s,
        help="how long each check waits (default: %(default)s)",
    )


def health_config_from_args(args) -> HealthConfig:
    return HealthConfig(
        metrics_port=args.metrics_port,
        redis_url=args.redis_url,
        requests_stream=args.requests_stream,
        consumer=args.consumer,
        max_idle_s=args.max_idle_s,
        timeout_s=args.timeout_s,
    )
