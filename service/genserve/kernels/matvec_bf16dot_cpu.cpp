// The bfloat16 x bfloat16 decode matvec by VDPBF16PS (AVX512-BF16), for matvec_cpu.cpp.
//
// matvec_cpu.cpp's float path widens every bf16 weight to float32 and issues one FMA per 16
// weights per x row: at 8 rows that is 8 FMAs (plus the widening) per 32 bytes of W, which
// held a 1B-shape bf16 step to ~33% of the read bandwidth (8 rows cost 3.1x one row).
// VDPBF16PS multiplies 32 bf16 pairs per instruction straight from the stored bits, so the
// same 8 rows take 8 instructions per 64 bytes of W and no widening: half the arithmetic.
//
// Numerics: used only when x is bfloat16 as well (the bf16 model's hidden states, or a float32
// x all of whose values are bf16 values: the LM head's, see matvec_cpu.cpp), so every product
// is the same exact float32 product the float path forms; sums are float32 in both, in another
// order (each lane adds its pair of products, then the lanes are reduced), and the
// instruction treats bf16 denormals (|v| < 1.2e-38) as zero.  Any other float32 x keeps the
// float path: rounding it to bf16 would change the products.
//
// The instruction set is chosen at run time (__builtin_cpu_supports), the kernel compiled
// under its own `#pragma GCC target` whatever -march the library is built with.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "cpu_features.h"
#include "matvec_bf16dot.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
using RunRange = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*,
                          int64_t, int64_t);
}  // namespace

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")
namespace matvec_avx512bf16 {
namespace {

constexpr int64_t kPairs = 32;  // bf16 values per 512-bit register
// How far ahead (bf16 values: 4 KB) each W row's stream is prefetched, into L2 (PREFETCHT1).
// Into L1 (PREFETCHT0, two rows ahead: 8 KB per stream at K = 2,048), four streams per core
// put ~32 KB of not-yet-used W in flight into the 32 KB L1D beside the x rows, evicting lines
// before their use: at 8 rows the 1B shape's matrices streamed at 19-21 GB/s, against 29-34
// GB/s with the same lines brought to L2 4 KB ahead (L1 is then filled by the hardware
// prefetcher and the loads themselves).  One row is unchanged (~35 GB/s, the bandwidth).
// Measured on the 2-vCPU Zen 4 (docs/benchmarks/cpu.md, w7-f16); prefetches never fault, so
// the rows past the end of W cost nothing.
constexpr int64_t kPrefetchAhead = 2048;
constexpr int64_t kMaxRows = 8;  // x rows per pass over a block of W (registers)

// W rows o0, o0 + step, ..., o0 + (O - 1) step against x rows [0, M): out[r, n] = x_r . w_n.
// O * M accumulators + M inputs + 1 weight register out of 32 (M <= 8: O <= 2; M <= 4: 4).
template <int M, int O>
inline void dot_block(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t o0,
                      float* out, int64_t step) {
  __m512 acc[O][M];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < M; ++r) acc[o][r] = _mm512_setzero_ps();
  const int64_t vec_end = K - K % kPairs;
  for (int64_t k = 0; k < vec_end; k += kPairs) {
    __m512i xv[M];
    for (int r = 0; r < M; ++r) xv[r] = _mm512_loadu_si512(x + r * K + k);
    for (int o = 0; o < O; ++o) {
      const uint16_t* row = w + (o0 + o * step) * K;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchAhead + k), _MM_HINT_T1);
      const __m512i wv = _mm512_loadu_si512(row + k);
      for (int r = 0; r < M; ++r) {
        acc[o][r] = _mm512_dpbf16_ps(acc[o][r], (__m512bh)xv[r], (__m512bh)wv);
      }
    }
  }
  if (vec_end < K) {  // K % 32 values: masked loads fill the rest of the pairs with zeros
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - vec_end)) - 1);
    __m512i xv[M];
    for (int r = 0; r < M; ++r) xv[r] = _mm512_maskz_loadu_epi16(mask, x + r * K + vec_end);
    for (int o = 0; o < O; ++o) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + (o0 + o * step) * K + vec_end);
      for (int r = 0; r < M; ++r) {
        acc[o][r] = _mm512_dpbf16_ps(acc[o][r], (__m512bh)xv[r], (__m512bh)wv);
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < M; ++r) out[r * N + o0 + o * step] = _mm512_reduce_add_ps(acc[o][r]);
}

// One block of W rows against every x row, a few x rows at a time (the block stays in L1 for
// the later passes, so W is still read from memory once): 4 with four W rows per block, 8
// with fewer (registers).
template <int O>
inline void all_rows(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t N,
                     int64_t o0, float* out, int64_t step) {
  constexpr int64_t chunk = O == 4 ? 4 : kMaxRows;
  for (int64_t r = 0; r < M; r += chunk) {
    const uint16_t* xr = x + r * K;
    float* outr = out + r * N;
    const int64_t m = std::min(chunk, M - r);
    if constexpr (O == 4) {
      switch (m) {
        case 1: dot_block<1, O>(xr, w, K, N, o0, outr, step); break;
        case 2: dot_block<2, O>(xr, w, K, N, o0, outr, step); break;
        case 3: dot_block<3, O>(xr, w, K, N, o0, outr, step); break;
        default: dot_block<4, O>(xr, w, K, N, o0, outr, step); break;
      }
    } else {
      switch (m) {
        case 1: dot_block<1, O>(xr, w, K, N, o0, outr, step); break;
        case 2: dot_block<2, O>(xr, w, K, N, o0, outr, step); break;
        case 3: dot_block<3, O>(xr, w, K, N, o0, outr, step); break;
        case 4: dot_block<4, O>(xr, w, K, N, o0, outr, step); break;
        case 5: dot_block<5, O>(xr, w, K, N, o0, outr, step); break;
        case 6: dot_block<6, O>(xr, w, K, N, o0, outr, step); break;
        case 7: dot_block<7, O>(xr, w, K, N, o0, outr, step); break;
        default: dot_block<8, O>(xr, w, K, N, o0, outr, step); break;
      }
    }
  }
}

// W rows [begin, end): cut into O sub-bands walked side by side (a block takes one row of
// each), so each core keeps O sequential streams in flight (as matvec_cpu.cpp does).
template <int O>
void run_range_o(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t N,
                 float* out, int64_t begin, int64_t end) {
  const int64_t per = (end - begin) / O;
  for (int64_t i = 0; i < per; ++i) all_rows<O>(x, w, M, K, N, begin + i, out, per);
  for (int64_t o = begin + O * per; o < end; ++o) all_rows<1>(x, w, M, K, N, o, out, 1);
}

// Four W rows per block at every M, the x rows four at a time: at 8 rows, two W rows against
// all eight x rows (the block's x, 8 x K bf16, is 32 KB at K = 2,048: the whole L1D of this
// Zen 4, so x came from L2 on every pass) streamed the 1B shape's matrices at 20-22 GB/s; four
// W rows against x rows 0-3 and then 4-7 (16 KB of x in flight, each x vector serving four W
// rows) at 22-26 GB/s, 8-23% faster on every matrix of the shape (2 threads, cold W).
// Every (W row, x row) sum is formed the same way whatever M is, so a row's outputs do not
// depend on how many rows share its step (batch invariance).
void run_range(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t N,
               float* out, int64_t begin, int64_t end) {
  run_range_o<4>(x, w, M, K, N, out, begin, end);
}

}  // namespace
RunRange range() { return &run_range; }
}  // namespace matvec_avx512bf16
#pragma GCC pop_options
#endif  // __x86_64__

namespace genserve_ops {

bool matvec_bf16dot_supported() {
#if defined(__x86_64__)
  // Asked on every call: GENSERVE_CPU_FEATURES_MASK may hide a feature after the first.
  __builtin_cpu_init();
  return GENSERVE_CPU_SUPPORTS("avx512f") && GENSERVE_CPU_SUPPORTS("avx512bw") &&
         GENSERVE_CPU_SUPPORTS("avx512vl") && GENSERVE_CPU_SUPPORTS("avx512bf16");
#else
  return false;
#endif
}

void matvec_bf16dot(const c10::BFloat16* x, const c10::BFloat16* w, int64_t M, int64_t K,
                    int64_t N, float* out) {
#if defined(__x86_64__)
  TORCH_CHECK(matvec_bf16dot_supported(), "matvec_bf16dot: this CPU has no AVX512-BF16");
  const RunRange run = matvec_avx512bf16::range();
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  const auto* ws = reinterpret_cast<const uint16_t*>(w);
  // Each task streams >= 256 KiB of W, so a small matrix stays on one thread.
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / std::max<int64_t>(1, K * 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    run(xs, ws, M, K, N, out, begin, end);
  });
#else
  (void)x, (void)w, (void)M, (void)K, (void)N, (void)out;
  TORCH_CHECK(false, "matvec_bf16dot: x86-64 only");
#endif
}

void matvec_bf16dot_rows(const c10::BFloat16* x, const c10::BFloat16* w, int64_t M, int64_t K,
                         int64_t N, float* out, int64_t begin, int64_t end) {
#if defined(__x86_64__)
  TORCH_CHECK(matvec_bf16dot_supported(), "matvec_bf16dot: this CPU has no AVX512-BF16");
  matvec_avx512bf16::range()(reinterpret_cast<const uint16_t*>(x),
                             reinterpret_cast<const uint16_t*>(w), M, K, N, out, begin, end);
#else
  (void)x, (void)w, (void)M, (void)K, (void)N, (void)out, (void)begin, (void)end;
  TORCH_CHECK(false, "matvec_bf16dot: x86-64 only");
#endif
}

}  // namespace genserve_ops
