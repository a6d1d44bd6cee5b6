"""The engine's LoRA adapters (multi-LoRA, `workers.config.LoRAConfig`): the folders a
`lora_dir` holds, and the identity that keys an adapter's prefix-cache chains.

The model side (slots, deltas, checks at load) is `gpu/lora.py`; which adapters a step
may hold is `workers/adapter_batching.py`'s.

**Identity.** A request's blocks are addressed by a chain that starts at its
`Request.cache_root`: b"" for the base model, `cache_root(adapter)` for an adapter's. The
root hashes the adapter's name, rank, scaling and weights, so a prefix computed under one
adapter is never reused under another, nor under the base model, nor under a different
adapter registered again under the same name; and two workers that load the same
adapter give it the same root.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from gpu.lora import LoRAAdapter


def adapter_folders(lora_dir: Path) -> dict[str, Path]:
    """The adapters in `lora_dir`: each subfolder (but hidden ones), by its name, sorted."""
    if not lora_dir.is_dir():
        raise ValueError(f"--lora-dir {lora_dir} is not a folder")
    return {path.name: path for path in sorted(lora_dir.iterdir()) if path.is_dir() and not path.name.startswith(".")}


def cache_root(adapter: LoRAAdapter) -> bytes:
    """Where the content addresses of a request under `adapter` start (see the module)."""
    digest = hashlib.blake2b(digest_size=16, person=b"inflight-lora")
    digest.update(f"{adapter.name}\0{adapter.rank}\0{adapter.scaling!r}".encode())
    for module in sorted(adapter.weights):
        digest.update(module.encode() + b"\0")
        for tensor in adapter.weights[module]:
            digest.update(str(tensor.dtype).encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return digest.digest()
