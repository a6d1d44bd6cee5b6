"""`.ci/seed_foreign_data.py`: CI fills the shared Redis with a developer's leftovers under
the default keys, and afterwards takes out exactly what it put in, whatever was there
before. Run against a private redis-server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import redis

from bench.processes import RedisServer

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "seed_foreign_data.py"


def seeding(action: str, state: Path, server: RedisServer) -> None:
    subprocess.run([sys.executable, str(SCRIPT), action, str(state), str(server.port)], check=True, timeout=60)


def snapshot(client: redis.Redis) -> dict:
    """Every key with its entries, and every group of inflight:requests with its consumers and pending ids."""
    found = {key: client.xrange(key) for key in client.keys("*")}
    if client.exists("inflight:requests"):
        for group in client.xinfo_groups("inflight:requests"):
            name = group["name"]
            consumers = {c["name"] for c in client.xinfo_consumers("inflight:requests", name)}
            pending = client.xpending_range("inflight:requests", name, "-", "+", 10_000)
            found[("group", name)] = (consumers, sorted(p["message_id"] for p in pending), group["last-delivered-id"])
    return found


def test_an_empty_redis_gets_the_backlog_and_is_empty_again_after(tmp_path):
    with RedisServer(tmp_path / "redis", appendonly=False) as server:
        client = redis.Redis.from_url(server.url)
        seeding("seed", tmp_path / "state.json", server)
        assert client.xlen("inflight:requests") == 5000
        assert client.xpending("inflight:requests", "inflight")["pending"] == 500
        assert client.xlen("inflight:control") == client.xlen("inflight:dead") == 100
        seeding("remove", tmp_path / "state.json", server)
        assert client.keys("*") == [] and not (tmp_path / "state.json").exists()


def test_what_was_there_before_stays_exactly_as_it_was(tmp_path):
    with RedisServer(tmp_path / "redis", appendonly=False) as server:
        client = redis.Redis.from_url(server.url)
        client.xadd("inflight:requests", {"id": "mine"})
        client.xgroup_create("inflight:requests", "inflight", id="0")
        client.xreadgroup("inflight", "my-worker", {"inflight:requests": ">"}, count=1)
        client.xadd("inflight:requests", {"id": "mine-unread"})
        client.xadd("inflight:dead", {"code": "mine"})
        before = snapshot(client)
        seeding("seed", tmp_path / "state.json", server)
        assert client.xlen("inflight:requests") == 5002
        seeding("remove", tmp_path / "state.json", server)
        assert snapshot(client) == before
