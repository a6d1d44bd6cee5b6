"""One worker over N ranks (`ModelConfig.tensor_parallel`): the leader and its followers.

Rank 0 is the worker itself: its engine schedules, samples and talks to Redis. It starts
N - 1 follower processes (`Leader.start`), each of which loads the same model, keeps its
share of the heads and MLP (`gpu.tensor_parallel`) and its own paged KV cache for its
heads, then mirrors the leader step by step: before every forward the leader broadcasts
the step's inputs (`StepInputs`: the chunks' tokens, positions and block ids, and the
KV copies to make), and every rank runs the same forward, meeting the others in the
layers' all-reduces. Only rank 0 samples. The scheduler never knows: block ids mean the
same blocks on every rank, since every rank's cache has the same number of them.

The group is torch.distributed's, over gloo on a CPU (one thread a rank). A rank that
dies takes the group down: a collective with it fails at once on every other rank (its
sockets close), and one stuck in a step's collective fails the others after
`COLLECTIVE_TIMEOUT_S` (starting, while every rank loads the model, may take up to
`START_TIMEOUT_S`). A follower then exits; the leader (the worker) exits at once with
`EXIT_GROUP_LOST`, leaving its jobs to be taken over by another worker, as when a worker
is killed.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from workers.config import CacheConfig, ModelConfig
from workers.plan import ScheduledChunk, StepPlan
from workers.request import Request

# A rank waiting this long in a step's collective gives up (the group is lost).
COLLECTIVE_TIMEOUT_S = 60.0
# Forming the group and loading the model on every rank may take this long.
START_TIMEOUT_S = 1800.0
# The worker's exit status when its group lost a rank.
EXIT_GROUP_LOST = 4


@dataclass
class StepInputs:
    """What every rank needs of a step: a `StepPlan` without its requests."""

    chunks: list[ScheduledChunk]
    copies_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    copies_in: list[tuple[int, int]] = field(default_factory=list)
    num_draft_tokens: int = 0

    @classmethod
    def of(cls, plan: StepPlan) -> StepInputs:
        # Without the request (a follower never reads it, and it does not travel).
        nobody = cast(Request, None)
        chunks = [
            chunk._replace(request=nobody, block_tables=tuple(map(list, chunk.block_tables))) for chunk in plan.chunks
        ]
        return cls(chunks, plan.copies_out, plan.copies, plan.copies_in, plan.num_draft_tokens)


class Leader:
    """Rank 0's end of the group: it started the followers and sends them every step."""

    def __init__(self, followers: list[subprocess.Popen], steps: Any) -> None:
        self.followers = followers
        self.steps = steps  # the process group of the steps' collectives
        # What rank 0's all-reduces took (`inflight bench --scenario tp`): their count, the
        # bytes each rank contributed, and the time in them, waiting for the others included.
        self.all_reduces = self.all_reduce_bytes = 0
        self.all_reduce_s = 0.0

    @classmethod
    def start(cls, model: ModelConfig, cache: CacheConfig) -> Leader:
        """Start the followers, form the group with them (this process is rank 0)."""
        world = model.tensor_parallel
        address = f"tcp://127.0.0.1:{_free_port()}"
        # A fresh interpreter each (no inherited torch threads), started as a module: unlike
        # multiprocessing's spawn, it never imports the leader's main script again.
        followers = []
        for rank in range(1, world):
            process = subprocess.Popen([sys.executable, "-m", "workers.tensor_parallel"], stdin=subprocess.PIPE)
            assert process.stdin is not None
            process.stdin.write(pickle.dumps((rank, world, address, model, cache)))
            process.stdin.close()
            followers.append(process)
        return cls(followers, _join_group(0, world, address))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """A step's all-reduce, on rank 0: the worker exits where a rank is gone."""
        started = time.perf_counter()
        collective(dist.all_reduce, tensor, group=self.steps)
        self.all_reduce_s += time.perf_counter() - started
        self.all_reduces += 1
        self.all_reduce_bytes += tensor.numel() * tensor.element_size()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The step's logits gather, on rank 0 (its slices side by side): exits as `all_reduce`."""
        parts = [torch.empty_like(tensor) for _ in range(len(self.followers) + 1)]
        collective(dist.all_gather, parts, tensor.contiguous(), group=self.steps)
        return torch.cat(parts, dim=-1)

    def wait_ready(self) -> None:
        """Wait until every follower has loaded and cut its model."""
        collective(dist.barrier)

    def send(self, plan: StepPlan) -> StepInputs:
        """Broadcast the step to the followers; the inputs rank 0 runs too."""
        inputs = StepInputs.of(plan)
        collective(dist.broadcast_object_list, [inputs], src=0, group=self.steps)
        return inputs

    def stop(self) -> None:
        """Tell the followers to exit, and wait for them."""
        dist.broadcast_object_list([None], src=0, group=self.steps)
        for process in self.followers:
            process.wait(timeout=10)
        dist.destroy_process_group()


def follow(rank: int, world: int, address: str, model_config: ModelConfig, cache: CacheConfig) -> None:
    """A follower's life: join the group, load and cut the model, mirror every step."""
    from gpu.tensor_parallel import Shard
    from workers.model_loader import load_model
    from workers.model_runner import ModelRunner

    torch.set_num_threads(threads_per_rank(model_config))
    steps = _join_group(rank, world, address)
    try:
        loaded = load_model(model_config)
        runner = ModelRunner(loaded.model, cache, model_config=model_config, shard=Shard(rank, world, steps))
        dist.barrier()  # ready: the leader's `wait_ready`
        while True:
            received: list[Any] = [None]
            dist.broadcast_object_list(received, src=0, group=steps)
            if received[0] is None:
                break
            runner.run(received[0])
    except (RuntimeError, ConnectionError):
        pass  # the leader is gone: so is this rank
    except Exception as error:  # the leader loaded the same model and says why it cannot serve it
        print(f"inflight tensor-parallel rank {rank}: {error}", file=sys.stderr, flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def collective(call, *args, **kwargs) -> None:
    """A collective of the leader's: where a rank is gone, the worker exits at once (its
    group cannot step again) with `EXIT_GROUP_LOST`, and says why in one line."""
    try:
        call(*args, **kwargs)
    except (RuntimeError, ConnectionError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"inflight worker: a tensor-parallel rank is gone ({reason}); exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_GROUP_LOST)


def threads_per_rank(model: ModelConfig) -> int:
    """`model.threads`, or else this process's cores shared out between the ranks."""
    return model.threads or max(1, len(os.sched_getaffinity(0)) // model.tensor_parallel)


def _join_group(rank: int, world: int, address: str) -> Any:
    """Form the group (every rank waits up to `START_TIMEOUT_S` for the others); returns
    the group the steps' collectives run in, which gives up after `COLLECTIVE_TIMEOUT_S`."""
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
    )  # fmt: skip
    return dist.new_group(timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":  # a follower, started by `Leader.start` with its arguments on stdin
    follow(*pickle.load(sys.stdin.buffer))
