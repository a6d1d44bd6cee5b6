"""`inflight bench`: a seeded synthetic workload on the engine and on transformers peers.

Entry points live in `bench.main` (`add_arguments`, `run`); this package does not
import them eagerly so `python -m bench` children start without extra imports.
"""
