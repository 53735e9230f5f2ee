// The row jobs of kquant_cpu.cpp (GGUF K-quant weight rows against float or Q8_K-quantized
// activations), declared for the ops that run them on their own slices of weights and
// activations (moe_quant_cpu.cpp: one expert's rows at a time) without going through
// kquant_linear's whole-matrix entry point.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace genserve_kquant {

// Rows [row0, row0 + rows) of W, all of one type.
struct KSegment {
  const uint8_t* data;
  int64_t type, row0, rows, block_bytes, row_bytes;
};

// GGML type codes (gguf's GGMLQuantizationType) of the K-quants, as the ops' `types` lists
// carry them.
constexpr int64_t kQ4K = 12;
constexpr int64_t kQ5K = 13;
constexpr int64_t kQ6K = 14;

// Bytes of one 256-weight super-block of `type`; 0 for a type that is not a K-quant.
inline int64_t block_bytes_of(int64_t type) {
  switch (type) {
    case kQ4K:
      return 144;
    case kQ5K:
      return 176;
    case kQ6K:
      return 210;
    default:
      return 0;
  }
}

// W's rows as one segment per (type, row count) over `data` (contiguous uint8 CPU blocks, rows
// of K weights, K a multiple of 256), checked against the data's size; `op` names the caller
// in the error messages.
inline std::vector<KSegment> segments_of(const at::Tensor& data, at::IntArrayRef types,
                                         at::IntArrayRef rows, int64_t K, const char* op) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.is_contiguous(),
              op, ": contiguous uint8 CPU data expected");
  TORCH_CHECK(K > 0 && K % 256 == 0, op, ": K must be a positive multiple of 256");
  TORCH_CHECK(types.size() == rows.size() && !types.empty(), op,
              ": one row count per type expected");
  std::vector<KSegment> segments;
  int64_t row0 = 0, offset = 0;
  for (size_t s = 0; s < types.size(); ++s) {
    const int64_t bytes = block_bytes_of(types[s]);
    TORCH_CHECK(bytes > 0, op, ": type ", types[s], " is not Q4_K, Q5_K or Q6_K");
    TORCH_CHECK(rows[s] >= 0, op, ": negative row count");
    const int64_t row_bytes = K / 256 * bytes;
    segments.push_back(KSegment{data.data_ptr<uint8_t>() + offset, types[s], row0, rows[s],
                                bytes, row_bytes});
    row0 += rows[s];
    offset += rows[s] * row_bytes;
  }
  TORCH_CHECK(offset == data.numel(), op, ": data holds ", data.numel(),
              " bytes, the segments need ", offset);
  return segments;
}

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
  float* out;  // [M, n], or nullptr when the output is out_bf16
  // out += the product (kquant_linear_add_: the residual add of the one-op decode layer); only
  // without a bias, so that the sum is the per-op path's residual + y in the same rounding.
  bool accumulate = false;
  // xq with each 64 inputs' two 32-byte chunks interleaved by 16-bit words, as the AVX2 path
  // multiplies them for 2+ activation rows (kquant_int_row_pairs.inc); nullptr: that path
  // interleaves xq itself, per call of the runner.
  const int8_t* xq_paired = nullptr;
  // xq with each 128 inputs' middle 32-byte quarters swapped, the order the AVX512-VNNI path
  // unpacks Q4_K / Q5_K nibbles in (kquant_zmm_row.inc); nullptr: that path reorders xq
  // itself, per call of the runner.
  const int8_t* xq_nibble_order = nullptr;
  // A bfloat16 model's output [M, n], rounded to nearest even as it is stored (as the
  // .to(bfloat16) copy of a float32 output it replaces); never with `accumulate`.
  c10::BFloat16* out_bf16 = nullptr;

  const KSegment& segment_of(int64_t row) const {
    int64_t s = 0;
    while (s + 1 < num_segments && row >= segments[s + 1].row0) ++s;
    return segments[s];
  }
  void store(int64_t m_row, int64_t col, float v) const {
    if (out_bf16 != nullptr) {
      out_bf16[m_row * n + col] = c10::BFloat16(bias == nullptr ? v : v + bias[col]);
      return;
    }
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
// Q8_K quants x [rows, K] as KRowJob::xq_nibble_order wants them: each 128 inputs' middle
// 32-byte quarters swapped (inputs 0..31, 64..95, 32..63, 96..127), the order the AVX512-VNNI
// path unpacks Q4_K / Q5_K nibbles in; into out, or as a new tensor.
void nibble_order(const int8_t* x, int64_t rows, int64_t k, int8_t* out);
at::Tensor nibble_ordered(const at::Tensor& q);

}  // namespace genserve_kquant
