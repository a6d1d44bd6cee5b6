"""The gateway's Batch API (issue 38): files and batches in Redis, driven by every gateway.

Against a real Redis, with the real gateway app served in-process by uvicorn (one test
kills a gateway process outright). Most tests put a fake worker behind it, which takes
each job off the request stream and answers it with the events a real one writes
(`service.protocol`'s own builders), or holds it, so the state machine can be walked on
purpose: cancel, expiry, refusals for load, a driver that dies half-way. One test runs a
real worker on a tiny random model, end to end, and checks every answer against the
same request sent to the gateway interactively.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import contextmanager

import openai
import pytest
import redis
import redis.asyncio as aioredis

from bench.processes import GatewayProcess, free_port
from service.config import DEFAULT_MODEL_NAME, GatewayConfig, RedisConfig
from service.protocol import Job, decode_job, done_fields, error_fields, token_fields
from service.worker import Worker
from tests.service.test_producer_tenants import InProcessGateway
from tests.waiting import wait_until
from workers.api import FinalEvent, FinishReason, Timings, Usage
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.model_loader import load_model

URL = "redis://127.0.0.1:6379"
MODEL = DEFAULT_MODEL_NAME
ACME_KEY, OPEN_KEY = "sk-acme", "sk-open"
ENDED = ("completed", "failed", "expired", "cancelled")


# -- a stand-in for the workers ------------------------------------------------------------


def echo(job: Job) -> list[dict]:
    """A one-token answer repeating the prompt, so each answer shows whose it is."""
    prompt = job.prompt if isinstance(job.prompt, str) else job.prompt[-1]["content"]
    final = FinalEvent(job.request_id, FinishReason.STOP, Usage(5, 1), Timings(0.0, 0.01, 0.02, (0.01,)))
    return [token_fields(0, f"re: {prompt}", [42]), done_fields(final, worker="fake")]


def cancelled(job: Job) -> list[dict]:
    final = FinalEvent(job.request_id, FinishReason.CANCELLED, Usage(0, 0), Timings(0.0, None, 0.0, ()))
    return [done_fields(final, worker="fake")]


class FakeWorker:
    """Takes every job off the request stream (deleting it, as workers do) and answers it
    with `answer(job)`'s reply entries, or holds it unanswered when that is None (until
    `release`). Like a worker it runs an id once, and a cancel on the control stream ends
    a held job (`done`, `cancelled`)."""

    def __init__(self, client: redis.Redis, stream: str, control: str, answer=echo, delay_s: float = 0.0) -> None:
        self.client, self.stream, self.control = client, stream, control
        self.answer, self.delay_s = answer, delay_s
        self.taken: list[Job] = []  # every entry read, in order, duplicates included
        self.answered: set[str] = set()
        self.held: dict[str, Job] = {}
        self.cancels: list[str] = []
        self.most_at_once = 0  # the most jobs waiting unanswered at any read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeWorker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        reply_streams = {job.reply_to for job in self.taken}
        if reply_streams:
            self.client.delete(*reply_streams)

    def release(self, request_ids=None, answer=echo) -> None:
        """Answer held jobs (all of them by default)."""
        with self._lock:
            for request_id in list(self.held if request_ids is None else request_ids):
                self._reply(self.held.pop(request_id), answer(self.held_job(request_id)))

    def held_job(self, request_id: str) -> Job:
        return next(job for job in self.taken if job.request_id == request_id)

    def _serve(self) -> None:
        last = {self.stream: "0", self.control: "0"}
        while not self._stop.is_set():
            found = self._read(last, block=100)
            if self.delay_s and found[self.stream]:
                self._stop.wait(self.delay_s)  # what the driver queues meanwhile is taken together
                for name, entries in self._read(last, block=None).items():
                    found[name] += entries
            with self._lock:
                self._take(found[self.stream])
                self._cancel(found[self.control])

    def _read(self, last: dict, block: int | None) -> dict[str, list]:
        """New entries of each stream; `last` moves past them."""
        found = {self.stream: [], self.control: []}
        for name, entries in self.client.xread(last, block=block) or ():
            last[name.decode()] = entries[-1][0]
            found[name.decode()] += entries
        return found

    def _take(self, entries) -> None:
        self.most_at_once = max(self.most_at_once, len(self.held) + len(entries))
        for entry_id, fields in entries:
            self.client.xdel(self.stream, entry_id)
            job = decode_job(entry_id, fields)
            self.taken.append(job)
            if job.request_id in self.answered or job.request_id in self.held:
                continue  # an id runs once
            replies = self.answer(job)
            if replies is None:
                self.held[job.request_id] = job
            else:
                self._reply(job, replies)

    def _cancel(self, entries) -> None:
        for _, fields in entries:
            request_id = fields[b"id"].decode()
            self.cancels.append(request_id)
            if request_id in self.held:
                job = self.held.pop(request_id)
                self._reply(job, cancelled(job))

    def _reply(self, job: Job, replies: list[dict]) -> None:
        """Entry ids as a worker gives them: token seq s is `<s + 1>-0`, the final `<n>-1`."""
        self.answered.add(job.request_id)
        tokens = 0
        for reply in replies:
            tokens += reply["type"] == "token"
            self.client.xadd(job.reply_to, reply, id=f"{tokens}-{0 if reply['type'] == 'token' else 1}")


# -- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture
def streams():
    """Private request and control streams, a blocking client of their Redis, and every
    key left under them removed at the end."""
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(URL, socket_timeout=30)
    yield client, f"{prefix}:requests", f"{prefix}:control"
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def config_for(streams, **settings) -> GatewayConfig:
    _, stream, control = streams
    settings = {"batch_poll_s": 0.05, "batch_lease_s": 1.0, "max_queue_depth": 0, **settings}
    return GatewayConfig(
        port=free_port(),
        redis_url=URL,
        requests_stream=stream,
        control_stream=control,
        api_keys={ACME_KEY: "acme", OPEN_KEY: None},
        **settings,
    )


@contextmanager
def serving(streams, answer=echo, delay_s: float = 0.0, **settings):
    """A gateway (and its client, as tenant acme) with a fake worker behind it."""
    client, stream, control = streams
    with (
        FakeWorker(client, stream, control, answer, delay_s) as worker,
        InProcessGateway(config_for(streams, **settings)) as gateway,
    ):
        yield gateway.client(ACME_KEY), worker, gateway


def completions_file(count: int, **body) -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"prompt {i}", "max_tokens": 4, **body},
        }
        for i in range(count)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def start_batch(api: openai.OpenAI, content: bytes, endpoint: str = "/v1/completions", **options):
    upload = api.files.create(file=("requests.jsonl", content), purpose="batch")
    return api.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h", **options)


def wait_for(api: openai.OpenAI, batch_id: str, condition, what: str, timeout_s: float = 30):
    seen = {}

    def holds() -> bool:
        seen["batch"] = api.batches.retrieve(batch_id)
        return condition(seen["batch"])

    wait_until(holds, timeout_s, what)
    return seen["batch"]


def ended(api: openai.OpenAI, batch_id: str, timeout_s: float = 30):
    return wait_for(api, batch_id, lambda b: b.status in ENDED, "the batch to end", timeout_s)


def file_lines(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in api.files.content(file_id).content.decode().splitlines()]


def job_id_of(output_line: dict) -> str:
    return output_line["response"]["request_id"]


# -- running a batch -----------------------------------------------------------------------


def test_a_batch_runs_each_line_as_a_batch_job_of_its_tenant_and_writes_openai_shaped_files(streams):
    content = completions_file(30)
    bad = [
        {"custom_id": "bad-temperature", "body": {"model": MODEL, "prompt": "x", "temperature": -1}},
        {"custom_id": "other-model", "body": {"model": "gpt-4o", "prompt": "x"}},
    ]
    content += b"".join(json.dumps({**b, "method": "POST", "url": "/v1/completions"}).encode() + b"\n" for b in bad)
    with serving(streams, delay_s=0.1, batch_max_outstanding=4) as (api, worker, gateway):
        batch = start_batch(api, content, metadata={"run": "nightly"})
        assert (batch.status, batch.object, batch.metadata) == ("validating", "batch", {"run": "nightly"})
        assert batch.expires_at - batch.created_at == 24 * 3600
        batch = ended(api, batch.id)

        assert batch.status == "completed"
        assert batch.request_counts.model_dump() == {"total": 32, "completed": 30, "failed": 2}
        assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
        assert batch.errors is None and batch.failed_at is None and batch.cancelled_at is None
        output = file_lines(api, batch.output_file_id)
        assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(30)]  # in input order
        for i, line in enumerate(output):
            response = line["response"]
            assert line["error"] is None and line["id"].startswith("batch_req_")
            assert response["status_code"] == 200
            assert response["body"]["id"] == "cmpl-" + response["request_id"]
            assert response["body"]["object"] == "text_completion"
            assert response["body"]["choices"][0]["text"] == f"re: prompt {i}"
            assert response["body"]["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        errors = {line["custom_id"]: line for line in file_lines(api, batch.error_file_id)}
        assert errors["bad-temperature"]["response"]["status_code"] == 400
        assert errors["bad-temperature"]["response"]["body"]["error"]["code"] == "invalid_field"
        assert errors["other-model"]["response"]["status_code"] == 404
        assert errors["other-model"]["response"]["body"]["error"]["code"] == "model_not_found"

        # Every line ran once, as a batch job of the batch's tenant; never more than 4 at once.
        assert sorted(job.request_id for job in worker.taken) == sorted(job_id_of(line) for line in output)
        assert all(job.batch and job.tenant == "acme" for job in worker.taken)
        assert worker.most_at_once == 4

        output_file = api.files.retrieve(batch.output_file_id)
        assert (output_file.purpose, output_file.filename) == ("batch_output", f"{batch.id}_output.jsonl")
        assert api.batches.list().data[0].id == batch.id

        # Another tenant sees none of it; another gateway answers the same.
        other = gateway.client(OPEN_KEY, "globex")
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(batch.output_file_id)
        assert other.batches.list().data == [] and other.files.list().data == []
        with InProcessGateway(config_for(streams)) as second:
            assert second.client(ACME_KEY).batches.retrieve(batch.id) == batch


def test_a_job_refused_for_load_is_queued_again_after_its_retry_after(streams):
    refusals: list[str] = []
    taken_at: dict[str, float] = {}

    def refuse_three(job: Job):
        taken_at[job.request_id] = time.monotonic()
        if len(refusals) < 3 and job.request_id.endswith("-0"):  # each refused once
            refusals.append(job.request_id)
            return [error_fields("queue_full", "the queue is full", 0.5)]
        return echo(job)

    with serving(streams, answer=refuse_three) as (api, worker, _):
        batch = ended(api, start_batch(api, completions_file(6)).id)
        assert batch.status == "completed"
        assert batch.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
        texts = [line["response"]["body"]["choices"][0]["text"] for line in file_lines(api, batch.output_file_id)]
        assert texts == [f"re: prompt {i}" for i in range(6)]
        assert batch.error_file_id is None
        # Each refused job went again under its next attempt's id, once its retry_after passed.
        for refused in refusals:
            again = refused.removesuffix("-0") + "-1"
            assert taken_at[again] - taken_at[refused] >= 0.45


# -- checks ----------------------------------------------------------------------------------


def test_a_bad_input_file_fails_the_batch_naming_each_line_and_runs_nothing(streams):
    lines = [
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}),
        "not json",
        "",  # blank lines are skipped, but counted
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {}}),
        json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions"}),
        json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": []}),
        json.dumps([1, 2]),
    ]
    with serving(streams) as (api, worker, _):
        batch = ended(api, start_batch(api, "\n".join(lines).encode()).id)
        assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
        assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
            (2, "invalid_json_line", None),
            (4, "duplicate_custom_id", "custom_id"),
            (5, "invalid_method", "method"),
            (6, "mismatched_endpoint", "url"),
            (7, "missing_required_parameter", "body"),
            (8, "invalid_body", "body"),
            (9, "invalid_json_line", None),
        ]
        assert batch.output_file_id is None and batch.error_file_id is None
        assert batch.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
        assert worker.taken == []


def test_the_batch_and_file_routes_refuse_what_they_cannot_serve(streams):
    with serving(streams, max_file_lines=3, max_file_bytes=1 << 20) as (api, _, gateway):
        upload = api.files.create(file=("in.jsonl", completions_file(1)), purpose="batch")
        for options, param in [
            ({"endpoint": "/v1/embeddings"}, "endpoint"),
            ({"completion_window": "1h"}, "completion_window"),
            ({"input_file_id": "file-nothere"}, "input_file_id"),
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ]:
            arguments = {"input_file_id": upload.id, "endpoint": "/v1/completions", "completion_window": "24h"}
            with pytest.raises(openai.BadRequestError) as refused:
                api.batches.create(**{**arguments, **options})
            assert refused.value.body["param"] == param
        with pytest.raises(openai.BadRequestError):  # another tenant's file is no file at all
            gateway.client(OPEN_KEY).batches.create(**arguments)
        with pytest.raises(openai.BadRequestError) as refused:
            api.files.create(file=("in.jsonl", completions_file(1)), purpose="fine-tune")
        assert refused.value.body["param"] == "purpose"
        with pytest.raises(openai.BadRequestError) as refused:
            api.files.create(file=("in.jsonl", completions_file(4)), purpose="batch")
        assert "over the limit of 3" in refused.value.body["message"]
        with pytest.raises(openai.APIStatusError) as refused:
            api.files.create(file=("in.jsonl", b"x" * ((1 << 20) + 1)), purpose="batch")
        assert refused.value.status_code == 413
        with pytest.raises(openai.AuthenticationError):
            gateway.client("sk-wrong").files.list()
        with pytest.raises(openai.NotFoundError):
            api.batches.retrieve("batch_nothere")


def test_files_are_listed_read_and_deleted(streams):
    with serving(streams) as (api, _, gateway):
        uploads = [api.files.create(file=(f"in-{i}.jsonl", completions_file(i + 1)), purpose="batch") for i in range(3)]
        assert uploads[0].object == "file" and uploads[0].id.startswith("file-")
        assert uploads[0].bytes == len(completions_file(1)) and uploads[0].filename == "in-0.jsonl"
        assert api.files.retrieve(uploads[1].id) == uploads[1]
        assert api.files.content(uploads[2].id).content == completions_file(3)

        assert [f.id for f in api.files.list().data] == [u.id for u in reversed(uploads)]  # newest first
        page = api.files.list(limit=2, order="asc")
        assert [f.id for f in page.data] == [uploads[0].id, uploads[1].id] and page.has_more
        assert [f.id for f in api.files.list(after=uploads[1].id, order="asc").data] == [uploads[2].id]
        pages = api.files.list(limit=1, order="asc").iter_pages()
        assert [f.id for page in pages for f in page.data] == [u.id for u in uploads]
        assert api.files.list(purpose="batch_output").data == []

        assert api.files.delete(uploads[0].id).deleted
        with pytest.raises(openai.NotFoundError):
            api.files.retrieve(uploads[0].id)
        with pytest.raises(openai.NotFoundError):
            api.files.delete(uploads[0].id)
        with pytest.raises(openai.NotFoundError):  # not another tenant's to delete
            gateway.client(OPEN_KEY).files.delete(uploads[1].id)
        assert len(api.files.list().data) == 2


# -- ending early ----------------------------------------------------------------------------


def hold(job: Job) -> None:
    return None


def test_cancel_ends_the_jobs_in_flight_keeps_what_finished_and_fails_the_rest(streams):
    with serving(streams, answer=hold, batch_max_outstanding=3, reply_timeout_s=5) as (api, worker, _):
        batch = start_batch(api, completions_file(10))
        wait_until(lambda: len(worker.held) == 3, 30, "three jobs in flight")
        first = sorted(worker.held)[0]
        worker.release([first])
        wait_for(api, batch.id, lambda b: b.request_counts.completed == 1, "the released job to be recorded")
        wait_until(lambda: len(worker.held) == 3, 30, "a fourth job in its place")

        cancelling = api.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
        batch = ended(api, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        assert batch.request_counts.model_dump() == {"total": 10, "completed": 1, "failed": 9}
        assert [job_id_of(line) for line in file_lines(api, batch.output_file_id)] == [first]
        errors = file_lines(api, batch.error_file_id)
        assert len(errors) == 9 and all(line["error"]["code"] == "batch_cancelled" for line in errors)
        assert all(line["response"] is None for line in errors)
        # The three jobs still in flight were cancelled on the control stream; none ran twice.
        assert len(worker.taken) == 4
        assert set(worker.cancels) == {job.request_id for job in worker.taken} - {first}

        assert api.batches.cancel(batch.id).status == "cancelled"  # again: no change
        worker.answer = echo
        finished = ended(api, start_batch(api, completions_file(1)).id)
        with pytest.raises(openai.ConflictError):
            api.batches.cancel(finished.id)


def test_a_batch_whose_window_ends_expires_keeping_its_finished_answers(streams):
    answered_first = []

    def answer_two(job: Job):
        if len(answered_first) < 2:
            answered_first.append(job.request_id)
            return echo(job)
        return None

    settings = {"batch_window_s": 2.0, "batch_max_outstanding": 2, "reply_timeout_s": 1}
    with serving(streams, answer=answer_two, **settings) as (api, worker, _):
        batch = ended(api, start_batch(api, completions_file(8)).id)
        assert batch.status == "expired" and batch.expired_at is not None and batch.completed_at is None
        assert batch.request_counts.model_dump() == {"total": 8, "completed": 2, "failed": 6}
        # The two answers, in the order they were recorded (which two jobs answered at once may swap).
        assert sorted(job_id_of(line) for line in file_lines(api, batch.output_file_id)) == sorted(answered_first)
        errors = file_lines(api, batch.error_file_id)
        assert [line["error"]["code"] for line in errors] == ["batch_expired"] * 6
        # The two jobs in flight at the end were cancelled; the rest were never queued.
        assert len(worker.taken) == 4
        assert set(worker.cancels) == {job.request_id for job in worker.taken} - set(answered_first)


# -- a driver that dies ----------------------------------------------------------------------


def test_a_gateway_that_dies_mid_batch_is_taken_over_with_no_line_lost_or_repeated(streams, tmp_path):
    client, stream, control = streams
    answering = {"count": 0}

    def answer_six(job: Job):
        if answering["count"] < 6:
            answering["count"] += 1
            return echo(job)
        return None  # held while the first gateway dies

    flags = ["--redis-url", URL, "--requests-stream", stream, "--control-stream", control, "--max-queue-depth", "0"]
    flags += ["--batch-lease-s", "1", "--batch-poll-s", "0.05", "--batch-max-outstanding", "4"]
    first = GatewayProcess("first", flags, tmp_path, env={"INFLIGHT_API_KEYS": OPEN_KEY})
    with FakeWorker(client, stream, control, answer_six) as worker:
        first.start()
        try:
            first.wait_ready()
            api = openai.OpenAI(base_url=f"{first.url}/v1", api_key=OPEN_KEY, max_retries=0, timeout=30)
            batch = start_batch(api, completions_file(20))
            wait_for(api, batch.id, lambda b: b.request_counts.completed == 6, "six answers recorded")
            wait_until(lambda: len(worker.held) == 4, 30, "four jobs in flight")
        finally:
            first.process.kill()  # SIGKILL: no lease given back, nothing tidied
            first.process.wait(30)
        held = sorted(worker.held)
        worker.release(held[:2])  # these finish while no gateway follows them
        worker.answer = echo

        def queued_again() -> bool:
            taken = [job.request_id for job in worker.taken]
            return all(taken.count(request_id) == 2 for request_id in held[2:])

        with InProcessGateway(config_for(streams)) as second:
            api = second.client(OPEN_KEY)
            wait_until(queued_again, 30, "the two that never ran to be queued again by the successor")
            worker.release()
            batch = ended(api, batch.id)
            output = file_lines(api, batch.output_file_id)

    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 20, "completed": 20, "failed": 0}
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(20)]
    assert [line["response"]["body"]["choices"][0]["text"] for line in output] == [f"re: prompt {i}" for i in range(20)]
    # Only the two jobs with no reply stream yet were queued again, under their own ids.
    taken = [job.request_id for job in worker.taken]
    assert sorted(request_id for request_id in set(taken) if taken.count(request_id) > 1) == held[2:]
    assert len(set(taken)) == 20


# -- end to end, with a real worker ----------------------------------------------------------


class InProcessWorker:
    """The real worker (`service.worker.Worker`) on a tiny random model, on an event loop
    in a thread of its own."""

    def __init__(self, stream: str, control: str) -> None:
        model = ModelConfig(source="random:tiny-llama", dtype="float32", device="cpu")
        self.engine = Engine(
            load_model(model),
            EngineConfig(
                model=model,
                cache=CacheConfig(kv_memory_bytes=8 << 20, swap_memory_bytes=8 << 20),
                scheduler=SchedulerConfig(max_running_requests=4),
            ),
        )
        self.config = RedisConfig(
            requests_stream=stream, control_stream=control, dead_letter_stream=f"{stream}:dead", block_ms=200
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        client = aioredis.Redis.from_url(URL, socket_timeout=30)
        await Worker(self.engine, client, self.config).run(self.stop)
        await client.aclose()

    def __enter__(self) -> InProcessWorker:
        self.thread.start()
        wait_until(lambda: self.stop is not None, 30, "the worker to start")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)


def test_end_to_end_a_batch_on_a_real_worker_answers_as_the_same_requests_sent_alone(streams):
    client, stream, control = streams
    chats = [f"Say something about the number {i}." for i in range(3)]
    chat_file = "".join(
        json.dumps(
            {
                "custom_id": f"chat-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
            }
        )
        + "\n"
        for i, text in enumerate(chats)
    ).encode()
    # One job at a time, as each request alone runs: greedy tokens then match exactly.
    with InProcessWorker(stream, control), InProcessGateway(config_for(streams, batch_max_outstanding=1)) as gateway:
        api = gateway.client(ACME_KEY)
        chat_batch = start_batch(api, chat_file, endpoint="/v1/chat/completions")
        text_batch = start_batch(api, completions_file(2, temperature=0, max_tokens=6))
        chat_batch, text_batch = ended(api, chat_batch.id, 120), ended(api, text_batch.id, 120)
        assert (chat_batch.status, text_batch.status) == ("completed", "completed")
        assert chat_batch.request_counts.completed == 3 and text_batch.request_counts.completed == 2

        for i, line in enumerate(file_lines(api, chat_batch.output_file_id)):
            body = line["response"]["body"]
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            alone = api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": chats[i]}], max_tokens=8, temperature=0
            )
            assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
            assert body["choices"][0]["finish_reason"] == alone.choices[0].finish_reason
            assert body["usage"] == alone.usage.model_dump(exclude_none=True)
        for i, line in enumerate(file_lines(api, text_batch.output_file_id)):
            alone = api.completions.create(model=MODEL, prompt=f"prompt {i}", max_tokens=6, temperature=0)
            assert line["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    for batch in (chat_batch, text_batch):
        replies = list(client.scan_iter(match=f"inflight:out:{{{batch.id}-*", count=1000))
        if replies:
            client.delete(*replies)
