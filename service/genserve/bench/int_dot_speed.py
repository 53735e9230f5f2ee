"""``python -m genserve.bench.int_dot_speed``: op-level timing of the quantized CPU matmul,
integer dot products (``genserve::int_dot_linear``, each instruction-set path this CPU has)
against the float dequantize path (``genserve::qpanel_linear``), on random Q8_0 and Q4_0
matrices of a real model's shapes (default: Llama-3.2-1B's MLP, gate/up fused [16384, 2048]
and down [2048, 8192]) at 1, 8 and 32 rows.

Prints a markdown table of the best of ``--repeats`` timings (ms per call) and the CPU's
name.  Not a test: numbers depend on the machine and on what else runs on it
(docs/cpu/integer-kernels.md records a run).
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
from genserve.kernels.int_dot import Isa
from genserve.model.int_dot_panels import IntDotPanels
from genserve.model.quantization import QuantizedWeight
from genserve.model.weight_panels import QuantizedPanels

DEFAULT_SHAPES = ((16384, 2048), (2048, 8192))  # [N, K]: Llama-3.2-1B gate_up, down


def q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """GGUF Q8_0 of ``weight [N, K]``: int8 per group of 32, ``d = max|w| / 127`` (float16)."""
    n, k = weight.shape
    w = weight.view(n, k // 32, 32)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    safe = torch.where(d == 0, torch.ones_like(d), d).to(torch.float32)[..., None]
    q = torch.round(w / safe).clamp(-127, 127).to(torch.int8).view(n, k)
    return QuantizedWeight(q, d, None, 8, 32)


def q4_0(weight: torch.Tensor) -> QuantizedWeight:
    """GGUF Q4_0 of ``weight``: ``w = d (q - 8)``, q in 0..15, as genserve keeps it
    (``min = -8 d``)."""
    n, k = weight.shape
    w = weight.view(n, k // 32, 32)
    idx = w.abs().argmax(-1, keepdim=True)
    d = (torch.gather(w, -1, idx).squeeze(-1) / -8).to(torch.float16)
    safe = torch.where(d == 0, torch.ones_like(d), d).to(torch.float32)[..., None]
    q = (torch.round(w / safe) + 8).clamp(0, 15).to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return QuantizedWeight(packed, d, (-8 * d.to(torch.float32)).to(torch.float16), 4, 32)


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first-touch, caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def cpu_name() -> str:
    """The model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not cpu_kernels.load():
        print("genserve CPU kernels unavailable")
        return 1
    torch.set_num_threads(args.threads)
    isas = [Isa(i) for i in torch.ops.genserve.int_dot_isas()]
    print(f"CPU: {cpu_name()}, {args.threads} threads; int-dot paths: {[i.name for i in isas]}")
    header = ["format", "N x K", "rows", "float path ms"] + [f"{i.name} ms" for i in isas]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    torch.manual_seed(0)
    for n, k in DEFAULT_SHAPES:
        weight = torch.randn(n, k) * 0.02
        for name, quant in (("Q8_0", q8_0(weight)), ("Q4_0", q4_0(weight))):
            panels, ints = QuantizedPanels.pack(quant), IntDotPanels.pack(quant)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                cells = [_best_ms(partial(panels.linear, x, None), args.repeats)]
                for isa in isas:
                    cells.append(_best_ms(partial(ints.linear, x, None, isa), args.repeats))
                shown = " | ".join(f"{c:.3f}" for c in cells)
                print(f"| {name} | {n} x {k} | {rows} | {shown} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
