// Many-row products on GGUF K-quant weights for CPUs without a hardware bfloat16 product
// (AVX2-only parts such as AMD Zen 3; AVX-512 / VNNI parts without AVX512-BF16): an integer
// GEMM, register-tiled over weight rows and activation rows.
//
// Why (issue #28): on such CPUs prefill_gemm_cpu.cpp's bfloat16 GEMM would be oneDNN's
// emulation, so a prompt chunk's K-quant projections ran kquant_cpu.cpp's integer kernel,
// which multiplies each decoded weight row by one activation row at a time: every product of
// 32 weights reloads the row's quants and scales (16 vectors, more than the registers hold).
// Here a tile of kNR weight rows × kMR activation rows keeps kNR · kMR integer sums in
// registers: each 32-byte chunk of quants is loaded once for kMR activation rows and each
// activation chunk once for kNR weight rows, and a weight row's super-blocks are decoded once
// per call (not once per 32 activation rows).
//
// Numerics: exactly the integer path's (kquant_cpu.cpp, isa AVX2): activations rounded per 256
// inputs to int8 as llama.cpp's Q8_K (genserve_kquant::quantize_rows_q8k), each 16-weight
// group's integer sum Σ q·x multiplied by its scale in int32 (exact), then per super-block
// d_w·d_x·Σ − dmin_w·d_x·Σ_g mn[g]·Σx_g in float32.  Only the order of the float32 sums over
// super-blocks differs from kquant_linear's (both are float64-close: the tests bound it).
// Results depend on the tile a row falls in only through that order, so the op is not used
// under --deterministic (kernels/prefill_gemm.py).
//
// Instructions: VPMADDUBSW (u8 quants × s8 activations, pairs summed in int16: 2 · 63 · 128 <
// 2^15, no saturation) and VPMADDWD by the groups' int16 scales, as llama.cpp's AVX2
// ggml_vec_dot_q4_K_q8_K.  AVX2 + FMA + F16C, chosen at run time (GENSERVE_CPU_SUPPORTS).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "kquant_rows.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using genserve_kquant::block_bytes_of;
using genserve_kquant::kQ4K;
using genserve_kquant::kQ5K;
using genserve_kquant::kQ6K;

using Segment = genserve_kquant::KSegment;

// The Q8_K activations and the output of one call.
struct GemmJob {
  const int8_t* xq;     // [M, K]
  const float* xd;      // [M, K / 256]
  const int16_t* xs;    // [M, K / 16]
  int64_t m, k, n;
  const Segment* segments;
  int64_t num_segments;
  const float* bias;    // [N] or nullptr
  float* out;           // [M, N]

  const Segment& segment_of(int64_t row) const {
    int64_t s = 0;
    while (s + 1 < num_segments && row >= segments[s + 1].row0) ++s;
    return segments[s];
  }
  const uint8_t* row_data(int64_t row) const {
    const Segment& s = segment_of(row);
    return s.data + (row - s.row0) * s.row_bytes;
  }
};

using RunPairs = void (*)(const GemmJob&, int64_t, int64_t);

}  // namespace

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kq_int_gemm_avx2 {
namespace {
#include "kquant_decode.inc"

constexpr int kNR = 2;  // weight rows per tile
constexpr int kMR = 4;  // activation rows per tile: kNR · kMR sums + kNR quants in registers

// One super-block of one weight row as the tile multiplies it.
struct Decoded {
  alignas(32) uint8_t q[256];
  __m256i s[8];  // chunk c (32 weights, groups 2c and 2c + 1): the int16 scales VPMADDWD takes
  __m256i mn;    // the 16 groups' int16 mins (Q6_K: 32 · sc, its −32 offset folded in)
  float d, dmin;
};

// Each group's int16 scale twice in an int32 lane, then lanes 2c', 2c' + 1 spread so that
// int16 lanes 0-7 of chunk c hold group 2c's scale and 8-15 group 2c + 1's (VPMADDUBSW's
// int16 lane l sums weights 2l, 2l + 1 of the chunk).
inline void decode(int64_t type, const uint8_t* p, Decoded& out) {
  KBlock b;
  kq_decode(type, p, b);
  std::memcpy(out.q, b.q, 256);
  const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(b.sc));
  const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(b.sc, 1));
  const __m256i mask = _mm256_set1_epi32(0xFFFF);
  const __m256i half[2] = {_mm256_or_si256(_mm256_slli_epi32(lo, 16), _mm256_and_si256(lo, mask)),
                           _mm256_or_si256(_mm256_slli_epi32(hi, 16), _mm256_and_si256(hi, mask))};
  for (int c = 0; c < 8; ++c) {
    const int g = 2 * (c % 4);
    const __m256i index = _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1);
    out.s[c] = _mm256_permutevar8x32_epi32(half[c / 4], index);
  }
  out.mn = b.mn;
  out.d = b.d;
  out.dmin = b.dmin;
}

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// res[r][m] = row r of w (kNR rows, nb super-blocks each) · activation row m0 + m, m < MR.
template <int MR>
inline void tile(const GemmJob& j, const Decoded* const* w, int64_t nb, int64_t m0,
                 float res[kNR][kMR]) {
  __m256 fac[kNR][MR];
  for (int r = 0; r < kNR; ++r) {
    for (int m = 0; m < MR; ++m) fac[r][m] = _mm256_setzero_ps();
  }
  const int8_t* xrow[MR];
  for (int m = 0; m < MR; ++m) xrow[m] = j.xq + (m0 + m) * j.k;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[kNR][MR];
    for (int r = 0; r < kNR; ++r) {
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_si256();
    }
    for (int c = 0; c < 8; ++c) {
      __m256i q[kNR];
      for (int r = 0; r < kNR; ++r) {
        q[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[r][b].q + 32 * c));
      }
      for (int m = 0; m < MR; ++m) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrow[m] + b * 256 + 32 * c));
        for (int r = 0; r < kNR; ++r) {
          const __m256i pairs = _mm256_maddubs_epi16(q[r], x);
          acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_madd_epi16(pairs, w[r][b].s[c]));
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      const __m256i xsums =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(j.xs + (row * nb + b) * 16));
      const float dx = j.xd[row * nb + b];
      for (int r = 0; r < kNR; ++r) {
        const Decoded& wb = w[r][b];
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(wb.mn, xsums));
        fac[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][m]), _mm256_set1_ps(wb.d * dx),
                                    fac[r][m]);
        fac[r][m] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(wb.dmin * dx), fac[r][m]);
      }
    }
  }
  for (int r = 0; r < kNR; ++r) {
    for (int m = 0; m < MR; ++m) res[r][m] = hsum(fac[r][m]);
  }
}

// Output columns 2·p0 .. 2·p1 (pairs of weight rows; a last odd row is paired with itself and
// stored once), every activation row.
void run_pairs(const GemmJob& j, int64_t p0, int64_t p1) {
  const int64_t nb = j.k / 256;
  thread_local std::vector<Decoded> buf;
  if (static_cast<int64_t>(buf.size()) < kNR * nb) buf.resize(kNR * nb);
  const Decoded* w[kNR];
  for (int r = 0; r < kNR; ++r) w[r] = buf.data() + r * nb;
  float res[kNR][kMR];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = kNR * p, count = std::min<int64_t>(kNR, j.n - n0);
    for (int r = 0; r < kNR; ++r) {
      const int64_t n = n0 + std::min<int64_t>(r, count - 1);
      const Segment& s = j.segment_of(n);
      const uint8_t* row = s.data + (n - s.row0) * s.row_bytes;
      Decoded* dst = buf.data() + r * nb;
      for (int64_t b = 0; b < nb; ++b) {
        __builtin_prefetch(row + (b + 2) * s.block_bytes, 0, 0);
        decode(s.type, row + b * s.block_bytes, dst[b]);
      }
    }
    for (int64_t m0 = 0; m0 < j.m; m0 += kMR) {
      const int64_t rows = std::min<int64_t>(kMR, j.m - m0);
      switch (rows) {
        case 4:
          tile<4>(j, w, nb, m0, res);
          break;
        case 3:
          tile<3>(j, w, nb, m0, res);
          break;
        case 2:
          tile<2>(j, w, nb, m0, res);
          break;
        default:
          tile<1>(j, w, nb, m0, res);
          break;
      }
      for (int64_t m = 0; m < rows; ++m) {
        float* o = j.out + (m0 + m) * j.n;
        for (int64_t r = 0; r < count; ++r) {
          o[n0 + r] = j.bias == nullptr ? res[r][m] : res[r][m] + j.bias[n0 + r];
        }
      }
    }
  }
}
}  // namespace
RunPairs run() { return &run_pairs; }
}  // namespace kq_int_gemm_avx2
#pragma GCC pop_options
#endif  // __x86_64__

namespace {

bool has_avx2() { return genserve_cpu::has_avx2_fma_f16c(); }

// Whether this CPU runs the op (AVX2, FMA and F16C, after GENSERVE_CPU_FEATURES_MASK).
bool kquant_int_gemm_available() { return has_avx2(); }

// y = x Wᵀ (+ b) in x's dtype, W the K-quant rows of `data` (segments `types` × `rows`).
at::Tensor kquant_linear_int_gemm(const at::Tensor& x, const at::Tensor& data,
                                  at::IntArrayRef types, at::IntArrayRef rows,
                                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "kquant_linear_int_gemm: CPU x [M, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "kquant_linear_int_gemm: float32, bfloat16 or float16 x expected");
  const int64_t M = x.size(0), K = x.size(1);
  const std::vector<Segment> segments =
      genserve_kquant::segments_of(data, types, rows, K, "kquant int gemm");
  const int64_t N = segments.back().row0 + segments.back().rows;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "kquant_linear_int_gemm: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  TORCH_CHECK(has_avx2(), "kquant_linear_int_gemm: this CPU lacks AVX2 (with FMA and F16C)");
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out.to(x.scalar_type());
#if defined(__x86_64__)
  const auto [xq, xd, xs] = genserve_kquant::quantize_rows_q8k(x.to(at::kFloat).contiguous());
  GemmJob job{xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<int16_t>(), M, K, N,
              segments.data(), static_cast<int64_t>(segments.size()),
              b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>()};
  const RunPairs run = kq_int_gemm_avx2::run();
  const int64_t pairs = (N + 1) / 2;
  at::parallel_for(0, pairs, 8, [&](int64_t p0, int64_t p1) { run(job, p0, p1); });
#endif
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("kquant_linear_int_gemm(Tensor x, Tensor data, int[] types, int[] rows, Tensor? bias) "
        "-> Tensor");
  m.def("kquant_int_gemm_available() -> bool", &kquant_int_gemm_available);
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("kquant_linear_int_gemm", &kquant_linear_int_gemm);
}
