"""``python -m genserve.bench.kquant_speed``: op-level timing of the decode-step matmuls on
each weight format a GGUF file brings, at a real model's shapes and 1 / 8 rows, against the
machine's measured read bandwidth.

* K-quants (Q4_K, Q5_K, Q6_K): ``genserve::kquant_linear``, its float path and each integer
  path this CPU has (and, with ``--bf16``, what genserve served K-quant files with before: the
  matrix dequantized to bfloat16 and streamed by ``genserve::matvec``);
* Q8_0, Q4_0: ``genserve::int_dot_linear`` (each integer path; the layout of
  ``model/int_dot_panels.py``) and the float path ``genserve::qpanel_linear``;
* F16: the bfloat16 matrix genserve serves an F16 file as, by ``genserve::matvec``.

Random valid blocks (``testing.tiny_gguf.random_blocks``) or random float weights quantized.
``--shapes 1b`` (the default) is Llama-3.2-1B's every decode matmul as genserve runs them
(qkv fused [3072, 2048], o [2048, 2048], k / v [512, 2048], gate or up [8192, 2048], gate_up
fused [16384, 2048], down [2048, 8192] and the tied output [49152, 2048]); ``--shapes mlp``
the fused MLP pair only.

Each call multiplies the next of several copies of the matrix (``--cold-mib``, 256 by
default), so its weights come from memory, not from a cache they would fit (a decode step
reads 16 layers' matrices before it meets the first one again).  Prints a markdown table: ms
per call (best of ``--repeats``), the weight bytes streamed per second (GB/s) and that as a
share of the read bandwidth ``machine_limits`` measures on the same threads (a buffer far
past the L3, summed).  A one-row matvec at the bandwidth is as fast
as that format can go; one well under it is compute- or overhead-bound.  ``--cpu-features-mask``
(``GENSERVE_CPU_FEATURES_MASK`` by default) hides CPU features from the kernels' choices, as the
server's flag does (e.g. ``avx2``: an AVX2-only CPU, the AVX2-level library; set
``ATEN_CPU_CAPABILITY=avx2`` beside it).  ``--clock cpu`` times
the process's CPU time instead of the wall clock (with ``--threads 1`` on a busy machine).
Not a test: numbers depend on the machine and on what else runs on it
(docs/cpu/quantization-formats.md and docs/benchmarks/cpu.md record runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from gguf import GGMLQuantizationType

from genserve.bench.int_dot_speed import _best_ms, cpu_name, q4_0, q8_0
from genserve.bench.machine_limits import read_bandwidth_gb_s
from genserve.kernels import cpu as cpu_kernels
from genserve.kernels.cpu_features import parse_mask
from genserve.kernels.int_dot import Isa
from genserve.model.int_dot_panels import IntDotPanels
from genserve.model.kquants import FLOAT_PATH, KQuantWeight
from genserve.model.weight_panels import QuantizedPanels
from genserve.testing.tiny_gguf import random_blocks

SHAPES: dict[str, tuple[tuple[int, int], ...]] = {  # [N, K]
    "1b": (
        (3072, 2048),
        (2048, 2048),
        (512, 2048),
        (8192, 2048),
        (16384, 2048),
        (2048, 8192),
        (49152, 2048),
    ),
    "mlp": ((2048, 8192), (16384, 2048)),
}
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")


def _best_cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """The least process CPU time of ``repeats`` calls (after one warm-up call), in ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


Run = tuple[str, Callable[[torch.Tensor], object], int]  # (column, x -> product, bytes)


def _copies(nbytes: int, cold_bytes: int) -> int:
    """How many copies of a matrix of ``nbytes`` make ``cold_bytes`` (at least one)."""
    return max(1, -(-cold_bytes // max(1, nbytes)))


def _rotating(fns: Sequence[Callable[[torch.Tensor], object]]) -> Callable[[torch.Tensor], object]:
    """Each call runs the next of ``fns``: copies of one matrix whose sum is far past the
    last-level cache, so each call reads its weights from memory as a decode step does (a
    1B model's step reads 16 layers' matrices before it meets the first one again)."""
    state = [0]

    def run(x: torch.Tensor) -> object:
        state[0] = (state[0] + 1) % len(fns)
        return fns[state[0]](x)

    return run


def _kquant_runs(fmt: str, n: int, k: int, isas: list[Isa], bf16: bool, cold: int) -> list[Run]:
    raw = random_blocks(GGMLQuantizationType[fmt], n, k, seed=0)
    first = KQuantWeight.from_blocks(raw, fmt)
    weights = [first] + [
        dataclasses.replace(first, data=first.data.clone())
        for _ in range(_copies(first.nbytes, cold) - 1)
    ]
    runs: list[Run] = []
    if bf16:
        dense = first.dequantize(torch.bfloat16)
        runs.append(("bf16 matvec", partial(_matvec, dense), dense.nbytes))
    paths = [("float", FLOAT_PATH)] + [(isa.name, int(isa)) for isa in isas]
    for name, path in paths:
        fns = [partial(_linear, w.serving(path)) for w in weights]
        runs.append((name, _rotating(fns), first.nbytes))
    return runs


def _block_runs(fmt: str, n: int, k: int, isas: list[Isa], cold: int) -> list[Run]:
    quant = (q8_0 if fmt == "Q8_0" else q4_0)(torch.randn(n, k) * 0.02)
    file_bytes = n * k // 32 * (34 if fmt == "Q8_0" else 18)  # the GGUF blocks' bytes
    copies = _copies(file_bytes, cold)
    panels = [QuantizedPanels.pack(quant) for _ in range(copies)]
    ints = [IntDotPanels.pack(quant) for _ in range(copies)]
    runs: list[Run] = [("float", _rotating([partial(_linear, p) for p in panels]), file_bytes)]
    for isa in isas:
        fns = [partial(_int_linear, p, isa) for p in ints]
        runs.append((isa.name, _rotating(fns), file_bytes))
    return runs


def _dense_runs(n: int, k: int, cold: int) -> list[Run]:
    first = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    dense = [first] + [first.clone() for _ in range(_copies(first.nbytes, cold) - 1)]
    return [("bf16 matvec", _rotating([partial(_matvec, d) for d in dense]), first.nbytes)]


def _matvec(w: torch.Tensor, x: torch.Tensor) -> object:
    return torch.ops.genserve.matvec(x, w, None)


def _linear(w: KQuantWeight | QuantizedPanels, x: torch.Tensor) -> object:
    return w.linear(x, None)


def _int_linear(w: IntDotPanels, isa: Isa, x: torch.Tensor) -> object:
    return w.linear(x, None, isa)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--formats", default="Q4_K,Q6_K,Q4_0,Q8_0,F16")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--isas", default="best", help="'best', 'all' or names (AVX2,...)")
    parser.add_argument("--bf16", action="store_true", help="K-quants dequantized to bf16 too")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument(
        "--cold-mib",
        type=int,
        default=256,
        help="rotate over copies of each matrix adding up to this many MiB, so that weights "
        "come from memory as in a decode step (0: one copy, cache-warm when it fits)",
    )
    parser.add_argument(
        "--cpu-features-mask",
        default=os.environ.get("GENSERVE_CPU_FEATURES_MASK", ""),
        help="CPU features the kernels treat as absent (kernels/cpu_features.py: e.g. avx2)",
    )
    args = parser.parse_args(argv)
    cold = args.cold_mib << 20
    try:
        hidden = parse_mask(args.cpu_features_mask)
    except ValueError as exc:
        raise SystemExit(f"--cpu-features-mask: {exc}") from None
    cpu_kernels.configure(hidden_features=hidden)
    best_ms = _best_cpu_ms if args.clock == "cpu" else _best_ms
    if not cpu_kernels.load():
        print("genserve CPU kernels unavailable")
        return 1
    torch.set_num_threads(args.threads)
    available = [Isa(i) for i in torch.ops.genserve.int_dot_isas()]
    if args.isas == "best":
        isas = available[-1:]
    elif args.isas == "all":
        isas = available
    else:
        isas = [i for i in available if i.name in args.isas.split(",")]
    read = read_bandwidth_gb_s()
    print(
        f"CPU: {cpu_name()}, {args.threads} threads, {args.clock} clock; integer paths "
        f"timed: {[i.name for i in isas]}; hidden features {list(hidden)}; read bandwidth "
        f"{read:.1f} GB/s"
    )
    print("| format | N x K | rows | path | ms | GB/s | % of read |\n|---|---|---|---|---|---|---|")
    for n, k in SHAPES[args.shapes]:
        for fmt in args.formats.split(","):
            if fmt in K_FORMATS:
                runs = _kquant_runs(fmt, n, k, isas, args.bf16, cold)
            elif fmt in ("Q8_0", "Q4_0"):
                runs = _block_runs(fmt, n, k, isas, cold)
            elif fmt == "F16":
                runs = _dense_runs(n, k, cold)
            else:
                raise SystemExit(f"unknown format {fmt}")
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                for name, fn, nbytes in runs:
                    ms = best_ms(partial(fn, x), args.repeats)
                    gb_s = nbytes / ms / 1e6
                    print(
                        f"| {fmt} | {n} x {k} | {rows} | {name} | {ms:.3f} | {gb_s:.1f} | "
                        f"{100 * gb_s / read:.0f}% |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
