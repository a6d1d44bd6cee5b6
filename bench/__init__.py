"""`inflight bench`: one harness, many scenarios. A scenario is a workload (random token
ids, real ShareGPT conversations, shared prefixes, multi-turn), an arrival process (all at
t0, Poisson at a rate, bursts, closed loop) and the systems it goes through (the engine in
process, a worker through Redis, the gateway, the peers vLLM, llama.cpp and transformers),
every request timed the same way and reported in one JSON shape and one PNG style.

Entry points live in `bench.main` (`add_arguments`, `run`); this package does not
import them eagerly so `python -m bench` children start without extra imports.
"""
