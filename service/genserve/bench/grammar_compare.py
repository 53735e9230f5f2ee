"""``genserve-bench grammar``: constrained vs unconstrained decoding throughput, one run.

The same prompts run at each concurrency level unconstrained and with every request
following a JSON schema (built-in, or ``--schema``), side by side: the two alternate within
each round (ABBA order over ``--rounds`` rounds, so drift and noise from other processes hit
both alike), and the median of the per-round ratios is reported.  Constrained outputs end
when the grammar completes, so throughput (generated tokens over wall time), not request
latency, is what compares.  Either drives a running server (``--address``) or launches one
(arguments after ``--`` go to ``genserve``; default: the embedded SmolLM2-135M).

    genserve-bench grammar --concurrency 1,32 --rounds 3 -- --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grpc

from genserve.bench.grpc_load import run_level
from genserve.bench.launch import LaunchedServer, split_server_args
from genserve.bench.prompts import Prompt
from genserve.bench.records import RequestRecord

BUILTIN_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "rating": {"type": "number"},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "year", "genres", "rating", "summary"],
    "additionalProperties": False,
}
PROMPT = "<|im_start|>user\nDescribe film number {} as JSON.<|im_end|>\n<|im_start|>assistant\n"


def _throughput(records: Sequence[RequestRecord], wall_s: float) -> float:
    tokens = sum(r.num_generated_tokens for r in records)
    return tokens / wall_s if wall_s > 0 else 0.0


async def _rate(channel: grpc.aio.Channel, prompts: list[Prompt], concurrency: int) -> float:
    result = await run_level([channel], prompts, concurrency, len(prompts), 600.0, 600.0)
    errors = [r.error for r in result.records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    return _throughput(result.records, result.wall_s)


async def compare(
    address: str,
    schema: str,
    levels: Sequence[int],
    max_new: int,
    rounds: int,
    requests_per_stream: int = 2,
) -> list[dict[str, float]]:
    """One row per concurrency level: median tokens/s both ways and the median ratio."""
    rows = []
    channel = grpc.aio.insecure_channel(address)
    try:
        for concurrency in levels:
            n = max(requests_per_stream * concurrency, 4)
            plain = [Prompt(i, PROMPT.format(i), 0, max_new) for i in range(n)]
            constrained = [dataclasses.replace(p, json_schema=schema) for p in plain]
            # Warm-up, not measured: the schema's compilation and the first steps' allocations.
            await _rate(channel, constrained[:1], 1)
            await _rate(channel, plain[:1], 1)
            plain_rates, grammar_rates = [], []
            for r in range(rounds):
                order = ("plain", "grammar") if r % 2 == 0 else ("grammar", "plain")
                for which in order:
                    if which == "plain":
                        plain_rates.append(await _rate(channel, plain, concurrency))
                    else:
                        grammar_rates.append(await _rate(channel, constrained, concurrency))
            ratios = [g / p for g, p in zip(grammar_rates, plain_rates, strict=True) if p > 0]
            row = {
                "streams": float(concurrency),
                "unconstrained_tok_s": statistics.median(plain_rates),
                "constrained_tok_s": statistics.median(grammar_rates),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
            rows.append(row)
            print(
                f"streams={concurrency:3d} unconstrained={row['unconstrained_tok_s']:8.1f} tok/s "
                f"constrained={row['constrained_tok_s']:8.1f} tok/s ratio={row['ratio']:.2f} "
                f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})",
                flush=True,
            )
    finally:
        await channel.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args_in, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="genserve-bench grammar", description=__doc__)
    p.add_argument("--address", help="a running server (default: launch one)")
    p.add_argument("--schema", type=Path, help="JSON schema file (default: a built-in one)")
    p.add_argument("--concurrency", default="1,32", help="stream counts, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternating repetitions per level")
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per measurement")
    p.add_argument("--port", type=int, default=50182, help="port of the launched server")
    p.add_argument("--threads", type=int, default=2, help="OMP threads of the launched server")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(args_in)
    schema = args.schema.read_text() if args.schema else json.dumps(BUILTIN_SCHEMA)
    levels = [int(c) for c in args.concurrency.split(",") if c]

    def run(address: str) -> list[dict[str, float]]:
        return asyncio.run(
            compare(
                address,
                schema,
                levels,
                args.max_new_tokens,
                args.rounds,
                args.requests_per_stream,
            )
        )

    if args.address:
        rows = run(args.address)
    else:
        with tempfile.TemporaryDirectory(prefix="genserve-bench-grammar-") as tmp:
            server = LaunchedServer(
                server_args, "127.0.0.1", args.port, args.threads, Path(tmp) / "server.log"
            )
            server.start()
            try:
                asyncio.run(server.wait_healthy(900))
                rows = run(server.address)
            except BaseException:
                print(server.log_tail(), file=sys.stderr)
                raise
            finally:
                server.stop()
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
