"""A fleet: workers and gateways on private streams of one Redis, their logs in one folder,
one teardown; the load scenarios' systems and the tests' workers, with the tests' job."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

from bench.processes import GatewayProcess, WorkerProcess, free_port, start_reaper, stop_reaper
from service.connect import connect_sync

PROMPT = "List the numbers from 1 to 300, comma separated:"
MAX_TOKENS = 80
# The tests' worker: a small KV cache, a few requests at a time. Workers share the
# machine's cores: one torch thread each, or their OpenMP teams outnumber the cores and
# every step slows down many times over.
SMALL_WORKER = ("--kv-memory-mb", "64", "--swap-memory-mb", "16", "--max-running-requests", "4",
                "--log-format", "json", "--threads", "1")  # fmt: skip
# A gateway that refuses nothing (no queue depth or age bound): a refused request would be
# a failure in the bench, and vLLM, the peer, queues whatever arrives.
BACKPRESSURE_OFF = ("--max-queue-depth", "0", "--max-queue-age-s", "0")


class Fleet:
    """Workers on the streams `prefix:requests`, `:control`, `:dead` of the Redis at `url`,
    each started with `worker_flags`; `client` is a blocking client of it. Closing SIGTERMs
    the workers with `graceful` (else SIGKILL), and deletes every key under the prefix and
    the submitted requests' replies; with `reap`, a watcher kills each worker should this
    process be SIGKILLed (the benches)."""

    def __init__(
        self,
        log_dir: Path,
        url: str = "redis://127.0.0.1:6379",
        prefix: str | None = None,
        worker_flags: tuple[str, ...] | list[str] = SMALL_WORKER,
        graceful: bool = False,
        reap: bool = False,
    ) -> None:
        self.url = url
        self.prefix = prefix or f"inflight:test:{uuid.uuid4().hex[:8]}"
        self.stream, self.control, self.dead = (f"{self.prefix}:{s}" for s in ("requests", "control", "dead"))
        self.client = connect_sync(url, socket_timeout=30)
        self.logs = Path(log_dir)
        self.worker_flags = list(worker_flags)
        self.graceful, self.reap = graceful, reap
        self.workers: dict[str, WorkerProcess] = {}
        self.gateways: dict[str, GatewayProcess] = {}
        self.request_ids: list[str] = []  # submitted: deleted at the end
        self._reapers: list[subprocess.Popen] = []
        self._issued = 0

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def stream_flags(self) -> list[str]:
        return ["--redis-url", self.url, "--requests-stream", self.stream, "--control-stream", self.control]

    def start(self, name: str, *flags: str, cores: str | None = None) -> WorkerProcess:
        """Worker `name` with the fleet's flags and `flags`, pinned to `cores` (`taskset -c`)
        if given; started again under the same name and flags if it ran before."""
        worker = self.workers.get(name)
        if worker is None:
            argv = [*self.stream_flags, "--dead-letter-stream", self.dead, *self.worker_flags, *flags]
            worker = self.workers[name] = WorkerProcess(name, argv, self.logs)
            if cores is not None:
                worker.argv = ["taskset", "-c", cores, *worker.argv]
        worker.start()
        if self.reap:
            self._reapers.append(start_reaper([str(worker.pid)]))
        return worker

    def gateway(self, name: str, *flags: str, env: dict[str, str] | None = None) -> GatewayProcess:
        gateway = self.gateways[name] = GatewayProcess(name, [*self.stream_flags, *flags], self.logs, env)
        gateway.start()
        return gateway

    def wait_until_serving(self, name: str, timeout_s: float = 120) -> None:
        self.workers[name].wait_ready(timeout_s)

    def wait_all(self, timeout_s: float = 300) -> None:
        for worker in self.workers.values():
            worker.wait_ready(timeout_s)
        for gateway in self.gateways.values():
            gateway.wait_ready()

    def log(self, name: str) -> str:
        return self.workers[name].log_path.read_text(errors="replace")

    def log_tails(self, chars: int = 1500) -> str:
        return "\n".join(f"--- {w.name}\n{w.log_tail(chars)}" for w in self.workers.values())

    def dead_workers(self) -> list[str]:
        return [w.name for w in self.workers.values() if not w.alive()]

    @staticmethod
    def reply(request_id: str) -> str:
        return f"inflight:out:{{{request_id}}}"

    def owner(self, request_id: str) -> str | None:
        """The consumer name in the reply stream's owner key: who writes it now."""
        value = self.client.get(f"{self.reply(request_id)}:owner")
        return value.decode().split()[1] if value else None

    def events(self, request_id: str) -> list[dict]:
        return [msgpack.unpackb(fields[b"data"]) for _, fields in self.client.xrange(self.reply(request_id))]

    def finished(self, request_id: str) -> bool:
        events = self.events(request_id)
        return bool(events) and events[-1]["type"] in ("done", "error")

    def submit(self, ids: list[str], **fields: str) -> list[str]:
        """The fleet's job (PROMPT, MAX_TOKENS greedy tokens) under each id, plus `fields`."""
        self.request_ids.extend(ids)
        job = {"prompt": PROMPT, "max_tokens": str(MAX_TOKENS), "ignore_eos": "true", **fields}
        for request_id in ids:
            self.client.xadd(self.stream, {"id": request_id, **job})
        return ids

    def new_ids(self, count: int) -> list[str]:
        """Request ids never handed out before by this fleet."""
        self._issued += count
        return [f"{self.prefix}-{i}" for i in range(self._issued - count, self._issued)]

    def close(self) -> None:
        for gateway in self.gateways.values():
            gateway.stop()
        for worker in self.workers.values():
            if worker.alive():
                worker.process.send_signal(signal.SIGCONT)  # a paused one too
                worker.stop() if self.graceful else worker.kill()
        for reaper in self._reapers:
            stop_reaper(reaper)
        replies = [self.reply(r) for r in self.request_ids]
        keys = [self.stream, self.dead, self.control, *replies, *(f"{reply}:owner" for reply in replies)]
        for pattern in (f"{self.prefix}:*", "{" + self.stream + "}:*"):  # the fair queue's keys too
            keys += self.client.scan_iter(pattern)
        for key in keys:
            self.client.delete(key)  # one key at a time: on a cluster they live in many slots
        self.client.close()


@contextlib.contextmanager
def redis_server(url: str) -> Iterator[str]:
    """The given server, else an embedded Valkey on a free port for the run."""
    if url:
        yield url
        return
    from service.embedded import embedded_valkey

    with tempfile.TemporaryDirectory(prefix="inflight-bench-valkey-") as data_dir:
        with embedded_valkey(free_port(), Path(data_dir)) as embedded:
            yield embedded


@dataclass(frozen=True)
class BenchRun:
    """A load scenario's Redis (`--redis-url`, else an embedded Valkey), its asyncio client,
    an id that keeps its request ids and keys apart, and a folder for its logs."""

    url: str
    client: object  # redis.asyncio
    run_id: str
    logs: Path

    def fleet(self, name: str, worker_flags: list[str], reap: bool = True) -> Fleet:
        """A fleet on streams and a log folder of `name`'s own; its workers stop gracefully."""
        (self.logs / name).mkdir()
        prefix = f"inflight:bench:{self.run_id}:{name}"
        return Fleet(self.logs / name, self.url, prefix, worker_flags, graceful=True, reap=reap)


@contextlib.asynccontextmanager
async def bench_run(redis_url: str, name: str, socket_timeout: float = 60) -> AsyncIterator[BenchRun]:
    from service.connect import connect

    with redis_server(redis_url) as url, tempfile.TemporaryDirectory(prefix=f"inflight-bench-{name}-") as logs:
        client = connect(url, socket_timeout=socket_timeout)
        try:
            yield BenchRun(url, client, uuid.uuid4().hex[:8], Path(logs))
        finally:
            await client.aclose()


def model_flags(args) -> list[str]:
    """The bench's model and dtype, as worker flags."""
    return ["--dtype", args.dtype, *(["--model", args.model] if args.model else [])]
