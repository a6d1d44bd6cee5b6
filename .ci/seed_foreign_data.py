"""Fill the shared Redis (127.0.0.1:6379) with what a developer's manual runs leave
behind, under the default key names, and take exactly that out again afterwards.

    python3 .ci/seed_foreign_data.py seed STATE [PORT]    # a backlog on inflight:requests,
                                                          # entries pending for a consumer
                                                          # that died, cancels, dead letters
    python3 .ci/seed_foreign_data.py remove STATE [PORT]  # delete what `seed` added, no more

STATE is a JSON file where `seed` writes the entry ids it added and which keys, group and
consumer it created, so `remove` leaves anything that was there before untouched. PORT is
the Redis on 127.0.0.1 (6379 by default). Speaks RESP over a socket, so it needs nothing
installed; tests/ops/test_ci_seed.py holds it to this."""

import json
import os
import socket
import sys

REQUESTS, CONTROL, DEAD = "inflight:requests", "inflight:control", "inflight:dead"
GROUP, CONSUMER = "inflight", "dead-consumer"
BACKLOG = 5000
DEAD_CONSUMER_PENDING = 500
SIDE_ENTRIES = 100
DELETE_BATCH = 1000


class RedisError(Exception):
    pass


class Connection:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.stream = self.sock.makefile("rb")

    def send(self, *args) -> None:
        parts = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        self.sock.sendall(b"".join(parts))

    def read(self):
        """One RESP reply: bytes, int, a list, None, or RedisError (returned, not raised)."""
        line = self.stream.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else self.stream.read(size + 2)[:-2]
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self.read() for _ in range(size)]
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return RedisError(rest.decode())
        return rest

    def call(self, *args):
        self.send(*args)
        return self.read()

    def pipeline(self, commands: list[tuple]) -> list:
        for args in commands:
            self.send(*args)
        return [self.read() for _ in commands]


def consumers_of(redis: Connection, stream: str) -> dict[str, set[str]] | None:
    """{group: {consumer names}} of `stream`, or None where the key does not exist."""
    groups = redis.call("XINFO", "GROUPS", stream)
    if isinstance(groups, RedisError):
        return None
    found = {}
    for fields in groups:
        name = dict(zip(fields[::2], fields[1::2]))[b"name"].decode()
        consumers = redis.call("XINFO", "CONSUMERS", stream, name)
        found[name] = {dict(zip(c[::2], c[1::2]))[b"name"].decode() for c in consumers}
    return found


def seed(state_path: str, port: int = 6379) -> None:
    redis = Connection(port)
    before = consumers_of(redis, REQUESTS)
    state = {
        "created_keys": [key for key in (REQUESTS, CONTROL, DEAD) if redis.call("EXISTS", key) == 0],
        "created_group": before is None or GROUP not in before,
        "created_consumer": before is None or CONSUMER not in before.get(GROUP, set()),
        "ids": {},
    }
    # Written before anything is added, so an interrupted seed is still removed.
    write_state(state_path, state)
    redis.call("XGROUP", "CREATE", REQUESTS, GROUP, "$", "MKSTREAM")  # BUSYGROUP if it is there
    backlog = redis.pipeline(
        [
            ("XADD", REQUESTS, "*", "id", f"leftover-{i}", "prompt", "x" * 2000, "max_tokens", "64")
            for i in range(BACKLOG)
        ]
    )
    state["ids"][REQUESTS] = [entry_id.decode() for entry_id in backlog]
    write_state(state_path, state)
    if state["created_group"]:
        # Created at "$" before the backlog went in, so this reads seeded entries only. A group
        # that was there could hand out someone else's entries: then no pending ones are made.
        redis.call("XREADGROUP", "GROUP", GROUP, CONSUMER, "COUNT", DEAD_CONSUMER_PENDING, "STREAMS", REQUESTS, ">")
    for stream, fields in ((CONTROL, ("type", "cancel")), (DEAD, ("code", "invalid_field", "message", "leftover"))):
        added = redis.pipeline([("XADD", stream, "*", *fields, "id", f"leftover-{i}") for i in range(SIDE_ENTRIES)])
        state["ids"][stream] = [entry_id.decode() for entry_id in added]
    write_state(state_path, state)


def remove(state_path: str, port: int = 6379) -> None:
    try:
        with open(state_path) as file:
            state = json.load(file)
    except FileNotFoundError:
        return  # nothing was seeded
    redis = Connection(port)
    for stream, ids in state["ids"].items():
        for start in range(0, len(ids), DELETE_BATCH):
            redis.call("XDEL", stream, *ids[start : start + DELETE_BATCH])
    if state["created_group"]:
        redis.call("XGROUP", "DESTROY", REQUESTS, GROUP)
    elif state["created_consumer"]:
        redis.call("XGROUP", "DELCONSUMER", REQUESTS, GROUP, CONSUMER)
    for key in state["created_keys"]:
        # A key the seed made goes too, unless something else was written to it since.
        groups = consumers_of(redis, key)
        if groups == {} and redis.call("XLEN", key) == 0:
            redis.call("DEL", key)
    os.remove(state_path)


def write_state(path: str, state: dict) -> None:
    with open(path, "w") as file:
        json.dump(state, file)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in ("seed", "remove"):
        sys.exit(__doc__)
    {"seed": seed, "remove": remove}[sys.argv[1]](sys.argv[2], *map(int, sys.argv[3:]))
