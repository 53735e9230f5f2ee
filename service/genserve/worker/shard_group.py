"""The tensor-parallel process group every rank joins, and rank 0's message channel to the
workers.

Two groups over the same ranks:

- the default group carries the model's collectives (all-reduce after row-parallel layers,
  all-gather of vocab-parallel logits): NCCL on CUDA, gloo on CPU — one code path;
- a gloo *control* group carries :mod:`~genserve.worker.shard_messages` from rank 0 to the
  workers.  It is gloo even on CUDA because messages are host bytes, and it has a very long
  timeout because a worker waits on it for as long as the server is idle.

Timeouts: a model collective waits for peers that are computing the same layer, so its
timeout (``COLLECTIVE_TIMEOUT``) only bounds how long a *stuck* (not dead) peer can hold the
step; a dead peer is noticed at once (gloo raises "Connection closed by peer").

Startup protocol (every rank, in this order): :func:`init_shard_group` → build the model
runner (each rank loads its own weight slices) → :func:`agree_kv_budget` → rank 0 sends
messages, workers execute them until ``SHUTDOWN``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from genserve.parallel import ParallelContext
from genserve.worker.model_runner import ModelRunner
from genserve.worker.shard_messages import ShardMessage, decode, encode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

COLLECTIVE_TIMEOUT = timedelta(minutes=2)
# Workers block on the control group between requests; an idle server must not time out.
IDLE_TIMEOUT = timedelta(days=365)

# One broadcast per message: a fixed buffer holding [kind, payload length, payload...];
# payloads that do not fit (long prompts) follow in a second broadcast.
_HEADER = struct.Struct("<qq")
_BUFFER_BYTES = 8192


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(rank: int, on_cuda: bool) -> torch.device:
    """Rank ``r`` uses ``cuda:r`` (of the visible devices); every rank shares the CPU."""
    return torch.device("cuda", rank) if on_cuda else torch.device("cpu")


def rendezvous_url(master_addr: str, master_port: int) -> str:
    host = (
        f"[{master_addr}]"
        if ":" in master_addr and not master_addr.startswith("[")
        else master_addr
    )
    return f"tcp://{host}:{master_port}"


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """This rank's membership: the model's :class:`ParallelContext` and the control group."""

    parallel: ParallelContext
    control: ProcessGroup

    @property
    def rank(self) -> int:
        return self.parallel.rank

    @property
    def world_size(self) -> int:
        return self.parallel.world_size


def init_shard_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    expert_parallel: bool = False,
) -> ShardGroup:
    """Rendezvous at ``master_addr:master_port`` (rank 0 listens there).  Blocks until every
    rank has joined or ``COLLECTIVE_TIMEOUT`` passes.  ``expert_parallel``: the model's
    context splits routed experts between the ranks (``--expert-parallel``)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=rendezvous_url(master_addr, master_port),
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    if not isinstance(control, dist.ProcessGroup):  # a non-member gets a sentinel; all are
        raise RuntimeError(f"rank {rank} is not in the control group")
    parallel = ParallelContext(rank, world_size, expert_parallel=expert_parallel)
    return ShardGroup(parallel, control)


def leave_shard_group() -> None:
    """Tear down the process groups (after the peers were told to stop).  Idempotent."""
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_kv_budget(runner: ModelRunner, fraction: float, group: ShardGroup) -> int:
    """Bytes of KV cache this rank may allocate such that every rank can hold the same
    number of tokens: the smallest rank's capacity, counted in this rank's bytes (ranks may
    store different numbers of KV heads).  Collective: every rank calls it once, after
    loading its weights.

    The ranks on CPU share one host's memory, so each takes ``1 / world_size`` of the
    measured budget; on CUDA every rank measures its own device."""
    dist.barrier(group=group.control)  # every rank has loaded: measure what is really left
    # The base class's measurement: rank 0's ShardedModelRunner overrides the method to
    # answer with the result of this function.
    budget = ModelRunner.available_kv_memory_bytes(runner, fraction)
    if runner.device.type != "cuda":
        budget //= group.world_size
    bytes_per_token = runner.kv_cache_bytes_per_block(1)
    num_tokens = torch.tensor([budget // bytes_per_token], dtype=torch.int64)
    dist.all_reduce(num_tokens, op=dist.ReduceOp.MIN, group=group.control)
    return int(num_tokens.item()) * bytes_per_token


class ShardChannel:
    """Rank 0 → workers, one typed message at a time, over the control group.

    Not thread-safe: one thread sends (rank 0's step thread, serialized by the runner)."""

    def __init__(self, group: ShardGroup) -> None:
        self._group = group.control
        self._buffer = torch.zeros(_BUFFER_BYTES, dtype=torch.uint8)

    def send(self, message: ShardMessage) -> None:
        kind, payload = encode(message)
        header = _HEADER.pack(int(kind), len(payload))
        inline = len(header) + len(payload) <= _BUFFER_BYTES
        data = header + payload if inline else header
        buf = self._buffer
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self._group)
        if not inline:
            extra = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(extra, src=0, group=self._group)

    def receive(self) -> ShardMessage:
        """Block until rank 0 sends the next message."""
        buf = self._buffer
        dist.broadcast(buf, src=0, group=self._group)
        kind, size = _HEADER.unpack(buf[: _HEADER.size].numpy().tobytes())
        if _HEADER.size + size <= _BUFFER_BYTES:
            payload = buf[_HEADER.size : _HEADER.size + size].numpy().tobytes()
        else:
            extra = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(extra, src=0, group=self._group)
            payload = extra.numpy().tobytes()
        return decode(kind, payload)
