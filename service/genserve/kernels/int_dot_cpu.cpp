// Quantized matmul by integer dot products: y = x Wᵀ (+ b) with W in 8-bit (Q8_0, per-channel
// int8) or 4-bit (Q4_0, Q4_1, --quantize int4) blocks of 32, x quantized per block of 32 to
// int8 on the fly, as llama.cpp multiplies its Q8_0 activations by its quantized weights.
//
// Why: qpanel_linear (panel_gemm_cpu.cpp) turns every weight back into a float32 before an
// FMA; at 4 bits that dequantize loop, ~6 cycles per group of 32 per row, not the memory,
// bounds a decode step, and batched steps are float-FMA-bound.  An integer dot-product
// instruction multiplies 4 weight bytes by 4 activation bytes and adds them into an int32
// lane in one step: VPDPBUSD (AVX512-VNNI on 512-bit registers, AVX-VNNI on 256-bit ones), or
// on plain AVX2 VPMADDUBSW + VPMADDWD + VPADDD.  This changes the numerics (x is rounded to 8
// bits per block), so it is a choice (--cpu-int-dot, kernels/int_dot.py), never implied.
//
// Layout (model/int_dot_panels.py packs it): the 32-column panels of the float kernels, but
// with k in quads: for each panel, block of 32 k-steps, quad t of 4 k-steps, the 32 columns'
// 4 weights are consecutive bytes, so one 64-byte load holds 16 columns × 4 k-steps, exactly
// the operand of a 512-bit VPDPBUSD whose other operand is x's 4 bytes broadcast.
//   8-bit: data uint8 [P, Kp / 4, 32 × 4], each byte w + 128 (u8, VPDPBUSD's unsigned side);
//   4-bit: data uint8 [P, Kp / 4, 64]: byte j holds column j / 4 (k-step j % 4 of the quad)
//          in its low nibble and column 16 + j / 4 in its high one, q in 0..15;
//   scales (and 4-bit mins) float16 [P, Kp / 32, 32], one per block of 32 k-steps (GGUF's
//   own values; widened once per block and row tile).  4-bit weights without mins are
//   Q4_0's symmetric blocks, m = -8 d, computed from the scale (the exact value the float16
//   min held), so a decode step streams 18 bytes per 32 weights, the file's, not 20;
// Kp is K rounded up to 32 (padded weights are zero, padded activations too).
//
// Per block, per output column: s = Σ q_w · q_x (int32, exact), then
//   y += d_w · d_x · s            (8-bit: w = d_w · q_w)
//   y += d_w · d_x · s + m_w · d_x · Σ q_x    (4-bit: w = d_w · q_w + m_w; Q4_0 has m = -8 d)
// Signedness: VPDPBUSD multiplies unsigned by signed bytes.  4-bit q_w is unsigned already;
// 8-bit weights are stored + 128 and each block's sum starts at -128 · Σ q_x (computed with
// the activations), which costs nothing per weight.  AVX2's VPMADDUBSW saturates at int16,
// where (w + 128) · x pairs would overflow, so that path flips the stored byte back to signed
// and multiplies |x| by w · sign(x) (llama.cpp's trick; q_x is in -127..127).
//
// The instruction set is chosen at run time from cpuid (__builtin_cpu_supports): each ISA's
// copy of the tile is compiled under its own `#pragma GCC target`, whatever -march the rest of
// the library is built with, and only called where the CPU has it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "int_dot.h"
#include "row_shares.h"
#include "scratch_arrays.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;        // output columns per panel
constexpr int64_t kBlock = 32;        // k-steps per activation (and weight) scale
constexpr int64_t kChunkBlocks = 8;   // blocks per L1-resident chunk (8 KB at 8 bits)
constexpr int64_t kRowBlock = 64;     // rows whose partial sums one task keeps

// The quantized activations of one call.
struct QActs {
  const int8_t* q;            // [M, Kp], q_x in -127..127
  const float* scales;        // [M, B]  d_x
  const int32_t* sums;        // [M, B]  Σ q_x
  const float* scaled_sums;   // [M, B]  d_x · Σ q_x (the 4-bit min term's factor)
};

struct IntPanels {
  const uint8_t* data;
  const uint16_t* scales;  // float16 [P, B, 32]
  const uint16_t* mins;    // float16 [P, B, 32] or nullptr (8-bit; 4-bit: m = -8 d)
  int64_t bits, padded_k, blocks;
};

struct Job {
  QActs x;
  IntPanels w;
  int64_t rows, panels, n;
  const float* bias;
  float* out;  // [rows, n], or nullptr when the output is out_bf16
  bool accumulate;
  // A bfloat16 model's output, rounded as it is stored (nullptr: float32 `out`).  The value
  // is the float32 result rounded to nearest even, as the .to(bfloat16) copy it replaces: that
  // copy and its float32 buffer were ~3 us of a one-row projection's fixed cost.
  c10::BFloat16* out_bf16 = nullptr;
};

// src rounded to bfloat16 into dst, by c10's conversion (to nearest even), as .to() rounds.
inline void store_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] = c10::BFloat16(src[c]);
}

// Columns [32p, 32p + 32) ∩ [0, n) of rows [m0, m0 + rows) from scratch into the output.
inline void store_rows(const Job& j, int64_t m0, int64_t rows, int64_t p, const float* scratch) {
  const int64_t col0 = p * kPanel, cols = std::min(kPanel, j.n - col0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = scratch + r * kPanel;
    const float* bias = j.bias == nullptr ? nullptr : j.bias + col0;
    if (j.out_bf16 != nullptr) {
      float summed[kPanel];
      if (bias != nullptr) {
        for (int64_t c = 0; c < cols; ++c) summed[c] = src[c] + bias[c];
        src = summed;
      }
      store_bf16(src, j.out_bf16 + (m0 + r) * j.n + col0, cols);
      continue;
    }
    float* dst = j.out + (m0 + r) * j.n + col0;
    if (j.accumulate) {
      for (int64_t c = 0; c < cols; ++c) dst[c] += bias != nullptr ? src[c] + bias[c] : src[c];
    } else if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bias[c];
    } else {
      std::memcpy(dst, src, cols * sizeof(float));
    }
  }
}

using RunRange = void (*)(const Job&, int64_t, int64_t);

}  // namespace

#if defined(__x86_64__)

// ---- AVX512-VNNI: 512-bit VPDPBUSD, 2 registers per panel row, 8 rows per tile ----------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma")
namespace int_dot_avx512vnni {
namespace {
using I = __m512i;
using F = __m512;
constexpr int kV = 2, kL = 16, kTileRows = 8;
constexpr bool kOffsetWeights = true;
inline I zero() { return _mm512_setzero_si512(); }
inline I set1(int32_t v) { return _mm512_set1_epi32(v); }
inline I bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
inline F loadh(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F set1f(float v) { return _mm512_set1_ps(v); }
inline F cvt(I v) { return _mm512_cvtepi32_ps(v); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline void weights8(const uint8_t* at, I* w) {
  w[0] = _mm512_loadu_si512(at);
  w[1] = _mm512_loadu_si512(at + 64);
}
inline void weights4(const uint8_t* at, I* w) {
  const I packed = _mm512_loadu_si512(at), mask = _mm512_set1_epi8(0x0F);
  w[0] = _mm512_and_si512(packed, mask);
  w[1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
}
inline void dot8(I* acc, const I* w, I x) {
  for (int v = 0; v < kV; ++v) acc[v] = _mm512_dpbusd_epi32(acc[v], w[v], x);
}
inline void dot4(I* acc, const I* w, I x) { dot8(acc, w, x); }
#include "int_dot_tile.inc"
}  // namespace
RunRange range() { return &run_range; }
}  // namespace int_dot_avx512vnni
#pragma GCC pop_options

// ---- AVX-VNNI: 256-bit VPDPBUSD (VEX), 4 registers per panel row, 2 rows per tile -------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define GENSERVE_YMM_DPBUSD _mm256_dpbusd_avx_epi32
namespace int_dot_avxvnni {
namespace {
#include "int_dot_ymm_vnni.inc"
}  // namespace
RunRange range() { return &run_range; }
}  // namespace int_dot_avxvnni
#undef GENSERVE_YMM_DPBUSD
#pragma GCC pop_options

// ---- The same 256-bit tile by the EVEX VPDPBUSD of AVX512-VNNI + VL (see the .inc) -------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#define GENSERVE_YMM_DPBUSD _mm256_dpbusd_epi32
namespace int_dot_avx512vl_vnni256 {
namespace {
#include "int_dot_ymm_vnni.inc"
}  // namespace
RunRange range() { return &run_range; }
}  // namespace int_dot_avx512vl_vnni256
#undef GENSERVE_YMM_DPBUSD
#pragma GCC pop_options

// ---- AVX2: VPMADDUBSW + VPMADDWD + VPADDD, 4 registers per panel row, 2 rows per tile ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace int_dot_avx2 {
namespace {
using I = __m256i;
using F = __m256;
constexpr int kV = 4, kL = 8, kTileRows = 2;
constexpr bool kOffsetWeights = false;  // 8-bit weights are flipped back to signed
inline I zero() { return _mm256_setzero_si256(); }
inline I set1(int32_t v) { return _mm256_set1_epi32(v); }
inline I bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
inline F loadh(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F set1f(float v) { return _mm256_set1_ps(v); }
inline F cvt(I v) { return _mm256_cvtepi32_ps(v); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
inline void weights8(const uint8_t* at, I* w) {
  const I flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int v = 0; v < kV; ++v) w[v] = _mm256_xor_si256(load(at + 32 * v), flip);  // signed
}
inline void weights4(const uint8_t* at, I* w) {
  const I mask = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const I packed = load(at + 32 * h);
    w[h] = _mm256_and_si256(packed, mask);
    w[h + 2] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
  }
}
// Pairs of products summed in int16 (|x| · ±|w| ≤ 2 · 127 · 127 < 2^15: no saturation),
// then pairs of those in int32.
inline void dot8(I* acc, const I* w, I x) {
  const I ones = _mm256_set1_epi16(1), ax = _mm256_abs_epi8(x);
  for (int v = 0; v < kV; ++v) {
    const I pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[v], x));
    acc[v] = _mm256_add_epi32(acc[v], _mm256_madd_epi16(pairs, ones));
  }
}
// q_w in 0..15 is VPMADDUBSW's unsigned side as it is (2 · 15 · 127 < 2^15).
inline void dot4(I* acc, const I* w, I x) {
  const I ones = _mm256_set1_epi16(1);
  for (int v = 0; v < kV; ++v) {
    acc[v] = _mm256_add_epi32(acc[v], _mm256_madd_epi16(_mm256_maddubs_epi16(w[v], x), ones));
  }
}
#include "int_dot_tile.inc"
}  // namespace
RunRange range() { return &run_range; }
}  // namespace int_dot_avx2
#pragma GCC pop_options

#endif  // __x86_64__

namespace {

bool cpu_has(int64_t isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case genserve_ops::kIntDotAvx2:
      return GENSERVE_CPU_SUPPORTS("avx2") && GENSERVE_CPU_SUPPORTS("fma") &&
             GENSERVE_CPU_SUPPORTS("f16c");
    case genserve_ops::kIntDotAvxVnni:
      return GENSERVE_CPU_SUPPORTS("avx2") && GENSERVE_CPU_SUPPORTS("fma") &&
             GENSERVE_CPU_SUPPORTS("f16c") && GENSERVE_CPU_SUPPORTS("avxvnni");
    case genserve_ops::kIntDotAvx512Vnni:
    case genserve_ops::kIntDotVnni256Evex:
      return GENSERVE_CPU_SUPPORTS("avx512f") && GENSERVE_CPU_SUPPORTS("avx512bw") &&
             GENSERVE_CPU_SUPPORTS("avx512vl") && GENSERVE_CPU_SUPPORTS("avx512vnni") &&
             GENSERVE_CPU_SUPPORTS("fma");
    default:
      return false;
  }
#else
  (void)isa;
  return false;
#endif
}

RunRange range_of(int64_t isa) {
#if defined(__x86_64__)
  switch (isa) {
    case genserve_ops::kIntDotAvx2:
      return int_dot_avx2::range();
    case genserve_ops::kIntDotAvxVnni:
      return int_dot_avxvnni::range();
    case genserve_ops::kIntDotAvx512Vnni:
      return int_dot_avx512vnni::range();
    case genserve_ops::kIntDotVnni256Evex:
      return int_dot_avx512vl_vnni256::range();
    default:
      break;
  }
#endif
  (void)isa;
  return nullptr;
}

// The best path this CPU runs (kIntDotNone where it has none).  Asked per call, not cached:
// GENSERVE_CPU_FEATURES_MASK may hide features after the library loads (cpu_features.h).
int64_t best_isa() {
  for (int64_t isa : {genserve_ops::kIntDotAvx512Vnni, genserve_ops::kIntDotAvxVnni,
                      genserve_ops::kIntDotAvx2}) {
    if (cpu_has(isa)) return isa;
  }
  return genserve_ops::kIntDotNone;
}

// Rows of x quantized per block of 32 (llama.cpp's Q8_0 activations, with a float32 scale):
// d = max|x| / 127, q = round(x / d) (ties to even), plus Σq and d · Σq per block.
#if defined(__AVX2__)
// One whole block of 32 by 256-bit vectors, the scalar loop's values exactly: max|x| is exact
// in any order (VMAXPS with the new value first keeps the running max when it is NaN, as
// std::max(amax, NaN) does), x · inv the same float product, VROUNDPS to nearest the same
// ties-to-even as nearbyint, the clamp's VMAXPS/VMINPS order maps NaN to -127 as std::max
// does, and the sum is exact in int32.  A one-row Q4_0 step quantizes ~14 K inputs a layer,
// where the scalar loop cost ~150 cycles a block.
inline void quantize_block_avx2(const float* src, int8_t* dst, float* d, int32_t* sum,
                                float* scaled_sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int g = 0; g < 4; ++g) {
    v[g] = _mm256_loadu_ps(src + 8 * g);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[g]), amax);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float scale = _mm_cvtss_f32(m4) / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i qi[4];
  __m256i total = _mm256_setzero_si256();
  for (int g = 0; g < 4; ++g) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[g], vinv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[g] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    total = _mm256_add_epi32(total, qi[g]);
  }
  // int32 -> int8 (in range, so the saturating packs are exact), then the lanes in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                            _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(packed, order));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 1));
  *d = scale;
  *sum = _mm_cvtsi128_si32(t4);
  *scaled_sum = scale * static_cast<float>(*sum);
}
#endif

// T: float, or c10::BFloat16 widened a block at a time (exactly) into the same code, so that
// a bfloat16 model's input needs no float32 copy of its own.
template <class T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* d,
                   int32_t* sums, float* scaled_sums) {
  const int64_t B = Kp / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float wide[kBlock];
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t k0 = b * kBlock, n = std::min(kBlock, K - k0);
        const float* src;
        if constexpr (std::is_same_v<T, float>) {
          src = x + m * K + k0;
        } else {
          for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<float>(x[m * K + k0 + i]);
          src = wide;
        }
        int8_t* dst = q + m * Kp + k0;
#if defined(__AVX2__)
        if (n == kBlock) {
          quantize_block_avx2(src, dst, d + m * B + b, sums + m * B + b, scaled_sums + m * B + b);
          continue;
        }
#endif
        float amax = 0.0f;
        for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(src[i]));
        const float scale = amax / 127.0f;
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < n; ++i) {
          const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(src[i] * inv)));
          dst[i] = static_cast<int8_t>(v);
          sum += static_cast<int32_t>(v);
        }
        for (int64_t i = n; i < kBlock; ++i) dst[i] = 0;
        d[m * B + b] = scale;
        sums[m * B + b] = sum;
        scaled_sums[m * B + b] = scale * static_cast<float>(sum);
      }
    }
  });
}

struct QuantizedRows {
  at::Tensor q, d, sums, scaled_sums;
};

QuantizedRows quantize(const at::Tensor& x32, int64_t Kp) {
  const int64_t M = x32.size(0), K = x32.size(1), B = Kp / kBlock;
  QuantizedRows r{at::empty({M, Kp}, x32.options().dtype(at::kChar)),
                  at::empty({M, B}, x32.options()), at::empty({M, B}, x32.options().dtype(at::kInt)),
                  at::empty({M, B}, x32.options())};
  quantize_rows(x32.data_ptr<float>(), M, K, Kp, r.q.data_ptr<int8_t>(), r.d.data_ptr<float>(),
                r.sums.data_ptr<int32_t>(), r.scaled_sums.data_ptr<float>());
  return r;
}

// A call's quantized activations, in scratch arrays (scratch_arrays.h: the calling thread's
// kept buffers, or tensors of their own for prefill-sized inputs).
class ActBuffers {
 public:
  ActBuffers(const at::Tensor& x, int64_t Kp) {
    const int64_t M = x.size(0), K = x.size(1), B = Kp / kBlock;
    using genserve_scratch::array;
    int8_t* q = array<int8_t, 0>(M * Kp, own_[0], at::kChar);
    float* d = array<float, 1>(M * B, own_[1], at::kFloat);
    int32_t* sums = array<int32_t, 2>(M * B, own_[2], at::kInt);
    float* scaled = array<float, 3>(M * B, own_[3], at::kFloat);
    if (x.scalar_type() == at::kBFloat16) {
      quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, Kp, q, d, sums, scaled);
    } else {
      quantize_rows(x.data_ptr<float>(), M, K, Kp, q, d, sums, scaled);
    }
    acts_ = QActs{q, d, sums, scaled};
  }
  const QActs& acts() const { return acts_; }

 private:
  at::Tensor own_[4];
  QActs acts_{};
};

int64_t padded(int64_t K) { return (K + kBlock - 1) / kBlock * kBlock; }

at::Tensor int_dot_linear_impl(const at::Tensor& x, const at::Tensor& data,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               int64_t bits, int64_t N, const c10::optional<at::Tensor>& bias,
                               int64_t isa, at::Tensor* into) {
  TORCH_CHECK(x.device().is_cpu() && data.device().is_cpu(), "int_dot_linear: CPU tensors only");
  TORCH_CHECK(bits == 8 || bits == 4, "int_dot_linear: bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int_dot_linear: float32 or bfloat16 x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), Kp = padded(K), B = Kp / kBlock;
  TORCH_CHECK(K > 0, "int_dot_linear: no input features");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 3 && data.size(1) == Kp / 4 &&
                  data.size(2) == kPanel * bits / 2,
              "int_dot_linear: data uint8 [P, ceil(K / 32) * 8, ", kPanel * bits / 2,
              "] expected");
  const int64_t P = data.size(0);
  TORCH_CHECK(N <= P * kPanel && N > (P - 1) * kPanel, "int_dot_linear: data and N disagree");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == P &&
                  scales.size(1) == B && scales.size(2) == kPanel,
              "int_dot_linear: float16 scales [P, ceil(K / 32), 32] expected");
  const bool has_mins = mins.has_value() && mins->defined() && mins->numel() > 0;
  TORCH_CHECK(!has_mins || bits == 4, "int_dot_linear: 8-bit weights take no mins");
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->sizes() == scales.sizes(),
                "int_dot_linear: mins like scales");
  }
  if (isa == genserve_ops::kIntDotAuto) isa = best_isa();
  TORCH_CHECK(isa != genserve_ops::kIntDotNone, "int_dot_linear: this CPU has no AVX2");
  TORCH_CHECK(cpu_has(isa), "int_dot_linear: this CPU lacks instruction set ", isa,
              " (1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI, 4 256-bit AVX512-VNNI)");
  const RunRange run = range_of(isa);
  TORCH_CHECK(run != nullptr, "int_dot_linear: no such instruction set path ", isa);
  // bfloat16 models: quantized from x as it is and the output rounded as it is stored (no
  // float32 copies); the accumulating form is float32 throughout.
  const bool bf16 = x.scalar_type() == at::kBFloat16 && into == nullptr;
  const auto xc = bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  const auto dc = data.contiguous();
  const auto sc = scales.contiguous();
  const auto mc = has_mins ? mins->contiguous() : at::Tensor();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "int_dot_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  bool accumulate = false;
  if (into != nullptr) {
    TORCH_CHECK(into->scalar_type() == at::kFloat && into->is_contiguous() && into->dim() == 2 &&
                    into->size(0) == M && into->size(1) == N,
                "int_dot_linear_add_: a contiguous float32 [M, N] accumulator expected");
    accumulate = true;
  }
  auto out = accumulate ? *into
                        : at::empty({M, N}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const auto as_x_dtype = [&](const at::Tensor& y) {
    return y.scalar_type() == x.scalar_type() || accumulate ? y : y.to(x.scalar_type());
  };
  if (M == 0 || N == 0) return as_x_dtype(out);
  const ActBuffers qx(xc, Kp);
  Job job{qx.acts(),
          IntPanels{dc.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sc.data_ptr()),
                    has_mins ? reinterpret_cast<const uint16_t*>(mc.data_ptr()) : nullptr, bits,
                    Kp, B},
          M, P, N, b.defined() ? b.data_ptr<float>() : nullptr,
          bf16 ? nullptr : out.data_ptr<float>(), accumulate};
  if (bf16) job.out_bf16 = out.data_ptr<c10::BFloat16>();
  // Tasks over (row block, panel) pairs, panel-major within a row block so that each thread
  // streams a contiguous band of W (its share, row_shares.h, which an idle thread helps
  // finish); each chunk of tasks moves >= ~128 KB of weights at one row.
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (Kp * kPanel * bits / 8));
  genserve_shares::parallel_shares(row_blocks * P, grain,
                                   [&](int64_t begin, int64_t end) { run(job, begin, end); });
  return as_x_dtype(out);
}

}  // namespace

namespace genserve_ops {

at::Tensor int_dot_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins, int64_t bits, int64_t N,
                          const c10::optional<at::Tensor>& bias, int64_t isa) {
  return int_dot_linear_impl(x, data, scales, mins, bits, N, bias, isa, nullptr);
}

at::Tensor& int_dot_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& data,
                                const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                int64_t bits, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int_dot_linear_add_: float32 x expected");
  int_dot_linear_impl(x, data, scales, mins, bits, N, bias, kIntDotAuto, &acc);
  return acc;
}

}  // namespace genserve_ops

namespace {

// x [M, K] quantized as int_dot_linear quantizes it: (q int8 [M, Kp], d float32 [M, B],
// Σq int32 [M, B]); for tests and the accuracy report.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int_dot_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0,
              "int_dot_quantize: a CPU [M, K] tensor expected");
  const auto xc = x.to(at::kFloat).contiguous();
  QuantizedRows r = quantize(xc, padded(x.size(1)));
  return {r.q, r.d, r.sums};
}

// The instruction-set paths this CPU runs (int_dot.h's codes), best last.
std::vector<int64_t> int_dot_isas() {
  std::vector<int64_t> isas;
  for (int64_t isa : {genserve_ops::kIntDotAvx2, genserve_ops::kIntDotVnni256Evex,
                      genserve_ops::kIntDotAvxVnni, genserve_ops::kIntDotAvx512Vnni}) {
    if (cpu_has(isa)) isas.push_back(isa);
  }
  return isas;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("int_dot_linear(Tensor x, Tensor data, Tensor scales, Tensor? mins, int bits, int n, "
        "Tensor? bias, int isa=0) -> Tensor");
  m.def("int_dot_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("int_dot_isas() -> int[]", &int_dot_isas);
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("int_dot_linear", &genserve_ops::int_dot_linear);
  m.impl("int_dot_quantize", &int_dot_quantize);
}
