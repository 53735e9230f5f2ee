"""Decode speed of the transformers fallback beside the native model, same weights, one
process, rounds interleaved (native, fallback, native, ...) so that load from other jobs on a
shared machine falls on both alike; prints each round and the median ratio.

    python -m genserve.bench.fallback_speed [--model-id DIR] [--dtype float32]
        [--batch 1] [--prompt-len 32] [--new-tokens 32] [--rounds 3] [--disable-cpu-kernels]

Default model: the embedded SmolLM2-135M (Llama architecture).  A bench, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence

import torch

from genserve.model.loader import resolve_model
from genserve.worker.model_runner import ModelRunner
from genserve.worker.runner_bench import BLOCK_SIZE, greedy_run, random_prompts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--disable-cpu-kernels", action="store_true")
    args = parser.parse_args(argv)
    from genserve.kernels import cpu as cpu_kernels

    if args.disable_cpu_kernels:
        cpu_kernels.configure(enabled=False)
    dtype = getattr(torch, args.dtype)
    resolved = resolve_model(args.model_id)
    runners = {}
    per_seq = -(-(args.prompt_len + args.new_tokens) // BLOCK_SIZE)
    for impl in ("auto", "transformers"):
        runner = ModelRunner(
            dataclasses.replace(resolved, model_impl=impl), dtype, torch.device("cpu")
        )
        runner.initialize_kv_cache(args.batch * per_seq + 1, BLOCK_SIZE)
        runner.warmup()
        runners[runner.serving.implementation] = runner
    prompts = random_prompts(
        runners["native"].config.vocab_size, args.batch, args.prompt_len, seed=0
    )
    rates: dict[str, list[float]] = {name: [] for name in runners}
    outputs = {}
    for round_index in range(args.rounds):
        for name, runner in runners.items():
            _, decode_s, generated = greedy_run(runner, prompts, args.new_tokens)
            rate = args.batch * (args.new_tokens - 1) / decode_s
            rates[name].append(rate)
            outputs[name] = generated
            print(f"round {round_index}: {name} {rate:.2f} tok/s", flush=True)
    native, fallback = (statistics.median(rates[n]) for n in ("native", "transformers"))
    same = outputs["native"] == outputs["transformers"]
    print(
        f"median decode tok/s, batch {args.batch}, {args.dtype}: native {native:.2f}, "
        f"transformers fallback {fallback:.2f} ({fallback / native:.2f}x); "
        f"same tokens: {same}",
        flush=True,
    )


if __name__ == "__main__":
    main()
