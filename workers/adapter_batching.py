"""Which LoRA adapters share a step (multi-LoRA): the scheduler's two rules for them.

**At most `max_loras` adapters a step.** The model holds that many adapters in its slots
(`gpu.lora.LoRASlots`), so a step may name no more. The scheduler keeps the adapters of
its *running* requests within it, which bounds every step's: a queued request starts
only if it runs on the base model, or on an adapter a running request already uses, or
while the running requests use fewer than `max_loras` (`adapter_fits`). Otherwise it
waits at the head of the queue, as one does for blocks: the queue is strict, so nothing
behind it starts, and the running requests' adapters drain until its own fits. It is
never starved, and it keeps its place. A request swapped out or sent back to recompute
is queued again and passes the same check when it resumes.

**Grouped by adapter.** Each adapter's rows are one run of the step's packed rows when
its chunks are adjacent, and a run is two matrix products per linear in place, where
scattered rows are gathered first (`gpu.lora.LoRABatch`). Nothing downstream depends on
the chunks' order (the runner packs and samples in plan order, the engine and
`Scheduler.update_from_output` read the plan in that order too), so the planned chunks
are put in adapter order (`group_by_adapter`).
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.plan import StepPlan
from workers.request import Request


def adapter_fits(request: Request, running: Iterable[Request], max_loras: int | None) -> bool:
    """Whether `request` may start beside `running` with their adapters still at most
    `max_loras` (None: multi-LoRA off, no bound)."""
    if request.adapter is None or max_loras is None:
        return True
    adapters = {r.adapter for r in running if r.adapter is not None}
    return request.adapter in adapters or len(adapters) < max_loras


def group_by_adapter(plan: StepPlan, max_loras: int | None) -> None:
    """Put each adapter's chunks together, adapters (and the base model) in the order they
    first appear, each one's chunks in their planned order (with multi-LoRA on: `max_loras`
    not None)."""
    if max_loras is None:
        return
    first: dict[str | None, int] = {}
    for chunk in plan.chunks:
        first.setdefault(chunk.adapter, len(first))
    if len(first) > 1:
        plan.chunks.sort(key=lambda chunk: first[chunk.adapter])  # stable
