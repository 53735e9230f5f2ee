"""``genserve-bench adapters``: multi-LoRA throughput against the base model, side by side.

One server is launched with K random PEFT adapters preloaded (``--lora-adapters``); the same
prompts then run at the same concurrency for the base model alone and for requests spread
round-robin over K = 1, 4, 16 adapters (every step mixes them), and the generated-token
throughput of each is reported relative to the base model (LoRAX's claim: near base-model
throughput).

    genserve-bench adapters --concurrency 32 --requests 96 --rounds 3 -- --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import grpc

from genserve.bench.grpc_load import run_level
from genserve.bench.launch import LaunchedServer, split_server_args
from genserve.bench.prompts import make_prompts
from genserve.bench.records import RunResult


def make_random_adapters(
    base_dir: Path, out_dir: Path, count: int, rank: int, targets: Sequence[str]
) -> list[Path]:
    """``count`` PEFT adapters for ``base_dir`` (random, non-zero B), made with one PEFT
    model whose LoRA weights are redrawn before each save."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from genserve.model.loader import transformers_weights_kwargs

    weights = transformers_weights_kwargs(base_dir)  # a GGUF entry: read from its file
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, **weights)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    model = get_peft_model(base, config)
    dirs = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        path = out_dir / f"adapter-{i}"
        model.save_pretrained(str(path))
        dirs.append(path)
    return dirs


def _throughput(result: RunResult) -> float:
    tokens = sum(r.num_generated_tokens for r in result.records if r.error is None)
    return tokens / result.wall_s if result.wall_s > 0 else 0.0


async def _measure(
    address: str,
    concurrency: int,
    num_requests: int,
    max_new: int,
    ks: Sequence[int],
    rounds: int,
) -> list[dict[str, object]]:
    """Base model and each K, interleaved ``rounds`` times (base, K1, K4, ... per round) so
    that machine noise hits all of them alike; each row reports the median round."""
    prompts = make_prompts(max(num_requests, 64), 64, max_new, seed=0)
    samples: dict[int, list[float]] = {k: [] for k in (0, *ks)}
    failures: dict[int, int] = dict.fromkeys(samples, 0)
    async with grpc.aio.insecure_channel(address) as channel:
        # Warm-up (not measured): every adapter installed, kernels and allocator warm.
        warm = [replace(p, adapter_id=f"a{i % max(ks)}") for i, p in enumerate(prompts[:32])]
        await run_level([channel], warm, concurrency, len(warm), 600, 600, stagger=False)
        for _ in range(rounds):
            for k in samples:
                batch = [
                    replace(p, adapter_id=f"a{i % k}" if k else "") for i, p in enumerate(prompts)
                ]
                result = await run_level(
                    [channel], batch, concurrency, num_requests, 1800, 1800, name=f"k{k}"
                )
                failures[k] += sum(r.error is not None for r in result.records)
                samples[k].append(_throughput(result))
    rows: list[dict[str, object]] = [
        {"adapters": k, "tokens_per_s": statistics.median(v), "failed": failures[k]}
        for k, v in samples.items()
    ]
    base = float(rows[0]["tokens_per_s"])  # type: ignore[arg-type]
    for row, k in zip(rows, samples, strict=True):
        row["vs_base"] = float(row["tokens_per_s"]) / base if base else 0.0  # type: ignore[arg-type]
        # Per round against the same round's base run: the spread says how much to trust it.
        row["vs_base_rounds"] = [
            round(v / b, 3) if b else 0.0 for v, b in zip(samples[k], samples[0], strict=True)
        ]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args_in, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="genserve-bench adapters", description=__doc__)
    parser.add_argument("--model-dir", type=Path, help="Base model dir. Default: embedded.")
    parser.add_argument("--adapters", default="1,4,16", help="K values (adapters in the mix)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=50181)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved repeats.")
    parser.add_argument("--out", type=Path, help="Write the rows as JSON here.")
    args = parser.parse_args(args_in)
    ks = [int(k) for k in args.adapters.split(",") if k]
    if args.model_dir is None:
        from genserve.testing.tiny_model import default_tokenizer_dir

        args.model_dir = default_tokenizer_dir()
    with tempfile.TemporaryDirectory(prefix="genserve-bench-lora-") as tmp:
        dirs = make_random_adapters(
            args.model_dir, Path(tmp), max(ks), args.rank, args.targets.split(",")
        )
        preload = ",".join(f"a{i}={d}" for i, d in enumerate(dirs))
        server = LaunchedServer(
            [
                "--model-id",
                str(args.model_dir),
                "--lora-adapters",
                preload,
                "--max-active-adapters",
                str(max(ks)),
                *server_args,
            ],
            "127.0.0.1",
            args.port,
            args.threads,
            Path(tmp) / "server.log",
        )
        server.start()
        try:
            asyncio.run(server.wait_healthy(900))
            rows = asyncio.run(
                _measure(
                    server.address,
                    args.concurrency,
                    args.requests,
                    args.max_new_tokens,
                    ks,
                    args.rounds,
                )
            )
        finally:
            server.stop()
    print(f"{'adapters':>8} {'tokens/s':>10} {'vs base':>8} {'failed':>6}  per round")
    for row in rows:
        label = "base" if row["adapters"] == 0 else str(row["adapters"])
        print(
            f"{label:>8} {float(row['tokens_per_s']):>10.1f} "  # type: ignore[arg-type]
            f"{float(row['vs_base']):>8.2f} {row['failed']:>6}  "  # type: ignore[arg-type]
            f"{row['vs_base_rounds']}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 1 if any(row["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
