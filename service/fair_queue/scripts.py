"""The fair queue's Lua scripts (service/lua/fair_queue_*.lua), read once, at import.

ADMIT, TAKE and CHARGE each run after fair_queue_keys.lua, which they share: the
constants below, the bookkeeping keys from the request stream's name, and helpers.
"""

from __future__ import annotations

from service.fair_queue.keys import AHEAD_FIELD, ORIGIN_FIELD, PROMPT_IDS_FIELD, TOKENS_FIELD
from service.lua_scripts import lua
from workers.api import PRIORITY_MIN

# A refusal's retry_after_s for queue_full: the excess over the drain rate, within these.
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 60.0
DRAIN_WINDOW_S = 30
# A tenant's bucket holds this many seconds of its tokens-per-second quota.
QUOTA_BURST_S = 10


def _with_keys(name: str) -> str:
    """Script `name` after the shared part, its constants filled in."""
    shared = lua(
        "fair_queue_keys",
        DRAIN_WINDOW_S=DRAIN_WINDOW_S,
        RETRY_AFTER_MIN_S=RETRY_AFTER_MIN_S,
        RETRY_AFTER_MAX_S=RETRY_AFTER_MAX_S,
        QUOTA_BURST_S=QUOTA_BURST_S,
        ORIGIN_FIELD=ORIGIN_FIELD.decode(),
        TOKENS_FIELD=TOKENS_FIELD.decode(),
        AHEAD_FIELD=AHEAD_FIELD.decode(),
        PROMPT_IDS_FIELD=PROMPT_IDS_FIELD.decode(),
        PRIORITY_MIN=PRIORITY_MIN,
    )
    return shared + lua(name)


ADMIT = _with_keys("fair_queue_admit")
TAKE = _with_keys("fair_queue_take")
CHARGE = _with_keys("fair_queue_charge")
ADMITTING = lua("fair_queue_admitting")
