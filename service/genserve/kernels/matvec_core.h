// Vector helpers of genserve's CPU matmuls: the register-blocked dot products of the
// weight-streaming matvec (matvec_cpu.cpp, [N, K] weights) and the widening loads of the
// column-panel kernel (panel_gemm_cpu.cpp: float16 scales, int8 and 4-bit weights).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace genserve_vec {

// One native vector register of floats: 16 lanes with AVX-512, 8 with AVX2 (so that the
// accumulators below fit the 32 or 16 registers the ISA has), 4 on the SSE baseline.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float f32v __attribute__((vector_size(kLanes * 4)));
typedef uint32_t u32v __attribute__((vector_size(kLanes * 4)));
typedef uint16_t u16v __attribute__((vector_size(kLanes * 2)));

inline f32v load16(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32v load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // One vpmovzxwd from memory (GCC's generic conversion splits it into two halves and
  // shuffles them back together, which made this loop shuffle-bound).
  const __m512i wide =
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  return (f32v)_mm512_castsi512_ps(wide);
#elif defined(__AVX2__)
  const __m256i wide =
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
  return (f32v)_mm256_castsi256_ps(wide);
#else
  u16v h;
  std::memcpy(&h, p, sizeof(h));
  const u32v wide = __builtin_convertvector(h, u32v) << 16;
  f32v v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}

typedef int32_t i32v __attribute__((vector_size(kLanes * 4)));

inline float half_to_float(const c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// kLanes consecutive float16 values (quantization scales) as float.
inline f32v load_f16(const c10::Half* p) {
#if defined(__AVX512F__)
  return (f32v)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__) && defined(__AVX2__)
  return (f32v)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  f32v v;
  for (int i = 0; i < kLanes; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

// float16 weights (--dtype float16) in the matvec: widened in registers like bfloat16.
inline f32v load16(const c10::Half* p) { return load_f16(p); }

// kLanes consecutive int8 weights widened to float (quantized weights).
inline f32v load_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return (f32v)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (f32v)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  i32v v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return __builtin_convertvector(v, f32v);
#endif
}

// kLanes bytes of a 4-bit group widened to int32 lanes (nibbles still packed).
inline i32v load_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (i32v)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  return (i32v)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
  i32v v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}

inline float hsum(f32v v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_f32(c10::Half v) { return half_to_float(v); }

// How far ahead (bytes) each W row's stream is prefetched, into L2 (PREFETCHT1): bringing
// two rows ahead into L1 (PREFETCHT0) put more not-yet-used W in flight than the 32-48 KB L1D
// holds beside x at 8 rows, so lines were evicted before their use (8 rows of the 1B shape's
// bf16 matrices on the 2-vCPU Zen 4: 10-15 GB/s with the AVX-512 build, 8-10 with the AVX2
// one, against 17 and 11 with this; one row unchanged; docs/benchmarks/cpu.md, w7-f16).
constexpr int64_t kPrefetchBytes = 4096;

// Rows o0, o0 + step, ..., o0 + (O - 1) step of W against all M rows of x (float32, [M, K]);
// out is float32 [M, N].  Each row prefetches its own stream kPrefetchBytes ahead (step > 1:
// the caller walks O separate bands of W; step 1: consecutive rows).  Prefetches never fault.
template <int M, int O, typename W>
inline void dot_block(const float* x, const W* w, int64_t K, int64_t N, int64_t o0, float* out,
                      int64_t step = 1) {
  f32v acc[O][M];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < M; ++r) acc[o][r] = f32v{};
  const int64_t vec_end = K - K % kLanes;
  for (int64_t k = 0; k < vec_end; k += kLanes) {
    f32v xv[M];
    for (int r = 0; r < M; ++r) xv[r] = load16(x + r * K + k);
    for (int o = 0; o < O; ++o) {
      const W* row = w + (o0 + o * step) * K;
      _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T1);
      const f32v wv = load16(row + k);
      for (int r = 0; r < M; ++r) acc[o][r] += xv[r] * wv;
    }
  }
  for (int o = 0; o < O; ++o) {
    const int64_t n = o0 + o * step;
    for (int r = 0; r < M; ++r) {
      float s = hsum(acc[o][r]);
      for (int64_t k = vec_end; k < K; ++k) s += x[r * K + k] * to_f32(w[n * K + k]);
      out[r * N + n] = s;
    }
  }
}

}  // namespace genserve_vec
