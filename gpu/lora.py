"""Multi-LoRA: requests of different PEFT adapters, and of none, in one step.

An adapter adds `scaling * (x A^T) B^T` to the output of some of the base model's linears
(the attention's q, k, v and o projections, the MLP's gate, up and down ones). Here every
targeted linear is wrapped once (`LoRALinear`), and holds the adapters resident in
`max_loras` slots: per slot its A and B, in tensors sized for `max_rank`. A step's rows
name their slot (or none); each wrapper adds the deltas of the rows that have one.

The delta is computed per adapter, not per row: the rows of one adapter form a segment,
and a segment is two matrix products (`x A^T`, then that times `B^T`), on the slot's real
rank. A step holds a few adapters and many rows, so a few products per linear beat a
batched product over a per-row gathered copy of A and B (which copies rank x width
numbers a row). The segments are found once per step (`LoRABatch`, shared by every
wrapper): where each adapter's rows already form one run of the packed rows, as they do
when the scheduler packs requests grouped by adapter, the segments are slices of them;
otherwise each layer gathers the adapter rows once, in slot order, and adds the deltas
back at their rows.

The scaling (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) is folded into B when an
adapter is copied into a slot. Adapters wait in host memory (`LoRASlots.load`; at most
`max_host_loras` of them, the least recently used read again from its folder); a step
copies those it needs into slots, evicting the least recently used adapter that the
step does not use.

A fused CPU projection (`gpu.cpu.fusions`: `qkv_proj`, `gate_up_proj`) outputs its parts'
columns side by side, so its delta is their deltas side by side: a slot holds the parts'
A one above the other (one product for all), and each part's B in its own columns (one
product each, into its columns of the output). Its parts' LoRA weights are still named
after the Hugging Face projections (`q_proj`, ...).

How the engine wires it (`gpu.prepare.prepare_model`), on any device:

    swap_modules_for_cpu(model, weights)            # fusions, quantization, packing first
    slots = LoRASlots(model, max_loras, max_rank)    # wraps the linears that will run
    lean = cpu_forward(model, backend, weights)      # after: it keeps the bound forwards
    slots.load(name, folder)                         # a job's adapter; BadAdapter refuses it
    slots.begin_step([(adapter or None, rows) for each sequence, in packed order])
    ...the step's forward...                         # every wrapper reads the step's rows

`begin_step` raises if one step names more than `max_loras` adapters: the scheduler keeps
a step's distinct adapters within it. What bypasses the modules bypasses the deltas too:
int4's one-call decode step (`gpu.cpu.int4_decode`) and replayed CUDA graphs serve only
steps without adapters; tensor parallelism would cut A (row-parallel linears) or B
(column-parallel ones) as it cuts the base weight, which is not done here.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from gpu.cpu.fusions import FusedGatedMLP, ProjectionSlice
from gpu.hf_module import HFModule

# The Hugging Face projections an adapter may target.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A fused CPU projection and the projections it holds, in its columns' order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

# LoraConfig fields that change the forward beyond `x A^T B^T` (truthy when in use).
UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "trainable_token_indices": "trained token embeddings",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer replication",
    "target_parameters": "parameter targets",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
}

_WEIGHT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")


class BadAdapter(ValueError):
    """An adapter refused at load; its message is one line naming the adapter and why."""


@dataclass(frozen=True)
class LoRATarget:
    """A linear to wrap and the Hugging Face projections its columns hold, side by side
    (one for a plain projection)."""

    path: str
    in_features: int
    parts: tuple[tuple[str, int], ...]  # (Hugging Face module path, output width)

    @property
    def out_features(self) -> int:
        return sum(width for _, width in self.parts)


def lora_targets(model: nn.Module) -> list[LoRATarget]:
    """The model's linears an adapter may change, fused CPU projections included (their
    `q_proj`-like slices are not linears of their own)."""
    targets = []
    for path, module in model.named_modules():
        parent_path, _, name = path.rpartition(".")
        prefix = f"{parent_path}." if parent_path else ""
        if isinstance(module, LoRALinear):
            raise ValueError(f"{path} already carries adapters")
        widths = _fused_widths(model.get_submodule(parent_path), name) if name in FUSED else None
        if widths is not None:
            parts = tuple((prefix + part, width) for part, width in zip(FUSED[name], widths))
            targets.append(LoRATarget(path, module.in_features, parts))
        elif name in TARGETS and hasattr(module, "in_features") and hasattr(module, "out_features"):
            targets.append(LoRATarget(path, module.in_features, ((path, module.out_features),)))
    return targets


def _fused_widths(parent: HFModule, name: str) -> list[int] | None:
    """The widths of the parts of `gpu.cpu.fusions`' fused projection `name`; None for a
    model's own linear of that name (Phi-3's), which no Llama adapter targets."""
    if name == "gate_up_proj":
        return [parent.intermediate_size] * 2 if isinstance(parent, FusedGatedMLP) else None
    parts: list[HFModule] = [getattr(parent, part, None) for part in FUSED[name]]
    if not all(isinstance(part, ProjectionSlice) for part in parts):
        return None
    return [part.stop - part.start for part in parts]


@dataclass(frozen=True)
class LoRAAdapter:
    """A PEFT LoRA adapter checked against a base model, in host memory."""

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path: (A [rank, in], B [out, rank])

    @classmethod
    def load(
        cls, folder: str | Path, shapes: Mapping[str, tuple[int, int]], max_rank: int, name: str = ""
    ) -> LoRAAdapter:
        """The adapter in `folder` (`adapter_config.json` and `adapter_model.safetensors` or
        `.bin`), for a base whose targetable linears have `shapes` (path: (in, out)).
        Raises `BadAdapter` for anything this serving cannot apply exactly."""
        folder = Path(folder)
        name = name or folder.name
        try:
            return cls._load(folder, shapes, max_rank, name)
        except _Refusal as refusal:
            raise BadAdapter(f"adapter {name!r}: {refusal}") from None

    @classmethod
    def _load(cls, folder: Path, shapes: Mapping[str, tuple[int, int]], max_rank: int, name: str) -> LoRAAdapter:
        config = _read_config(folder)
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
            raise _Refusal(f"r ({rank!r}) and lora_alpha ({alpha!r}) must be a positive integer and a number")
        if rank > max_rank:
            raise _Refusal(f"rank {rank} is over the maximum {max_rank} (--max-lora-rank)")
        _check_targets(config.get("target_modules"), shapes)
        weights = _paired_weights(_read_weights(folder))
        for module, (a, b) in weights.items():
            if module not in shapes:
                leaf = module.rpartition(".")[2]
                raise _Refusal(
                    f"targets {module}, which the base model lacks"
                    if leaf in TARGETS
                    else f"targets {leaf}; only {', '.join(TARGETS)} are supported"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise _Refusal(f"{module} has weights that are not finite")
            in_features, out_features = shapes[module]
            if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
                raise _Refusal(
                    f"{module} has A {list(a.shape)} and B {list(b.shape)} where the base model takes "
                    f"{[rank, in_features]} and {[out_features, rank]} (an adapter for another model?)"
                )
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        return cls(name, rank, scaling, weights)


class _Refusal(Exception):
    """Why an adapter is refused, before its name is put in front."""


def _read_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise _Refusal(f"no adapter_config.json in {folder}") from None
    except (OSError, ValueError) as error:
        raise _Refusal(f"cannot read {path}: {_one_line(error)}") from None
    if not isinstance(config, dict):
        raise _Refusal(f"{path} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _Refusal(f"is a {config['peft_type']} adapter, not LoRA")
    for field, feature in UNSUPPORTED.items():
        if config.get(field):
            raise _Refusal(f"uses {feature}, which is not supported")
    if config.get("bias", "none") != "none":
        raise _Refusal(f"trains biases (bias={config['bias']!r}), which is not supported")
    # `fan_in_fan_out` describes GPT-2's Conv1D base layers; PEFT ignores it for nn.Linear,
    # the only base layers here, and its lora_A and lora_B keep nn.Linear's layout.
    return config


def _check_targets(target_modules: object, shapes: Mapping[str, tuple[int, int]]) -> None:
    """The named targets are all supported and in the base model (a regular expression,
    or "all-linear", is checked through the weights' names instead)."""
    if not isinstance(target_modules, list):
        return
    present = {path.rpartition(".")[2] for path in shapes}
    for target in target_modules:
        if target not in TARGETS:
            raise _Refusal(f"targets {target}; only {', '.join(TARGETS)} are supported")
        if target not in present:
            raise _Refusal(f"targets {target}, which the base model lacks")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safetensors.is_file():
            return load_file(safetensors)
        if pickled.is_file():
            return torch.load(pickled, map_location="cpu", weights_only=True)
    except (OSError, SafetensorError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise _Refusal(f"cannot read its weights: {_one_line(error)}") from None
    raise _Refusal(f"no adapter_model.safetensors or adapter_model.bin in {folder}")


def _paired_weights(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) by module path, from PEFT's tensor names."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_KEY.match(key)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise _Refusal(f"holds {key}, which is no floating-point tensor")
        if match is None:
            if "lora_embedding" in key:
                raise _Refusal("targets an embedding, which is not supported")
            if "lora_magnitude_vector" in key:
                raise _Refusal("uses DoRA, which is not supported")
            raise _Refusal(f"holds {key}, which is not a LoRA weight")
        found.setdefault(match["module"], {})[match["kind"]] = tensor
    if not found:
        raise _Refusal("holds no LoRA weights")
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise _Refusal(f"{module} has lora_{''.join(pair)} without lora_{'B' if 'A' in pair else 'A'}")
    return {module: (pair["A"], pair["B"]) for module, pair in found.items()}


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


@dataclass(frozen=True)
class Segment:
    """One adapter's rows in a step: positions [start, stop) of the packed rows, or of
    the gathered rows where the step gathers them (`LoRABatch.rows`)."""

    slot: int
    rank: int
    start: int
    stop: int


class LoRABatch:
    """A step's rows by adapter slot, set once per step and read by every `LoRALinear`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.segments: list[Segment] = []
        self.num_rows = 0
        # The adapter rows in slot order, where an adapter's rows are not one run; None where
        # the segments are slices of the packed rows as they are.
        self.rows: torch.Tensor | None = None

    def update(self, spans: Sequence[tuple[int, int]], ranks: Sequence[int]) -> None:
        """`spans`: (slot, or -1 for the base model; row count) of each sequence, in the
        step's packed order. `ranks`: each slot's adapter rank."""
        runs: list[tuple[int, int, int]] = []  # (slot, start, stop): consecutive spans of one slot merged
        start = 0
        for slot, count in spans:
            if runs and runs[-1][0] == slot and runs[-1][2] == start:
                runs[-1] = (slot, runs[-1][1], start + count)
            elif count:
                runs.append((slot, start, start + count))
            start += count
        self.num_rows = start
        runs = [run for run in runs if run[0] >= 0]
        if len({slot for slot, _, _ in runs}) == len(runs):
            self.rows = None
            self.segments = [Segment(slot, ranks[slot], start, stop) for slot, start, stop in runs]
            return
        pieces, self.segments, position = [], [], 0
        for slot in sorted({slot for slot, _, _ in runs}):
            count = 0
            for _, start, stop in (run for run in runs if run[0] == slot):
                pieces.append(torch.arange(start, stop))
                count += stop - start
            self.segments.append(Segment(slot, ranks[slot], position, position + count))
            position += count
        self.rows = torch.cat(pieces).to(self.device)

    def clear(self) -> None:
        """Every row on the base model."""
        self.segments, self.rows, self.num_rows = [], None, 0


class LoRALinear(nn.Module):
    """A linear whose output gains each row's adapter delta. A slot holds the A of each
    part its adapter targets, one above the other (rows [i * rank, (i + 1) * rank) of
    `lora_a` for the i-th), and each one's B, scaled and transposed, in that part's
    columns of `lora_bt`."""

    def __init__(self, base: nn.Module, target: LoRATarget, batch: LoRABatch, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        self.target = target
        self.batch = batch
        self.in_features, self.out_features = target.in_features, target.out_features
        height = len(target.parts) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, height, self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_bt", torch.zeros(max_loras, max_rank, self.out_features, dtype=dtype, device=device))
        self.lora_a: torch.Tensor
        self.lora_bt: torch.Tensor
        # Each slot's targeted parts, as their columns of the output, in `lora_a`'s order.
        self.columns: list[list[slice]] = [[] for _ in range(max_loras)]

    @property
    def gated(self) -> bool:
        """A packed gate_up projection computes SiLU(gate) x up in its product's pass
        (`gpu.cpu.packed_linear`), but the delta must come before the SiLU: only a step
        without adapters takes that path."""
        return bool(getattr(self.base, "gated", False)) and not self.batch.segments

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.silu_mul(x)  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.segments:
            self._add_deltas(x.reshape(-1, self.in_features), y.view(-1, self.out_features))
        return y

    def _add_deltas(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.shape[0] != self.batch.num_rows:
            raise ValueError(f"the step's spans cover {self.batch.num_rows} rows; {self.target.path} got {x.shape[0]}")
        rows = self.batch.rows
        gathered = x if rows is None else x.index_select(0, rows)
        for segment in self.batch.segments:
            slot, rank, start, stop = segment.slot, segment.rank, segment.start, segment.stop
            parts = self.columns[slot]
            if not parts:
                continue
            # One product for every part's A; then each part's B into its own columns (a fused
            # projection's B side by side would be block-diagonal: mostly zeros to read).
            shrunk = gathered[start:stop] @ self.lora_a[slot, : len(parts) * rank].T
            for index, columns in enumerate(parts):
                part, b = shrunk[:, index * rank : (index + 1) * rank], self.lora_bt[slot, :rank, columns]
                if rows is None:  # added in the product's own pass
                    y[start:stop, columns].addmm_(part, b)
                else:
                    y[:, columns].index_add_(0, rows[start:stop], part @ b)

    @torch.no_grad()
    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        rank, start = adapter.rank, 0
        self.columns[slot] = []
        for module, width in self.target.parts:
            columns = slice(start, start + width)
            start += width
            if module in adapter.weights:
                a, b = adapter.weights[module]
                index = len(self.columns[slot])
                self.lora_a[slot, index * rank : (index + 1) * rank] = a
                self.lora_bt[slot, :rank, columns] = (b.float() * adapter.scaling).T
                self.columns[slot].append(columns)

    def extra_repr(self) -> str:
        return f"parts={[module.rpartition('.')[2] for module, _ in self.target.parts]}"


class LoRASlots:
    """The adapters of a model: loaded ones in host memory (at most `max_host_loras`, or
    any number), at most `max_loras` of them resident in the wrapped linears' slots; the
    least recently used one goes first from each."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_host_loras: int | None = None) -> None:
        if max_loras < 1 or max_rank < 1 or (max_host_loras is not None and max_host_loras < 1):
            raise ValueError("--max-loras, --max-lora-rank and the host adapters' bound must be at least 1")
        self.max_loras, self.max_rank, self.max_host_loras = max_loras, max_rank, max_host_loras
        parameter = next(model.parameters())
        self.batch = LoRABatch(parameter.device)
        self.linears: list[LoRALinear] = []
        for target in lora_targets(model):
            parent_path, _, name = target.path.rpartition(".")
            parent = model.get_submodule(parent_path)
            linear = LoRALinear(getattr(parent, name), target, self.batch, max_loras, max_rank,
                                parameter.dtype, parameter.device)  # fmt: skip
            setattr(parent, name, linear)
            self.linears.append(linear)
        self.shapes = {
            module: (linear.in_features, width) for linear in self.linears for module, width in linear.target.parts
        }
        # Both least recently used first. An adapter dropped from host memory is read again
        # from its folder when a step needs it.
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.resident: OrderedDict[str, int] = OrderedDict()  # name: slot
        self.folders: dict[str, Path] = {}
        self.ranks = [0] * max_loras

    def load(self, name: str, folder: str | Path) -> LoRAAdapter:
        """Read and check the adapter in `folder` into host memory, as `name` (replacing an
        adapter of that name). Raises `BadAdapter`."""
        adapter = self.read(name, folder)
        self.add(name, folder, adapter)
        return adapter

    def read(self, name: str, folder: str | Path) -> LoRAAdapter:
        """The adapter in `folder`, read and checked for this model but not held: it reads
        nothing a step changes, so it may run beside one (`add` it between steps)."""
        return LoRAAdapter.load(folder, self.shapes, self.max_rank, name)

    def add(self, name: str, folder: str | Path, adapter: LoRAAdapter) -> None:
        """Hold `adapter`, read from `folder`, as `name` (replacing an adapter of that name)."""
        self.unload(name)
        self.folders[name] = Path(folder)
        self._hold(name, adapter)

    def unload(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.resident.pop(name, None)
        self.folders.pop(name, None)

    def begin_step(self, spans: Sequence[tuple[str | None, int]]) -> None:
        """Set the step's rows: (adapter name, or None for the base model; row count) of
        each sequence, in packed order. Copies the adapters the step needs into slots."""
        needed = list(dict.fromkeys(name for name, _ in spans if name is not None))
        if len(needed) > self.max_loras:
            raise ValueError(f"a step names {len(needed)} adapters; {self.max_loras} fit (--max-loras)")
        for name in needed:
            self._make_resident(name, needed)
        slots = [(-1 if name is None else self.resident[name], count) for name, count in spans]
        self.batch.update(slots, self.ranks)

    def end_step(self) -> None:
        """Back to the base model for every row (a forward outside the steps, a warm-up)."""
        self.batch.clear()

    def _make_resident(self, name: str, in_step: Sequence[str]) -> None:
        if name not in self.folders:
            raise KeyError(f"adapter {name!r} is not loaded")
        if name in self.resident:
            self.resident.move_to_end(name)
            if name in self.adapters:
                self.adapters.move_to_end(name)
            return
        adapter = self.adapters.get(name) or LoRAAdapter.load(self.folders[name], self.shapes, self.max_rank, name)
        self._hold(name, adapter)
        free = sorted(set(range(self.max_loras)) - set(self.resident.values()))
        if free:
            slot = free[0]
        else:
            victim = next(resident for resident in self.resident if resident not in in_step)
            slot = self.resident.pop(victim)
        for linear in self.linears:
            linear.load_slot(slot, adapter)
        self.ranks[slot] = adapter.rank
        self.resident[name] = slot

    def _hold(self, name: str, adapter: LoRAAdapter) -> None:
        """Keep `adapter` in host memory as the most recently used one."""
        self.adapters[name] = adapter
        self.adapters.move_to_end(name)
        if self.max_host_loras is not None and len(self.adapters) > self.max_host_loras:
            self.adapters.popitem(last=False)
