"""One layer's attention of a realistic mixed step, per ``--gpu-prefill-attention`` path.

    python -m genserve.bench.mixed_attention [--device cuda] [--seconds 10]

The step (issue #29's measured case, Llama-3.1-8B's attention shape by default: 32 query
heads, 8 KV heads, head size 128, bf16, 16-token blocks): ``--decodes`` decode rows with
contexts around ``--context`` tokens, ``--prompts`` fresh prompts of ``--prompt-len``
tokens and one chunk of ``--chunk`` tokens continuing ``--chunk-after`` cached ones.  For
each path (``triton``, ``sdpa``, ``sdpa-pinned``) it builds the step's metadata once (as a
step does) and times the layer's ``attend`` call: device milliseconds per call between
``torch.cuda.Event`` s, host milliseconds per call (the launch loop without waiting), and
whether the build or the call synchronised (``torch.cuda.set_sync_debug_mode("warn")``:
the warnings counted).  On the CPU (a smoke run; the Triton path needs
``TRITON_INTERPRET=1`` there) only host time is reported.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from genserve.model.attention import PrefillAttention, SeqSpec, TorchPagedAttention

_PATHS: tuple[PrefillAttention, ...] = ("triton", "sdpa", "sdpa-pinned")


@dataclass(frozen=True, slots=True)
class PathResult:
    path: str
    device_ms: float | None  # per attend call (CUDA only)
    host_ms: float  # per attend call, launches only
    build_ms: float  # the step's metadata, once per step
    sync_warnings: int  # CUDA sync debug warnings in one build + one call (-1: not on CUDA)


def mixed_step(args: argparse.Namespace) -> tuple[list[SeqSpec], int]:
    """The step's sequences (decodes first) and the number of decode rows; each sequence
    owns its own consecutive blocks."""
    bs = args.block_size
    seqs, next_block = [], 0

    def blocks(n: int) -> tuple[int, ...]:
        nonlocal next_block
        count = -(-n // bs)
        next_block += count
        return tuple(range(next_block - count, next_block))

    for i in range(args.decodes):
        ctx = args.context + (i * 7) % 41 - 20  # contexts spread around --context
        seqs.append(SeqSpec(1, ctx - 1, blocks(ctx)))
    for _ in range(args.prompts):
        seqs.append(SeqSpec(args.prompt_len, 0, blocks(args.prompt_len)))
    if args.chunk:
        total = args.chunk_after + args.chunk
        seqs.append(SeqSpec(args.chunk, args.chunk_after, blocks(total)))
    return seqs, args.decodes


def _count_sync_warnings(fn: Callable[[], object], device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run_path(
    path: PrefillAttention,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> PathResult:
    seqs, num_decodes = mixed_step(args)
    num_tokens = sum(s.num_tokens for s in seqs)
    num_blocks = sum(len(s.block_ids) for s in seqs) + 1
    gen = torch.Generator().manual_seed(0)
    shape = (2, args.kv_heads, num_blocks, args.block_size, args.head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(num_tokens, args.heads, args.head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(num_tokens, args.kv_heads, args.head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn_like(k)
    scale = args.head_dim**-0.5
    backend = TorchPagedAttention(
        device, use_triton_decode=device.type == "cuda", batch_prompts=True, prefill=path
    )

    def build() -> object:
        return backend.build(seqs, num_decodes, args.block_size)

    meta = backend.build(seqs, num_decodes, args.block_size)

    def call() -> torch.Tensor:
        return meta.attend(q, k, v, cache, scale, None)

    for _ in range(3):  # compile / plan / warm the allocator
        call()
    syncs = _count_sync_warnings(lambda: (build(), call()), device)
    start = time.perf_counter()
    for _ in range(args.builds):
        build()
    build_ms = (time.perf_counter() - start) * 1e3 / args.builds
    cuda = device.type == "cuda"
    iters = args.iters
    if cuda:
        torch.cuda.synchronize(device)
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        begin.record()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    host_ms = (time.perf_counter() - start) * 1e3 / iters
    device_ms = None
    if cuda:
        end.record()
        end.synchronize()
        device_ms = begin.elapsed_time(end) / iters
    return PathResult(path, device_ms, host_ms, build_ms, syncs)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--paths", default=",".join(_PATHS), help="comma-separated")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--chunk", type=int, default=128, help="0: no continuing chunk")
    p.add_argument("--chunk-after", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=200, help="timed attend calls per path")
    p.add_argument("--builds", type=int, default=50, help="timed metadata builds per path")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    seqs, num_decodes = mixed_step(args)
    print(
        f"mixed step: {num_decodes} decode rows, {args.prompts} prompts of {args.prompt_len}, "
        f"chunk {args.chunk} after {args.chunk_after}; {sum(s.num_tokens for s in seqs)} rows; "
        f"heads {args.heads}/{args.kv_heads}x{args.head_dim} {args.dtype} on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    print(f"{'path':<12} {'device ms':>10} {'host ms':>9} {'build ms':>9} {'syncs':>6}")
    with torch.inference_mode():
        for path in args.paths.split(","):
            r = run_path(path, args, device, dtype)  # type: ignore[arg-type]
            dev = "-" if r.device_ms is None else f"{r.device_ms:.3f}"
            syncs = "-" if r.sync_warnings < 0 else str(r.sync_warnings)
            print(f"{r.path:<12} {dev:>10} {r.host_ms:>9.3f} {r.build_ms:>9.3f} {syncs:>6}")


if __name__ == "__main__":
    main()
