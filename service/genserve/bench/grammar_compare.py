"""Constrained vs unconstrained decoding throughput against a running server, in one run:
``python -m genserve.bench.grammar_compare --address HOST:PORT [--schema FILE]``.

Each concurrency level runs the same prompts twice, unconstrained and with every request
following the JSON schema (built-in, or ``--schema``), and prints generated tokens per
second of both and their ratio.  Constrained outputs end when the grammar completes, so
throughput (tokens over wall time), not request latency, is what compares."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import grpc

from genserve.bench.grpc_load import run_level
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


async def _compare(address: str, schema: str, levels: Sequence[int], max_new: int) -> None:
    channel = grpc.aio.insecure_channel(address)
    try:
        for concurrency in levels:
            n = max(2 * concurrency, 4)
            plain = [Prompt(i, PROMPT.format(i), 0, max_new) for i in range(n)]
            constrained = [dataclasses.replace(p, json_schema=schema) for p in plain]
            # One constrained request first: the schema's compilation is not measured.
            await run_level([channel], constrained[:1], 1, 1, 600.0, 600.0, stagger=False)
            rates = []
            for prompts in (plain, constrained):
                result = await run_level([channel], prompts, concurrency, n, 600.0, 600.0)
                errors = [r.error for r in result.records if r.error]
                if errors:
                    raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
                rates.append(_throughput(result.records, result.wall_s))
            print(
                f"streams={concurrency:3d} unconstrained={rates[0]:8.1f} tok/s "
                f"constrained={rates[1]:8.1f} tok/s ratio={rates[1] / rates[0]:.2f}",
                flush=True,
            )
    finally:
        await channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m genserve.bench.grammar_compare")
    p.add_argument("--address", required=True)
    p.add_argument("--schema", type=Path, help="JSON schema file (default: a built-in one)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    schema = args.schema.read_text() if args.schema else json.dumps(BUILTIN_SCHEMA)
    asyncio.run(_compare(args.address, schema, args.concurrency, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
