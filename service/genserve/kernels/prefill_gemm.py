"""When a quantized matmul of many rows (a prompt chunk) decodes its weights to bfloat16 and
runs torch's bfloat16 GEMM (``genserve::kquant_linear_bf16`` for K-quants,
``genserve::int_dot_linear_bf16`` for the block formats; ``kernels/prefill_gemm_cpu.cpp``)
instead of the integer kernels (``genserve::kquant_linear``, ``genserve::int_dot_linear``).

The integer kernels multiply each decoded block by a few activation rows at a time; past a few
dozen rows oneDNN's bfloat16 GEMM (VDPBF16PS / AMX-BF16) is faster, and the decode to bfloat16
is paid once per matmul for all rows (docs/cpu/prefill.md).  Where the CPU has no native bfloat16
product oneDNN emulates it, so the integer kernel stays.  Only on the integer path
(``--cpu-int-dot auto|on``): the float path's numerics (``off``) are kept as they are, and
``--deterministic`` keeps one code path per row (the choice here depends on the batch).

Where the CPU has no native bfloat16 product (AVX2-only parts such as AMD Zen 3, AVX-512 parts
without AVX512-BF16), K-quant prompt chunks take ``genserve::kquant_linear_int_gemm``
(``kernels/prefill_int_gemm_cpu.cpp``) instead: the integer path's own numerics, register-tiled
over weight and activation rows (:func:`int_gemm_min_rows`; docs/benchmarks/cpu-avx2.md).
"""

from __future__ import annotations

import os

import torch

from genserve.kernels import cpu as cpu_kernels

# K-quants: rows from which the bfloat16 GEMM runs.  Tuned on AMD EPYC (Zen 4, AVX512-BF16 and
# AVX512-VNNI, no AMX), 1 thread, Llama-3.2-1B's shapes (docs/cpu/prefill.md): the crossover
# with the integer kernel lies between 32 and 64 rows there.
BF16_MIN_ROWS = 64
# The block formats (Q8_0, Q4_0, Q4_1): never by default.  Their integer kernel (8-row VNNI
# tiles) measured as fast as oneDNN's bfloat16 GEMM at 256 rows on the same CPU (104-115
# against 97-102 GMAC/s per core with the decode), so the decode would only add work there.
BLOCK_BF16_MIN_ROWS = 0
# With AMX tiles oneDNN's bfloat16 GEMM runs ~1,000 GFLOP/s a core-pair, and the block formats
# cross over at 128 rows (Intel Xeon with AMX, 2 threads, 1B shapes, session 17: 1.00-1.09x the
# integer kernel at 128 rows, 1.64-1.79x at 256; 0.6-0.7x at 64).  K-quants cross at 64 there
# too (1.00-1.18x), so BF16_MIN_ROWS holds on both kinds of CPU.
BLOCK_BF16_MIN_ROWS_AMX = 128
# Override the two thresholds (0: never), for measuring one path against the other.
ENV_MIN_ROWS = "GENSERVE_KQUANT_BF16_ROWS"
ENV_BLOCK_MIN_ROWS = "GENSERVE_BLOCK_BF16_ROWS"
# K-quants on CPUs without a native bfloat16 product: rows from which the integer GEMM runs
# instead of the one-row-at-a-time integer kernel.  Emulated AVX2-only on Zen 4, 1 thread,
# Llama-3.2-1B shapes (docs/benchmarks/cpu-avx2.md): 0.98-1.13x the one-row kernel at 8 rows,
# 1.18-1.24x at 16, 1.47-2.07x at 256.  GENSERVE_KQUANT_INT_GEMM_ROWS overrides it (0: never).
INT_GEMM_MIN_ROWS = 16
ENV_INT_GEMM_MIN_ROWS = "GENSERVE_KQUANT_INT_GEMM_ROWS"


def bf16_min_rows(blocks: bool = False) -> int:
    """Activation rows from which matmuls on the integer path take the bfloat16 GEMM here:
    K-quant matrices, or with ``blocks`` those in ``IntDotPanels``' layout; 0 where they
    never do (no native bfloat16 product, no kernels, deterministic mode, or by default for
    the block formats on CPUs without AMX tiles)."""
    if not cpu_kernels.load() or cpu_kernels.batch_invariant():
        return 0
    if not bool(torch.ops.genserve.bf16_gemm_native()):
        return 0
    override = os.environ.get(ENV_BLOCK_MIN_ROWS if blocks else ENV_MIN_ROWS, "").strip()
    if override:
        return max(0, int(override))
    if not blocks:
        return BF16_MIN_ROWS
    return BLOCK_BF16_MIN_ROWS_AMX if cpu_kernels.amx_bf16() else BLOCK_BF16_MIN_ROWS


def int_gemm_min_rows() -> int:
    """Activation rows from which K-quant matmuls on the integer path take the register-tiled
    integer GEMM here; 0 where they never do (the bfloat16 GEMM serves many rows, no kernels,
    no AVX2, or deterministic mode)."""
    if not cpu_kernels.load() or cpu_kernels.batch_invariant():
        return 0
    if bool(torch.ops.genserve.bf16_gemm_native()):
        return 0
    if not bool(torch.ops.genserve.kquant_int_gemm_available()):
        return 0
    override = os.environ.get(ENV_INT_GEMM_MIN_ROWS, "").strip()
    if override:
        return max(0, int(override))
    return INT_GEMM_MIN_ROWS
