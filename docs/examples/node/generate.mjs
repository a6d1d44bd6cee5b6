// inflight from Node.js: queue a chat job as one msgpack `payload` field, then follow
// its reply stream, decoding each entry's msgpack `data`, until the final event.
//
//   npm ci && node generate.mjs "Write a haiku about the sea."
//
// REDIS_URL defaults to the embedded server `make run` starts; INFLIGHT_REQUESTS names
// the request stream (default inflight:requests).
import { randomUUID } from "node:crypto";
import { decode, encode } from "@msgpack/msgpack";
import Redis from "ioredis";

const redis = new Redis(process.env.REDIS_URL ?? "redis://127.0.0.1:6399");
const requests = process.env.INFLIGHT_REQUESTS ?? "inflight:requests";
const id = `node-${randomUUID()}`;
const job = {
  id,
  messages: [{ role: "user", content: process.argv[2] ?? "What is the capital of France?" }],
  max_tokens: 24,
  priority: 2,
};
await redis.xaddBuffer(requests, "*", "payload", Buffer.from(encode(job)));

const reply = `inflight:out:{${id}}`; // the default reply_to; {…} is a Redis Cluster hash tag
let last = "0";
for (;;) {
  // Buffers, not strings: `data` is binary msgpack.
  const batch = await redis.xreadBuffer("BLOCK", 5000, "STREAMS", reply, last);
  for (const [, entries] of batch ?? []) {
    for (const [entryId, fields] of entries) {
      last = entryId.toString();
      const event = decode(fields[fields.findIndex((f, i) => i % 2 === 0 && f.toString() === "data") + 1]);
      if (event.type === "token") {
        process.stdout.write(event.text);
      } else if (event.type === "done") {
        console.log(`${event.text}\n(${event.finish_reason}: ${event.usage.completion_tokens} tokens)`);
        redis.disconnect();
        process.exit(0);
      } else {
        console.error(`error ${event.code}: ${event.message}`);
        redis.disconnect();
        process.exit(1);
      }
    }
  }
}
