"""Scheduler knobs (TGI / SGLang flag names in the comments).  Pure Python; no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from genserve.engine.rotary_salt import LengthRotary


class SchedulePolicy(enum.Enum):
    """Order in which waiting requests are admitted (``--schedule-policy``)."""

    FCFS = "fcfs"  # arrival order (preempted requests first: they arrived earlier)
    LPM = "lpm"  # longest cached prefix first (SGLang); FCFS when the queue is long


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Everything the scheduler needs; validated on construction.

    KV capacity is ``num_blocks * block_size`` tokens (:attr:`max_batch_total_tokens`); the
    launcher derives ``num_blocks`` from ``--max-batch-total-tokens`` or from free memory.
    """

    num_blocks: int
    block_size: int = 16
    # --max-batch-prefill-tokens: prompt (and recompute) tokens of all requests in one step.
    # Decode tokens (one per running request) are not counted.
    max_batch_prefill_tokens: int = 4096
    # --disable-chunked-prefill turns this off: whole prompts, TGI's admission policy.
    chunked_prefill_enabled: bool = True
    # --chunked-prefill-size: prompt tokens of one request per step (None: the step's budget).
    chunked_prefill_size: int | None = None
    # --max-batch-size: running requests at most (None: limited by the KV cache only).
    max_num_running: int | None = None
    # --schedule-policy
    policy: SchedulePolicy = SchedulePolicy.FCFS
    # SGLang falls back from lpm to fcfs above 128 waiting requests: sorting a long queue by
    # prefix match costs more than it saves.
    lpm_max_queue_len: int = 128
    # --disable-prefix-caching turns this off.
    enable_prefix_caching: bool = True
    # The model's length-dependent rotary (longrope, dynamic NTK): prompts share cached
    # blocks only within one rotary regime (engine/rotary_salt.py).  None: position only.
    length_rotary: LengthRotary | None = None
    # --waiting-served-ratio / --max-waiting-tokens: TGI's admission policy, used when
    # chunked prefill is disabled or ``batch_arrivals`` is set (genserve.engine.scheduler_policy).
    waiting_served_ratio: float = 1.2
    max_waiting_tokens: int = 20
    # --prefill-batching: TGI's admission policy with chunked prefill too (on by default where
    # decode steps replay CUDA graphs and a step with a prefill chunk runs eagerly).
    batch_arrivals: bool = False
    # Admission headroom (SGLang's "new token ratio").  A request joins a non-empty batch
    # only if the blocks left free afterwards cover this fraction of the tokens the running
    # requests may still generate (at most ``growth_reserve_max_tokens`` each), so that
    # admissions do not have to be undone by preemption a few steps later.  None learns the
    # fraction online: the running mean of generated / max_new_tokens over requests that
    # ended on their own (starting at 0.5).  0 admits greedily and leaves everything to
    # preemption.
    growth_reserve_ratio: float | None = None
    growth_reserve_max_tokens: int = 4096
    # --speculate: n-gram draft tokens verified per decode step (0: off).  Drafts are
    # proposed only while at most ``speculate_max_batch_size`` requests run: a small batch
    # leaves the step memory-bound, so extra rows are nearly free, while a large one is
    # compute-bound and every rejected draft costs a row of real work (vLLM's
    # ``disable_by_batch_size``; on a 2-core CPU, drafts that mostly land still paid at 32
    # streams, and a request whose drafts miss stops drafting for a while).  Requests with
    # repetition/frequency penalties never draft.
    num_speculative_tokens: int = 0
    speculate_max_batch_size: int = 32
    # Longest and shortest n-gram the proposer matches.
    speculate_ngram_max: int = 3
    speculate_ngram_min: int = 1
    # --max-loras-per-batch (SGLang): distinct LoRA adapters running at once (None: no cap).
    max_loras_per_batch: int | None = None
    # --adapter-cycle-time-s (LoRAX): while requests of an adapter wait for a place under
    # max_loras_per_batch, an adapter that has been running longer than this stops taking
    # new requests (those already running finish), so the waiting adapter gets its turn.
    adapter_cycle_time_s: float = 2.0

    def __post_init__(self) -> None:
        positive = {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_batch_prefill_tokens": self.max_batch_prefill_tokens,
            "max_waiting_tokens": self.max_waiting_tokens,
        }
        if self.chunked_prefill_size is not None:
            positive["chunked_prefill_size"] = self.chunked_prefill_size
        if self.max_num_running is not None:
            positive["max_num_running"] = self.max_num_running
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.waiting_served_ratio < 0:
            raise ValueError(f"waiting_served_ratio must be >= 0, got {self.waiting_served_ratio}")
        ratio = self.growth_reserve_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"growth_reserve_ratio must be in [0, 1], got {ratio}")
        if self.growth_reserve_max_tokens <= 0:
            raise ValueError("growth_reserve_max_tokens must be positive")
        if self.num_speculative_tokens < 0 or self.speculate_max_batch_size < 0:
            raise ValueError("num_speculative_tokens and speculate_max_batch_size must be >= 0")
        if not 1 <= self.speculate_ngram_min <= self.speculate_ngram_max:
            raise ValueError("need 1 <= speculate_ngram_min <= speculate_ngram_max")

    @property
    def max_batch_total_tokens(self) -> int:
        """KV capacity in tokens (TGI's ``--max-batch-total-tokens``)."""
        return self.num_blocks * self.block_size

    @property
    def max_chunk_tokens(self) -> int:
        """Prompt tokens one request may get in one step."""
        if not self.chunked_prefill_enabled:
            return self.max_batch_prefill_tokens
        size = self.chunked_prefill_size or self.max_batch_prefill_tokens
        return min(size, self.max_batch_prefill_tokens)
