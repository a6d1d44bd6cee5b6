"""`inflight gateway`: an OpenAI-compatible HTTP front onto the queue.

Each HTTP request becomes one protocol job (docs/protocol.md) on the request stream;
its reply stream is read back and answered as OpenAI JSON or server-sent events. The
gateway keeps no state between requests (the Batch API's files and batches live in
Redis), so any number of them can front one queue.

    config       GatewayConfig lives in service/config.py with the other settings, its flags in
                 service/flags.py
    openai_api   OpenAI request bodies -> job fields, and replies -> OpenAI responses
    errors       OpenAI-shaped errors, and the queue's error codes as HTTP statuses
    queue        the Redis side: submit, read replies resumably, cancel, queue depth
    auth         optional bearer keys, and the tenant a request is for
    files        the Files API: batch input and output files in Redis
    batches      the Batch API: batch objects, their state in Redis, the routes
    batch_lines  a batch's input lines checked, its output and error lines shaped
    batch_driver every gateway's driver: leases on batches, their jobs queued and followed
    metrics      the gateway's Prometheus metrics
    app          the Starlette app: routes and the streaming response
    server       uvicorn on uvloop, and the start-up line
"""
