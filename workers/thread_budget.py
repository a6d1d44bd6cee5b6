"""Torch threads that give way to other processes on a shared host (`--threads 0`).

Torch's CPU operations split their work over OpenMP threads, one per core, that meet at
a barrier after every operation. Where another process keeps one of those cores busy,
the thread on it runs only in the turns the kernel gives it, and every operation waits
for that turn: a worker on two cores with one taken runs 10 to 50 times slower, while
one thread fewer would lose at most that core's share (docs/benchmarks.md, "Threads on
a shared host").

So with `threads` 0 the engine runs one thread per core of its CPU affinity that other
processes leave free, at least one (`OMP_NUM_THREADS`, where set, fixes the count as
`--threads` does). Between steps, at most once every `INTERVAL_S`, it
reads how busy those cores were (`/proc/stat`) less its own CPU time: the rest is other
processes'. A core counts as taken from `TAKEN_SHARE` of its time on (a thread sharing
a core with a busy process gets about half of it). Where `/proc/stat` cannot be read
(not Linux), the thread count stays as torch set it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

INTERVAL_S = 1.0
TAKEN_SHARE = 0.35


def threads_for(cores: int, others_busy: float) -> int:
    """Threads for `cores` cores of which other processes kept `others_busy` cores' worth busy."""
    return max(1, cores - math.floor(others_busy + 1 - TAKEN_SHARE))


def read_busy_seconds(cpus: set[int], stat_text: str, ticks_per_s: float) -> float:
    """CPU seconds `cpus` have spent busy (anything but idle and iowait), from `/proc/stat`'s
    text; stolen time counts: a thread waits for it as for another process."""
    busy = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(value) for value in rest.split()]
        idle, iowait = fields[3], fields[4] if len(fields) > 4 else 0
        busy += sum(fields[:8]) - idle - iowait  # user nice system idle iowait irq softirq steal
    return busy / ticks_per_s


def adapts(threads: int, tensor_parallel: int, device_type: str) -> bool:
    """Whether a worker's thread count follows the load: `threads` 0 on a CPU, one rank,
    and no OMP_NUM_THREADS set."""
    return threads == 0 and tensor_parallel == 1 and device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ


class ThreadBudget:
    """Sets torch's thread count to the cores other processes leave free (see the module)."""

    def __init__(self, read_stat: Callable[[], str] | None = None, clock: Callable[[], float] = time.monotonic):
        self.cpus = os.sched_getaffinity(0)
        self._read_stat = read_stat or _proc_stat
        self._clock = clock
        self._ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        self.threads = torch.get_num_threads()
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall, busy seconds of our cores, our own CPU seconds), or None without /proc/stat."""
        try:
            stat = self._read_stat()
        except OSError:
            return None
        own = os.times()
        return self._clock(), read_busy_seconds(self.cpus, stat, self._ticks_per_s), own.user + own.system

    def adjust(self) -> None:
        """Between steps: once an interval has passed, set the thread count for the load seen."""
        if self._last is None or self._clock() - self._last[0] < INTERVAL_S:
            return
        now = self._sample()
        if now is None:
            return
        wall, busy, own = (a - b for a, b in zip(now, self._last))
        self._last = now
        threads = threads_for(len(self.cpus), max(0.0, busy - own) / wall)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads


def _proc_stat() -> str:
    with open("/proc/stat") as stat:
        return stat.read()
