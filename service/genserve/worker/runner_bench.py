"""Micro-benchmark of the model runner alone (no gRPC, no scheduler), with transformers'
``generate()`` on the same weights in the same process as the baseline.

    python -m genserve.worker.runner_bench [--model-id ID] [--dtype bfloat16]
        [--batch 1 32] [--prompt-len 40] [--new-tokens 128] [--hf] [--profile]

For each batch size: one prefill step of ``batch`` prompts, then ``new-tokens - 1`` decode
steps of the whole batch; prints decode tokens/s and ms/step.  ``--hf`` runs padded
``generate()`` with the same batch size and lengths (its figure includes its prefill, as a
server's throughput would).  ``--profile`` prints a torch-profiler table of a short run.
Machines here are shared: quote ratios from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from genserve.model.loader import ResolvedModel, resolve_model
from genserve.step import NewRequestData, SamplingParams, ScheduledChunk, SchedulerOutput
from genserve.worker.model_runner import ModelRunner

BLOCK_SIZE = 16


def _decode_run(
    runner: ModelRunner, batch: int, prompt_len: int, new_tokens: int, seed: int
) -> tuple[float, float]:
    """Seconds spent in the prefill step and in the decode steps."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    prompts = [
        torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)
    ]
    per_seq = -(-(prompt_len + new_tokens) // BLOCK_SIZE)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = [f"bench-{i}" for i in range(batch)]
    new = tuple(
        NewRequestData(r, tuple(p), prompt_len, 0, SamplingParams())
        for r, p in zip(ids, prompts, strict=True)
    )
    chunks = tuple(
        ScheduledChunk(r, tuple(p), 0, t, True)
        for r, p, t in zip(ids, prompts, tables, strict=True)
    )
    start = time.perf_counter()
    out = runner.execute_model(SchedulerOutput(0, chunks, new))
    prefilled = time.perf_counter()
    for step in range(1, new_tokens):
        last = {s.req_id: s.token_id for s in out.sampled}
        pos = prompt_len + step - 1
        chunks = tuple(
            ScheduledChunk(r, (last[r],), pos, t, True) for r, t in zip(ids, tables, strict=True)
        )
        out = runner.execute_model(SchedulerOutput(step, chunks))
    done = time.perf_counter()
    runner.execute_model(SchedulerOutput(new_tokens, (), finished_req_ids=tuple(ids)))
    return prefilled - start, done - prefilled


def _hf_run(
    model_dir: Path, dtype: torch.dtype, batch: int, prompt_len: int, new_tokens: int
) -> float:
    """Generated tokens/s of padded batched ``generate()`` (prefill included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, model.config.vocab_size, (batch, prompt_len), generator=gen)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        elapsed = time.perf_counter() - start
    return batch * new_tokens / elapsed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None)
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "genserve" / "models"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--hf", action="store_true", help="also run transformers generate()")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--cuda-graphs",
        default="0",
        help="decode batch sizes captured as CUDA graphs (0: eager), e.g. 1,32,64",
    )
    parser.add_argument("--profile-out", type=Path, default=None, help="write the table here")
    parser.add_argument(
        "--disable-cpu-kernels", action="store_true", help="torch ops only (A/B the kernels)"
    )
    args = parser.parse_args(argv)
    if args.disable_cpu_kernels:
        from genserve.kernels import cpu as cpu_kernels

        cpu_kernels.configure(enabled=False)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    resolved: ResolvedModel = resolve_model(args.model_id, cache_dir=args.cache_dir)
    device = torch.device(args.device)
    runner = ModelRunner(resolved, dtype, device)
    per_seq = -(-(args.prompt_len + args.new_tokens) // BLOCK_SIZE)
    from genserve.worker.cuda_graphs import parse_batch_sizes

    graph_sizes = parse_batch_sizes(args.cuda_graphs)
    if graph_sizes:
        runner.enable_cuda_graphs(graph_sizes, per_seq * BLOCK_SIZE, BLOCK_SIZE)
    runner.initialize_kv_cache(max(args.batch) * per_seq + 1, BLOCK_SIZE)
    runner.warmup()
    print(f"cuda graphs: {list(runner.cuda_graph_sizes) or 'off'}", flush=True)
    for batch in args.batch:
        _decode_run(runner, batch, args.prompt_len, 8, seed=0)  # first-touch of this shape
        prefill_s, decode_s = _decode_run(runner, batch, args.prompt_len, args.new_tokens, seed=1)
        steps = args.new_tokens - 1
        total = batch * args.new_tokens / (prefill_s + decode_s)
        print(
            f"genserve {args.dtype} batch {batch}: decode {batch * steps / decode_s:.1f} tok/s "
            f"({decode_s / steps * 1000:.1f} ms/step), prefill {prefill_s * 1000:.0f} ms, "
            f"overall {total:.1f} tok/s",
            flush=True,
        )
        if args.hf:
            rate = _hf_run(resolved.local_dir, dtype, batch, args.prompt_len, args.new_tokens)
            print(
                f"transformers generate() {args.dtype} batch {batch}: {rate:.1f} tok/s", flush=True
            )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        sort_by = "self_cpu_time_total"
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            sort_by = "self_cuda_time_total"
        with profile(activities=activities) as prof:
            _decode_run(runner, max(args.batch), args.prompt_len, min(16, args.new_tokens), seed=2)
        table = prof.key_averages().table(sort_by=sort_by, row_limit=30)
        print(table)
        if args.profile_out is not None:
            args.profile_out.parent.mkdir(parents=True, exist_ok=True)
            args.profile_out.write_text(table + "\n")


if __name__ == "__main__":
    main()
