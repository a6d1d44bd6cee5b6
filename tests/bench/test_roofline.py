"""The roofline's weight bytes: what a decode step streams, each storage once."""

from __future__ import annotations

import torch
from torch import nn

from bench.roofline import read_bandwidth, streamed_weight_bytes
from gpu.cpu.int4_linear import Int4Linear
from gpu.cpu.int8_linear import Int8Linear
from gpu.cpu.packed_linear import PackedLinear


def test_weight_bytes_count_every_kind_of_linear_once_and_skip_the_embedding():
    embedding = nn.Embedding(1000, 64).to(torch.bfloat16)
    tied_head = nn.Linear(64, 1000, bias=False).to(torch.bfloat16)
    tied_head.weight = embedding.weight  # a tied LM head is read by the step: counted, once
    model = nn.ModuleDict({
        "embedding": embedding,
        "head": tied_head,
        "packed": PackedLinear(nn.Linear(64, 128, bias=False)),  # float32: oneDNN packs it on every CPU
        "int8": Int8Linear(nn.Linear(64, 128, bias=False).to(torch.bfloat16)),
        "int4": Int4Linear(nn.Linear(64, 128, bias=False).to(torch.bfloat16)),
        "norm": nn.LayerNorm(64, bias=False),
    })  # fmt: skip
    int8 = model["int8"]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage()
        for t in (int8.scales, int8.scales_in_dtype, int8.dense_scales)
    }
    scale_bytes = sum(storage.nbytes() for storage in storages.values())
    want = (
        1000 * 64 * 2  # the head
        + 128 * 64 * 4  # packed float32
        + 128 * 64
        + scale_bytes  # each storage once: where oneDNN lacks bfloat16 the dense path's scales are the float32 ones
        + 128 * 64 // 2
        + (64 // 32) * 128 * 2 * 2  # four bits a weight, a bfloat16 scale and zero per group
        + 64 * 4  # the norm
    )
    assert streamed_weight_bytes(model) == want


def test_read_bandwidth_is_a_rate():
    rate = read_bandwidth(8 << 20, repeats=3)
    assert 1e8 < rate < 1e13
