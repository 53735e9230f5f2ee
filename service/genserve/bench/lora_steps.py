"""Multi-LoRA cost in the model runner alone (no gRPC, no scheduler): decode steps of
``--batch`` rows spread round-robin over K adapters against the base model, interleaved.

    python -m genserve.bench.lora_steps [--model-id DIR] [--dtype bfloat16] [--batch 32]
        [--adapters 1,4,16] [--rank 8] [--targets q_proj,k_proj,v_proj,o_proj] [--rounds 3]

Each round runs the base model and every K once (same prompts, same lengths), so machine
noise hits all of them alike; reported: median ms per decode step and throughput relative
to the base model.  What ``genserve-bench adapters`` measures end to end, minus the server.
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


def decode_ms_per_step(
    runner: ModelRunner, refs: Sequence[AdapterRef | None], prompt_len: int, steps: int
) -> float:
    """Prefill one prompt per row (row ``i`` uses ``refs[i]``), then time ``steps`` decode
    steps of all rows; returns ms per decode step."""
    batch = len(refs)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    prompts = [
        torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)
    ]
    per_seq = -(-(prompt_len + steps + 1) // BLOCK_SIZE)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = [f"lora-bench-{i}" for i in range(batch)]
    new = tuple(
        NewRequestData(r, tuple(p), prompt_len, 0, SamplingParams(), adapter=ref)
        for r, p, ref in zip(ids, prompts, refs, strict=True)
    )
    chunks = tuple(
        ScheduledChunk(r, tuple(p), 0, t, True)
        for r, p, t in zip(ids, prompts, tables, strict=True)
    )
    out = runner.execute_model(SchedulerOutput(0, chunks, new))
    start = time.perf_counter()
    for step in range(1, steps + 1):
        last = {s.req_id: s.token_id for s in out.sampled}
        pos = prompt_len + step - 1
        chunks = tuple(
            ScheduledChunk(r, (last[r],), pos, t, True) for r, t in zip(ids, tables, strict=True)
        )
        out = runner.execute_model(SchedulerOutput(step, chunks))
    elapsed = time.perf_counter() - start
    runner.execute_model(SchedulerOutput(steps + 1, (), (), finished_req_ids=tuple(ids)))
    return elapsed / steps * 1000


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
    parser.add_argument("--rounds", type=int, default=3)
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
    runner.initialize_kv_cache(args.batch * per_seq, BLOCK_SIZE)
    with tempfile.TemporaryDirectory(prefix="genserve-lora-steps-") as tmp:
        dirs = make_random_adapters(
            model_dir, Path(tmp), max(ks), args.rank, args.targets.split(",")
        )
        refs = [AdapterRef(i, f"a{i}", str(d)) for i, d in enumerate(dirs)]
        mixes = {k: [refs[i % k] if k else None for i in range(args.batch)] for k in (0, *ks)}
        for mix in mixes.values():  # warm-up: adapters installed, allocator warm
            decode_ms_per_step(runner, mix, args.prompt_len, 2)
        samples: dict[int, list[float]] = {k: [] for k in mixes}
        for _ in range(args.rounds):
            for k, mix in mixes.items():
                samples[k].append(decode_ms_per_step(runner, mix, args.prompt_len, args.steps))
    base = statistics.median(samples[0])
    print(f"{dtype}, {args.batch} decode rows, rank {args.rank} {args.targets}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'adapters':>8} {'ms/step':>8} {'vs base':>8}  per round")
    for k, values in samples.items():
        ms = statistics.median(values)
        rounds = [round(b / v, 3) for b, v in zip(samples[0], values, strict=True)]
        print(f"{k or 'base':>8} {ms:>8.1f} {base / ms:>8.2f}  {rounds}")


if __name__ == "__main__":
    main()
