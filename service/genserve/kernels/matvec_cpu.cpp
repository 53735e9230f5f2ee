// Weight-streaming matmul for decode steps: y = x W^T (+ b), W [N, K] stored in float32,
// bfloat16 or float16, x [M, K] with M small (up to 8 in registers; more in chunks over each block of W
// kept in L1), every product accumulated in float32.
//
// With one to a few rows a decode step is a matrix-vector product: each weight is used M
// times, so the cost is reading W once, and the only goal is to stream W at the memory
// bandwidth.  torch's CPU GEMMs are tuned for the other regime (MKL's float32 path at one row
// measured ~55 GB/s on 7 MB of weights; bfloat16 at one row is slower still, because oneDNN
// converts and packs per call).  Here each thread streams its own contiguous band of W rows,
// four at a time, converting bf16 to float32 in registers (a shift: bf16 is float32's high
// half), with 4 * M independent vector accumulators so FMA latency is hidden.
//
// bf16 x bf16 (a bfloat16 model's steps) goes to VDPBF16PS where the CPU has AVX512-BF16
// (matvec_bf16dot_cpu.cpp: the same products, half the instructions at 8 rows).
//
// The vector type is GCC's generic vector of one register's width (AVX-512 when built with
// -march=x86-64-v4, AVX2 with x86-64-v3), so the same source serves both ISA builds
// (genserve.kernels.cpu names the build after the level torch detected at run time).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "genserve_ops.h"

#include <cstdint>

#include "matvec_amx.h"
#include "matvec_bf16dot.h"
#include "matvec_core.h"

namespace {

using namespace genserve_vec;

template <int M, typename W>
void matvec_rows(const float* x, const W* w, int64_t K, int64_t N, float* out) {
  // Four W rows per block for one or two x rows, fewer as M grows (registers: O * M + M
  // accumulators and inputs out of 32 AVX-512 / 16 AVX2 vector registers).  Two W rows up to
  // 8 x rows with AVX-512 (26 registers): each x vector loaded serves two W rows, where at one
  // W row the step was bound by its 8 x loads per 16 weights.
  constexpr int O = M <= 2 ? 4 : (M <= 4 || kLanes >= 16 ? 2 : 1);
  // Each task streams >= 256 KiB of W, so a small matrix stays on one thread.
  const int64_t grain = std::max<int64_t>(O, (1 << 18) / std::max<int64_t>(1, K * sizeof(W)));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    // The task's band of rows is cut into O sub-bands walked side by side (a block takes
    // one row of each): O sequential streams per core keep more lines in flight than one.
    // bf16, one row: 19-23 -> 24-29 GB/s on the default model's matrices (2 AVX-512 cores).
    const int64_t per = (end - begin) / O;
    for (int64_t i = 0; i < per; ++i) dot_block<M, O>(x, w, K, N, begin + i, out, per);
    for (int64_t o = begin + O * per; o < end; ++o) dot_block<M, 1>(x, w, K, N, o, out);
  });
}

// More rows than one block's accumulators hold: each block of four W rows (a few KB, kept in
// L1) is applied to the rows of x a few at a time, so W is still read from memory once.
constexpr int kChunk = kLanes >= 16 ? 4 : 2;

template <typename W>
void matmul_chunked(const float* x, const W* w, int64_t M, int64_t K, int64_t N, float* out) {
  constexpr int O = 4;
  const int64_t grain = std::max<int64_t>(O, (1 << 16) / std::max<int64_t>(1, K * sizeof(W)));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + O <= end; o += O) {
      int64_t r = 0;
      for (; r + kChunk <= M; r += kChunk) {
        dot_block<kChunk, O>(x + r * K, w, K, N, o, out + r * N);
      }
      for (; r < M; ++r) dot_block<1, O>(x + r * K, w, K, N, o, out + r * N);
    }
    for (; o < end; ++o) {
      for (int64_t r = 0; r < M; ++r) dot_block<1, 1>(x + r * K, w, K, N, o, out + r * N);
    }
  });
}

template <typename W>
void dispatch_rows(int64_t M, const float* x, const W* w, int64_t K, int64_t N, float* out) {
  switch (M) {
    case 1: return matvec_rows<1>(x, w, K, N, out);
    case 2: return matvec_rows<2>(x, w, K, N, out);
    case 3: return matvec_rows<3>(x, w, K, N, out);
    case 4: return matvec_rows<4>(x, w, K, N, out);
    case 5: return matvec_rows<5>(x, w, K, N, out);
    case 6: return matvec_rows<6>(x, w, K, N, out);
    case 7: return matvec_rows<7>(x, w, K, N, out);
    case 8: return matvec_rows<8>(x, w, K, N, out);
    default: return matmul_chunked(x, w, M, K, N, out);
  }
}

}  // namespace

namespace genserve_ops {
namespace {

// x (float32) as bfloat16 where every value is one exactly (its low 16 bits are zero: the
// bf16 copy is the top halves), else an undefined tensor.  One pass over M * K values, a few
// microseconds against the milliseconds of a head the bf16 kernel then streams.
at::Tensor exact_bf16(const at::Tensor& x) {
  const auto xc = x.contiguous();
  const int64_t n = xc.numel();
  const auto* bits = reinterpret_cast<const uint32_t*>(xc.data_ptr<float>());
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) low |= bits[i];
  if ((low & 0xFFFFu) != 0) return at::Tensor();
  auto out = at::empty(xc.sizes(), xc.options().dtype(at::kBFloat16));
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(bits[i] >> 16);
  return out;
}

// matvec below; `bf16dot`: whether bf16 x bf16 may take the AVX512-BF16 kernel.
at::Tensor matvec_impl(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool bf16dot) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "matvec: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "matvec: x [M, K] and weight [N, K] expected");
  const auto wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf,
              "matvec: float32, bfloat16 or float16 weight");
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
              "matvec: float32, bfloat16 or float16 x");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (bias.has_value() && bias->defined()) {
    const auto bt = bias->scalar_type();
    TORCH_CHECK(bias->numel() == N && (bt == at::kFloat || bt == at::kBFloat16 || bt == at::kHalf),
                "matvec: bias must be [N], float32, bfloat16 or float16");
  }
  // bf16 x is widened, and the float32 sums rounded back, by plain loops here rather than
  // tensor.to(): at one decode row the two conversions' dispatch and allocations cost more
  // than the conversions (~5 us per projection, a few percent of a bf16 step).
  const bool half = xt != at::kFloat;
  const bool bf16_kernel = bf16dot && wt == at::kBFloat16 && matvec_bf16dot_supported();
  at::Tensor xf;
  // A float32 x all of whose values are bfloat16 values (the LM head's x: a bf16 model's final
  // norm output, widened exactly) goes to the bf16 kernel too: its bf16 copy is exact, so the
  // products are the FMA path's, and the sums stay float32 and unrounded (the logits).  At 8
  // rows the FMA path read a 1B model's head at ~16 GB/s, the bf16 kernel at 21-23.
  const bool by_bf16dot =
      bf16_kernel && (xt == at::kBFloat16 || (xt == at::kFloat && (xf = exact_bf16(x)).defined()));
  if (by_bf16dot) {
    if (!xf.defined()) xf = x.contiguous();  // stays bf16: the kernel multiplies the stored bits
  } else if (xt == at::kBFloat16) {
    const auto xc = x.contiguous();
    xf = at::empty({M, K}, x.options().dtype(at::kFloat));
    const auto* src = xc.data_ptr<c10::BFloat16>();
    float* dst = xf.data_ptr<float>();
    for (int64_t i = 0; i < M * K; ++i) dst[i] = static_cast<float>(src[i]);
  } else if (xt == at::kHalf) {
    xf = x.to(at::kFloat).contiguous();
  } else {
    xf = x.contiguous();
  }
  const auto wc = weight.contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  // Five rows and more on AMX tiles where the CPU has them (matvec_amx_cpu.cpp: VDPBF16PS's
  // arithmetic bounds those steps there); not under --deterministic, whose rows must each be
  // summed the same way whatever their number, nor for fewer, which VDPBF16PS streams as fast.
  const bool amx = by_bf16dot && M >= kMatvecAmxMinRows && !batch_invariant() &&
                   matvec_amx_fits(M, K, N) && matvec_amx_available();
  if (M > 0 && N > 0) {
    if (amx) {  // implies by_bf16dot
      const auto* xb = xf.data_ptr<c10::BFloat16>();
      const auto* wb = wc.data_ptr<c10::BFloat16>();
      float* o = out.data_ptr<float>();
      matvec_amx(xb, wb, M, K, N, o, [&](int64_t begin, int64_t end) {
        matvec_bf16dot_rows(xb, wb, M, K, N, o, begin, end);
      });
    } else if (by_bf16dot) {
      matvec_bf16dot(xf.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), M, K, N,
                     out.data_ptr<float>());
    } else if (wt == at::kFloat) {
      dispatch_rows(M, xf.data_ptr<float>(), wc.data_ptr<float>(), K, N, out.data_ptr<float>());
    } else if (wt == at::kBFloat16) {
      dispatch_rows(M, xf.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(), K, N,
                    out.data_ptr<float>());
    } else {
      dispatch_rows(M, xf.data_ptr<float>(), wc.data_ptr<c10::Half>(), K, N,
                    out.data_ptr<float>());
    }
  }
  float* o = out.data_ptr<float>();
  if (bias.has_value() && bias->defined()) {
    const auto bc = bias->scalar_type() == at::kHalf ? bias->to(at::kFloat) : bias->contiguous();
    for (int64_t m = 0; m < M; ++m) {
      if (bc.scalar_type() == at::kFloat) {
        const float* b = bc.data_ptr<float>();
        for (int64_t n = 0; n < N; ++n) o[m * N + n] += b[n];
      } else {
        const auto* b = bc.data_ptr<c10::BFloat16>();
        for (int64_t n = 0; n < N; ++n) o[m * N + n] += static_cast<float>(b[n]);
      }
    }
  }
  if (!half) return out;
  if (xt == at::kHalf) return out.to(at::kHalf);
  auto rounded = at::empty({M, N}, x.options());
  auto* r = rounded.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < M * N; ++i) r[i] = c10::BFloat16(o[i]);
  return rounded;
}

// The float-FMA path whatever the CPU has (tests and benchmarks compare the two).
at::Tensor matvec_fma(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias) {
  return matvec_impl(x, weight, bias, false);
}

}  // namespace

// Entry point, also called directly by decode_layer_cpu.cpp (genserve_ops.h).
// x: [M, K] float32, bfloat16 or float16; weight: [N, K] float32, bfloat16 or float16; bias:
// [N] or None.  Returns [M, N] in x's dtype (float32 sums, rounded once at the end): a
// float32 x gives float32 results from half-precision weights (the LM head's logits).
at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  return matvec_impl(x, weight, bias, true);
}

}  // namespace genserve_ops

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("matvec_fma(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // Whether bf16 steps of 5+ rows take AMX tiles here (tests name the path they check).
  m.def("matvec_amx_available() -> bool", &genserve_ops::matvec_amx_available);
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("matvec", &genserve_ops::matvec);
  m.impl("matvec_fma", &genserve_ops::matvec_fma);
}
