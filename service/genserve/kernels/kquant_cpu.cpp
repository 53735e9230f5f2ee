// Matmul on GGUF K-quant weights kept as the file stores them: y = x Wᵀ (+ b) with W's rows in
// Q4_K, Q5_K or Q6_K super-blocks of 256 weights (model/kquants.py holds them), several types
// stacked by rows where a fused projection mixes them (Q4_K_M's Q/K in Q4_K with V in Q6_K).
//
// Why: decoding a K-quant file to bfloat16 at load (what genserve did before) doubled the bytes
// every decode step streams against the file's 4.5-6.6 bits per weight, and a 1B Q4_K_M model
// took 2 GB.  Here the blocks are read in place, a row at a time, and decoded in registers.
//
// Two paths (kernels/int_dot.py's --cpu-int-dot chooses; the layers pass `isa`):
//  * float (isa = -1, the default): each super-block is dequantized to 256 float32 weights
//    exactly as gguf-py's dequantizer computes them (up to an FMA's single rounding) and
//    multiplied by the float32 activations; the result is a float32 matmul on the dequantized
//    matrix up to the order of sums.
//  * integer (isa = the int_dot.h codes): each activation row is quantized per 256 inputs to
//    int8 as llama.cpp's Q8_K (d = max|x| / 127, q = round(x / d), Σq per 16), and the unsigned
//    weight quants are multiplied by those bytes with VPDPBUSD (AVX512-VNNI on 512-bit
//    registers, AVX-VNNI or AVX512-VNNI on 256-bit ones) or VPMADDUBSW + VPMADDWD (AVX2), each
//    16-weight group's integer sum scaled by its 6/8-bit scale exactly in int32, and the
//    block's float scales applied once per block.  Chosen from cpuid per call, each copy
//    compiled under its own `#pragma GCC target`, as int_dot_cpu.cpp does.
//
// Work: tasks are ranges of weight rows (row_shares.h's shares); a row's super-block is decoded
// once and multiplied by every activation row of a 32-row tile before the next block, so a
// batched decode step reads each weight once.  Each output depends only on its own row of x
// and of W (same code path and order whatever the batch): batch-invariant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "genserve_ops.h"
#include "int_dot.h"
#include "kquant_rows.h"
#include "row_shares.h"
#include "scratch_arrays.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using genserve_kquant::block_bytes_of;
using genserve_kquant::kQ4K;
using genserve_kquant::kQ5K;
using genserve_kquant::kQ6K;
constexpr int64_t kTileRows = 32;  // activation rows per pass over a weight row

using genserve_kquant::KRowJob;
using genserve_kquant::KSegment;
using genserve_kquant::RunRows;

#include "kquant_decode.inc"

// ---- the float path: compiled for the library's level, vectorised by GCC's vector types ----
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));


// 16 quants (16-byte aligned) as float32, minus `offset`.  Intrinsics where the library's level
// has them: GCC lowered a generic u8 -> float vector conversion to scalar code.
inline v16 quants_as_float(const uint8_t* q, int offset) {
#if defined(__AVX512F__)
  const __m512i i = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q)));
  return reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_sub_epi32(i, _mm512_set1_epi32(offset))));
#elif defined(__AVX2__)
  const __m256i off = _mm256_set1_epi32(offset);
  const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(q));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), off));
  const __m256 hi = _mm256_cvtepi32_ps(
      _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes)), off));
  v16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<float*>(&out) + 8, &hi, 32);
  return out;
#else
  v16 out;
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(static_cast<int>(q[i]) - offset);
  return out;
#endif
}

// 256 float32 weights of one block, as gguf-py computes them: the per-group factors are
// rounded first (d · sc, dmin · m), then w = factor · q − min.
inline void kq_dequantize(int64_t type, const uint8_t* p, float* w) {
  alignas(64) uint8_t q[256];
  kq_quants(type, p, q);
  v16* out = reinterpret_cast<v16*>(w);
  if (type == kQ6K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const float d = kq_half(p + 208);
    for (int g = 0; g < 16; ++g) {
      const float ds = d * static_cast<float>(sc[g]);
      out[g] = ds * quants_as_float(q + 16 * g, 32);
    }
    return;
  }
  uint8_t sc[8], m[8];
  kq_scale_min(p + 4, sc, m);
  const float d = kq_half(p), dmin = kq_half(p + 2);
  for (int g = 0; g < 16; ++g) {
    const float ds = d * static_cast<float>(sc[g / 2]), dm = dmin * static_cast<float>(m[g / 2]);
    out[g] = ds * quants_as_float(q + 16 * g, 0) - dm;
  }
}

inline float hsum16(v16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Weight rows go 4 at a time (within one segment): each activation vector loaded is used by 4
// rows' FMAs, so a batched step reads its activations from cache a quarter as often (at 8 rows
// of K = 8192 they are 256 KB: L2).  Each (row, activation row) pair keeps its own chain of
// FMAs in block order, so the result does not depend on the tile, the batch or the threads.
constexpr int kFloatRows = 4;

void float_rows(const KRowJob& j, int64_t n0, int64_t n1) {
  const int64_t nb = j.k / 256;
  alignas(64) float w[kFloatRows][256];
  v16 acc[kTileRows][kFloatRows];
  for (int64_t n = n0; n < n1;) {
    const KSegment& s = j.segment_of(n);
    const int64_t r_count = std::min<int64_t>({kFloatRows, n1 - n, s.row0 + s.rows - n});
    const uint8_t* rows_at[kFloatRows];
    for (int r = 0; r < kFloatRows; ++r) {  // a short tile repeats its last row (not stored)
      rows_at[r] = s.data + (n + std::min<int64_t>(r, r_count - 1) - s.row0) * s.row_bytes;
    }
    for (int64_t m0 = 0; m0 < j.m; m0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, j.m - m0);
      for (int64_t m = 0; m < rows; ++m) {
        for (int r = 0; r < kFloatRows; ++r) acc[m][r] = v16{};
      }
      for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < kFloatRows; ++r) {
          const uint8_t* block = rows_at[r] + b * s.block_bytes;
          __builtin_prefetch(block + 4 * s.block_bytes, 0, 1);
          __builtin_prefetch(block + 4 * s.block_bytes + 64, 0, 1);
          __builtin_prefetch(block + 4 * s.block_bytes + 128, 0, 1);
          kq_dequantize(s.type, block, w[r]);
        }
        const v16* w0 = reinterpret_cast<const v16*>(w[0]);
        const v16* w1 = reinterpret_cast<const v16*>(w[1]);
        const v16* w2 = reinterpret_cast<const v16*>(w[2]);
        const v16* w3 = reinterpret_cast<const v16*>(w[3]);
        for (int64_t m = 0; m < rows; ++m) {
          const float* x = j.xf + (m0 + m) * j.k + b * 256;
          v16 a0 = acc[m][0], a1 = acc[m][1], a2 = acc[m][2], a3 = acc[m][3];
          for (int c = 0; c < 16; ++c) {
            const v16 xv = *reinterpret_cast<const v16u*>(x + 16 * c);
            a0 += w0[c] * xv;
            a1 += w1[c] * xv;
            a2 += w2[c] * xv;
            a3 += w3[c] * xv;
          }
          acc[m][0] = a0;
          acc[m][1] = a1;
          acc[m][2] = a2;
          acc[m][3] = a3;
        }
      }
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t r = 0; r < r_count; ++r) j.store(m0 + m, n + r, hsum16(acc[m][r]));
      }
    }
    n += r_count;
  }
}

}  // namespace

#if defined(__x86_64__)

using genserve_kquant::KRowJob;
using genserve_kquant::RunRows;

// ---- AVX512-VNNI: 512-bit VPDPBUSD + VPDPWSSD, quants unpacked in registers ------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace kquant_avx512vnni {
namespace {
#include "kquant_decode.inc"
#include "kquant_zmm_row.inc"
}  // namespace
RunRows run() { return &run_rows; }
}  // namespace kquant_avx512vnni
#pragma GCC pop_options

// The 256-bit paths share their scale layout: chunk c holds groups 2c, 2c + 1.
#define GENSERVE_KQ_YMM_COMMON                                                              \
  using I = __m256i;                                                                        \
  using F = __m256;                                                                         \
  constexpr int kW = 32;                                                                    \
  inline I loadq(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); } \
  inline I loadw(const uint8_t* p) { return loadq(p); }                                     \
  inline I zero() { return _mm256_setzero_si256(); }                                        \
  inline I add(I a, I b) { return _mm256_add_epi32(a, b); }                                 \
  inline F cvt(I v) { return _mm256_cvtepi32_ps(v); }                                       \
  inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }                        \
  inline F set1f(float v) { return _mm256_set1_ps(v); }                                     \
  /* int32 lanes [2c] x4, [2c + 1] x4 */                                                    \
  inline I pair_index(int c) {                                                              \
    return _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1,   \
                             2 * c + 1);                                                    \
  }                                                                                         \
  inline float hsum(F v) {                                                                  \
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));          \
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                                 \
    h = _mm_add_ss(h, _mm_movehdup_ps(h));                                                  \
    return _mm_cvtss_f32(h);                                                                \
  }

// VPDPBUSD on 256 bits: int32 lane l sums weights 4l .. 4l + 3, so lanes 0-3 are group 2c.
#define GENSERVE_KQ_YMM_VNNI(DPBUSD)                                                     \
  inline void scale_vectors(const KBlock& b, I* out) {                                   \
    const I half[2] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(b.sc)),              \
                       _mm256_cvtepi16_epi32(_mm256_extracti128_si256(b.sc, 1))};        \
    for (int c = 0; c < 8; ++c) out[c] = _mm256_permutevar8x32_epi32(half[c / 4], pair_index(c % 4)); \
  }                                                                                      \
  inline I scaled_dot(I w, I x, I s) { return _mm256_mullo_epi32(DPBUSD(zero(), w, x), s); } \
  /* kquant_ymm_row.inc: int16 scale pairs as int32 lanes, sign-extended */              \
  inline I ymm_scale_operand(I s16) { return _mm256_srai_epi32(s16, 16); }               \
  inline I ymm_scaled_dot(I w, I x, I s) { return scaled_dot(w, x, s); }

// ---- AVX-VNNI: 256-bit VPDPBUSD (VEX) -----------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace kquant_avxvnni {
namespace {
#include "kquant_decode.inc"
GENSERVE_KQ_YMM_COMMON
GENSERVE_KQ_YMM_VNNI(_mm256_dpbusd_avx_epi32)
#include "kquant_int_row.inc"
#include "kquant_ymm_row.inc"
}  // namespace
RunRows run() { return &run_rows_ymm; }
}  // namespace kquant_avxvnni
#pragma GCC pop_options

// ---- the same by AVX512-VNNI's 256-bit (EVEX) VPDPBUSD: tests only, never chosen -----------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
namespace kquant_vnni256 {
namespace {
#include "kquant_decode.inc"
GENSERVE_KQ_YMM_COMMON
GENSERVE_KQ_YMM_VNNI(_mm256_dpbusd_epi32)
#include "kquant_int_row.inc"
#include "kquant_ymm_row.inc"
}  // namespace
RunRows run() { return &run_rows_ymm; }
}  // namespace kquant_vnni256
#pragma GCC pop_options

// ---- AVX2: VPMADDUBSW (u8 × s8 pairs in int16: 2 · 63 · 127 < 2^15, no saturation), then
// VPMADDWD by the groups' scales (int16 lane l sums weights 2l, 2l + 1: lanes 0-7 group 2c) --
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kquant_avx2 {
namespace {
#include "kquant_decode.inc"
GENSERVE_KQ_YMM_COMMON
inline void scale_vectors(const KBlock& b, I* out) {
  // each group's int16 scale twice in an int32 lane, then lanes 2c', 2c' + 1 spread
  const I lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(b.sc));
  const I hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(b.sc, 1));
  const I mask = _mm256_set1_epi32(0xFFFF);
  const I half[2] = {_mm256_or_si256(_mm256_slli_epi32(lo, 16), _mm256_and_si256(lo, mask)),
                     _mm256_or_si256(_mm256_slli_epi32(hi, 16), _mm256_and_si256(hi, mask))};
  for (int c = 0; c < 8; ++c) out[c] = _mm256_permutevar8x32_epi32(half[c / 4], pair_index(c % 4));
}
inline I scaled_dot(I w, I x, I s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s); }
inline I ymm_scale_operand(I s16) { return s16; }  // VPMADDWD's pairs: the scale twice
inline I ymm_scaled_dot(I w, I x, I s) { return scaled_dot(w, x, s); }
#include "kquant_int_row_pairs.inc"  // 2+ activation rows: two chunks per scale VPMADDWD
#include "kquant_ymm_row.inc"
}  // namespace
RunRows run() { return &run_rows_ymm; }
// x [rows, K] as KRowJob::xq_paired wants it.
void pair_rows(const int8_t* x, int64_t rows, int64_t k, int8_t* out) {
  pair_activations(x, rows, k, out);
}
}  // namespace kquant_avx2
#pragma GCC pop_options

#undef GENSERVE_KQ_YMM_COMMON
#undef GENSERVE_KQ_YMM_VNNI

#endif  // __x86_64__

namespace {

bool cpu_has(int64_t isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = GENSERVE_CPU_SUPPORTS("avx2") && GENSERVE_CPU_SUPPORTS("fma") &&
                    GENSERVE_CPU_SUPPORTS("f16c");
  switch (isa) {
    case genserve_ops::kIntDotAvx2:
      return avx2;
    case genserve_ops::kIntDotAvxVnni:
      return avx2 && GENSERVE_CPU_SUPPORTS("avxvnni");
    case genserve_ops::kIntDotAvx512Vnni:
    case genserve_ops::kIntDotVnni256Evex:
      return avx2 && GENSERVE_CPU_SUPPORTS("avx512f") && GENSERVE_CPU_SUPPORTS("avx512bw") &&
             GENSERVE_CPU_SUPPORTS("avx512vl") && GENSERVE_CPU_SUPPORTS("avx512vnni");
    default:
      return false;
  }
#else
  (void)isa;
  return false;
#endif
}

RunRows int_path(int64_t isa) {
#if defined(__x86_64__)
  if (isa == genserve_ops::kIntDotAuto) {
    for (int64_t best : {genserve_ops::kIntDotAvx512Vnni, genserve_ops::kIntDotAvxVnni,
                         genserve_ops::kIntDotAvx2}) {
      if (cpu_has(best)) return int_path(best);
    }
    return nullptr;
  }
  if (!cpu_has(isa)) return nullptr;
  switch (isa) {
    case genserve_ops::kIntDotAvx2:
      return kquant_avx2::run();
    case genserve_ops::kIntDotAvxVnni:
      return kquant_avxvnni::run();
    case genserve_ops::kIntDotAvx512Vnni:
      return kquant_avx512vnni::run();
    case genserve_ops::kIntDotVnni256Evex:
      return kquant_vnni256::run();
    default:
      break;
  }
#endif
  (void)isa;
  return nullptr;
}

// x [M, K] as llama.cpp's Q8_K: per 256 inputs d = max|x| / 127, q = round(x / d) (ties to
// even, as int_dot_cpu.cpp's Q8_0), and Σq per 16 inputs.
struct Q8K {
  at::Tensor q, d, sums;
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline bool quantize_block_avx512(const float* src, int8_t* dst, float* d, int16_t* sums) {
  __m512 v[16];
  __m512 amax = _mm512_setzero_ps();
  for (int g = 0; g < 16; ++g) {
    v[g] = _mm512_loadu_ps(src + 16 * g);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[g]));
  }
  const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (int g = 0; g < 16; ++g) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[g], vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * g), _mm512_cvtepi32_epi8(qi));
    sums[g] = static_cast<int16_t>(_mm512_reduce_add_epi32(qi));
  }
  *d = scale;
  return true;
}
#endif

// Rows [M, K] of x (float, or c10::BFloat16 widened a block at a time, exactly, into the same
// code) as Q8_K into q [M, K], d [M, K / 256], Σq [M, K / 16].
template <class T>
void quantize_q8k_into(const T* x, int64_t M, int64_t K, int8_t* q, float* d, int16_t* sums) {
  const int64_t nb = K / 256;
  at::parallel_for(0, M * nb, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float wide[256];
    for (int64_t t = begin; t < end; ++t) {
      const float* src;  // row t / nb, block t % nb: contiguous
      if constexpr (std::is_same_v<T, float>) {
        src = x + t * 256;
      } else {
        for (int i = 0; i < 256; ++i) wide[i] = static_cast<float>(x[t * 256 + i]);
        src = wide;
      }
      int8_t* dst = q + t * 256;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // The same values by 512-bit vectors (a one-row step quantizes 14 K inputs per layer,
      // which the scalar loop took ~1.5% of a 1B step for): max|x| is exact in any order,
      // x · inv the same float product, VRNDSCALEPS to nearest the same ties-to-even rounding.
      if (quantize_block_avx512(src, dst, d + t, sums + t * 16)) continue;
#endif
      float amax = 0.0f;
      for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(src[i]));
      const float scale = amax / 127.0f;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      for (int i = 0; i < 256; ++i) {
        dst[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(src[i] * inv))));
      }
      d[t] = scale;
      for (int g = 0; g < 16; ++g) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += dst[16 * g + i];
        sums[t * 16 + g] = static_cast<int16_t>(s);
      }
    }
  });
}

Q8K quantize_q8k(const at::Tensor& x32) {
  const int64_t M = x32.size(0), K = x32.size(1), nb = K / 256;
  Q8K r{at::empty({M, K}, x32.options().dtype(at::kChar)), at::empty({M, nb}, x32.options()),
        at::empty({M, K / 16}, x32.options().dtype(at::kShort))};
  quantize_q8k_into(x32.data_ptr<float>(), M, K, r.q.data_ptr<int8_t>(), r.d.data_ptr<float>(),
                    r.sums.data_ptr<int16_t>());
  return r;
}

// A call's Q8_K activations of float32 or bfloat16 x, in scratch arrays (scratch_arrays.h:
// the calling thread's kept buffers, or tensors of their own for prefill-sized inputs).
class Q8KActs {
 public:
  explicit Q8KActs(const at::Tensor& x) {
    const int64_t M = x.size(0), K = x.size(1);
    using genserve_scratch::array;
    q = array<int8_t, 4>(M * K, own_[0], at::kChar);
    d = array<float, 5>(M * K / 256, own_[1], at::kFloat);
    sums = array<int16_t, 6>(M * K / 16, own_[2], at::kShort);
    if (x.scalar_type() == at::kBFloat16) {
      quantize_q8k_into(x.data_ptr<c10::BFloat16>(), M, K, q, d, sums);
    } else {
      quantize_q8k_into(x.data_ptr<float>(), M, K, q, d, sums);
    }
  }
  int8_t* q = nullptr;
  float* d = nullptr;
  int16_t* sums = nullptr;

 private:
  at::Tensor own_[3];
};

// The product into `out` ([M, N] contiguous): written (float32, or bfloat16 rounded as it is
// stored), or added to with `accumulate` (float32).
void kquant_run(const at::Tensor& x, const at::Tensor& data, at::IntArrayRef types,
                at::IntArrayRef rows, const c10::optional<at::Tensor>& bias, int64_t isa,
                at::Tensor& out, bool accumulate) {
  TORCH_CHECK(x.device().is_cpu() && data.device().is_cpu(), "kquant_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                               x.scalar_type() == at::kHalf),
              "kquant_linear: float32, bfloat16 or float16 x [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % 256 == 0, "kquant_linear: K must be a positive multiple of 256");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous(),
              "kquant_linear: contiguous uint8 data expected");
  const std::vector<KSegment> segments =
      genserve_kquant::segments_of(data, types, rows, K, "kquant_linear");
  const int64_t N = segments.back().row0 + segments.back().rows;
  const bool out_bf16 = out.scalar_type() == at::kBFloat16 && !accumulate;
  TORCH_CHECK((out.scalar_type() == at::kFloat || out_bf16) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == M && out.size(1) == N,
              "kquant_linear: the output must be float32 (or bfloat16) [M, N] contiguous");
  RunRows run = &float_rows;
  if (isa != genserve_ops::kIntDotNone) {
    run = int_path(isa);
    TORCH_CHECK(run != nullptr, "kquant_linear: this CPU has no integer path ", isa,
                " (0 best, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI, 4 256-bit AVX512-VNNI)");
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(!accumulate, "kquant_linear_add_: no bias (its add would round otherwise)");
    TORCH_CHECK(bias->numel() == N, "kquant_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return;
  // The integer path quantizes a float32 or bfloat16 x as it is; the float path (and float16
  // x) reads a float32 copy.
  const bool int_path_only = isa != genserve_ops::kIntDotNone &&
                             (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  const auto xc = int_path_only ? x.contiguous() : x.to(at::kFloat).contiguous();
  KRowJob job{nullptr, nullptr, nullptr,
              xc.scalar_type() == at::kFloat ? xc.data_ptr<float>() : nullptr, K, M, N,
              segments.data(), static_cast<int64_t>(segments.size()), 0, 0,
              b.defined() ? b.data_ptr<float>() : nullptr,
              out_bf16 ? nullptr : out.data_ptr<float>(), accumulate};
  if (out_bf16) job.out_bf16 = out.data_ptr<c10::BFloat16>();
  std::optional<Q8KActs> qx;
  if (isa != genserve_ops::kIntDotNone) {
    qx.emplace(xc);
    job.xq = qx->q;
    job.xd = qx->d;
    job.xsums = qx->sums;
  }
#if defined(__x86_64__)
  at::Tensor paired;
  if (run == kquant_avx2::run() && M > 1) {  // its 2+-row path's layout, once per call
    paired = at::empty({M, K}, x.options().dtype(at::kChar));
    kquant_avx2::pair_rows(job.xq, M, K, paired.data_ptr<int8_t>());
    job.xq_paired = paired.data_ptr<int8_t>();
  }
  at::Tensor reordered_own;  // the AVX512-VNNI path's order for Q4_K / Q5_K, once per call
  if (run == kquant_avx512vnni::run() &&
      std::any_of(segments.begin(), segments.end(),
                  [](const KSegment& s) { return s.type != kQ6K; })) {
    int8_t* reordered = genserve_scratch::array<int8_t, 7>(M * K, reordered_own, at::kChar);
    genserve_kquant::nibble_order(job.xq, M, K, reordered);
    job.xq_nibble_order = reordered;
  }
#endif
  // Each chunk streams >= ~32 KB of weights (a few rows at 1B sizes), a multiple of 8 rows so
  // that the one-row path's 4-row passes stay whole; shares a busy thread gets help with
  // (row_shares.h).
  const int64_t rows_32k = std::max<int64_t>(1, (int64_t{1} << 15) / segments[0].row_bytes);
  genserve_shares::parallel_shares(N, (rows_32k + 7) / 8 * 8,
                                   [&](int64_t begin, int64_t end) { run(job, begin, end); });
}

}  // namespace

namespace genserve_ops {

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& data, at::IntArrayRef types,
                         at::IntArrayRef rows, const c10::optional<at::Tensor>& bias,
                         int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "kquant_linear: x [M, K] expected");
  int64_t n = 0;
  for (const int64_t r : rows) n += r;
  // A bfloat16 model's output is rounded as it is stored (kquant_run); float16 through float32.
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto out = at::empty({x.size(0), n}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  kquant_run(x, data, types, rows, bias, isa, out, false);
  return x.scalar_type() == out.scalar_type() ? out : out.to(x.scalar_type());
}

at::Tensor& kquant_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& data,
                               at::IntArrayRef types, at::IntArrayRef rows, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "kquant_linear_add_: float32 x expected");
  kquant_run(x, data, types, rows, c10::nullopt, isa, acc, true);
  return acc;
}

}  // namespace genserve_ops

namespace {

// x quantized as the integer path quantizes it: (q int8 [M, K], d float32 [M, K / 256],
// Σq int16 [M, K / 16]); for tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> kquant_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0 && x.size(1) % 256 == 0,
              "kquant_quantize: a CPU [M, K] tensor with K a multiple of 256 expected");
  Q8K r = quantize_q8k(x.to(at::kFloat).contiguous());
  return {r.q, r.d, r.sums};
}

// W [N, K] dequantized by the float path's decode (float32); for tests.
at::Tensor kquant_dequantize(const at::Tensor& data, at::IntArrayRef types, at::IntArrayRef rows,
                             int64_t K) {
  TORCH_CHECK(K > 0 && K % 256 == 0, "kquant_dequantize: K must be a positive multiple of 256");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.device().is_cpu(),
              "kquant_dequantize: contiguous uint8 CPU data expected");
  const std::vector<KSegment> segments =
      genserve_kquant::segments_of(data, types, rows, K, "kquant_linear");
  const int64_t N = segments.back().row0 + segments.back().rows;
  auto out = at::empty({N, K}, data.options().dtype(at::kFloat));
  float* w = out.data_ptr<float>();
  for (const KSegment& s : segments) {
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t b = 0; b < K / 256; ++b) {
        kq_dequantize(s.type, s.data + r * s.row_bytes + b * s.block_bytes,
                      w + (s.row0 + r) * K + b * 256);
      }
    }
  }
  return out;
}

}  // namespace

namespace genserve_kquant {

RunRows float_runner() { return &float_rows; }
RunRows int_runner(int64_t isa) { return int_path(isa); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_q8k(const at::Tensor& x32) {
  Q8K r = quantize_q8k(x32);
  return {r.q, r.d, r.sums};
}

void nibble_order(const int8_t* x, int64_t rows, int64_t k, int8_t* out) {
  for (int64_t i = 0; i < rows * k; i += 128) {
    std::memcpy(out + i, x + i, 32);
    std::memcpy(out + i + 32, x + i + 64, 32);
    std::memcpy(out + i + 64, x + i + 32, 32);
    std::memcpy(out + i + 96, x + i + 96, 32);
  }
}

at::Tensor nibble_ordered(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() &&
                  q.size(1) % 256 == 0,
              "nibble_ordered: contiguous int8 [M, K] with K a multiple of 256 expected");
  auto out = at::empty_like(q);
  nibble_order(q.data_ptr<int8_t>(), q.size(0), q.size(1), out.data_ptr<int8_t>());
  return out;
}

}  // namespace genserve_kquant

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("kquant_linear(Tensor x, Tensor data, int[] types, int[] rows, Tensor? bias, "
        "int isa=-1) -> Tensor");
  m.def("kquant_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("kquant_dequantize(Tensor data, int[] types, int[] rows, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("kquant_linear", &genserve_ops::kquant_linear);
  m.impl("kquant_quantize", &kquant_quantize);
  m.impl("kquant_dequantize", &kquant_dequantize);
}
