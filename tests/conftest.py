"""Shared fixtures: the real SmolLM2 model (converted once, then cached) and engines
that must give back every KV block by the end of each test. Tests marked `gpu` are
skipped where there is no CUDA device or no cupy."""

from __future__ import annotations

import os

import pytest
import torch

from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from workers.engine import Engine
from workers.model_loader import LoadedModel, load_model

TEST_KV_MEMORY = 128 << 20
TEST_SWAP_MEMORY = 64 << 20


def pytest_configure(config):
    """Under `pytest -n` (`make test`), each test process gets its share of the cores, and so
    do the workers and gateways its tests start: more OpenMP threads than cores make
    every one of them spin and wait."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if processes > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // processes)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_modifyitems(config, items):
    from gpu.cuda.cupy_kernels import cupy_available

    if torch.cuda.is_available() and cupy_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and cupy")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: tests/gpu/ is a keyword too
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct in float32, shared by every engine (they switch it to paged attention)."""
    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def smollm2_reference() -> LoadedModel:
    """A second copy on transformers' own attention: the oracle for `generate`."""
    return load_model(ModelConfig())


@pytest.fixture
def make_engine(smollm2):
    """Build engines over the shared model; after the test, all their blocks must be free."""
    engines: list[Engine] = []

    def build(
        loaded: LoadedModel | None = None,
        kv_memory_bytes: int = TEST_KV_MEMORY,
        swap_memory_bytes: int = TEST_SWAP_MEMORY,
        block_size: int = CacheConfig.block_size,
        prefix_caching: bool = CacheConfig.prefix_caching,
        speculative: SpeculativeConfig = SpeculativeConfig(),
        model: ModelConfig = ModelConfig(),
        **scheduler,
    ) -> Engine:
        config = EngineConfig(
            model=model,
            cache=CacheConfig(
                kv_memory_bytes=kv_memory_bytes,
                swap_memory_bytes=swap_memory_bytes,
                block_size=block_size,
                prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(**scheduler),
            speculative=speculative,
        )
        engine = Engine(loaded or smollm2, config)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        assert not engine.has_unfinished(), "a test left requests in the engine"
        assert engine.allocator.num_free == engine.allocator.num_blocks, "KV blocks leaked"
        host = engine.host_allocator
        assert host is None or host.num_free == host.num_blocks, "host KV blocks leaked"


def run_to_completion(engine: Engine, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 10_000):
    """Step until idle; `arrivals[step]` lists the `GenerationRequest` fields (request_id,
    prompt, params[, priority, deadline, arrived_at]) of the requests added before that step.

    Returns {request_id: (token_ids, final_event, text)}, in the order the requests finished.
    """
    from bench.drive import Driver

    driver = Driver(engine, raise_errors=False)  # bad input is a final event the test looks at
    driver.drain(arrivals, max_steps)
    return {
        request_id: (driver.tokens.get(request_id, []), final, driver.texts.get(request_id, ""))
        for request_id, final in driver.finals.items()
    }


@pytest.fixture(scope="session")
def greedy_tokens(smollm2) -> list[int]:
    """The fleet job's greedy tokens (tests/fleet_jobs.py), from one uninterrupted run."""
    from tests.fleet_jobs import greedy_reference

    return greedy_reference(smollm2)
