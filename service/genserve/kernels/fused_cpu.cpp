// Fused elementwise ops of a Llama layer on CPU, in float32 and half precision.
//
// On the default model a decode step's matmuls run near the machine's peak, and what is left
// is dominated by small elementwise ops: each norm is ~8 torch ops, the rotary embedding 5,
// the gated MLP activation 2, every one paying dispatch and a pass over memory.  Each op here
// does the same arithmetic in one pass per row, rounding to the storage dtype at the same
// points the torch path does (so results match it, up to the order of the float32 sum inside
// the norm and the last bit of silu's exp).  In float32 the "rounding" is a no-op, and the
// products and sums of rotary and silu_and_mul must stay separately rounded operations as in
// torch: hence no fused multiply-add contraction in this file.
//
//   rms_norm(x, w, eps)           w * to_dtype(x_f * rsqrt(mean(x_f^2) + eps))
//   add_rms_norm(x, r, w, eps)    r' = to_dtype(x + r); (r', rms_norm(r', w, eps))
//   silu_and_mul(gate_up)         to_dtype(to_dtype(silu(gate)) * up)
//   rotary(x, cos, signed_sin)    to_dtype(to_dtype(x * cos) + to_dtype(swap_halves(x) * sin))

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "genserve_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "matvec_core.h"
#include "vec_math.h"

// x * c + y * s must not become fma(x, c, y * s): torch rounds the product first.
#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);  // round to nearest even, as torch's .to(dtype)
}

// Rows per task: enough work per task that small (decode) batches stay on one thread.
inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* o = out + r * n;
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < n; ++i) sq += f32(xr[i]) * f32(xr[i]);
      const float inv = 1.0f / std::sqrt(sq / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        o[i] = round_to<T>(f32(w[i]) * f32(round_to<T>(f32(xr[i]) * inv)));
      }
    }
  });
}

template <typename T>
void add_rows(const T* x, const T* r, T* out, int64_t numel) {
  at::parallel_for(0, numel, 32768, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) out[i] = round_to<T>(f32(x[i]) + f32(r[i]));
  });
}

template <typename T>
void silu_and_mul_rows(const T* gu, T* out, int64_t rows, int64_t n) {
  // Two passes over a stack chunk: the exp, then the division and product.  Written as one
  // loop, g / (1 + exp(-g)) compiled (GCC 12) into masked code whose speed depends on the
  // data: ~9 cycles per element on activations against ~1.2 this way, same operations and
  // the same result.
  constexpr int64_t kChunk = 256;
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t begin, int64_t end) {
    float denom[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gu + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int64_t m = std::min(kChunk, n - c0);
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) denom[i] = 1.0f + genserve::exp_approx(-f32(gate[c0 + i]));
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) {
          const T act = round_to<T>(f32(gate[c0 + i]) / denom[i]);
          o[c0 + i] = round_to<T>(f32(act) * f32(up[c0 + i]));
        }
      }
    }
  });
}

// x: token t's heads at x + t * x_stride (a column slice of the qkv projection's output, read
// in place), out contiguous.
template <typename T>
void rotary_rows(const T* x, int64_t x_stride, const T* cos, const T* sin, T* out,
                 int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * x_stride + h * dim;
        T* o = out + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) {
          const int64_t j = i < half ? i + half : i - half;  // swap the halves
          const T a = round_to<T>(f32(xr[i]) * f32(c[i]));
          const T b = round_to<T>(f32(xr[j]) * f32(s[i]));
          o[i] = round_to<T>(f32(a) + f32(b));
        }
      }
    }
  });
}

void check_half(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf ||
                  t.scalar_type() == at::kFloat,
              name, " must be float32, bfloat16 or float16");
}

#define GENSERVE_DISPATCH_HALF(dtype, ...)                     \
  switch (dtype) {                                             \
    case at::kFloat: {                                         \
      using scalar_t = float;                                  \
      __VA_ARGS__();                                           \
      break;                                                   \
    }                                                          \
    case at::kBFloat16: {                                      \
      using scalar_t = c10::BFloat16;                          \
      __VA_ARGS__();                                           \
      break;                                                   \
    }                                                          \
    case at::kHalf: {                                          \
      using scalar_t = c10::Half;                              \
      __VA_ARGS__();                                           \
      break;                                                   \
    }                                                          \
    default:                                                   \
      TORCH_CHECK(false, "unsupported dtype ", dtype);         \
  }

}  // namespace

// Entry points, also called directly by decode_layer_cpu.cpp (genserve_ops.h).
namespace genserve_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_half(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                  x.size(-1) == weight.size(0),
              "weight must be [hidden] of x's dtype");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t n = xc.size(-1);
  GENSERVE_DISPATCH_HALF(x.scalar_type(), [&] {
    rms_norm_rows(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                  xc.numel() / n, n, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_half(x, "x");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  const auto xc = x.contiguous();
  const auto rc = residual.contiguous();
  auto summed = at::empty_like(xc);
  GENSERVE_DISPATCH_HALF(x.scalar_type(), [&] {
    add_rows(xc.data_ptr<scalar_t>(), rc.data_ptr<scalar_t>(), summed.data_ptr<scalar_t>(),
             xc.numel());
  });
  return {summed, rms_norm(summed, weight, eps)};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_half(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * n]");
  const auto gc = gate_up.contiguous();
  const int64_t n = gc.size(1) / 2;
  auto out = at::empty({gc.size(0), n}, gc.options());
  GENSERVE_DISPATCH_HALF(gate_up.scalar_type(), [&] {
    silu_and_mul_rows(gc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gc.size(0), n);
  });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  check_half(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be [tokens, heads, even head_dim]");
  const int64_t tokens = x.size(0), dim = x.size(2);
  for (const auto* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->numel() == tokens * dim,
                "cos/sin must be [tokens, 1, head_dim] of x's dtype");
  }
  const auto xc = genserve_ops::rows_in_place(x);
  const auto cc = cos.contiguous();
  const auto sc = signed_sin.contiguous();
  auto out = at::empty(xc.sizes(), xc.options());
  GENSERVE_DISPATCH_HALF(x.scalar_type(), [&] {
    rotary_rows(xc.data_ptr<scalar_t>(), xc.stride(0), cc.data_ptr<scalar_t>(),
                sc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), tokens, xc.size(1), dim);
  });
  return out;
}

// rotary(qk) and the step's K/V stored in one call (the CPU decode path): qk is
// [tokens, heads + kv_heads, head_dim] (Q heads then K heads), v [tokens, kv_heads, head_dim],
// kv_cache [2, kv_heads, blocks, block_size, head_dim] contiguous, slots [tokens] the flat
// block * block_size + offset of each token.  Returns rotated qk; writes rotated K and V into
// the cache, as TorchAttentionMetadata.write_kv's two index_copy_ calls do, minus their
// Python and the transposed views they copy through.
at::Tensor rotary_write_kv(const at::Tensor& qk, const at::Tensor& cos,
                           const at::Tensor& signed_sin, const at::Tensor& v,
                           const at::Tensor& kv_cache, const at::Tensor& slots) {
  auto out = rotary(qk, cos, signed_sin);
  const int64_t tokens = out.size(0), heads = out.size(1), dim = out.size(2);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(4) == dim &&
                  kv_cache.is_contiguous() && kv_cache.scalar_type() == out.scalar_type(),
              "kv_cache must be a contiguous [2, kv_heads, blocks, block_size, head_dim] of "
              "qk's dtype");
  const int64_t kv_heads = kv_cache.size(1);
  const int64_t capacity = kv_cache.size(2) * kv_cache.size(3);
  TORCH_CHECK(heads > kv_heads && v.dim() == 3 && v.size(0) == tokens && v.size(1) == kv_heads &&
                  v.size(2) == dim && v.scalar_type() == out.scalar_type(),
              "v must be [tokens, kv_heads, head_dim] of qk's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens, "slots: [tokens] int64");
  const auto vc = genserve_ops::rows_in_place(v);
  const auto sl = slots.contiguous();
  const int64_t* slot = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " outside the cache");
  const int64_t row_bytes = dim * out.element_size();
  const char* src_k = static_cast<const char*>(out.data_ptr());
  const char* src_v = static_cast<const char*>(vc.data_ptr());
  const int64_t v_stride = vc.stride(0);
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t q_heads = heads - kv_heads;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t k_at = (h * capacity + slot[t]) * row_bytes;
      const int64_t v_at = ((kv_heads + h) * capacity + slot[t]) * row_bytes;
      std::memcpy(cache + k_at, src_k + ((t * heads) + q_heads + h) * row_bytes, row_bytes);
      std::memcpy(cache + v_at, src_v + (t * v_stride + h * dim) * out.element_size(),
                  row_bytes);
    }
  }
  return out;
}

// Each row's first maximum, the maximum itself and log(sum(exp(row - maximum))): what a
// sampling step of greedy rows needs from the logits (the chosen token's log-probability is
// (x[t] - peak) - log_total, log_softmax's formula) without writing a [rows, vocab]
// log_softmax.  Two passes over each row, rows over the threads.  A row holding NaN or +inf,
// or only -inf, gives a non-finite log_total, and the caller then takes torch's path.
std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_stats(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.size(1) > 0,
              "greedy_stats: float32 CPU logits [rows, vocab] expected");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto argmax = at::empty({rows}, x.options().dtype(at::kLong));
  auto peak = at::empty({rows}, x.options());
  auto log_total = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* ap = argmax.data_ptr<int64_t>();
  float* pp = peak.data_ptr<float>();
  float* lp = log_total.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * vocab;
      // Per-lane best value and its first index, then the lanes' best (lowest index on ties).
      using genserve_vec::f32v;
      using genserve_vec::i32v;
      using genserve_vec::kLanes;
      float top = row[0];
      int64_t top_at = 0;
      int64_t j = 1;
      if (vocab >= 2 * kLanes && vocab < (int64_t{1} << 31)) {
        f32v best = genserve_vec::load16(row);
        i32v at, index;
        for (int l = 0; l < kLanes; ++l) at[l] = l;
        index = at;
        for (j = kLanes; j + kLanes <= vocab; j += kLanes) {
          index += static_cast<int32_t>(kLanes);
          const f32v v = genserve_vec::load16(row + j);
          const i32v better = v > best;
          best = better ? v : best;
          at = better ? index : at;
        }
        top = best[0];
        top_at = at[0];
        for (int l = 1; l < kLanes; ++l) {
          if (best[l] > top || (best[l] == top && at[l] < top_at)) {
            top = best[l];
            top_at = at[l];
          }
        }
      }
      for (; j < vocab; ++j) {  // the tail, or a short row
        if (row[j] > top) {
          top = row[j];
          top_at = j;
        }
      }
      // float32 sums of 1024 terms, added in double: a whole 49152-term row summed in float32
      // lanes drifts by ~5e-6 (relative), more than torch's log_softmax does.
      constexpr int64_t kSumChunk = 1024;
      double total = 0.0;
      for (int64_t c0 = 0; c0 < vocab; c0 += kSumChunk) {
        const int64_t c1 = std::min(vocab, c0 + kSumChunk);
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int64_t j = c0; j < c1; ++j) part += genserve::exp_approx(row[j] - top);
        total += part;
      }
      ap[r] = top_at;
      pp[r] = top;
      lp[r] = std::isfinite(top) ? static_cast<float>(std::log(total))
                                 : std::numeric_limits<float>::quiet_NaN();
    }
  });
  return {argmax, peak, log_total};
}

}  // namespace genserve_ops

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("rotary_write_kv(Tensor qk, Tensor cos, Tensor signed_sin, Tensor v, Tensor(a!) kv_cache, "
        "Tensor slots) -> Tensor");
  m.def("greedy_stats(Tensor logits) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("rms_norm", &genserve_ops::rms_norm);
  m.impl("add_rms_norm", &genserve_ops::add_rms_norm);
  m.impl("silu_and_mul", &genserve_ops::silu_and_mul);
  m.impl("rotary", &genserve_ops::rotary);
  m.impl("rotary_write_kv", &genserve_ops::rotary_write_kv);
  m.impl("greedy_stats", &genserve_ops::greedy_stats);
}
