// inflight from Node.js: queue a chat job as one msgpack `payload` field, then follow
// its reply stream, decoding each entry's msgpack `data`, until the final event.
//
//   npm ci && node generate.mjs "Write a haiku about the sea."
//   node generate.mjs "Name a city and its country as JSON." --json-schema schema.json
//
// With --json-schema FILE the job is constrained: the answer is JSON valid under the
// schema in FILE (unless it ends for `length`).
//
// REDIS_URL defaults to the embedded server `make run` starts; INFLIGHT_REQUESTS names
// the request stream (default inflight:requests). A server that cannot be reached or
// goes away, or no reply for INFLIGHT_TIMEOUT_S seconds (default 60: no worker is
// running), ends it with one line on stderr and exit status 1.
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { decode, encode } from "@msgpack/msgpack";
import Redis from "ioredis";

const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6399";
const requests = process.env.INFLIGHT_REQUESTS ?? "inflight:requests";
const timeoutMs = Number(process.env.INFLIGHT_TIMEOUT_S ?? 60) * 1000;
// Fail rather than wait: no reconnecting, no retries, and a command that gets no
// answer (a hung server) times out. The blocking read below waits at most 5 s.
const redis = new Redis(url, { retryStrategy: () => null, maxRetriesPerRequest: 0, commandTimeout: 15_000 });
let cause; // the connection's own error says why (ECONNREFUSED, ...); keep it for the one line
redis.on("error", (error) => { cause ??= error; });

function fail(message) {
  console.error(message);
  redis.disconnect();
  process.exit(1);
}
const unavailable = (error) => fail(`Redis at ${url.replace(/\/\/.*@/, "//")} is unavailable: ${(cause ?? error).message}`);

const id = `node-${randomUUID()}`;
const job = {
  id,
  messages: [{ role: "user", content: process.argv[2] ?? "What is the capital of France?" }],
  max_tokens: 24,
  priority: 2,
};
const schemaFlag = process.argv.indexOf("--json-schema");
if (schemaFlag > 0) {
  job.json_schema = JSON.parse(readFileSync(process.argv[schemaFlag + 1], "utf8")); // a map in the msgpack payload
  job.max_tokens = 64;
}
await redis.xaddBuffer(requests, "*", "payload", Buffer.from(encode(job))).catch(unavailable);

const reply = `inflight:out:{${id}}`; // the default reply_to; {…} is a Redis Cluster hash tag
let last = "0";
let heard = Date.now();
for (;;) {
  const left = heard + timeoutMs - Date.now();
  if (left <= 0) {
    fail(`no reply to ${id} within ${timeoutMs / 1000} s: no worker is serving ${requests}, or it stopped (the job stays queued)`);
  }
  // Buffers, not strings: `data` is binary msgpack.
  const batch = await redis.xreadBuffer("BLOCK", Math.min(5000, left), "STREAMS", reply, last).catch(unavailable);
  for (const [, entries] of batch ?? []) {
    for (const [entryId, fields] of entries) {
      last = entryId.toString();
      heard = Date.now();
      const event = decode(fields[fields.findIndex((f, i) => i % 2 === 0 && f.toString() === "data") + 1]);
      if (event.type === "token") {
        process.stdout.write(event.text);
      } else if (event.type === "done") {
        console.log(`${event.text}\n(${event.finish_reason}: ${event.usage.completion_tokens} tokens)`);
        redis.disconnect();
        process.exit(0);
      } else {
        fail(`error ${event.code}: ${event.message}`);
      }
    }
  }
}
