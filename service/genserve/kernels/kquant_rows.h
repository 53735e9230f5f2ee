// The row jobs of kquant_cpu.cpp (GGUF K-quant weight rows against float or Q8_K-quantized
// activations), declared for the ops that run them on their own slices of weights and
// activations (moe_quant_cpu.cpp: one expert's rows at a time) without going through
// kquant_linear's whole-matrix entry point.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace genserve_kquant {

// Rows [row0, row0 + rows) of W, all of one type.
struct KSegment {
  const uint8_t* data;
  int64_t type, row0, rows, block_bytes, row_bytes;
};

struct KRowJob {
  // The integer path's activations (Q8_K): q [M, K], d [M, K / 256], Σq [M, K / 16].
  const int8_t* xq;
  const float* xd;
  const int16_t* xsums;
  const float* xf;  // the float path's activations [M, K]
  int64_t k, m, n;  // n: the row stride of `out` (the output width)
  const KSegment* segments;
  int64_t num_segments;
  int64_t type, block_bytes;  // of the row being computed
  const float* bias;
  float* out;  // [M, n]
  // out += the product (kquant_linear_add_: the residual add of the one-op decode layer); only
  // without a bias, so that the sum is the per-op path's residual + y in the same rounding.
  bool accumulate = false;

  const KSegment& segment_of(int64_t row) const {
    int64_t s = 0;
    while (s + 1 < num_segments && row >= segments[s + 1].row0) ++s;
    return segments[s];
  }
  void store(int64_t m_row, int64_t col, float v) const {
    float& o = out[m_row * n + col];
    if (accumulate) {
      // The finished sum first: under -fassociative-math the compiler may otherwise start
      // the horizontal sum's chain from `o` (o + v0 + v1 + ...), which rounds otherwise than
      // the per-op path's residual + y.  An empty asm makes v opaque, at no cost.
#if defined(__x86_64__)
      __asm__("" : "+x"(v));
#elif defined(__aarch64__)
      __asm__("" : "+w"(v));
#else
      __asm__("" : "+m"(v));
#endif
      o += v;
    } else {
      o = bias == nullptr ? v : v + bias[col];
    }
  }
};

// Computes output columns [n0, n1) of a job (weight rows n0..n1) for all its m rows.
using RunRows = void (*)(const KRowJob&, int64_t, int64_t);

// The float path (weights dequantized as gguf-py does, float32 activations).
RunRows float_runner();
// The integer path on instruction set `isa` (int_dot.h's codes); nullptr where this CPU lacks it.
RunRows int_runner(int64_t isa);
// x [M, K] (float32, contiguous, K a multiple of 256) as the integer path's Q8_K activations:
// (q int8 [M, K], d float32 [M, K / 256], Σq int16 [M, K / 16]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_q8k(const at::Tensor& x32);

}  // namespace genserve_kquant
