"""`--threads 0` on a shared host (workers/thread_budget.py): one torch thread per core
that other processes leave free, read from `/proc/stat` less the worker's own CPU time."""

from __future__ import annotations

import os

import pytest
import torch

from workers.thread_budget import INTERVAL_S, ThreadBudget, adapts, read_busy_seconds, threads_for

STAT = """cpu  900 0 300 5000 20 0 0 0 0 0
cpu0 400 0 100 2500 10 0 0 0 0 0
cpu1 500 0 200 2500 10 0 0 5 0 0
intr 12345
"""


def test_a_core_counts_as_taken_from_a_third_of_its_time():
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.3) == 2  # a light neighbour: keep both
    assert threads_for(2, 0.5) == 1  # a thread sharing its core with a busy process gets about half
    assert threads_for(2, 1.0) == 1
    assert threads_for(2, 2.0) == 1  # never fewer than one
    assert threads_for(8, 2.4) == 5  # two cores and four tenths of a third: three taken
    assert threads_for(8, 2.3) == 6


def test_busy_time_is_everything_but_idle_and_iowait_of_our_cores_steal_included():
    assert read_busy_seconds({0}, STAT, 100.0) == 5.0
    assert read_busy_seconds({1}, STAT, 100.0) == 7.05
    assert read_busy_seconds({0, 1}, STAT, 100.0) == 12.05


class FakeHost:
    """`/proc/stat` and a clock the test moves: another process's busy ticks on core 1."""

    def __init__(self) -> None:
        self.now = 0.0
        self.ticks = 0

    def stat(self) -> str:
        return f"cpu0 0 0 0 1000 0 0 0 0\ncpu1 {self.ticks} 0 0 1000 0 0 0 0\n"

    def clock(self) -> float:
        return self.now


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_engine_drops_a_thread_while_another_process_keeps_a_core_and_takes_it_back(two_threads, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    host = FakeHost()
    budget = ThreadBudget(host.stat, host.clock)
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    host.now, host.ticks = INTERVAL_S / 2, int(ticks_per_s * INTERVAL_S / 2)
    budget.adjust()
    assert torch.get_num_threads() == 2  # not an interval yet
    host.now, host.ticks = 2 * INTERVAL_S, int(2 * ticks_per_s * INTERVAL_S)  # a core's worth, all along
    budget.adjust()
    assert budget.threads == torch.get_num_threads() == 1
    host.now += 2 * INTERVAL_S  # then nothing more: the core is free again
    budget.adjust()
    assert budget.threads == torch.get_num_threads() == 2


def test_only_a_cpu_worker_of_one_rank_with_threads_0_and_no_omp_num_threads_adapts(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert adapts(0, 1, "cpu")
    assert not adapts(2, 1, "cpu") and not adapts(0, 2, "cpu") and not adapts(0, 1, "cuda")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert not adapts(0, 1, "cpu")
