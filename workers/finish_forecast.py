"""The finish forecast: how many steps until a queued request is predicted to finish,
for the deadline check as it arrives (`Scheduler.predicted_finish_s`; the engine ends a
request whose deadline it misses with `deadline_unmeetable`).

Steps to wait for a running slot (the queue ahead of it, freed at the rate the running
requests' predicted remainders free them), to compute its prompt (at the prefill
budget) and to produce its predicted output (one token a step; under the predicted
policy times `deadline_length_margin`, at most its max_tokens). It errs short when
outputs run past their predictions or steps slow down as the batch grows, and long when
accepted drafts give a request more than one token a step.
"""

from __future__ import annotations

from workers.config import SchedulerConfig
from workers.request import Request


def steps_to_finish(
    request: Request, config: SchedulerConfig, num_ahead: int, free_slots: int, running: list[Request]
) -> float:
    """Steps until `request` finishes, with `num_ahead` requests queued before it and
    `free_slots` running slots free now."""
    short_of_room = num_ahead + 1 - free_slots
    wait_steps = 0.0
    if short_of_room > 0 and running:
        mean_remaining = sum(r.predicted_remaining for r in running) / len(running)
        wait_steps = short_of_room * mean_remaining / len(running)
    prompt_steps = -(-request.num_prompt_tokens // config.max_prefill_tokens)
    own = request.predicted_remaining
    if config.length_policy == "predicted":  # a prediction's margin; true lengths take none
        own = min(own * config.deadline_length_margin, request.params.max_tokens - len(request.output_token_ids))
    return wait_steps + prompt_steps + own
