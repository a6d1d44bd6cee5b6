"""Fault drills for disaggregated prefill and decode, with real `inflight worker` processes
(`--role prefill` and `--role decode`, float32, the bundled model) on private streams of
a real Redis: a prefill worker killed mid-prompt, a decode worker killed mid-stream, a
handoff whose K/V expired before any decode worker came, and cancels while a job waits
on the handoff stream and while it streams from a decode worker.

Every drill ends the same way: each job's reply stream is gapless and duplicate-free in
`seq` and holds exactly the greedy tokens one colocated engine makes (a cancelled job: a
prefix of them), nothing is pending on the request streams or the handoff stream, nothing
was dead-lettered, and every surviving worker's /metrics show no handoff K/V held and no
KV block in use, on the device or in the host tier.

One set of workers serves all the drills, in this file's order (each finds the workers it
needs among those still alive): `p1` and `p2` prefill from the request stream and hold
staged K/V for `HOLD_S`; `p3` prefills from a stream of its own and holds them only
`SHORT_HOLD_S`; `d1` and `d2` decode everything all three hand off. Each drill uses a
prompt of its own, so no worker's prefix cache already holds it.
"""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest

from bench.fleet import Fleet
from bench.processes import WorkerProcess
from service.sdk import SyncClient
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
pytest.importorskip("nixl_cu12")

BLOCK = 4
# Staged K/V live this long on p1 and p2 unless confirmed: far beyond any drill, so a
# prompt's K/V freed during a drill were freed by a confirmation.
HOLD_S = 60.0
# p3's hold: the expired-handle drill waits it out. Above the decode side's read margin
# (service/handoff.py: READ_MARGIN_S), so a decode worker in time would read them.
SHORT_HOLD_S = 4.0
PREFILL, DECODE = ("p1", "p2", "p3"), ("d1", "d2")
# About 200 tokens (50 blocks): a prefill worker on one thread computes it for half a
# second or more, time enough to kill it mid-prompt.
LONG_PROMPT = "Inventory of the north warehouse, aisle by aisle: " + " ".join(
    f"aisle {i} holds {i * 7 % 31 + 2} crates of {('bolts', 'nails', 'hinges', 'screws', 'washers')[i % 5]};"
    for i in range(15)
)
PROMPTS = {
    "prefill-killed": LONG_PROMPT,
    "decode-killed": "Describe, in two short paragraphs, how a lighthouse keeper spent a stormy night "
    "in the year 1890, what he ate, and which ships he saw passing the rocks.",
    "cancel-streaming": "Write a recipe for a simple vegetable soup: list the ingredients with their "
    "amounts, then the steps, one per line, and say how long it simmers.",
    "expired": "Summarise the rules of chess for a child of eight: how each piece moves, what check "
    "means, and how a game can end in a draw.",
    "cancel-queued": "Plan a three-day walking trip in the hills: where to sleep each night, what to "
    "carry, and what to do when the weather turns bad on the second day.",
}
MAX_TOKENS = {"prefill-killed": 4, "decode-killed": 10, "cancel-streaming": 10, "expired": 4, "cancel-queued": 4}
HELD = ("inflight_handoff_kv_held_bytes", ())
DEVICE_USED = ("inflight_kv_cache_blocks", (("pool", "device"), ("state", "used")))
HOST_USED = ("inflight_kv_cache_blocks", (("pool", "host"), ("state", "used")))


def handoff_count(outcome: str) -> tuple[str, tuple]:
    return ("inflight_handoff_requests_total", (("outcome", outcome),))


class DisaggFleet(Fleet):
    """The fleet's streams plus a handoff stream, and `short_stream`: a second request
    stream, for the prefill worker with the short hold."""

    def __init__(self, log_dir) -> None:
        super().__init__(log_dir)
        self.handoffs = f"{self.prefix}:handoffs"
        self.short_stream = f"{self.prefix}:requests-short"

    def start_role(self, name: str, role: str, stream: str | None = None, hold_s: float = HOLD_S) -> WorkerProcess:
        worker = WorkerProcess(
            name,
            [
                *("--redis-url", self.url, "--requests-stream", stream or self.stream),
                *("--dead-letter-stream", self.dead, "--control-stream", self.control),
                *("--role", role, "--handoff-stream", self.handoffs, "--handoff-min-prompt-tokens", "16"),
                *("--handoff-memory-mb", "32", "--handoff-hold-s", str(hold_s)),
                # Room for the longest prompt several times over, in the device pool, the host
                # tier (where a decode worker puts the K/V it reads) and the handoff memory.
                *("--dtype", "float32", "--block-size", str(BLOCK), "--kv-memory-mb", "32", "--swap-memory-mb", "16"),
                *("--max-running-requests", "4", "--log-format", "json", "--threads", "1"),
            ],
            self.logs,
        )
        self.workers[name] = worker
        worker.start()
        return worker

    def stream_of(self, name: str) -> str:
        return self.handoffs if name in DECODE else self.short_stream if name == "p3" else self.stream

    def alive(self, names) -> list[str]:
        return [name for name in names if name in self.workers and self.workers[name].alive()]

    def metric(self, name: str, key: tuple[str, tuple]) -> float:
        return self.workers[name].metrics().get(key, 0.0)

    def submit_drill(self, drill: str, stream: str | None = None) -> SimpleNamespace:
        request_id = f"{self.prefix}-{drill}"
        self.request_ids.append(request_id)
        fields = {"id": request_id, "prompt": PROMPTS[drill], "max_tokens": str(MAX_TOKENS[drill])}
        entry_id = self.client.xadd(stream or self.stream, {**fields, "ignore_eos": "true"}).decode()
        return SimpleNamespace(request_id=request_id, entry_id=entry_id, drill=drill)

    def tokens(self, request_id: str) -> list[dict]:
        return [e for e in self.events(request_id) if e["type"] == "token"]

    def cancel(self, request_id: str) -> None:
        with SyncClient(self.url, requests_stream=self.stream, control_stream=self.control) as sdk:
            sdk.cancel(request_id)

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.alive():
                worker.process.send_signal(signal.SIGCONT)  # a paused one too
                worker.kill()
        for key in [self.handoffs, self.short_stream, *self.client.scan_iter(f"{self.handoffs}:agent:*")]:
            self.client.delete(key)
        super().close()  # the request, control and dead-letter streams, the replies


@pytest.fixture(scope="module")
def drill(tmp_path_factory, smollm2):
    fleet = DisaggFleet(tmp_path_factory.mktemp("disagg-faults"))
    try:
        for name in PREFILL + DECODE:
            role = "decode" if name in DECODE else "prefill"
            hold_s = SHORT_HOLD_S if name == "p3" else HOLD_S
            fleet.start_role(name, role, fleet.short_stream if name == "p3" else None, hold_s)
        want = colocated_tokens(smollm2)  # while the workers load the model
        for name in PREFILL + DECODE:
            fleet.wait_until_serving(name, timeout_s=300)
        for name in PREFILL + DECODE:  # reading its stream, not only loaded
            wait_until(lambda: consuming(fleet, name), 60, f"{name} reading {fleet.stream_of(name)}")
        yield SimpleNamespace(fleet=fleet, want=want)
    finally:
        fleet.close()


def colocated_tokens(loaded) -> dict[str, list[int]]:
    """Each drill's greedy tokens from one engine that serves the whole job (as a `--role
    both` worker does), with the workers' block size."""
    import torch

    from tests.conftest import run_to_completion
    from workers.api import SamplingParams
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.engine import Engine

    engine = Engine(
        loaded, EngineConfig(model=ModelConfig(), cache=CacheConfig(kv_memory_bytes=32 << 20, block_size=BLOCK))
    )
    jobs = [(d, p, SamplingParams(max_tokens=MAX_TOKENS[d], ignore_eos=True)) for d, p in PROMPTS.items()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cores are busy loading the workers: more threads would only wait on each other
    try:
        return {drill: tokens for drill, (tokens, _, _) in run_to_completion(engine, {0: jobs}).items()}
    finally:
        torch.set_num_threads(threads)


def consuming(fleet: DisaggFleet, name: str) -> bool:
    stream = fleet.stream_of(name)
    if not fleet.client.exists(stream):
        return False
    try:
        consumers = fleet.client.xinfo_consumers(stream, "inflight")
    except Exception:  # no group yet
        return False
    return any(c["name"] in (name, name.encode()) for c in consumers)


def holder(fleet: DisaggFleet, stream: str, entry_id: str) -> str | None:
    """The consumer an entry is pending with, if any."""
    rows = fleet.client.xpending_range(stream, "inflight", min=entry_id, max=entry_id, count=1)
    return rows[0]["consumer"].decode() if rows else None


def pause(fleet: DisaggFleet, names) -> None:
    for name in names:
        fleet.workers[name].process.send_signal(signal.SIGSTOP)


def resume(fleet: DisaggFleet, names) -> None:
    for name in names:
        fleet.workers[name].process.send_signal(signal.SIGCONT)


def wait_for_metrics(condition, timeout_s: float, what: str) -> None:
    """`wait_until` for a condition on /metrics, polled less often: every scrape costs
    the worker CPU that the drills' model steps want."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def handed_off_by_p3(fleet: DisaggFleet) -> bool:
    """p3's job is on the handoff stream, and its request entry acked."""
    return fleet.client.xlen(fleet.handoffs) == 1 and fleet.client.xlen(fleet.short_stream) == 0


def only_decode_worker(fleet: DisaggFleet) -> str:
    """The one decode worker left (the decode worker drill killed the other; run alone, a
    drill stops it): a paused worker's handoff, idle past the lease when it wakes, is then
    taken over by no other."""
    name, *others = fleet.alive(DECODE)
    for other in others:
        fleet.workers[other].stop()
    return name


def assert_reply(fleet: DisaggFleet, job, want: list[int], finish_reason: str = "length") -> dict:
    """Every seq once and in order, the colocated greedy tokens (a prefix of them for a
    cancelled job), one final event; returns that event."""
    wait_until(lambda: fleet.finished(job.request_id), 120, f"the {job.drill} job's final event")
    events = fleet.events(job.request_id)
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["seq"] for e in tokens] == list(range(len(tokens))), events
    assert [e["type"] for e in events[len(tokens) :]] == ["done"], events[-1]
    token_ids = [t for e in tokens for t in e["token_ids"]]
    done = events[-1]
    assert done["finish_reason"] == finish_reason, done
    if finish_reason == "length":
        assert token_ids == want
    else:
        assert token_ids == want[: len(token_ids)] and len(token_ids) < len(want), (token_ids, want)
    assert done["usage"]["completion_tokens"] == len(token_ids), done
    return done


def assert_settled(fleet: DisaggFleet) -> None:
    """Nothing pending or left on the request and handoff streams, no dead letter, and no
    K/V held by any live worker: neither staged or read handoff memory nor device blocks."""
    for stream in (fleet.stream, fleet.short_stream, fleet.handoffs):
        wait_until(lambda: fleet.client.xpending(stream, "inflight")["pending"] == 0, 10, f"{stream} acked")
        assert fleet.client.xlen(stream) == 0, fleet.client.xrange(stream)
    assert fleet.client.xlen(fleet.dead) == 0, fleet.client.xrange(fleet.dead)
    for name in fleet.alive(PREFILL + DECODE):

        def idle() -> bool:
            metrics = fleet.workers[name].metrics()
            return all(metrics.get(key, 0.0) == 0 for key in (HELD, DEVICE_USED, HOST_USED))

        wait_for_metrics(idle, 10, f"{name} holding no K/V")


def test_a_prefill_worker_killed_mid_prompt_is_taken_over_by_another_prefill_worker(drill):
    """Killed after it read the job, before it published a token: the request entry stays
    pending, the other prefill worker takes it over, computes the prompt and hands it off."""
    fleet = drill.fleet
    assert fleet.alive(("p1", "p2")) == ["p1", "p2"], "runs first: both prefill workers of the request stream"
    handed_off = {name: fleet.metric(name, handoff_count("handed_off")) for name in ("p1", "p2")}
    job = fleet.submit_drill("prefill-killed")
    wait_until(lambda: holder(fleet, fleet.stream, job.entry_id), 30, "a prefill worker reading the job")
    victim = holder(fleet, fleet.stream, job.entry_id)
    pause(fleet, [victim])
    time.sleep(0.05)  # a write it had sent lands
    assert fleet.client.xlen(fleet.reply(job.request_id)) == 0, "the prompt was computed before the kill"
    fleet.workers[victim].kill()

    [survivor] = fleet.alive({"p1", "p2"} - {victim})
    done = assert_reply(fleet, job, drill.want[job.drill])
    assert done["worker"] in DECODE  # handed off again by the survivor, and decoded
    assert fleet.metric(survivor, handoff_count("handed_off")) == handed_off[survivor] + 1
    assert_settled(fleet)


def test_a_decode_worker_killed_mid_stream_is_taken_over_reading_the_kv_again(drill):
    """Killed after it published tokens of its own: the handoff entry stays pending, the
    other decode worker takes it over, reads the prompt's K/V from the prefill worker
    (which still holds them: no confirmation came) and continues from the published tokens."""
    fleet = drill.fleet
    decode = fleet.alive(DECODE)
    assert len(decode) == 2, "needs both decode workers"
    before = {name: fleet.workers[name].metrics() for name in decode}
    job = fleet.submit_drill("decode-killed")

    def decoding_for_a_while() -> bool:  # the first token is the prefill worker's
        return fleet.owner(job.request_id) in decode and len(fleet.tokens(job.request_id)) >= 4

    wait_until(decoding_for_a_while, 60, "a decode worker publishing tokens")
    victim = fleet.owner(job.request_id)
    pause(fleet, [victim])
    time.sleep(0.05)
    assert not fleet.finished(job.request_id), "finished before the kill"
    published = len(fleet.tokens(job.request_id))
    fleet.workers[victim].kill()
    holding = [name for name in fleet.alive(("p1", "p2")) if fleet.metric(name, HELD) > 0]
    assert len(holding) == 1, "the prefill worker still holds the prompt's K/V"

    [survivor] = fleet.alive(DECODE)
    done = assert_reply(fleet, job, drill.want[job.drill])
    assert done["worker"] == survivor and published < MAX_TOKENS[job.drill]
    after = fleet.workers[survivor].metrics()
    counts = {o: after[handoff_count(o)] - before[survivor][handoff_count(o)] for o in ("kv_read", "kv_computed")}
    assert counts == {"kv_read": 1, "kv_computed": 0}, "the survivor read the prompt's K/V from the prefill worker"
    assert after[handoff_count("kv_failed")] == before[survivor][handoff_count("kv_failed")]
    assert_settled(fleet)


def test_a_cancel_mid_stream_on_a_decode_worker_ends_the_job_and_frees_the_prefill_side(drill):
    """A cancel through the SDK while a decode worker streams the job: `done` with
    `cancelled`, and the decode worker's confirmation frees the prefill side's K/V."""
    fleet = drill.fleet
    decode, prefill = fleet.alive(DECODE), fleet.alive(("p1", "p2"))
    job = fleet.submit_drill("cancel-streaming")

    def streaming() -> bool:
        return fleet.owner(job.request_id) in decode and len(fleet.tokens(job.request_id)) >= 3

    wait_until(streaming, 60, "a decode worker publishing tokens")
    worker = fleet.owner(job.request_id)
    pause(fleet, [worker])  # so the cancel lands mid-stream however fast it decodes
    try:
        assert not fleet.finished(job.request_id)
        fleet.cancel(job.request_id)
    finally:
        resume(fleet, [worker])
    done = assert_reply(fleet, job, drill.want[job.drill], "cancelled")
    assert done["worker"] == worker
    # Freed on the decode worker's confirmation, not by the hold (HOLD_S).
    for name in prefill:
        wait_for_metrics(lambda: fleet.metric(name, HELD) == 0, 3, f"{name} freeing the cancelled job's K/V")
    assert_settled(fleet)


def test_a_handoff_whose_kv_expired_is_computed_by_the_decode_worker(drill):
    """No decode worker reads the handoff (the one left is paused) until p3's hold has freed the
    K/V: the decode worker computes the prompt (`kv_computed`), with the same tokens."""
    fleet = drill.fleet
    decode = [only_decode_worker(fleet)]
    before = {name: fleet.workers[name].metrics() for name in decode}
    pause(fleet, decode)  # no decode worker reads the handoff until its hold has passed
    try:
        job = fleet.submit_drill("expired", fleet.short_stream)
        wait_until(lambda: handed_off_by_p3(fleet), 60, "p3 handing the job off")
        wait_for_metrics(lambda: fleet.metric("p3", HELD) > 0, 2, "p3 holding the staged K/V")
        wait_for_metrics(
            lambda: fleet.metric("p3", HELD) == 0, SHORT_HOLD_S + 5, "p3 freeing the K/V at the hold's end"
        )
        # Its log line follows the freeing, through the process's buffered output.
        wait_until(lambda: '"handoff_expired"' in fleet.log("p3"), 10, "p3 logging the expiry")
        assert not fleet.finished(job.request_id)
    finally:
        resume(fleet, decode)
    done = assert_reply(fleet, job, drill.want[job.drill])
    assert done["worker"] in decode
    after = {name: fleet.workers[name].metrics() for name in decode}
    outcomes = ("kv_read", "kv_computed", "kv_failed")
    delta = {o: sum(after[n][handoff_count(o)] - before[n][handoff_count(o)] for n in decode) for o in outcomes}
    assert delta == {"kv_read": 0, "kv_computed": 1, "kv_failed": 0}
    assert_settled(fleet)


def test_a_cancel_while_the_job_waits_on_the_handoff_stream_frees_the_prefill_side(drill):
    """A cancel while the job waits on the handoff stream, no decode worker running (the
    one left is paused; it has never read from p3, as a decode worker started after the
    cancel would not have): the decode worker ends it `cancelled` without running it, and
    its confirmation frees p3's K/V well before the hold would."""
    fleet = drill.fleet
    decode = [only_decode_worker(fleet)]
    before = fleet.workers[decode[0]].metrics()
    pause(fleet, decode)  # no decode worker running yet
    try:
        job = fleet.submit_drill("cancel-queued", fleet.short_stream)
        wait_until(lambda: handed_off_by_p3(fleet), 60, "p3 handing the job off")
        staged_at = time.monotonic()
        wait_for_metrics(lambda: fleet.metric("p3", HELD) > 0, 2, "p3 holding the staged K/V")
        fleet.cancel(job.request_id)
    finally:
        resume(fleet, decode)
    done = assert_reply(fleet, job, drill.want[job.drill], "cancelled")
    assert done["worker"] in decode and done["usage"]["completion_tokens"] == 1  # the prefill worker's token
    after = fleet.workers[decode[0]].metrics()
    for outcome in ("kv_read", "kv_computed", "kv_failed"):  # never run: its K/V were not read either
        assert after[handoff_count(outcome)] == before[handoff_count(outcome)], outcome
    for stream in (fleet.short_stream, fleet.handoffs):
        wait_until(lambda: fleet.client.xpending(stream, "inflight")["pending"] == 0, 10, f"{stream} acked")
    # Freed on the decode worker's confirmation, well before the hold would free it.
    deadline = staged_at + SHORT_HOLD_S - 1.5
    wait_for_metrics(lambda: fleet.metric("p3", HELD) == 0, max(deadline - time.monotonic(), 0.1), "p3 freeing K/V")
    assert time.monotonic() < deadline
    assert_settled(fleet)
