"""Every error code a worker can put on a reply stream (docs/protocol.md, "Error codes")
has its own HTTP answer at the gateway (`service/gateway/errors.py`): none falls through
to a bare 500 by being forgotten."""

from __future__ import annotations

import re
from pathlib import Path

from service.gateway.errors import QUEUE_ERRORS, from_queue

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def protocol_error_codes() -> set[str]:
    section = PROTOCOL.read_text().split("## Error codes", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))


def test_every_error_code_of_the_protocol_has_an_http_answer():
    codes = protocol_error_codes()
    assert {"invalid_field", "queue_full", "deadline_unmeetable", "internal_error"} <= codes
    assert codes <= set(QUEUE_ERRORS)


def test_a_refusal_for_load_says_when_to_come_back_and_a_missed_deadline_is_a_503():
    assert from_queue("quota_exceeded", "over", 2.3).headers == {"Retry-After": "3"}
    assert from_queue("deadline_unmeetable", "too late").status == 503
