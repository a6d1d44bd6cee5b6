"""LoRA adapters at the edge (docs/protocol.md, "LoRA adapters"): the registry of the
adapters a request stream's workers serve, and the control message that asks them all
to load one more.

The registry is a Redis hash beside the request stream, `{<requests stream>}:adapters`
(one Redis Cluster slot with the fair queue's keys), adapter name -> the folder it was
loaded from. Workers write it at start (their `--lora-dir`) and after each adapter they
load; the gateway reads it to know which `model` names an adapter. Nothing removes a
name: every worker of a stream is meant to serve the same adapters.

`XADD <control stream> * type load_adapter name <name> path <folder>` asks every worker
following the control stream to load the PEFT adapter in `folder` (on its own
filesystem) as `name`; each logs how it went and serves on either way.
"""

from __future__ import annotations

from service.protocol import ADAPTER_PATTERN, ADAPTER_RULE

LOAD_ADAPTER = "load_adapter"


def registry_key(requests_stream: str) -> str:
    """The hash of the adapters `requests_stream`'s workers serve, in the stream's hash slot."""
    return "{" + requests_stream + "}:adapters"


def check_name(name: object) -> str:
    """`name` when it can name an adapter (a job's `adapter` field's rule), else ValueError."""
    if not isinstance(name, str) or ADAPTER_PATTERN.fullmatch(name) is None:
        raise ValueError(ADAPTER_RULE)
    return name


def load_message(name: str, path: str) -> dict[str, str]:
    """The control-stream entry asking every worker to load the adapter in `path` as `name`."""
    if not isinstance(path, str) or not path:
        raise ValueError("an adapter's path must be a non-empty folder path")
    return {"type": LOAD_ADAPTER, "name": check_name(name), "path": path}
