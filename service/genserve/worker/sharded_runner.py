"""Rank 0's model runner in a tensor-parallel server: every step it executes is first
broadcast to the shard workers, so all ranks run the same forward pass in lockstep.

:class:`ShardedModelRunner` *is* a :class:`~genserve.worker.model_runner.ModelRunner` (rank
0's shard, and the only rank that samples) whose ``execute_model`` broadcasts the step first.
Warm-up therefore reaches the workers too, since ``ModelRunner.warmup`` runs its synthetic
steps through ``self.execute_model`` and (re)allocates the cache through
``self.initialize_kv_cache``, both of which this class forwards.

Failure contract: once a broadcast or a collective has failed, the ranks are out of step and
cannot be brought back, so any exception inside a sharded step is fatal for the group:
``is_alive()`` turns False, the failure is reported (naming the dead shard when one exited)
and every later step raises :class:`ShardFailedError` at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from genserve.model.attention_backend import PrefillAttentionFlag
from genserve.model.loader import ResolvedModel
from genserve.step import RunnerOutput, SchedulerOutput
from genserve.worker.model_runner import ModelRunner
from genserve.worker.shard_group import (
    ShardChannel,
    ShardGroup,
    agree_kv_budget,
    backend_for,
    init_shard_group,
    leave_shard_group,
    rank_device,
)
from genserve.worker.shard_messages import (
    InitKVCacheMessage,
    ShardMessage,
    ShutdownMessage,
    StepMessage,
)
from genserve.worker.shard_plan import cpu_threads_per_shard
from genserve.worker.shard_processes import ShardProcesses, WorkerSpec

log = structlog.get_logger("genserve.shards")

# How long a failed step waits for a worker's exit to be noticed, so that the reported
# reason names the shard rather than only the collective's error.
_NAME_THE_SHARD_S = 1.0
# Shutdown waits this long for a running step (the lock) and then for workers to exit.
_SHUTDOWN_STEP_WAIT_S = 5.0
_SHUTDOWN_EXIT_WAIT_S = 5.0


class ShardFailedError(RuntimeError):
    """The tensor-parallel group broke; the message names the shard when known."""


class ShardedModelRunner(ModelRunner):
    """Rank 0 of ``group``: a :class:`ModelRunner` that keeps the workers in ``processes`` in
    step.  Build it with :func:`launch_sharded_runner`."""

    def __init__(
        self,
        model: ResolvedModel,
        dtype: torch.dtype,
        device: torch.device,
        group: ShardGroup,
        processes: ShardProcesses,
        memory_fraction: float,
        trust_remote_code: bool = False,
        prefill_attention: PrefillAttentionFlag = "auto",
    ) -> None:
        super().__init__(
            model,
            dtype,
            device,
            group.parallel,
            trust_remote_code,
            prefill_attention=prefill_attention,
        )
        self.group = group
        self.processes = processes
        self._channel = ShardChannel(group)
        self._lock = threading.Lock()  # one message at a time, steps vs. shutdown
        self._memory_fraction = memory_fraction
        self._kv_budget = agree_kv_budget(self, memory_fraction, group)
        self._warmup_req_ids: set[str] | None = None
        self._closed = False

    @property
    def num_shard(self) -> int:
        return self.group.world_size

    def is_alive(self) -> bool:
        """False once the group broke (a worker died or a collective failed)."""
        return self.processes.failure is None

    def available_kv_memory_bytes(self, fraction: float) -> int:
        """The budget every rank agreed on at start-up (the smallest rank's)."""
        if fraction != self._memory_fraction:
            raise ValueError(
                f"the shards measured their KV budget for fraction {self._memory_fraction}, "
                f"not {fraction}"
            )
        return self._kv_budget

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._send(InitKVCacheMessage(num_blocks, block_size))
        super().initialize_kv_cache(num_blocks, block_size)

    def warmup(self) -> None:
        """Rank 0's warm-up, with the workers following each step and each cache
        (re)allocation; then the workers drop the warm-up requests (rank 0 already did)."""
        self._warmup_req_ids = set()
        try:
            super().warmup()
        finally:
            req_ids, self._warmup_req_ids = self._warmup_req_ids, None
        self.execute_model(SchedulerOutput(step_id=-1, chunks=(), finished_req_ids=tuple(req_ids)))

    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        """Broadcast ``step``, then run rank 0's shard of it and sample."""
        if self._warmup_req_ids is not None:
            self._warmup_req_ids.update(r.req_id for r in step.new_requests)
        with self._lock:
            self._check_whole()
            try:
                self._channel.send(StepMessage(step))
                return super().execute_model(step)
            except Exception as exc:
                raise ShardFailedError(self._broke(f"step {step.step_id} failed: {exc}")) from exc

    def _send(self, message: ShardMessage) -> None:
        with self._lock:
            self._check_whole()
            try:
                self._channel.send(message)
            except Exception as exc:
                raise ShardFailedError(self._broke(f"sending to the shards failed: {exc}")) from exc

    def _check_whole(self) -> None:
        if self._closed:
            raise ShardFailedError("the sharded runner was shut down")
        failure = self.processes.failure
        if failure is not None:
            raise ShardFailedError(failure)

    def _broke(self, what: str) -> str:
        """Report the group broken; returns the reason (a dead shard's exit when one is
        noticed within ``_NAME_THE_SHARD_S``)."""
        reason = self.processes.wait_failure(_NAME_THE_SHARD_S)
        if reason is None:
            self.processes.fail(f"shard 0 (rank 0): {what}")
            reason = self.processes.failure or what
        return reason

    def shutdown(self) -> None:
        """Tell the workers to exit, wait for them (killing stragglers), release rank 0's
        cache and the process group.  Idempotent; bounded in time even when a worker hangs."""
        if self._closed:
            return
        acquired = self._lock.acquire(timeout=_SHUTDOWN_STEP_WAIT_S)
        try:
            self._closed = True
            whole = acquired and self.processes.failure is None
            if whole:
                self.processes.expect_exits()  # a worker may obey before stop() below
                try:
                    self._channel.send(ShutdownMessage())
                except Exception:
                    log.warning("shard_shutdown_message_failed", exc_info=True)
                    whole = False
            self.processes.stop(_SHUTDOWN_EXIT_WAIT_S if whole else 0.0)
            super().shutdown()
            if whole:
                leave_shard_group()
        finally:
            if acquired:
                self._lock.release()


@dataclass(frozen=True, slots=True)
class ShardSettings:
    """The launcher's flags a tensor-parallel group needs (built by cli.py)."""

    master_addr: str  # --master-addr: the rendezvous of torch.distributed
    master_port: int  # --master-port
    cuda_memory_fraction: float
    cpu_memory_fraction: float
    json_output: bool  # the workers log as rank 0 does
    trust_remote_code: bool
    kernel_cache_dir: Path  # where the CPU kernels are built (shared by the ranks)
    cpu_kernels: bool  # False: --disable-cpu-kernels
    deterministic: bool = False  # --deterministic: batch-invariant kernels on every rank
    cpu_int_dot: str = "auto"  # --cpu-int-dot: every rank multiplies as rank 0 does
    # --cpu-features-mask (or its environment variable): every rank hides the same features,
    # so no rank runs other kernels than rank 0 (an emulation for testing and benchmarking)
    cpu_features_mask: str = ""
    expert_parallel: bool = False  # --expert-parallel: whole routed experts per rank
    # --gpu-prefill-attention: every rank attends a step's prompt rows the same way
    gpu_prefill_attention: PrefillAttentionFlag = "auto"


def launch_sharded_runner(
    model: ResolvedModel,
    settings: ShardSettings,
    num_shard: int,
    dtype_name: str,
    on_failure: Callable[[str], None],
) -> ShardedModelRunner:
    """Start ranks 1..N-1, join the group as rank 0 (rendezvous at ``--master-addr`` /
    ``--master-port``), load rank 0's shard and agree on the KV-cache budget.

    ``on_failure(reason)`` is called once, from another thread, if the group breaks later
    (or while loading).  On any error here the workers are stopped before it propagates."""
    on_cuda = torch.cuda.is_available()
    num_threads = None
    if not on_cuda:
        num_threads = cpu_threads_per_shard(torch.get_num_threads(), num_shard)
        torch.set_num_threads(num_threads)
    spec = WorkerSpec(
        world_size=num_shard,
        master_addr=settings.master_addr,
        master_port=settings.master_port,
        model_dir=str(model.local_dir),
        model_id=model.model_id,
        dtype=dtype_name,
        memory_fraction=settings.cuda_memory_fraction if on_cuda else settings.cpu_memory_fraction,
        num_threads=num_threads,
        json_output=settings.json_output,
        trust_remote_code=settings.trust_remote_code,
        kernel_cache_dir=str(settings.kernel_cache_dir),
        cpu_kernels=settings.cpu_kernels,
        deterministic=settings.deterministic,
        cpu_int_dot=settings.cpu_int_dot,
        cpu_features_mask=settings.cpu_features_mask,
        expert_parallel=settings.expert_parallel,
        prefill_attention=settings.gpu_prefill_attention,
        rope_scaling=model.rope_scaling,
        rope_factor=model.rope_factor,
        quantize=model.quantize,
        gguf_file=None if model.gguf_file is None else str(model.gguf_file),
    )
    processes = ShardProcesses(spec, on_failure)
    try:
        device = rank_device(0, on_cuda)
        group = init_shard_group(
            0,
            num_shard,
            settings.master_addr,
            settings.master_port,
            device,
            expert_parallel=settings.expert_parallel,
        )
        runner = ShardedModelRunner(
            model,
            getattr(torch, dtype_name),
            device,
            group,
            processes,
            spec.memory_fraction,
            settings.trust_remote_code,
            prefill_attention=settings.gpu_prefill_attention,
        )
    except BaseException:
        processes.stop(timeout_s=0.0)
        leave_shard_group()
        raise
    log.info(
        "shards_joined",
        num_shard=num_shard,
        backend=backend_for(device),
        pids=list(processes.pids),
        threads_per_shard=num_threads,
    )
    return runner
