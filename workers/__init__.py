"""The engine: one Hugging Face causal LM over a paged KV cache, stepped by a
priority-aware continuous batcher.

`engine.py` steps (schedule → run → sample → update), `scheduler.py` decides and owns
request state, `model_runner.py` runs the forward, `sampler.py` and `detokenizer.py`
turn logits into tokens and text, `async_engine.py` is the asyncio front end.
Configuration lives in `config.py`. Knows nothing of Redis; imports only `gpu`.
"""
