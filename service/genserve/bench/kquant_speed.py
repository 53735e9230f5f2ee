"""``python -m genserve.bench.kquant_speed``: op-level timing of the K-quant matmul
(``genserve::kquant_linear``: the float path and each integer path this CPU has) against what
genserve served K-quant files with before, the matrix dequantized to bfloat16 at load and
streamed by ``genserve::matvec``; random valid Q4_K / Q6_K blocks of a real model's shapes
(default: Llama-3.2-1B's down projection [2048, 8192] and fused gate/up [16384, 2048]) at 1
and 8 rows.

Prints a markdown table: ms per call (best of ``--repeats``) and the weight bytes streamed per
second (GB/s) for each column.  ``--clock cpu`` times the process's CPU time instead of the
wall clock: on a machine shared with more runnable jobs than cores the wall clock mostly
measures the wait for a core (use it with ``--threads 1``).  Not a test: numbers depend on the
machine and on what else runs on it (docs/cpu/quantization-formats.md records a run).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from gguf import GGMLQuantizationType

from genserve.bench.int_dot_speed import _best_ms, cpu_name
from genserve.kernels import cpu as cpu_kernels
from genserve.kernels.int_dot import Isa
from genserve.model.kquants import FLOAT_PATH, KQuantWeight
from genserve.testing.tiny_gguf import random_blocks

DEFAULT_SHAPES = ((2048, 8192), (16384, 2048))  # [N, K]: Llama-3.2-1B down, gate_up


def _best_cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """The least process CPU time of ``repeats`` calls (after one warm-up call), in ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--formats", default="Q4_K,Q6_K")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args(argv)
    best_ms = _best_cpu_ms if args.clock == "cpu" else _best_ms
    if not cpu_kernels.load():
        print("genserve CPU kernels unavailable")
        return 1
    torch.set_num_threads(args.threads)
    isas = [Isa(i) for i in torch.ops.genserve.int_dot_isas()]
    print(
        f"CPU: {cpu_name()}, {args.threads} threads, {args.clock} clock; "
        f"integer paths: {[i.name for i in isas]}"
    )
    columns = ["bf16 matvec (before)", "float path"] + [f"int {i.name}" for i in isas]
    header = ["format", "N x K", "rows"] + [f"{c} ms (GB/s)" for c in columns]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for n, k in DEFAULT_SHAPES:
        for qtype in args.formats.split(","):
            raw = random_blocks(GGMLQuantizationType[qtype], n, k, seed=0)
            weight = KQuantWeight.from_blocks(raw, qtype)
            bf16 = weight.dequantize(torch.bfloat16)  # what loading used to keep
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                timed = [
                    (best_ms(partial(torch.ops.genserve.matvec, x, bf16, None), args.repeats),
                     bf16.nbytes),
                    (best_ms(partial(weight.serving(FLOAT_PATH).linear, x, None), args.repeats),
                     weight.nbytes),
                ]  # fmt: skip
                for isa in isas:
                    run = partial(weight.serving(int(isa)).linear, x, None)
                    timed.append((best_ms(run, args.repeats), weight.nbytes))
                cells = " | ".join(f"{ms:.3f} ({nbytes / ms / 1e6:.1f})" for ms, nbytes in timed)
                print(f"| {qtype} | {n} x {k} | {rows} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
