"""The commands `Engine.add_request`, `cancel` and `load_adapter` post for the stepping
thread, which takes them between steps (`Engine._drain_inbox`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.lora import LoRAAdapter
from workers.api import FinalEvent
from workers.outputs import RequestState


@dataclass(frozen=True)
class AddRequest:
    state: RequestState
    prompt_kv: torch.Tensor | None = None  # read from a prefill worker (disaggregated serving)


@dataclass(frozen=True)
class CancelRequest:
    request_id: str


@dataclass(frozen=True)
class FailRequest:
    """A request that ends at `add_request` (refused, or resumed with nothing left to
    make): its only event is this one."""

    event: FinalEvent


@dataclass(frozen=True)
class AddAdapter:
    """A LoRA adapter read and checked (`Engine.load_adapter`), for the slots to hold."""

    name: str
    folder: Path
    adapter: LoRAAdapter


Command = AddRequest | CancelRequest | FailRequest | AddAdapter
