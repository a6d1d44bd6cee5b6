"""The engine: one Hugging Face causal LM over a paged KV cache, stepped by a
priority-aware continuous batcher.

`engine.py` steps (inbox → schedule → execute → sample or verify → update → outputs),
`validation.py` checks a request as it comes in, `scheduler.py` decides and owns request
state, `model_runner.py` runs the forward, `sampler.py` and `detokenizer.py` turn logits
into tokens and text, `outputs.py` turns new tokens into events, `async_engine.py` is the
asyncio front end.
Configuration lives in `config.py`. Knows nothing of Redis; imports only `gpu`.
"""
