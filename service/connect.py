"""The one place a Redis URL becomes a client (README, "Connecting to Redis").

    redis://host:6379/0, rediss://...          one server: redis.Redis
    redis+cluster://host:7000, rediss+cluster://...
                                               a Redis Cluster, found from that seed node:
                                               redis-py's RedisCluster, which routes each
                                               command to the shard holding its key
    redis+sentinel://h1:26379,h2:26379/mymaster[/0], rediss+sentinel://...
                                               the primary that these Sentinels name
                                               `mymaster`, asked again after a failover

Everything else in the URL (user, password, `ssl_ca_certs` and the other query options)
means what it means for one server, and applies to every node of a cluster.

`block_ms` is the longest BLOCK the client will be used for: its socket timeout then
outlasts that (redis-py's default of 5 s would cut a blocking read short), and no more,
so a server that stops answering is noticed within seconds.

A cluster client that cannot reach any seed node, or finds slots uncovered, raises the
underlying redis-py error (ConnectionError, AuthenticationError, ClusterDownError)
rather than redis-py's RedisClusterException, so the retry policy (`service/retry.py`)
and the SDK's error translation treat a cluster as they treat one server.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError, ResponseError

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # whether TLS
# How much longer than its longest BLOCK a blocking reader's socket waits for a reply.
BLOCK_MARGIN_S = 10.0


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def connect(url: str, *, block_ms: int | None = None, **kwargs):
    """An asyncio client for `url`: `redis.asyncio.Redis`, or a `RedisCluster`."""
    kwargs = _with_timeout(block_ms, kwargs)
    # Unbounded (per node): redis-py's asyncio default of 100 fails commands with
    # MaxConnectionsError whenever more of a worker's jobs than that talk to Redis at once
    # (claims when hundreds of jobs arrive together).
    kwargs.setdefault("max_connections", 2**31)
    if is_cluster(url):
        return _AsyncCluster.from_url(_seed_url(url), **kwargs)
    if is_sentinel(url):
        sentinels, service, options = _sentinel_parts(url, kwargs)
        return redis.asyncio.sentinel.Sentinel(sentinels, sentinel_kwargs=_sentinel_kwargs(kwargs)).master_for(
            service, **options
        )
    return aioredis.Redis.from_url(url, **kwargs)


def connect_sync(url: str, *, block_ms: int | None = None, **kwargs):
    """A blocking client for `url`: `redis.Redis`, or a `redis.cluster.RedisCluster`
    (which reaches a seed node as it is built, so this may raise a ConnectionError)."""
    kwargs = _with_timeout(block_ms, kwargs)
    if is_cluster(url):
        try:
            return redis.cluster.RedisCluster.from_url(_seed_url(url), **kwargs)
        except RedisClusterException as error:
            raise as_redis_error(error) from error
    if is_sentinel(url):
        sentinels, service, options = _sentinel_parts(url, kwargs)
        return redis.sentinel.Sentinel(sentinels, sentinel_kwargs=_sentinel_kwargs(kwargs)).master_for(
            service, **options
        )
    return redis.Redis.from_url(url, **kwargs)


def is_sentinel(url: str) -> bool:
    return urlsplit(url).scheme.lower() in SENTINEL_SCHEMES


def _sentinel_parts(url: str, kwargs: dict) -> tuple[list[tuple[str, int]], str, dict]:
    """The Sentinels' addresses, the primary's service name, and the options for its
    connections (credentials, database, TLS and query options, as for one server)."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    sentinels = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        sentinels.append((host or address, int(port) if host else 26379))
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2:
        raise ValueError("a Sentinel URL names its primary: redis+sentinel://host:26379,.../mymaster[/db]")
    options: dict[str, Any] = {key: value for key, value in parse_qsl(parts.query)}
    options.update(kwargs)
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    if len(path) == 2:
        options["db"] = int(path[1])
    if SENTINEL_SCHEMES[parts.scheme.lower()]:
        options["ssl"] = True
    return sentinels, path[0], options


def _sentinel_kwargs(kwargs: dict) -> dict:
    """How to talk to the Sentinels themselves: the same timeouts, no credentials."""
    return {key: kwargs[key] for key in ("socket_timeout", "socket_connect_timeout") if key in kwargs}


def as_redis_error(error: RedisClusterException) -> RedisError:
    """The redis-py error behind a RedisClusterException: what the retry policy and the
    SDK know how to judge."""
    if isinstance(error.__cause__, RedisError):
        return error.__cause__  # e.g. no seed node reachable, or credentials refused
    if "not enabled" in str(error):  # a plain server behind a cluster URL: not transient
        return ResponseError(f"{error}: use redis:// (or rediss://) for a single server")
    return ClusterDownError(str(error))  # slots not (yet) covered: the cluster is forming or failing over


def _seed_url(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme.lower()]).geturl()


def _with_timeout(block_ms: int | None, kwargs: dict) -> dict:
    if block_ms is None:
        return kwargs
    return {"socket_timeout": block_ms / 1000 + BLOCK_MARGIN_S, **kwargs}


class _AsyncCluster(redis.asyncio.cluster.RedisCluster):
    """RedisCluster whose (re)discovery of the cluster raises plain redis-py errors. It
    discovers lazily: on the first command, and again after a node failed."""

    async def initialize(self, *args, **kwargs):
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as error:
            raise as_redis_error(error) from error
