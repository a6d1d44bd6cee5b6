"""`inflight bench`: one harness, many scenarios (see `bench/main.py`). Its entry points
(`bench.main.add_arguments`, `run`) are not imported eagerly, so `python -m bench` children
start without extra imports.
"""
