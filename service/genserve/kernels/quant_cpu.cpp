// y = x W^T (+ b) with W stored weight-only quantized (genserve/model/quantization.py):
//   bits 8: int8 [N, K], w = scale * q, one float16 scale per `group` weights along K
//           (group == K: per output channel; 32: GGUF Q8_0);
//   bits 4: uint8 [N, K/2] in groups of 32 (byte j of a group: q[j] low nibble, q[j+16] high),
//           w = scale * q + min (GGUF Q4_0/Q4_1 blocks, --quantize int4).
// Activations stay float32 (x in bfloat16 is widened once), every product is accumulated in
// float32.  llama.cpp instead quantizes x to int8 per block and uses integer dot products;
// keeping x in float keeps the result within float rounding of the dequantized reference
// (the e2e tests compare greedy tokens against transformers on those weights), at the cost
// of more instructions per weight: at one stream the 4-bit loop is compute-bound, not
// bandwidth-bound (measured ~6 cycles per group of 32 weights and row on AVX-512).
//
// Three regimes by the number of rows M:
// * few rows (decode of a few streams: up to 8 for per-row int8, 3 otherwise): each W block
//   is dequantized in registers right where it is used, O rows at a time, against all M
//   rows of x (the float loop of matvec_core.h, with a dequantizing load);
// * up to 32 rows (batched decode): four rows of W are dequantized once into an L1 scratch
//   and the float dot_block of matvec_core.h runs every row of x over them (an
//   outer-product micro-kernel was tried here and measured no faster on the default
//   model's shapes);
// * larger M (prefill): bands of W rows are dequantized into a float buffer and multiplied
//   with torch's GEMM, which is compute-bound there anyway.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "matvec_core.h"


namespace {

using namespace genserve_vec;

typedef int32_t i32v __attribute__((vector_size(kLanes * 4)));

inline float half_to_float(const c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// kLanes consecutive int8 weights widened to float.
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

struct QWeight {
  const void* data;
  const c10::Half* scales;
  const c10::Half* mins;  // nullptr: symmetric
  int64_t bits, group, K, groups;  // groups = K / group

  int64_t row_bytes() const { return bits == 4 ? K / 2 : K; }
};

// Scales and mins (float16) of rows [o0, o0 + O), groups [g0, g0 + n), as float32: converted
// a chunk at a time so that the loop below broadcasts each from memory (a load, not a
// conversion and a shuffle per group).
constexpr int64_t kGroupChunk = 64;

template <int O>
inline void chunk_to_float(const c10::Half* src, int64_t groups, int64_t o0, int64_t g0,
                           int64_t n, float (*dst)[kGroupChunk]) {
  for (int o = 0; o < O; ++o) {
    const c10::Half* row = src + (o0 + o) * groups + g0;
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16)
      _mm512_storeu_ps(dst[o] + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + j))));
#elif defined(__F16C__)
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(dst[o] + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + j))));
#endif
    for (; j < n; ++j) dst[o][j] = half_to_float(row[j]);
  }
}

// sum_j a[j] * b[j] over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  f32v acc{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) acc += load16(a + j) * load16(b + j);
  float s = hsum(acc);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// Rows [o0, o0 + O) of W against M rows of x, dequantizing in registers.
//   int8, per row (group == K): sum x * q over the row, times the scale once at the end;
//   int8, groups of 32 (Q8_0): w = q * scale per group;
//   4-bit: w = q * scale, and the min's share added separately as
//          sum_g min_g * (sum of x over group g), xsum[r * groups + g] computed once per call.
template <int M, int O>
inline void qdot_block(const float* x, const float* xsum, const QWeight& w, int64_t N,
                       int64_t o0, float* out) {
  f32v acc[O][M];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < M; ++r) acc[o][r] = f32v{};
  float min_term[O][M] = {};
  const int64_t K = w.K;
  if (w.bits == 8 && w.group == K) {
    const int8_t* q = static_cast<const int8_t*>(w.data);
    for (int64_t k = 0; k < K; k += kLanes) {
      f32v xv[M];
      for (int r = 0; r < M; ++r) xv[r] = load16(x + r * K + k);
      for (int o = 0; o < O; ++o) {
        __builtin_prefetch(q + (o0 + O + o) * K + k);
        const f32v wv = load_i8(q + (o0 + o) * K + k);
        for (int r = 0; r < M; ++r) acc[o][r] += xv[r] * wv;
      }
    }
    for (int o = 0; o < O; ++o) {
      const float scale = half_to_float(w.scales[o0 + o]);
      for (int r = 0; r < M; ++r) out[r * N + o0 + o] = hsum(acc[o][r]) * scale;
    }
    return;
  }
  float scale[O][kGroupChunk], mins[O][kGroupChunk];
  const i32v low_mask = i32v{} + 0x0F;
  const int64_t row_bytes = w.row_bytes();
  for (int64_t g0 = 0; g0 < w.groups; g0 += kGroupChunk) {
    const int64_t n = std::min(kGroupChunk, w.groups - g0);
    chunk_to_float<O>(w.scales, w.groups, o0, g0, n, scale);
    if (w.bits == 8) {
      const int8_t* q = static_cast<const int8_t*>(w.data);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t k = (g0 + j) * w.group; k < (g0 + j + 1) * w.group; k += kLanes) {
          f32v xv[M];
          for (int r = 0; r < M; ++r) xv[r] = load16(x + r * K + k);
          for (int o = 0; o < O; ++o) {
            __builtin_prefetch(q + (o0 + O + o) * K + k);
            const f32v wv = load_i8(q + (o0 + o) * K + k) * scale[o][j];
            for (int r = 0; r < M; ++r) acc[o][r] += xv[r] * wv;
          }
        }
      }
      continue;
    }
    chunk_to_float<O>(w.mins, w.groups, o0, g0, n, mins);
    for (int o = 0; o < O; ++o)
      for (int r = 0; r < M; ++r) min_term[o][r] += dot(mins[o], xsum + r * w.groups + g0, n);
    const uint8_t* q = static_cast<const uint8_t*>(w.data);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = g0 + j;
      // A group is 16 bytes: kLanes of them give weights [b, b + kLanes) from the low
      // nibbles and [16 + b, 16 + b + kLanes) from the high ones.
      for (int64_t b = 0; b < 16; b += kLanes) {
        const int64_t k = g * 32 + b;
        f32v x_lo[M], x_hi[M];
        for (int r = 0; r < M; ++r) {
          x_lo[r] = load16(x + r * K + k);
          x_hi[r] = load16(x + r * K + k + 16);
        }
        for (int o = 0; o < O; ++o) {
          const uint8_t* p = q + (o0 + o) * row_bytes + g * 16 + b;
          __builtin_prefetch(p + O * row_bytes);
          const i32v packed = load_u8(p);
          const f32v w_lo = __builtin_convertvector(packed & low_mask, f32v) * scale[o][j];
          const f32v w_hi = __builtin_convertvector(packed >> 4, f32v) * scale[o][j];
          for (int r = 0; r < M; ++r) {
            acc[o][r] += x_lo[r] * w_lo;
            acc[o][r] += x_hi[r] * w_hi;
          }
        }
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < M; ++r) out[r * N + o0 + o] = hsum(acc[o][r]) + min_term[o][r];
}

// Sum of each row of x over each group of 32 (4-bit weights' min terms): [M, K / 32].
std::vector<float> group_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * (K / 32));
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < K / 32; ++g) {
      f32v s{};
      for (int64_t k = g * 32; k < g * 32 + 32; k += kLanes) s += load16(x + r * K + k);
      sums[r * (K / 32) + g] = hsum(s);
    }
  }
  return sums;
}

// Row o of W into dst[K] as float32.
inline void dequant_row(const QWeight& w, int64_t o, float* dst) {
  if (w.bits == 8) {
    const int8_t* q = static_cast<const int8_t*>(w.data) + o * w.K;
    for (int64_t g = 0; g < w.groups; ++g) {
      const f32v scale = f32v{} + half_to_float(w.scales[o * w.groups + g]);
      for (int64_t k = g * w.group; k < (g + 1) * w.group; k += kLanes) {
        const f32v v = load_i8(q + k) * scale;
        std::memcpy(dst + k, &v, sizeof(v));
      }
    }
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(w.data) + o * (w.K / 2);
  const i32v low_mask = i32v{} + 0x0F;
  for (int64_t g = 0; g < w.groups; ++g) {
    const f32v scale = f32v{} + half_to_float(w.scales[o * w.groups + g]);
    const f32v minv = f32v{} + half_to_float(w.mins[o * w.groups + g]);
    for (int64_t b = 0; b < 16; b += kLanes) {
      const i32v packed = load_u8(q + g * 16 + b);
      const f32v lo = __builtin_convertvector(packed & low_mask, f32v) * scale + minv;
      const f32v hi = __builtin_convertvector(packed >> 4, f32v) * scale + minv;
      std::memcpy(dst + g * 32 + b, &lo, sizeof(lo));
      std::memcpy(dst + g * 32 + 16 + b, &hi, sizeof(hi));
    }
  }
}

template <int M>
void qmatvec_rows(const float* x, const QWeight& w, int64_t N, float* out) {
  constexpr int O = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  const std::vector<float> xsum = w.bits == 4 ? group_sums(x, M, w.K) : std::vector<float>();
  const int64_t grain = std::max<int64_t>(O, (1 << 16) / std::max<int64_t>(1, w.row_bytes()));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + O <= end; o += O) qdot_block<M, O>(x, xsum.data(), w, N, o, out);
    for (; o < end; ++o) qdot_block<M, 1>(x, xsum.data(), w, N, o, out);
  });
}

// Up to 32 rows: four W rows dequantized into a per-task L1 scratch, then every row of x.
void qmatmul_scratch(const float* x, const QWeight& w, int64_t M, int64_t N, float* out) {
  constexpr int O = 4;
  constexpr int kChunk = kLanes >= 16 ? 4 : 2;
  const int64_t K = w.K;
  const int64_t grain = std::max<int64_t>(O, (1 << 14) / std::max<int64_t>(1, w.row_bytes()));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(O * K);
    int64_t o = begin;
    for (; o < end; o += O) {
      const int rows = static_cast<int>(std::min<int64_t>(O, end - o));
      for (int i = 0; i < rows; ++i) dequant_row(w, o + i, scratch.data() + i * K);
      // dot_block indexes W rows from o0 and writes out[r * N + o0 + j]: W is the scratch
      // (rows from 0) and the output pointer starts at column o.
      float* out_o = out + o;
      if (rows == O) {
        int64_t r = 0;
        for (; r + kChunk <= M; r += kChunk)
          dot_block<kChunk, O>(x + r * K, scratch.data(), K, N, 0, out_o + r * N);
        for (; r < M; ++r) dot_block<1, O>(x + r * K, scratch.data(), K, N, 0, out_o + r * N);
      } else {
        for (int i = 0; i < rows; ++i)
          for (int64_t r = 0; r < M; ++r)
            dot_block<1, 1>(x + r * K, scratch.data() + i * K, K, N, 0, out_o + i + r * N);
      }
    }
  });
}

// Prefill: bands of W dequantized (in parallel) and multiplied by torch's GEMM.
void qmatmul_gemm(const at::Tensor& xf, const QWeight& w, int64_t N, at::Tensor& out) {
  const int64_t K = w.K;
  const int64_t band = std::max<int64_t>(64, (8 << 20) / (K * 4));  // <= ~8 MB of floats
  auto buffer = at::empty({std::min(band, N), K}, xf.options());
  for (int64_t n0 = 0; n0 < N; n0 += band) {
    const int64_t rows = std::min(band, N - n0);
    float* dst = buffer.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dequant_row(w, n0 + i, dst + i * K);
    });
    out.narrow(1, n0, rows).copy_(at::mm(xf, buffer.narrow(0, 0, rows).t()));
  }
}

constexpr int64_t kScratchMaxRows = 32;
// 4-bit and Q8_0 weights are dequantized in registers up to this many rows of x.
constexpr int64_t kRegisterRows4 = 3;

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && data.device().is_cpu(), "qlinear: CPU tensors only");
  TORCH_CHECK(bits == 8 || bits == 4, "qlinear: bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 2 && data.dim() == 2 && scales.dim() == 2, "qlinear: 2-D tensors");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "qlinear: float16 scales");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0);
  TORCH_CHECK(data.size(1) * (bits == 4 ? 2 : 1) == K, "qlinear: weight and x disagree on K");
  TORCH_CHECK(group > 0 && K % group == 0 && group % kLanes == 0, "qlinear: bad group size");
  TORCH_CHECK(bits == 8 || group == 32, "qlinear: 4-bit weights come in groups of 32");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == K / group, "qlinear: scales shape");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == (bits == 4), "qlinear: 4-bit weights need mins, 8-bit none");
  TORCH_CHECK(data.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "qlinear: data dtype");
  const auto dc = data.contiguous();
  const auto sc = scales.contiguous();
  at::Tensor mc;
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->sizes() == scales.sizes(),
                "qlinear: mins like scales");
    mc = mins->contiguous();
  }
  const QWeight w{dc.data_ptr(), sc.data_ptr<c10::Half>(),
                  has_mins ? mc.data_ptr<c10::Half>() : nullptr, bits, group, K, K / group};
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0 && N > 0) {
    const float* xp = xf.data_ptr<float>();
    float* op = out.data_ptr<float>();
    // Dequantizing in registers pays the unpacking once per x row; past a few rows, the
    // L1 scratch (unpacked once, then plain float dot products) is faster, except for
    // per-row int8, whose unpacking is one widening load (measured on the default model's
    // shapes: 4-bit at 8 rows 320 us in registers vs ~200 us through the scratch).
    const int64_t in_registers = (bits == 8 && group == K) ? 8 : kRegisterRows4;
    if (M > in_registers && M <= kScratchMaxRows) {
      qmatmul_scratch(xp, w, M, N, op);
    } else if (M > kScratchMaxRows) {
      qmatmul_gemm(xf, w, N, out);
    } else {
      switch (M) {
        case 1: qmatvec_rows<1>(xp, w, N, op); break;
        case 2: qmatvec_rows<2>(xp, w, N, op); break;
        case 3: qmatvec_rows<3>(xp, w, N, op); break;
        case 4: qmatvec_rows<4>(xp, w, N, op); break;
        case 5: qmatvec_rows<5>(xp, w, N, op); break;
        case 6: qmatvec_rows<6>(xp, w, N, op); break;
        case 7: qmatvec_rows<7>(xp, w, N, op); break;
        default: qmatvec_rows<8>(xp, w, N, op); break;
      }
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "qlinear: bias must be [N]");
    out.add_(bias->to(at::kFloat));
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("qlinear(Tensor x, Tensor data, Tensor scales, Tensor? mins, int bits, int group, "
        "Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("qlinear", &qlinear); }
