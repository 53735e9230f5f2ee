"""``python -m genserve.bench.moe_speed``: op-level timing of one mixture-of-experts layer's
routed experts on CPU, ``genserve::moe_experts`` (kernels/moe_cpu.cpp) against the torch loop
over the chosen experts that transformers runs (``model.moe.experts_torch``), on random
weights of a real layer's shape (default: Qwen3-30B-A3B's, 128 experts, top-8, hidden 2048,
expert width 768) at 1, 8 and 32 rows, with routing from random router logits.

Prints a markdown table of the best of ``--repeats`` timings (ms per call), the weight bytes
the op streams (the distinct experts the rows chose) and the CPU's name.  Not a test:
numbers depend on the machine and on what else runs on it (docs/models/moe.md records a run).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.moe import experts_torch, route
from genserve.model.spec import RouterSpec


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first-touch, caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not cpu_kernels.load():
        print("genserve CPU kernels unavailable")
        return 1
    gen = torch.Generator().manual_seed(0)
    spec = RouterSpec(args.experts, args.top_k, renormalize=True)
    print(f"CPU: {_cpu_name()}, {torch.get_num_threads()} threads")
    print(f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, width {args.width}")
    print()
    print("| dtype | rows | experts hit | MiB read | torch loop ms | moe_experts ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        e, h, w = args.experts, args.hidden, args.width
        w13 = (0.02 * torch.randn(e, 2 * w, h, generator=gen)).to(dtype)
        w2 = (0.02 * torch.randn(e, h, w, generator=gen)).to(dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, h, generator=gen).to(dtype)
            weights, ids = route(torch.randn(rows, e, generator=gen), spec)
            hit = int(torch.unique(ids).numel())
            mib = hit * 3 * w * h * w13.element_size() / 2**20
            step = (x, ids, weights, w13, w2)
            with torch.inference_mode():
                loop = _best_ms(partial(experts_torch, *step), args.repeats)
                fused = _best_ms(partial(torch.ops.genserve.moe_experts, *step), args.repeats)
            print(
                f"| {name} | {rows} | {hit} | {mib:.0f} | {loop:.2f} | {fused:.2f} | "
                f"{loop / fused:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
