"""Fill the shared Redis (127.0.0.1:6379) with what a developer's manual runs leave
behind, under the default key names: a backlog on inflight:requests, entries pending
for consumers that died, cancels and dead letters. Speaks RESP over a socket, so it
needs nothing installed. Idempotent: it tops the data up to the same size."""

import socket

BACKLOG = 5000
DEAD_CONSUMER_PENDING = 500


def command(sock, *args) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    sock.sendall(b"".join(parts))
    return sock


def main() -> None:
    with socket.create_connection(("127.0.0.1", 6379)) as sock:
        stream = sock.makefile("rb")

        def call(*args) -> bytes:
            command(sock, *args)
            return read(stream)

        if int(call("XLEN", "inflight:requests")) >= BACKLOG:
            return
        call("XGROUP", "CREATE", "inflight:requests", "inflight", "0", "MKSTREAM")  # BUSYGROUP if there
        for i in range(BACKLOG):
            command(sock, "XADD", "inflight:requests", "*", "id", f"leftover-{i}", "prompt", "x" * 2000,
                    "max_tokens", "64")
        for _ in range(BACKLOG):
            read(stream)
        call("XREADGROUP", "GROUP", "inflight", "dead-consumer", "COUNT", DEAD_CONSUMER_PENDING,
             "STREAMS", "inflight:requests", ">")
        for i in range(100):
            call("XADD", "inflight:control", "*", "type", "cancel", "id", f"leftover-{i}")
            call("XADD", "inflight:dead", "*", "code", "invalid_field", "message", "leftover")


def read(stream):
    """One RESP reply, skipped over (arrays and bulk strings read whole)."""
    line = stream.readline()
    kind, rest = line[:1], line[1:-2]
    if kind == b"$":
        size = int(rest)
        return b"" if size < 0 else stream.read(size + 2)[:-2]
    if kind == b"*":
        return [read(stream) for _ in range(max(int(rest), 0))]
    return rest


if __name__ == "__main__":
    main()
