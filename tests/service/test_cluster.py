"""A fleet on a real Redis Cluster of three masters (`redis+cluster://`): workers, the SDK
and `inflight submit` speak the cluster protocol; each request's keys live in its own
hash slot, so reply streams spread over the shards; takeovers, cancels, dead letters and
the workers' scripts work as on one server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import defaultdict

import pytest
import redis

from bench.fleet import PROMPT, Fleet
from bench.processes import REPO_ROOT, RedisClusterServers, free_port
from service.connect import connect, connect_sync
from service.protocol import token_data
from service.publish import Append, ReplyPublisher, owner_key
from service.sdk import Client, ServerUnavailable, SyncClient
from tests.fleet_jobs import assert_well_formed
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisClusterServers(tmp_path_factory.mktemp("cluster")) as servers:
        yield servers


@pytest.fixture(scope="module")
def fleet(cluster, tmp_path_factory):
    """Two workers on the cluster, shared by the tests of this file."""
    fleet = Fleet(tmp_path_factory.mktemp("workers"), cluster.url)
    for name in ("a", "b"):
        fleet.start(name)
    for name in ("a", "b"):
        fleet.wait_until_serving(name)
    yield fleet
    fleet.close()


def ids_on_every_shard(fleet: Fleet, per_shard: int) -> list[str]:
    """New request ids whose reply streams hash to each master `per_shard` times."""
    by_port: dict[int, list[str]] = defaultdict(list)
    while len(by_port) < 3 or min(len(ids) for ids in by_port.values()) < per_shard:
        [request_id] = fleet.new_ids(1)
        port = fleet.client.get_node_from_key(fleet.reply(request_id)).port
        if len(by_port[port]) < per_shard:
            by_port[port].append(request_id)
    return [request_id for ids in by_port.values() for request_id in ids]


def local_keys(port: int) -> set[str]:
    """The keys one node holds itself (SCAN on a cluster node sees only its own)."""
    with redis.Redis(port=port) as node:
        return {key.decode() for key in node.scan_iter(match="inflight:*", count=1000)}


def test_one_append_writes_every_shard_and_recovers_from_noscript(cluster):
    """The worker's per-step write on a cluster: `ReplyPublisher.append` groups the
    streams by hash slot into script calls, the cluster pipeline routes each to its
    shard, and a node that lost its scripts (NOSCRIPT, as after a restart without
    persistence) gets them again, with nothing written twice."""
    streams = [f"inflight:out:{{pipelined-{i}}}" for i in range(12)]

    def step(seq: int) -> list[Append]:
        return [
            Append(stream, f"{i}-0", [token_data(seq, f"t{seq}", [seq])], None, refresh_ttl=True)
            for i, stream in enumerate(streams)
        ]

    async def scenario() -> tuple[list, list, list, list, set]:
        client = connect(cluster.url, block_ms=500)
        try:
            publisher = ReplyPublisher(client, ttl_s=60, worker="w")
            for i, stream in enumerate(streams):
                assert (await publisher.claim(stream, f"{i}-0")).owned
            first = await publisher.append(step(0))
            with redis.Redis(port=client.get_node_from_key(streams[0]).port) as node:
                node.script_flush()
            second = await publisher.append(step(1))
            again = await publisher.append(step(1))  # a retried step that had landed
            lengths = [await client.xlen(stream) for stream in streams]
            shards = {client.get_node_from_key(stream).port for stream in streams}
            await client.delete(*streams, *[owner_key(stream) for stream in streams])
            return first, second, again, lengths, shards
        finally:
            await client.aclose()

    first, second, again, lengths, shards = asyncio.run(scenario())
    assert len(shards) > 1  # the streams spread over the shards
    assert first == second == again == [True] * len(streams)
    assert lengths == [2] * len(streams)


def test_a_cluster_url_that_names_a_plain_server_is_refused_with_a_clear_error():
    with pytest.raises(redis.ResponseError, match="use redis://"):
        connect_sync("redis+cluster://127.0.0.1:6379")


def test_the_sdk_reports_an_unreachable_cluster_as_unavailable():
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailable, match="unavailable"):
        SyncClient(url)

    async def submit():
        async with Client(url) as client:
            await client.submit("Hi")

    with pytest.raises(ServerUnavailable, match="unavailable"):
        asyncio.run(submit())


@pytest.mark.slow
def test_jobs_are_served_with_exact_tokens_and_their_reply_streams_spread_over_the_shards(
    fleet, cluster, greedy_tokens
):
    ids = fleet.submit(ids_on_every_shard(fleet, per_shard=2))
    wait_until(lambda: all(fleet.finished(r) for r in ids), 180, "every job's final event")
    for request_id in ids:
        assert_well_formed(fleet.events(request_id), greedy_tokens)
    assert {fleet.events(r)[-1]["worker"] for r in ids} <= {"a", "b"}

    held = {port: local_keys(port) for port in cluster.ports}
    homes = {}
    for request_id in ids:
        reply = fleet.reply(request_id)
        [port] = [port for port, keys in held.items() if reply in keys]  # on exactly one node
        assert f"{reply}:owner" in held[port]  # the fence key shares its stream's slot, so its node
        homes[request_id] = port
    assert set(homes.values()) == set(cluster.ports)  # six jobs, three shards: every shard holds replies
    for request_id, port in homes.items():  # where the slot map says
        slot = fleet.client.keyslot(fleet.reply(request_id))
        with redis.Redis(port=port) as node:
            assert node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) >= 2  # stream and owner key
    assert fleet.client.xlen(fleet.stream) == 0  # acked and deleted
    assert not [f for _, f in fleet.client.xrange(fleet.dead) if f[b"field:id"].decode() in ids]


@pytest.mark.slow
def test_scripts_lost_by_every_node_are_loaded_again(fleet, cluster, greedy_tokens):
    """A node restarted without persistence has no scripts: the workers' next EVALSHA gets
    NOSCRIPT, and they load the script on the cluster's masters and go on."""
    for port in cluster.ports:
        with redis.Redis(port=port) as node:
            node.script_flush()
    ids = fleet.submit(ids_on_every_shard(fleet, per_shard=1))
    wait_until(lambda: all(fleet.finished(r) for r in ids), 180, "every job's final event")
    for request_id in ids:
        assert_well_formed(fleet.events(request_id), greedy_tokens)


@pytest.mark.slow
def test_a_bad_job_is_dead_lettered_with_its_code(fleet):
    [request_id] = fleet.new_ids(1)
    fleet.request_ids.append(request_id)
    fleet.client.xadd(fleet.stream, {"id": request_id, "prompt": "Hi", "colour": "blue"})

    def letters() -> list[dict]:
        return [fields for _, fields in fleet.client.xrange(fleet.dead) if fields[b"field:id"] == request_id.encode()]

    wait_until(letters, 60, "its dead letter")
    [letter] = letters()
    assert letter[b"code"] == b"unknown_field" and letter[b"field:colour"] == b"blue"
    [error] = fleet.events(request_id)
    assert (error["type"], error["code"]) == ("error", "unknown_field")
    wait_until(lambda: fleet.client.xlen(fleet.stream) == 0, 30, "the bad entry acked and deleted")
    assert all(fleet.workers[name].alive() for name in ("a", "b"))
    # The workers' ingest poll (XINFO GROUPS, XPENDING and XLEN, on two shards) sees it.
    wait_until(
        lambda: fleet.workers["a"].metrics().get(("inflight_dead_letter_stream_entries", ()), 0) >= 1,
        30,
        "worker a's dead-letter gauge to count it",
    )


@pytest.mark.slow
def test_the_sdk_and_inflight_submit_speak_to_the_cluster(fleet, cluster, greedy_tokens):
    with SyncClient(cluster.url, requests_stream=fleet.stream, control_stream=fleet.control) as client:
        events = list(client.generate(PROMPT, max_tokens=8))
    assert [t for e in events[:-1] for t in e["token_ids"]] == greedy_tokens[:8]
    assert events[-1]["type"] == "done"
    text = "".join(e["text"] for e in events)

    async def generate():
        async with Client(cluster.url, requests_stream=fleet.stream, control_stream=fleet.control) as client:
            return [event async for event in client.generate(PROMPT, max_tokens=8)]

    assert [t for e in asyncio.run(generate())[:-1] for t in e["token_ids"]] == greedy_tokens[:8]

    submitted = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "submit",
            "--redis-url",
            cluster.url,
            "--requests-stream",
            fleet.stream,
            "--raw",
            "--max-tokens",
            "8",
            PROMPT,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout == text + "\n"
    assert "(length: 8 tokens" in submitted.stderr


@pytest.mark.slow
def test_a_cancel_on_the_control_stream_ends_a_running_job(fleet):
    [request_id] = fleet.submit(fleet.new_ids(1), max_tokens="1000")
    wait_until(lambda: fleet.client.xlen(fleet.reply(request_id)) >= 3, 120, "the job to be generating")

    async def cancel():
        async with Client(fleet.url, requests_stream=fleet.stream, control_stream=fleet.control) as client:
            await client.cancel(request_id)

    asyncio.run(cancel())
    wait_until(lambda: fleet.finished(request_id), 60, "the cancelled job's final event")
    done = fleet.events(request_id)[-1]
    assert (done["type"], done["finish_reason"]) == ("done", "cancelled")
    assert done["usage"]["completion_tokens"] < 1000


@pytest.mark.slow
def test_a_killed_workers_jobs_are_taken_over_with_exact_tokens(fleet, greedy_tokens):
    ids = fleet.submit(ids_on_every_shard(fleet, per_shard=1))  # room for all of them on either worker
    wait_until(lambda: all(fleet.client.xlen(fleet.reply(r)) >= 3 for r in ids), 120, "every job to be generating")
    killed = fleet.owner(ids[0])
    survivor = ({"a", "b"} - {killed}).pop()
    victims = [r for r in ids if fleet.owner(r) == killed]
    fleet.workers[killed].kill()  # SIGKILL, mid-stream
    wait_until(lambda: all(fleet.finished(r) for r in ids), 180, "every job's final event")
    for request_id in ids:
        assert_well_formed(fleet.events(request_id), greedy_tokens)
    assert all(fleet.events(r)[-1]["worker"] == survivor for r in victims)
    assert fleet.client.xlen(fleet.stream) == 0
    assert not [f for _, f in fleet.client.xrange(fleet.dead) if f[b"field:id"].decode() in ids]


@pytest.mark.slow
def test_a_worker_and_the_sdk_reach_a_cluster_over_tls_as_an_acl_user(tmp_path, greedy_tokens):
    from tests.service.test_redis_security import make_certificates

    make_certificates(tmp_path)
    secured = (
        "--tls-cert-file",
        str(tmp_path / "server.pem"),
        "--tls-key-file",
        str(tmp_path / "server.key"),
        "--tls-ca-cert-file",
        str(tmp_path / "ca.pem"),
        "--tls-auth-clients",
        "no",
        "--tls-cluster",
        "yes",
        "--user",
        "default",
        "off",
        "--user",
        "inflight",
        "on",
        ">s3cret",
        "~*",
        "&*",
        "+@all",
        "--masteruser",
        "inflight",
        "--masterauth",
        "s3cret",
    )
    with RedisClusterServers(
        tmp_path / "cluster", args=secured, username="inflight", password="s3cret", tls_ca=tmp_path / "ca.pem"
    ) as cluster:
        assert cluster.url.startswith("rediss+cluster://inflight:s3cret@")
        fleet = Fleet(tmp_path, cluster.url)
        try:
            fleet.start("secure")
            fleet.wait_until_serving("secure")
            with SyncClient(cluster.url, requests_stream=fleet.stream) as client:
                events = list(client.generate(PROMPT, max_tokens=8))
            assert [t for e in events[:-1] for t in e["token_ids"]] == greedy_tokens[:8]
            with pytest.raises(ServerUnavailable, match="refused the credentials"):
                SyncClient(cluster.url.replace("s3cret", "not-the-password"))
            assert "s3cret" not in fleet.log("secure") and "rediss+cluster://inflight:***@" in fleet.log("secure")
        finally:
            fleet.close()
