"""Micro-benchmark of the model runner alone (no gRPC, no scheduler), with transformers'
``generate()`` on the same weights in the same process as the baseline.

    python -m genserve.worker.runner_bench [--model-id ID] [--dtype bfloat16]
        [--batch 1 32] [--prompt-len 40] [--new-tokens 128] [--hf] [--profile]
        [--model-impl transformers] [--cpu-int-dot on] [--quantize gguf|int8|int4|none]
        [--cpu-features-mask avx2]

For each batch size: one prefill step of ``batch`` prompts, then ``new-tokens - 1`` decode
steps of the whole batch; prints decode tokens/s and ms/step.  ``--hf`` runs padded
``generate()`` with the same batch size and lengths (its figure includes its prefill, as a
server's throughput would).  ``--profile`` prints a torch-profiler table of a short run.
Machines here are shared: quote ratios from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from genserve.model.loader import ResolvedModel, resolve_model
from genserve.step import (
    NewRequestData,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from genserve.worker.model_runner import ModelRunner

BLOCK_SIZE = 16


def random_prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def greedy_run(
    runner: ModelRunner,
    prompts: list[list[int]],
    new_tokens: int,
    decode_scope: AbstractContextManager[object] | None = None,
) -> tuple[float, float, list[list[int]]]:
    """Prefill ``prompts`` in one step, then ``new_tokens - 1`` greedy decode steps of all of
    them (inside ``decode_scope``, e.g. a profiler).  Returns the seconds of the prefill step
    and of the decode steps, and each prompt's generated ids.  The KV cache must hold
    ``len(prompts) * ceil((longest prompt + new_tokens) / BLOCK_SIZE)`` blocks."""
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    ids = [f"bench-{i}" for i in range(len(prompts))]
    new = tuple(
        NewRequestData(r, tuple(p), len(p), 0, SamplingParams())
        for r, p in zip(ids, prompts, strict=True)
    )
    chunks = tuple(
        ScheduledChunk(r, tuple(p), 0, t, True)
        for r, p, t in zip(ids, prompts, tables, strict=True)
    )
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    start = time.perf_counter()
    out = runner.execute_model(SchedulerOutput(0, chunks, new))
    with decode_scope or nullcontext():
        prefilled = time.perf_counter()
        for step in range(1, new_tokens):
            for s in out.sampled:
                tokens[s.req_id].append(s.token_id)
            chunks = tuple(
                ScheduledChunk(r, (tokens[r][-1],), len(p) + step - 1, t, True)
                for r, p, t in zip(ids, prompts, tables, strict=True)
            )
            out = runner.execute_model(SchedulerOutput(step, chunks))
        done = time.perf_counter()
    for s in out.sampled:
        tokens[s.req_id].append(s.token_id)
    runner.execute_model(SchedulerOutput(new_tokens, (), finished_req_ids=tuple(ids)))
    return prefilled - start, done - prefilled, [tokens[r] for r in ids]


def _decode_run(
    runner: ModelRunner,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    seed: int,
    decode_scope: AbstractContextManager[object] | None = None,
) -> tuple[float, float]:
    """Seconds spent in the prefill step and in the decode steps of random prompts."""
    prompts = random_prompts(runner.config.vocab_size, batch, prompt_len, seed)
    prefill_s, decode_s, _ = greedy_run(runner, prompts, new_tokens, decode_scope)
    return prefill_s, decode_s


def _hf_run(
    model_dir: Path, dtype: torch.dtype, batch: int, prompt_len: int, new_tokens: int
) -> float:
    """Generated tokens/s of padded batched ``generate()`` (prefill included)."""
    from transformers import AutoModelForCausalLM

    from genserve.model.loader import transformers_weights_kwargs

    weights = transformers_weights_kwargs(model_dir)  # a GGUF entry: read from its file
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **weights).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, model.config.vocab_size, (batch, prompt_len), generator=gen)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        elapsed = time.perf_counter() - start
    return batch * new_tokens / elapsed


def default_quantize(
    requested: str | None, resolved: ResolvedModel, device: torch.device
) -> str | None:
    """The server's ``--quantize`` default (config.py): a .gguf model on CPU keeps its
    blocks ("gguf"); otherwise the model dtype.  Without it a GGUF file was timed through a
    bfloat16 copy of its weights (1B Q4_0: 71.6 ms a step against the server's ~26)."""
    if requested == "none":
        return None
    if requested is None and resolved.gguf_file is not None and device.type == "cpu":
        return "gguf"
    return requested


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
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4", "gguf", "none"],
        default=None,
        help="as the server's; default as the server's: gguf for a .gguf model on CPU, else none",
    )
    parser.add_argument(
        "--model-impl",
        choices=["auto", "transformers"],
        default="auto",
        help="transformers: the transformers fallback even for a native architecture",
    )
    parser.add_argument("--profile-out", type=Path, default=None, help="write the table here")
    parser.add_argument(
        "--disable-cpu-kernels", action="store_true", help="torch ops only (A/B the kernels)"
    )
    parser.add_argument(
        "--deterministic", action="store_true", help="batch-invariant kernels (A/B their cost)"
    )
    parser.add_argument(
        "--cpu-int-dot", choices=["off", "auto", "on"], default="auto", help="as the server's"
    )
    parser.add_argument(
        "--cpu-features-mask",
        default=os.environ.get("GENSERVE_CPU_FEATURES_MASK", ""),
        help="CPU features the kernels treat as absent, as the server's (avx2: an AVX2-only "
        "CPU's kernels on this one)",
    )
    args = parser.parse_args(argv)
    from genserve.kernels import int_dot
    from genserve.kernels.cpu_features import parse_mask

    try:
        hidden = parse_mask(args.cpu_features_mask)
    except ValueError as exc:  # a typo must not time the full CPU's kernels under its label
        parser.error(f"--cpu-features-mask: {exc}")
    int_dot.configure(args.cpu_int_dot, args.dtype)
    if args.disable_cpu_kernels or args.deterministic or hidden:
        from genserve.kernels import cpu as cpu_kernels

        cpu_kernels.configure(
            enabled=not args.disable_cpu_kernels,
            batch_invariant=args.deterministic,
            hidden_features=hidden,
        )
        if hidden:
            print(f"hidden CPU features: {','.join(hidden)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    resolved: ResolvedModel = resolve_model(args.model_id, cache_dir=args.cache_dir)
    device = torch.device(args.device)
    quantize = default_quantize(args.quantize, resolved, device)
    resolved = dataclasses.replace(resolved, quantize=quantize, model_impl=args.model_impl)
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
        from genserve.worker.step_profile import StepProfiler

        if device.type == "cuda":
            # GPU: the raw op table with CUDA kernel times (the CPU-side part grouping below
            # would only show launch overhead there).
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _decode_run(
                    runner, max(args.batch), args.prompt_len, min(16, args.new_tokens), seed=2
                )
            tables = [prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)]
        else:
            steps = min(16, args.new_tokens)
            tables = []
            for batch in args.batch:
                profiler = StepProfiler(runner)
                _decode_run(runner, batch, args.prompt_len, steps, seed=2, decode_scope=profiler)
                title = f"decode profile, {args.dtype}, batch {batch}"
                tables.append(profiler.result(steps - 1).table(title))
        for table in tables:
            print(table, flush=True)
        if args.profile_out is not None:
            args.profile_out.parent.mkdir(parents=True, exist_ok=True)
            args.profile_out.write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
