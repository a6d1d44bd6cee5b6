"""The static type of a Hugging Face module walked by attribute, as the kernels walk it
(`model.model.layers[0].self_attn.q_proj`).

torch types `nn.Module.__getattr__` as `Tensor | Module`, so every submodule, weight and
constant reached that way reads as that union, whatever the architecture holds there.
The code that walks a transformers model (Llama, Qwen2 and Mistral stacks, recognised by
class name) takes it as `HFModule`: what it reads is checked at run time (the class
names, `lean_forward_applies`, the layer checks), not by the type checker.
"""

from typing import Any

HFModule = Any
