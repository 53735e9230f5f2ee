"""``genserve-bench grammar``: constrained vs unconstrained decoding throughput, in one run.

At each stream count the same prompts run unconstrained and with every request following a
JSON schema (built-in, or ``--schema``), alternating ``--repeats`` times (plain, constrained,
plain, constrained, ...) so that load from anything else on the machine falls on both alike;
the report gives generated tokens per second of each run, the medians and their ratio
(issue #15's target: constrained >= 0.8x unconstrained).  Constrained outputs end when the
grammar completes, so throughput (tokens over wall time), not request latency, is compared.

    genserve-bench grammar --launch --concurrency 1,32 --repeats 3
    genserve-bench grammar --address 127.0.0.1:50051 --schema schema.json
    python -m genserve.bench.grammar_compare ...          # the same

Everything after ``--`` is passed to ``genserve`` when ``--launch`` is given.
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
from typing import Any

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
Row = dict[str, Any]  # one level: summarize()'s keys
PROMPT = "<|im_start|>user\nDescribe film number {} as JSON.<|im_end|>\n<|im_start|>assistant\n"


def _throughput(records: Sequence[RequestRecord], wall_s: float) -> float:
    tokens = sum(r.num_generated_tokens for r in records)
    return tokens / wall_s if wall_s > 0 else 0.0


def summarize(concurrency: int, plain: Sequence[float], constrained: Sequence[float]) -> Row:
    """One level's row: every run's tokens/s, the medians and constrained / unconstrained."""
    p, c = statistics.median(plain), statistics.median(constrained)
    return {
        "streams": concurrency,
        "unconstrained_tok_s": list(plain),
        "constrained_tok_s": list(constrained),
        "unconstrained_median": p,
        "constrained_median": c,
        "ratio": c / p if p > 0 else 0.0,
    }


async def compare(
    address: str,
    schema: str,
    levels: Sequence[int],
    max_new: int,
    repeats: int,
    temperature: float = 0.0,
) -> list[Row]:
    """Run every level; returns :func:`summarize`'s rows (raises when a request failed)."""
    rows = []
    async with grpc.aio.insecure_channel(address) as channel:
        for concurrency in levels:
            n = max(2 * concurrency, 4)
            plain = [Prompt(i, PROMPT.format(i), 0, max_new, temperature) for i in range(n)]
            constrained = [dataclasses.replace(p, json_schema=schema) for p in plain]
            # Unmeasured: the schema's compilation, and a first batch warming the allocator.
            for prompts in (constrained[:concurrency], plain[:concurrency]):
                await run_level(
                    [channel], prompts, concurrency, concurrency, 600, 600, stagger=False
                )
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for is_constrained, prompts in ((False, plain), (True, constrained)):
                    result = await run_level([channel], prompts, concurrency, n, 1800, 1800)
                    errors = [r.error for r in result.records if r.error]
                    if errors:
                        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
                    rates[is_constrained].append(_throughput(result.records, result.wall_s))
            row = summarize(concurrency, rates[False], rates[True])
            print(
                f"streams={concurrency:3d} "
                f"unconstrained={row['unconstrained_median']:8.1f} tok/s "
                f"constrained={row['constrained_median']:8.1f} tok/s "
                f"ratio={row['ratio']:.2f}  (runs: "
                + ", ".join(
                    f"{p:.1f}/{c:.1f}" for p, c in zip(rates[False], rates[True], strict=True)
                )
                + ")",
                flush=True,
            )
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, server_args = args_in[:cut], args_in[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="genserve-bench grammar",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--address", default="127.0.0.1:50051", help="server (without --launch)")
    p.add_argument("--launch", action="store_true", help="start genserve (args after --)")
    p.add_argument("--port", type=int, default=50191, help="port of the launched server")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the launched server")
    p.add_argument("--schema", type=Path, help="JSON schema file (default: a built-in one)")
    p.add_argument("--concurrency", default="1,32", help="comma-separated stream counts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each mode")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(args_in)
    if server_args and not args.launch:
        p.error("arguments after -- are for --launch")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        p.error("--concurrency, --repeats and --max-new-tokens must be positive")
    schema = args.schema.read_text() if args.schema else json.dumps(BUILTIN_SCHEMA)

    def run(address: str) -> list[Row]:
        return asyncio.run(
            compare(address, schema, levels, args.max_new_tokens, args.repeats, args.temperature)
        )

    if args.launch:
        from genserve.bench.launch import LaunchedServer

        with tempfile.TemporaryDirectory(prefix="genserve-bench-grammar-") as tmp:
            server = LaunchedServer(
                server_args, "127.0.0.1", args.port, args.threads, Path(tmp) / "server.log"
            )
            server.start()
            try:
                asyncio.run(server.wait_healthy(900))
                rows = run(server.address)
            finally:
                server.stop()
    else:
        rows = run(args.address)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
