"""The bench's HTTP client: streamed `POST /v1/completions` to inflight's gateway or vLLM's
server alike, each request timed from its send (every text chunk's arrival, stamped before
it is parsed, and the stream's end), with the tokens the server's usage reports."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from bench.metrics import RequestRecord
from service.config import DEFAULT_MODEL_NAME

# Every request's sampling and streaming options: greedy, EOS ignored, usage in the stream.
GREEDY_STREAMED = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_tokens: int  # how many token ids the text was decoded from
    output_len: int  # max_tokens, with EOS ignored


class CompletionsClient:
    """Greedy streamed completions with `ignore_eos`; a request silent for `timeout_s` fails.
    `fresh_connections`: a connection per request, as separate users open (else pooled)."""

    def __init__(self, base_url: str, timeout_s: float, fresh_connections: bool = True) -> None:
        self.url = f"{base_url}/v1/completions"
        self.timeout_s = timeout_s
        self.fresh_connections = fresh_connections

    async def __aenter__(self) -> CompletionsClient:
        import aiohttp

        # No connection cap. A pooled idle connection can be closed by the server (keep-alive)
        # just as it is reused, failing that request with "Server disconnected".
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=self.fresh_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout_s),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def send(self, prompts: list[Prompt], arrivals: list[float]) -> tuple[list[RequestRecord], float]:
        """Send prompt i at t0 + arrivals[i]; every record, and t0 to the last stream's end."""
        t0 = time.perf_counter()

        async def send_at(prompt: Prompt, at_s: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
            return await self.request(prompt, t0)

        records = await asyncio.gather(*(send_at(p, at) for p, at in zip(prompts, arrivals)))
        return list(records), time.perf_counter() - t0

    async def request(self, prompt: Prompt, t0: float) -> RequestRecord:
        """One streamed request; an error (HTTP, in the stream, a wrong token count) is kept
        in the record, not raised."""
        import aiohttp

        body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt.text, "max_tokens": prompt.output_len, **GREEDY_STREAMED}
        sent = time.perf_counter()
        record = RequestRecord(sent_s=sent - t0)
        try:
            async with self.session.post(self.url, json=body) as response:
                record.request_id = response.headers.get("x-request-id")
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return record
                async for line in response.content:
                    arrived = time.perf_counter() - sent  # stamped before parsing
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        record.error = f"stream error: {str(chunk['error'])[:200]}"
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        record.chunk_times_s.append(arrived)
                    if chunk.get("usage"):
                        record.completion_tokens = chunk["usage"]["completion_tokens"]
                        record.prompt_tokens = chunk["usage"]["prompt_tokens"]
            record.end_s = time.perf_counter() - sent
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            record.error = f"{type(error).__name__}: {error}"[:200]
        if record.error is None and not record.chunk_times_s:
            record.error = "no text came back"
        elif record.error is None and record.completion_tokens != prompt.output_len:
            record.error = f"{record.completion_tokens} tokens, {prompt.output_len} asked"
        return record


class ServerSentEvents:
    """Server-sent events as a client reads them: fed the stream's lines one by one, it gives
    back each complete event as (its id or None, its data)."""

    def __init__(self) -> None:
        self.event_id: str | None = None
        self.data: list[str] = []

    def feed(self, raw: bytes) -> tuple[str | None, str] | None:
        line = raw.decode().rstrip("\r\n")
        if line == "":
            event = (self.event_id, "\n".join(self.data)) if self.data else None
            self.event_id, self.data = None, []
            return event
        if line.startswith("id: "):
            self.event_id = line[4:]
        elif line.startswith("data: "):
            self.data.append(line[6:])
        return None


def token_times(record: RequestRecord) -> list[float]:
    """Each output token's arrival after t0: each text chunk's time, then the last one's for
    the tokens the usage counts beyond the chunks (a partial character held back)."""
    times = [record.sent_s + t for t in record.chunk_times_s]
    return times + [times[-1]] * (record.completion_tokens - len(times))
