"""The edge: jobs from Redis Streams into the engine, events out to reply streams.

The Redis worker (`worker.py`) and its parts (`ingest.py`, `publish.py`, `cancels.py`,
`retry.py`), the wire format (`protocol.py`), the Python client (`sdk.py`), metrics,
logging, configuration and the `inflight` command line. Imports `workers` and `gpu`,
never the other way round.
"""
