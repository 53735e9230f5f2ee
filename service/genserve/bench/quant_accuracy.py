"""``genserve-bench quant-accuracy``: what weight quantization costs in accuracy, measured
through a real server over gRPC against a float32 baseline (issue #14).

Each configuration is a list of extra ``genserve`` flags (built in: ``float32``, ``bfloat16``,
``int8``, ``int4``, ``gguf``; ``--config NAME='FLAGS'`` adds others).  One server is
launched per configuration, one after the other (never two at once), with a small KV cache
(``--max-batch-total-tokens``), and the baseline (``--baseline``, default float32) always
runs first.  Requests go one at a time, so batch composition never enters the comparison.
Three measures per configuration:

1. Greedy agreement: the fixed prompts (:data:`~genserve.bench.accuracy_texts.PROMPTS`, varied:
   prose, code, lists, arithmetic, chat-formatted questions) decoded greedily for
   ``--max-new-tokens``.  Reported: the fraction of prompts whose generated token ids equal the
   baseline's exactly, and the mean over prompts of the agreeing prefix (tokens identical before
   the first divergence, over the longer of the two outputs).
2. Teacher-forced logprob deltas: each prompt followed by the *baseline's* greedy
   continuation, sent as token ids (``input_ids``) with ``decoder_input_details`` and
   ``max_new_tokens=1``; the prompt logprobs at the continuation positions are compared with
   the baseline's own teacher-forced logprobs of the same ids: mean and max ``|Δ logprob|``
   over all those positions.  Every configuration sees the same tokens, so one early
   divergence does not make the rest of a greedy output incomparable.
3. Perplexity of a fixed text (:data:`~genserve.bench.accuracy_texts.PASSAGE`, the opening of
   *Pride and Prejudice*, public domain; ``--text-file`` to use another), tokenized once by the
   baseline server and sent as the same ids everywhere: ``exp(-mean logprob)`` over every token
   after the first.  A famous text is partly memorized, which lowers the perplexity itself; the
   ratio to the baseline is what compares.

The default model is the embedded SmolLM2-135M-Instruct, a Q4_1 GGUF: ``float32`` serves its
dequantized weights, so ``gguf`` (keeping Q4_1) should match float32 up to compute order, and
``int8``/``int4`` re-quantize weights that were already 4-bit.  Writes ``--out`` (JSON: the
summary rows and every per-prompt measurement) and prints a markdown table, with each
server's weight size where its Info reports ``model_weight_bytes``.

    genserve-bench quant-accuracy --configs float32,int8,int4,gguf --out quant-accuracy.json
    genserve-bench quant-accuracy --configs float32,bfloat16 --max-new-tokens 16
    genserve-bench quant-accuracy --configs float32,gguf,gguf-int-dot   # --cpu-int-dot cost

``--llama-cpp`` (a ``--model-id`` that is a ``.gguf`` file) adds full next-token
distributions over the first ``--dist-tokens`` ids of the passage, from every configuration
and from ``llama-server`` on the same file, each compared with the baseline's: top-1
agreement, mean KL divergence and the perplexity ratio (:mod:`genserve.bench.dist_compare`).

    genserve-bench quant-accuracy --model-id FILE.gguf --configs float32,gguf,gguf-int-dot \
        --llama-cpp --out accuracy.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from genserve.bench import dist_compare
from genserve.bench.accuracy_texts import PASSAGE, PROMPTS
from genserve.bench.launch import LaunchedServer, split_server_args
from genserve.v1 import generate_pb2, generate_pb2_grpc

# Extra server flags of each built-in configuration.
BUILTIN_CONFIGS: dict[str, tuple[str, ...]] = {
    # --quantize none: a .gguf model (the default one) keeps its blocks on CPU otherwise.
    "float32": ("--dtype", "float32", "--quantize", "none"),
    "bfloat16": ("--dtype", "bfloat16", "--quantize", "none"),
    # The float path by name: the integer kernels are the default where the CPU has them.
    "int8": ("--dtype", "float32", "--quantize", "int8", "--cpu-int-dot", "off"),
    "int4": ("--dtype", "float32", "--quantize", "int4", "--cpu-int-dot", "off"),
    "gguf": ("--dtype", "float32", "--quantize", "gguf", "--cpu-int-dot", "off"),
    # The same weights through the integer dot-product kernels (activations rounded to int8
    # per block of 32, issue #28): what that rounding costs, beside the float path above.
    "int8-int-dot": ("--dtype", "float32", "--quantize", "int8", "--cpu-int-dot", "on"),
    "int4-int-dot": ("--dtype", "float32", "--quantize", "int4", "--cpu-int-dot", "on"),
    "gguf-int-dot": ("--dtype", "float32", "--quantize", "gguf", "--cpu-int-dot", "on"),
}
DEFAULT_CONFIGS = ("float32", "int8", "int4", "gguf")

# ---------------------------------------------------------------------------------------------
# Pure measures (unit-tested without a server)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(base: Sequence[int], other: Sequence[int]) -> tuple[bool, float]:
    """(exact match, agreeing-prefix fraction) of one output against the baseline's.

    The fraction is over the longer of the two, so an output that stops early (or runs on)
    is not counted as agreeing; two empty outputs agree fully.
    """
    longest = max(len(base), len(other))
    if longest == 0:
        return True, 1.0
    return list(base) == list(other), common_prefix_len(base, other) / longest


def abs_deltas(base: Sequence[float], other: Sequence[float]) -> list[float]:
    """``|other - base|`` position by position; the two must be equally long."""
    if len(base) != len(other):
        raise ValueError(f"logprob lists differ in length: {len(base)} vs {len(other)}")
    return [abs(o - b) for b, o in zip(base, other, strict=True)]


def perplexity(logprobs: Sequence[float]) -> float:
    """``exp(-mean(logprobs))``: natural-log probabilities of each predicted token."""
    if not logprobs:
        raise ValueError("perplexity of no tokens")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


@dataclass(slots=True)
class ConfigResult:
    """What one configuration's server answered."""

    name: str
    server_args: list[str]
    model_id: str = ""
    model_dtype: str = ""
    weight_bytes: int = 0  # Info.model_weight_bytes where the server reports it, else 0
    prompt_ids: list[list[int]] = field(default_factory=list)  # the server's tokenization
    generated_ids: list[list[int]] = field(default_factory=list)  # greedy, per prompt
    generated_text: list[str] = field(default_factory=list)
    forced_logprobs: list[list[float]] = field(default_factory=list)  # baseline continuation
    passage_logprobs: list[float] = field(default_factory=list)  # tokens after the first


def summarize(base: ConfigResult, other: ConfigResult) -> dict[str, float | str]:
    """One table row: ``other`` against ``base`` (``base`` against itself gives the ideal)."""
    pairs = [agreement(b, o) for b, o in zip(base.generated_ids, other.generated_ids, strict=True)]
    deltas = [
        d
        for b, o in zip(base.forced_logprobs, other.forced_logprobs, strict=True)
        for d in abs_deltas(b, o)
    ]
    ppl = perplexity(other.passage_logprobs)
    base_ppl = perplexity(base.passage_logprobs)
    return {
        "config": other.name,
        "model_dtype": other.model_dtype,
        "weight_bytes": other.weight_bytes,
        "exact_match": sum(exact for exact, _ in pairs) / len(pairs),
        "mean_agreeing_prefix": sum(frac for _, frac in pairs) / len(pairs),
        "mean_abs_dlogprob": sum(deltas) / len(deltas) if deltas else 0.0,
        "max_abs_dlogprob": max(deltas, default=0.0),
        "perplexity": ppl,
        "ppl_ratio": ppl / base_ppl,
    }


def markdown_table(rows: Sequence[Mapping[str, float | str]], baseline: str) -> str:
    """The summary rows as a markdown table (weight sizes only where servers report them)."""
    sizes = any(float(r.get("weight_bytes", 0)) > 0 for r in rows)
    lines = [
        f"| config |{' weights (MiB) |' if sizes else ''} greedy exact-match "
        f"| mean agreeing prefix | mean \\|Δlogprob\\| "
        f"| max \\|Δlogprob\\| | perplexity | ppl / {baseline} |",
        "|---|" + "---:|" * (7 if sizes else 6),
    ]
    for r in rows:
        mib = f" {float(r.get('weight_bytes', 0)) / 2**20:.1f} |" if sizes else ""
        lines.append(
            f"| {r['config']} |{mib} {float(r['exact_match']):.3f} "
            f"| {float(r['mean_agreeing_prefix']):.3f} | {float(r['mean_abs_dlogprob']):.4f} "
            f"| {float(r['max_abs_dlogprob']):.4f} | {float(r['perplexity']):.3f} "
            f"| {float(r['ppl_ratio']):.4f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Talking to a server


def _logprobs(tokens: Sequence[generate_pb2.Token], first: int, what: str) -> list[float]:
    out = []
    for pos in range(first, len(tokens)):
        if not tokens[pos].HasField("logprob"):
            raise RuntimeError(f"{what}: no logprob at prompt position {pos}")
        out.append(float(tokens[pos].logprob))
    return out


async def _prefill_logprobs(
    stub: generate_pb2_grpc.TextGenerationServiceStub, ids: Sequence[int], timeout_s: float
) -> list[generate_pb2.Token]:
    """The prompt tokens of ``ids`` with their logprobs (one token generated, ignored)."""
    request = generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=list(ids))],
        parameters=generate_pb2.GenerateParameters(
            max_new_tokens=1, details=True, decoder_input_details=True
        ),
    )
    response = await stub.Generate(request, timeout=timeout_s)
    prefill = list(response.results[0].details.prefill)
    if [t.id for t in prefill] != list(ids):
        raise RuntimeError("the server's prefill tokens are not the ids sent")
    return prefill


async def measure(
    address: str,
    result: ConfigResult,
    prompts: Sequence[str],
    max_new_tokens: int,
    base: ConfigResult | None,
    passage: str | list[int],
    timeout_s: float,
) -> list[int]:
    """Fill ``result`` from the server at ``address``; returns the passage's token ids.

    ``base`` is None for the baseline itself: its own greedy continuations are then the
    teacher-forced ones.  ``passage`` is text for the baseline (tokenized here and cut to the
    server's ``max_input_tokens``), and the baseline's ids for every other configuration.
    """
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        info = await stub.Info(generate_pb2.InfoRequest(), timeout=timeout_s)
        result.model_id, result.model_dtype = info.model_id, info.model_dtype
        if "model_weight_bytes" in info.DESCRIPTOR.fields_by_name:  # newer servers only
            result.weight_bytes = int(info.model_weight_bytes)
        params = generate_pb2.GenerateParameters(
            max_new_tokens=max_new_tokens, details=True, decoder_input_details=True
        )
        for text in prompts:
            response = await stub.Generate(
                generate_pb2.GenerateRequest(inputs=[text], parameters=params), timeout=timeout_s
            )
            details = response.results[0].details
            result.prompt_ids.append([t.id for t in details.prefill])
            result.generated_ids.append([t.id for t in details.tokens])
            result.generated_text.append(response.results[0].generated_text)
        reference = base if base is not None else result
        if base is not None and base.prompt_ids != result.prompt_ids:
            raise RuntimeError(f"{result.name}: prompts tokenize differently from the baseline")
        for prompt, continuation in zip(reference.prompt_ids, reference.generated_ids, strict=True):
            prefill = await _prefill_logprobs(stub, prompt + continuation, timeout_s)
            result.forced_logprobs.append(_logprobs(prefill, len(prompt), result.name))
        if isinstance(passage, str):
            tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(inputs=passage))
            ids = [t.id for t in tokens.tokens][: info.max_input_tokens]
        else:
            ids = passage
        prefill = await _prefill_logprobs(stub, ids, timeout_s)
        result.passage_logprobs = _logprobs(prefill, 1, result.name)
    return ids


def run_config(
    result: ConfigResult,
    port: int,
    threads: int,
    log_dir: Path,
    max_new_tokens: int,
    base: ConfigResult | None,
    passage: str | list[int],
    timeout_s: float,
    after: Callable[[str, list[int]], None] | None = None,
) -> list[int]:
    """Launch one server with ``result.server_args``, :func:`measure` it, call ``after``
    (its address and the passage ids) while it still runs, stop it."""
    log = log_dir / f"{result.name}.log"
    server = LaunchedServer(result.server_args, "127.0.0.1", port, threads, log)
    start = time.perf_counter()
    server.start()
    try:
        asyncio.run(server.wait_healthy(900))
        healthy = time.perf_counter()
        ids = asyncio.run(
            measure(server.address, result, PROMPTS, max_new_tokens, base, passage, timeout_s)
        )
        print(
            f"{result.name}: healthy after {healthy - start:.0f} s, "
            f"measured in {time.perf_counter() - healthy:.0f} s",
            flush=True,
        )
        if after is not None:
            after(server.address, ids)
        return ids
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()


def _parse_config(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME='FLAGS', got {text!r}")
    return name.strip(), tuple(shlex.split(flags))


def main(argv: Sequence[str] | None = None) -> int:
    args_in, common = split_server_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="genserve-bench quant-accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"configurations to run, comma-separated (built in: {', '.join(BUILTIN_CONFIGS)})",
    )
    p.add_argument(
        "--config",
        dest="extra",
        type=_parse_config,
        action="append",
        default=[],
        metavar="NAME='FLAGS'",
        help="define (or redefine) a configuration by its server flags; repeatable",
    )
    p.add_argument("--baseline", default="float32", help="the configuration compared against")
    p.add_argument("--model-id", help="passed to every server (default: the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--text-file", type=Path, help="perplexity text (default: built in)")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=4096,
        help="--max-batch-total-tokens of each server (small: one request at a time)",
    )
    p.add_argument("--port", type=int, default=50183, help="port of the launched servers")
    p.add_argument("--threads", type=int, default=2, help="OMP threads of the servers")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", type=Path, help="write the summary and raw measurements as JSON")
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also compare full distributions with llama-server's on the same --model-id GGUF",
    )
    p.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=Path(os.environ.get("LLAMA_CPP_BIN", "/work/llamacpp/build/bin")),
        help="directory with llama-server (env LLAMA_CPP_BIN)",
    )
    p.add_argument(
        "--dist-tokens", type=int, default=64, help="passage ids the distributions cover"
    )
    args = p.parse_args(args_in)
    if args.llama_cpp and not (args.model_id and args.model_id.endswith(".gguf")):
        p.error("--llama-cpp compares on one file: give --model-id FILE.gguf")
    known = {**BUILTIN_CONFIGS, **dict(args.extra)}
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in [*names, args.baseline] if n not in known]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; define with --config NAME='FLAGS'")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    names = [args.baseline, *(n for n in dict.fromkeys(names) if n != args.baseline)]
    shared = ["--max-batch-total-tokens", str(args.kv_tokens), *common]
    if args.model_id:
        shared = ["--model-id", args.model_id, *shared]
    passage: str | list[int] = args.text_file.read_text() if args.text_file else PASSAGE
    dists = (
        dist_compare.DistRun(
            Path(args.model_id), args.dist_tokens, args.timeout, args.llama_cpp_bin, args.port,
            args.threads,
        )
        if args.llama_cpp
        else None
    )  # fmt: skip
    if dists is not None:
        shared += ["--max-top-n-tokens", str(dists.vocab)]

    results: list[ConfigResult] = []
    with tempfile.TemporaryDirectory(prefix="genserve-bench-quant-") as tmp:
        for name in names:
            print(f"{name}: genserve {shlex.join([*known[name], *shared])}", flush=True)
            result = ConfigResult(name, [*known[name], *shared])
            passage = run_config(
                result,
                args.port,
                args.threads,
                Path(tmp),
                args.max_new_tokens,
                results[0] if results else None,
                passage,
                args.timeout,
                dists.collector(name) if dists is not None else None,
            )
            results.append(result)
        if dists is not None:
            dists.run_llama_cpp(Path(tmp))
    base = results[0]
    rows = [summarize(base, r) for r in results]
    table = markdown_table(rows, args.baseline)
    print(
        f"\n{base.model_id}: {len(PROMPTS)} prompts x {args.max_new_tokens} greedy tokens, "
        f"perplexity over {len(base.passage_logprobs)} tokens\n"
    )
    print(table)
    dist_rows = dists.rows(args.baseline) if dists is not None else []
    if dists is not None:
        print(f"\nFull distributions, {dists.model.name} ({args.baseline} = reference):\n")
        print(dist_compare.markdown_table(dist_rows, args.baseline, len(dists.ids) - 1))
    if args.out is not None:
        report = {
            "baseline": args.baseline,
            "model_id": base.model_id,
            "max_new_tokens": args.max_new_tokens,
            "prompts": list(PROMPTS),
            "passage_tokens": len(base.passage_logprobs) + 1,
            "rows": rows,
            "distribution_rows": dist_rows,
            "configs": [asdict(r) for r in results],
        }
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
