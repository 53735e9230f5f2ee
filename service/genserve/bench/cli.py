"""``genserve-bench``: load a running (or launched) genserve over gRPC at several
concurrencies, optionally run the Hugging Face baselines on the same prompts, and write
``results.json`` and ``bench.png``.

Examples::

    genserve-bench --address 127.0.0.1:50051 --concurrency 1,8,32 --out bench-results/
    genserve-bench --hf-baseline --hf-batch-sizes 1,32 --launch -- --dtype bfloat16

Everything after ``--`` is passed to ``genserve`` when ``--launch`` is given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from genserve.bench.bench_config import BenchConfig
from genserve.bench.launch import split_server_args


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _concurrency_list(text: str) -> tuple[str, ...]:
    """Integers, or ``kv<F>x``: F times the requests the server's KV cache can hold."""
    parts = tuple(part.strip() for part in text.split(",") if part.strip())
    for part in parts:
        if part.isdigit() and int(part) > 0:
            continue
        if part.startswith("kv") and part.endswith("x"):
            try:
                if float(part[2:-1]) > 0:
                    continue
            except ValueError:
                pass
        raise argparse.ArgumentTypeError(f"bad concurrency {part!r} (want e.g. 1,8,32,kv4x)")
    if not parts:
        raise argparse.ArgumentTypeError("empty concurrency list")
    return parts


HF_MODES = ("eager", "static", "static-compile")


def _hf_modes(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [m for m in modes if m not in HF_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"bad mode(s) {bad or text!r}; choose from {HF_MODES}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="genserve-bench",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("--address", default="127.0.0.1:50051", help="genserve gRPC address (loopback only)")
    add(
        "--concurrency",
        type=_concurrency_list,
        default=("1", "8", "32"),
        help="comma-separated stream counts; kv4x = 4x the requests the KV cache holds",
    )
    add(
        "--num-prompts",
        type=int,
        default=128,
        help="requests per concurrency level (at least 3 per stream, so most join a running batch)",
    )
    add("--prompt-len-mean", type=float, default=40.0, help="mean prompt length in tokens")
    add("--prompt-len-std", type=float, default=None, help="std of prompt length (mean/4)")
    add("--max-new-tokens", type=int, default=128, help="new tokens asked for per request")
    add(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy requests; above 0: sampled at this temperature (seeded per request; "
        "the HF baselines sample too)",
    )
    add("--seed", type=int, default=0, help="seed of the prompt set")
    add("--out", type=Path, default=Path("bench-results"), help="output directory")
    add(
        "--max-duration",
        dest="max_duration_s",
        type=float,
        default=60.0,
        help="seconds per level after which no new request starts",
    )
    add(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        default=300.0,
        help="gRPC deadline of each request",
    )
    add("--warmup-requests", type=int, default=2, help="unmeasured requests sent first")
    add(
        "--no-stagger",
        dest="stagger",
        action="store_false",
        help="start all streams of a level at once (lock-step bursts) instead of spreading "
        "their first requests over one request's output; throughput is then over the whole "
        "level, not its steady window",
    )
    add(
        "--client-processes",
        type=int,
        default=1,
        help="split each load level's streams over this many client processes: one Python "
        "process saturates a core near 12-14k streamed messages/s (docs/stream-host.md)",
    )
    add(
        "--scenario",
        choices=("load", "prefix", "all"),
        default="load",
        help="load: concurrency levels; prefix: shared-system-prompt TTFT; all: both",
    )
    add("--prefix-requests", type=int, default=6, help="cold and warm requests (prefix)")
    add("--prefix-tokens", type=int, default=1000, help="shared system prompt length")
    add("--prefix-max-new-tokens", type=int, default=8, help="new tokens per prefix request")
    add("--hf-baseline", action="store_true", help="also run Hugging Face transformers")
    add(
        "--model-id",
        default=None,
        help="weights for the baseline: a save_pretrained directory (default: the server's)",
    )
    add(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16", "float16"),
        help="baseline dtype",
    )
    add("--hf-batch-sizes", type=_int_list, default=(1, 32), help="padded generate() batches")
    add(
        "--hf-min-prompts",
        type=int,
        default=4,
        help="prompts per baseline batch size at least (rounded up to whole batches)",
    )
    add(
        "--no-hf-generate-batch",
        dest="hf_generate_batch",
        action="store_false",
        help="skip transformers' continuous batching baseline",
    )
    add(
        "--hf-modes",
        type=_hf_modes,
        default=("eager",),
        help="transformers generate() setups at each --hf-batch-sizes: eager (dynamic cache), "
        "static (static cache), static-compile (static cache + torch.compile: CUDA graphs)",
    )
    add(
        "--hf-device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the baselines run (auto: cuda when available)",
    )
    add("--threads", type=int, default=2, help="torch threads of the baseline and launched server")
    add("--no-progress", dest="progress", action="store_false", help="no progress bars")
    add(
        "--launch",
        action="store_true",
        help="start genserve (args after --) for this run and stop it at the end",
    )
    add(
        "--launch-timeout",
        dest="launch_timeout_s",
        type=float,
        default=900.0,
        help="seconds the launched server gets to become healthy",
    )
    return p


def parse_args(argv: Sequence[str]) -> BenchConfig:
    """Parse ``argv`` (without the program name); arguments after ``--`` are server args."""
    own, server_args = split_server_args(argv)
    parser = build_parser()
    ns = parser.parse_args(own)
    if server_args and not ns.launch:
        parser.error("arguments after -- are for --launch")
    for name in ("num_prompts", "max_new_tokens", "threads", "prefix_requests", "prefix_tokens"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.temperature < 0:
        parser.error("--temperature must be >= 0")
    from genserve.bench.grpc_load import check_loopback

    try:
        check_loopback(ns.address)
    except ValueError as exc:
        parser.error(str(exc))
    return BenchConfig(**vars(ns), server_args=tuple(server_args))


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit code (1 when any request failed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--make-model"]:  # genserve-bench --make-model SHAPE DIR [options]
        from genserve.bench.make_model import main as make_model_main

        return make_model_main(args[1:])
    if args[:1] == ["adapters"]:  # the multi-LoRA scenario has its own options
        from genserve.bench.adapters import main as adapters_main

        return adapters_main(args[1:])
    if args[:1] == ["cpu"]:  # CPU decode against llama.cpp / transformers, in-process
        from genserve.bench.cpu_compare import main as cpu_main

        return cpu_main(args[1:])
    if args[:1] == ["gguf-start"]:  # start-up time, memory and cache disk on a real-shape GGUF
        from genserve.bench.gguf_start import main as gguf_start_main

        return gguf_start_main(args[1:])
    if args[:1] == ["grammar"]:  # constrained vs unconstrained decoding, side by side
        from genserve.bench.grammar_compare import main as grammar_main

        return grammar_main(args[1:])
    if args[:1] == ["quant-accuracy"]:  # quantized weights against float32, one server each
        from genserve.bench.quant_accuracy import main as quant_accuracy_main

        return quant_accuracy_main(args[1:])
    config = parse_args(args)
    from genserve.bench.suite import run_suite

    try:
        results = run_suite(config)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"genserve-bench: {exc}", file=sys.stderr)
        return 2
    failed = sum(s["num_failed"] for s in results["genserve"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
