"""``genserve-bench cpu``: decode speed on this CPU, genserve against llama.cpp and
transformers, each in this process on the same prompts, next to the machine's limits.

    genserve-bench cpu --streams 1,32 --new-tokens 64 --repeats 3 --llamacpp F32,Q8_0
    genserve-bench cpu --model m.Q4_0.gguf --streams 1,8 -- --cpu-int-dot on   # vs llama-server

Every engine runs the same random prompts (``--prompt-len`` tokens) with greedy decoding;
a run is one prefill of all streams then ``new-tokens - 1`` batched decode steps, and the
figure is generated tokens per second over the decode steps.  Engines and stream counts are
interleaved within each repeat, and the median over repeats is reported (the machines this
runs on are shared: compare within one run, never across runs).

* genserve: its model runner (the step a server runs: attention metadata, forward, sampler),
  without gRPC, per ``--precisions``: ``float32``, ``bfloat16`` (weights and compute),
  ``int8`` / ``int4`` (``--quantize``, float32 activations), ``gguf`` (``--quantize gguf`` on
  the embedded Q4_1 file: its blocks as they are) and ``gguf:FORMAT`` (``--quantize gguf`` on
  the file llama.cpp's quantizer wrote for ``--llamacpp FORMAT``: the very same weights).
* llama.cpp (``--llamacpp``, needs the ``llamacpp`` extra): the embedded GGUF re-encoded by
  llama.cpp's own quantizer to each format named (Q4_1, the embedded file's own format, runs
  the file itself), batched the way ``llama-server -np N`` does.
* transformers: ``generate()`` on the same float32 weights (unpadded: equal prompt lengths);
  decode time is ``generate(N)`` minus ``generate(1)``.

The limits (``genserve.bench.machine_limits``): at 1 stream, read bandwidth / weight bytes
per token at the engine's storage precision; at more streams, the float32 GEMM rate / flops
per token.  Both are measured before and after the engines run, and the better kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from genserve.bench import llama_cpp_repack, machine_limits
from genserve.bench.llamacpp_baseline import FTYPES
from genserve.model.loader import ResolvedModel, transformers_weights_kwargs

_PRECISIONS = ("float32", "bfloat16", "int8", "int4", "gguf")


def _is_gguf_format(precision: str) -> bool:
    return precision.startswith("gguf:") and precision.removeprefix("gguf:") in FTYPES


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    weight_bytes: float  # bytes of weights read per decode step (the bandwidth limit's)
    # (prompts, new_tokens) -> (decode tok/s, generated ids per prompt)
    run: Callable[[list[list[int]], int], tuple[float, list[list[int]]]]


def _genserve_engine(
    resolved: ResolvedModel, precision: str, max_streams: int, max_len: int, gguf_dir: Path
) -> Engine:
    from genserve.worker.model_runner import ModelRunner
    from genserve.worker.runner_bench import BLOCK_SIZE, greedy_run

    dtype, quantize = torch.float32, None
    if precision == "bfloat16":
        dtype = torch.bfloat16
    elif precision in ("int8", "int4", "gguf"):
        quantize = precision
    elif precision.startswith("gguf:"):
        assert resolved.gguf_file is not None
        gguf = _llamacpp_file(resolved.gguf_file, precision.removeprefix("gguf:"), gguf_dir)
        resolved = dataclasses.replace(resolved, gguf_file=gguf)
        quantize = "gguf"
    runner = ModelRunner(
        dataclasses.replace(resolved, quantize=quantize), dtype, torch.device("cpu")
    )
    runner.initialize_kv_cache(max_streams * -(-max_len // BLOCK_SIZE) + 1, BLOCK_SIZE)
    runner.warmup()

    def run(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        _, decode_s, tokens = greedy_run(runner, prompts, new_tokens)
        return len(prompts) * (new_tokens - 1) / decode_s, tokens

    return Engine(f"genserve {precision}", runner.weight_bytes(), run)


def _hf_engine(local_dir: Path) -> Engine:
    from transformers import AutoModelForCausalLM

    weights = transformers_weights_kwargs(local_dir)  # a GGUF entry: the .gguf file
    model = AutoModelForCausalLM.from_pretrained(str(local_dir), dtype=torch.float32, **weights)
    model.eval()

    def generate(ids: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start, out

    def run(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            first_s, _ = generate(ids, 1)
            total_s, out = generate(ids, new_tokens)
        decode_s = max(total_s - first_s, 1e-9)
        return len(prompts) * (new_tokens - 1) / decode_s, out[:, ids.shape[1] :].tolist()

    params = sum(p.numel() for p in model.parameters())
    return Engine("transformers float32", 4.0 * params, run)


def _llamacpp_file(source: Path, ftype: str, cache: Path) -> Path:
    """The GGUF llama.cpp runs for ``ftype``: the embedded file itself in its own format,
    else llama.cpp's re-encoding of it."""
    from genserve.bench.llamacpp_baseline import make_gguf

    if source.stem.endswith(f".{ftype}"):
        return source
    return make_gguf(source, cache, ftype, torch.get_num_threads())


def _gguf_weight_bytes(path: Path) -> float:
    from gguf import GGUFReader

    return float(sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors))


def _llamacpp_engine(
    source: Path, ftype: str, cache: Path, args: argparse.Namespace, max_len: int
) -> Engine:
    from genserve.bench.llamacpp_baseline import LlamaCppModel

    path = _llamacpp_file(source, ftype, cache)
    model = LlamaCppModel(path, max(args.streams), max_len, args.threads, args.llamacpp_extra_bufts)

    def run(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        result = model.greedy(prompts, new_tokens)
        return result.decode_tok_s, result.tokens

    return Engine(f"llama.cpp {ftype}", _gguf_weight_bytes(path), run)


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of streams whose greedy continuations are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def run_compare(args: argparse.Namespace) -> dict[str, object]:
    from genserve.model.config import load_model_config
    from genserve.model.loader import default_gguf_path, resolve_model
    from genserve.worker.runner_bench import random_prompts

    torch.set_num_threads(args.threads)
    resolved = resolve_model(None, cache_dir=args.cache_dir)
    config = load_model_config(resolved.local_dir)
    cost = machine_limits.model_cost(
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.vocab_size,
    )
    measured = [machine_limits.measure(cost, rows=max(args.streams))]
    _print_limits("machine (before the engines)", measured[0])
    max_streams, max_len = max(args.streams), args.prompt_len + args.new_tokens
    gguf_dir = args.cache_dir / "gguf"
    engines = [
        _genserve_engine(resolved, p, max_streams, max_len, gguf_dir) for p in args.precisions
    ]
    if args.llamacpp:
        source = default_gguf_path()
        engines += [_llamacpp_engine(source, f, gguf_dir, args, max_len) for f in args.llamacpp]
    if args.hf:
        engines.append(_hf_engine(resolved.local_dir))
    rates: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for rep in range(args.repeats):
        for streams in args.streams:
            prompts = random_prompts(config.vocab_size, streams, args.prompt_len, seed=rep)
            for engine in engines:
                rate, out = engine.run(prompts, args.new_tokens)
                rates.setdefault((engine.name, streams), []).append(rate)
                if rep == 0:
                    tokens[(engine.name, streams)] = out
                print(f"  repeat {rep} {engine.name} x{streams}: {rate:.1f} tok/s", flush=True)
    # Measured again after the engines, and the better of the two kept: the limit is what
    # the machine can do, and on a shared VM one measurement may fall in a neighbour's burst
    # (a run here read 23.8 GB/s at the start while the engines streamed weights faster).
    measured.append(machine_limits.measure(cost, rows=max(args.streams)))
    _print_limits("machine (after the engines)", measured[1])
    limits = machine_limits.best(measured)
    rows = []
    reference = f"genserve {args.precisions[0]}"
    for engine in engines:
        for streams in args.streams:
            values = rates[(engine.name, streams)]
            median = statistics.median(values)
            if streams == 1:
                limit = limits.read_gb_s * 1e9 / engine.weight_bytes
            else:
                limit = cost.matmul_tok_s(limits)
            rows.append(
                {
                    "engine": engine.name,
                    "streams": streams,
                    "tok_s": median,
                    "min": min(values),
                    "max": max(values),
                    "limit_tok_s": limit,
                    "percent_of_limit": 100 * median / limit,
                    "same_tokens_as_" + reference: _agreement(
                        tokens[(engine.name, streams)], tokens[(reference, streams)]
                    ),
                }
            )
    return {
        "limits": limits.as_dict(),
        "limits_measured": [m.as_dict() for m in measured],
        "matmul_params": cost.matmul_params,
        "llamacpp_extra_bufts": args.llamacpp_extra_bufts,
        "rows": rows,
    }


def _print_limits(label: str, limits: machine_limits.MachineLimits) -> None:
    print(
        f"{label}: read {limits.read_gb_s:.1f} GB/s, float32 GEMM {limits.matmul_gflop_s:.0f} "
        f"GFLOP/s at {limits.matmul_rows} rows, {limits.threads} threads",
        flush=True,
    )


def format_table(result: Mapping[str, object]) -> str:
    rows = result["rows"]
    assert isinstance(rows, list)
    agree = next(k for k in rows[0] if k.startswith("same_tokens_as_"))
    lines = [
        "| engine | streams | decode tok/s (median) | min-max | limit tok/s | % of limit | "
        f"{agree.replace('_', ' ')} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['streams']} | {r['tok_s']:.1f} | {r['min']:.1f}-{r['max']:.1f}"
            f" | {r['limit_tok_s']:.0f} | {r['percent_of_limit']:.0f}% | {r[agree] * 100:.0f}% |"
        )
    return "\n".join(lines)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str]) -> int:
    """``--model FILE.gguf ...``: genserve's server against llama-server on those files
    (``genserve.bench.server_compare``; genserve's flags after ``--``); without it, the
    in-process comparison on the embedded model described above."""
    from genserve.bench import server_compare
    from genserve.bench.launch import split_server_args

    argv, server_args = split_server_args(argv)
    parser = argparse.ArgumentParser(prog="genserve-bench cpu", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        action="append",
        default=[],
        help="a GGUF file to serve with genserve and llama-server (repeatable); the "
        "server comparison of genserve.bench.server_compare",
    )
    server_compare.add_arguments(parser)
    parser.add_argument("--streams", type=lambda t: [int(x) for x in _csv(t)], default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", type=_csv, default=["float32", "bfloat16"])
    parser.add_argument(
        "--llamacpp", type=_csv, default=[], help="GGUF formats for llama.cpp, e.g. F32,Q8_0"
    )
    parser.add_argument(
        "--llamacpp-extra-bufts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="llama.cpp's repacked weight layouts (AMX, interleaved Q4_0). Default: on, except "
        "on AMX CPUs, where llama.cpp 0.3.36's AMX path segfaulted in KVM guests "
        "(genserve.bench.llama_cpp_repack); with --model: llama-server's --repack/--no-repack",
    )
    parser.add_argument("--no-hf", dest="hf", action="store_false")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "genserve" / "models"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results") / "cpu.json",
        help="JSON file to write (a directory: cpu.json inside it)",
    )
    args = parser.parse_args(argv)
    args.server_args = server_args
    if args.llamacpp_extra_bufts is None:
        args.llamacpp_extra_bufts = llama_cpp_repack.default_on()
    if args.out.is_dir():  # checked first: a run takes minutes, its end must not fail
        args.out = args.out / "cpu.json"
    if args.model:
        missing = [str(m) for m in args.model if not m.is_file()]
        if missing or not args.streams or min(args.streams) < 1 or args.new_tokens < 2:
            parser.error(f"--model files must exist ({missing}); --streams >= 1, --new-tokens >= 2")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = server_compare.run_servers(args)
        args.out.write_text(json.dumps(record, indent=2))
        return 0
    if server_args:
        parser.error("server arguments after -- go with --model")
    bad = [f for f in args.llamacpp if f not in FTYPES]
    bad += [p for p in args.precisions if p not in _PRECISIONS and not _is_gguf_format(p)]
    if bad:
        parser.error(f"unknown format in --llamacpp/--precisions: {bad}")
    if not args.streams or min(args.streams) < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("--streams >= 1, --new-tokens >= 2, --repeats >= 1")
    result = run_compare(args)
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0
