"""What this machine can do at best for a decode step: its memory read bandwidth and its
float32 matmul rate, and the tokens/s ceilings they imply for a given model.

* Single-stream decode multiplies one row by every weight matrix: it must read all the
  weight bytes once per step, so ``read_bandwidth / weight_bytes`` steps per second is its
  ceiling (KV and activations are a few hundred KB, ignored).
* Many-stream decode (32 rows) reuses each weight 32 times: it is bounded by arithmetic,
  ``2 * params`` flops per token at the machine's float32 GEMM rate for that shape.

Both are measured, not taken from a spec sheet: VMs and shared hosts differ a lot.  The read
benchmark sums a buffer far larger than the last-level cache (torch's vectorised,
multi-threaded reduction does ~1 add per loaded float, well under the core's peak), best of
several repeats so that a neighbour's burst does not count against the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

# Well past any L3 we expect to meet (the Xeons of these sessions report 260-480 MiB).
_READ_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class MachineLimits:
    read_gb_s: float  # DRAM read bandwidth, GB/s (10^9 bytes)
    matmul_gflop_s: float  # float32 F.linear at the model's shapes, ``rows`` rows
    matmul_rows: int
    threads: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Per-token work of a decoder: the matrices every decode step reads."""

    matmul_params: int  # weights multiplied per token (layers' projections + LM head)
    shapes: tuple[tuple[int, int], ...]  # (out, in) of each distinct projection, per layer

    def weight_bytes(self, bytes_per_param: float) -> float:
        return self.matmul_params * bytes_per_param

    def bandwidth_tok_s(self, limits: MachineLimits, bytes_per_param: float) -> float:
        """Single-stream ceiling: one full read of the weights per token."""
        return limits.read_gb_s * 1e9 / self.weight_bytes(bytes_per_param)

    def matmul_tok_s(self, limits: MachineLimits) -> float:
        """Batched ceiling: 2 flops per weight per token at the measured GEMM rate."""
        return limits.matmul_gflop_s * 1e9 / (2 * self.matmul_params)


def model_cost(
    hidden: int,
    intermediate: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab: int,
) -> ModelCost:
    """Llama-family cost: fused QKV, O, fused gate/up, down per layer, then the LM head."""
    qkv = ((num_heads + 2 * num_kv_heads) * head_dim, hidden)
    o = (hidden, num_heads * head_dim)
    gate_up = (2 * intermediate, hidden)
    down = (hidden, intermediate)
    per_layer = sum(a * b for a, b in (qkv, o, gate_up, down))
    return ModelCost(per_layer * num_layers + vocab * hidden, (qkv, o, gate_up, down))


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first touch / warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_gb_s(num_bytes: int = _READ_BYTES, repeats: int = 7) -> float:
    """Best-of-``repeats`` GB/s of one full read of a ``num_bytes`` float32 buffer."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: buf.sum(), repeats)
    return num_bytes / seconds / 1e9


def matmul_gflop_s(shapes: tuple[tuple[int, int], ...], rows: int, repeats: int = 7) -> float:
    """Best-of GFLOP/s of float32 ``F.linear`` with ``rows`` rows over ``shapes`` (out, in),
    one matrix per shape, all in a loop as a layer runs them."""
    weights = [torch.randn(out, inp) for out, inp in shapes]
    inputs = [torch.randn(rows, inp) for _, inp in shapes]
    flops = sum(2 * rows * out * inp for out, inp in shapes)

    def run() -> None:
        for _ in range(8):
            for x, w in zip(inputs, weights, strict=True):
                F.linear(x, w)

    return 8 * flops / _best_seconds(run, repeats) / 1e9


def measure(cost: ModelCost, rows: int = 32) -> MachineLimits:
    """Both limits, on the current torch thread count."""
    return MachineLimits(
        read_gb_s=read_bandwidth_gb_s(),
        matmul_gflop_s=matmul_gflop_s(cost.shapes, rows),
        matmul_rows=rows,
        threads=torch.get_num_threads(),
    )


def best(measured: list[MachineLimits]) -> MachineLimits:
    """The best read bandwidth and matmul rate among several measurements of one machine
    (same rows and threads)."""
    if not measured:
        raise ValueError("no measurement")
    return replace(
        measured[0],
        read_gb_s=max(m.read_gb_s for m in measured),
        matmul_gflop_s=max(m.matmul_gflop_s for m in measured),
    )
