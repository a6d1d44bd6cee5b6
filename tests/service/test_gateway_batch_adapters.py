"""A batch line whose `body.model` names a LoRA adapter the workers list runs as a job
naming that adapter; one naming neither the model nor an adapter is the line's 404, as
its HTTP request would be (tests/service/test_gateway_batches.py's fake worker and
in-process gateway)."""

from __future__ import annotations

import json

from service.adapters import registry_key
from tests.service import test_gateway_batches
from tests.service.test_gateway_batches import MODEL, ended, file_lines, job_id_of, serving, start_batch

streams = test_gateway_batches.streams  # the fixture: private streams, their keys removed after


def test_a_batch_line_naming_an_adapter_runs_under_it(streams):
    client, stream, _ = streams
    client.hset(registry_key(stream), "sql", "/adapters/sql")
    lines = [("base", MODEL), ("sql", "sql"), ("nope", "nope")]
    content = b"".join(
        json.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": model, "prompt": "x", "max_tokens": 2},
            }
        ).encode()
        + b"\n"
        for custom_id, model in lines
    )
    with serving(streams) as (api, worker, _):
        batch = ended(api, start_batch(api, content).id)
        assert batch.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
        output = {line["custom_id"]: line for line in file_lines(api, batch.output_file_id)}
        adapters = {job.request_id: job.adapter for job in worker.taken}
        assert adapters[job_id_of(output["sql"])] == "sql" and adapters[job_id_of(output["base"])] is None
        assert output["sql"]["response"]["body"]["model"] == "sql"
        error = file_lines(api, batch.error_file_id)[0]
        assert error["custom_id"] == "nope" and error["response"]["status_code"] == 404
        assert error["response"]["body"]["error"]["code"] == "model_not_found"
