"""Multi-LoRA cost in the model runner alone (no gRPC, no scheduler): decode steps of
``--batch`` rows spread round-robin over K adapters against the base model, interleaved.

    python -m genserve.bench.lora_steps [--model-id DIR] [--dtype bfloat16] [--batch 32]
        [--adapters 1,4,16] [--rank 8] [--targets q_proj,k_proj,v_proj,o_proj] [--steps 24]

All batches live in the runner at once (own requests and KV blocks) and take decode steps
in turn (base, K=1, K=4, ...), so drift in the machine's load hits all of them alike;
reported: median ms per decode step and throughput relative to the base model.  What
``genserve-bench adapters`` measures end to end, minus the server.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from genserve.step import (
    AdapterRef,
    NewRequestData,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from genserve.worker.model_runner import ModelRunner

BLOCK_SIZE = 16


class DecodeBatch:
    """``len(refs)`` requests (row ``i`` uses ``refs[i]``) with their own KV blocks from
    ``first_block``, prefilled at construction; :meth:`step` times one decode step."""

    def __init__(
        self,
        runner: ModelRunner,
        name: str,
        refs: Sequence[AdapterRef | None],
        prompt_len: int,
        steps: int,
        first_block: int,
    ) -> None:
        self.runner = runner
        gen = torch.Generator().manual_seed(0)
        vocab = runner.config.vocab_size
        prompts = [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in refs]
        per_seq = -(-(prompt_len + steps + 1) // BLOCK_SIZE)
        self.tables = [
            tuple(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
            for i in range(len(refs))
        ]
        self.num_blocks = per_seq * len(refs)
        self.ids = [f"{name}-{i}" for i in range(len(refs))]
        new = tuple(
            NewRequestData(r, tuple(p), prompt_len, 0, SamplingParams(), adapter=ref)
            for r, p, ref in zip(self.ids, prompts, refs, strict=True)
        )
        chunks = tuple(
            ScheduledChunk(r, tuple(p), 0, t, True)
            for r, p, t in zip(self.ids, prompts, self.tables, strict=True)
        )
        self.out = runner.execute_model(SchedulerOutput(0, chunks, new))
        self.pos = prompt_len

    def step(self) -> float:
        """One decode step of every row; its wall time in ms."""
        last = {s.req_id: s.token_id for s in self.out.sampled}
        chunks = tuple(
            ScheduledChunk(r, (last[r],), self.pos, t, True)
            for r, t in zip(self.ids, self.tables, strict=True)
        )
        start = time.perf_counter()
        self.out = self.runner.execute_model(SchedulerOutput(self.pos, chunks))
        self.pos += 1
        return (time.perf_counter() - start) * 1000


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m genserve.bench.lora_steps")
    parser.add_argument("--model-id", type=Path, help="Model dir. Default: embedded.")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    from genserve.bench.adapters import make_random_adapters
    from genserve.dtype_choice import choose_dtype
    from genserve.model.loader import resolve_model
    from genserve.testing.tiny_model import default_tokenizer_dir

    model_dir = args.model_id or default_tokenizer_dir()
    dtype = getattr(torch, choose_dtype(args.dtype, on_cuda=False).name)
    ks = [int(k) for k in args.adapters.split(",") if k]
    runner = ModelRunner(resolve_model(str(model_dir)), dtype, torch.device("cpu"))
    per_seq = -(-(args.prompt_len + args.steps + 1) // BLOCK_SIZE)
    mixes_count = 1 + len(ks)
    runner.initialize_kv_cache(mixes_count * args.batch * per_seq, BLOCK_SIZE)
    with tempfile.TemporaryDirectory(prefix="genserve-lora-steps-") as tmp:
        dirs = make_random_adapters(
            model_dir, Path(tmp), max(ks), args.rank, args.targets.split(",")
        )
        refs = [AdapterRef(i, f"a{i}", str(d)) for i, d in enumerate(dirs)]
        batches: dict[int, DecodeBatch] = {}
        first_block = 0
        for k in (0, *ks):
            mix = [refs[i % k] if k else None for i in range(args.batch)]
            batches[k] = DecodeBatch(runner, f"k{k}", mix, args.prompt_len, args.steps, first_block)
            first_block += batches[k].num_blocks
        for batch in batches.values():  # warm-up: adapters installed, allocator warm
            batch.step()
        # Step by step in turn (base, K1, K4, ...): drift in the machine's load hits all.
        samples: dict[int, list[float]] = {k: [] for k in batches}
        for _ in range(args.steps - 1):
            for k, batch in batches.items():
                samples[k].append(batch.step())
    base = statistics.median(samples[0])
    print(f"{dtype}, {args.batch} decode rows, rank {args.rank} {args.targets}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'adapters':>8} {'ms/step':>8} {'vs base':>8}  (median of {args.steps - 1} steps)")
    for k, values in samples.items():
        ms = statistics.median(values)
        print(f"{k or 'base':>8} {ms:>8.1f} {base / ms:>8.2f}")


if __name__ == "__main__":
    main()
